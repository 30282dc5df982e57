"""Global gradient norms of a ZeRO model's sharded grads, for ``zerofuse.zero.Optimizer``: the
clip coefficient and the fp16 overflow check of a step, and LAMB/LARS's per-param norms (each
rank's squares summed over the data-parallel ranks, and over the tensor-parallel group for params
TP shards). A mixin: it reads the optimizer's engine, scale and kept launch tables."""
from __future__ import annotations

import numbers

import torch

from zerofuse.ops import l2norm
from zerofuse.kernels.common import upload
from zerofuse.ops._optim import Prepared, direct
from zerofuse.ops.l2norm import clip_inputs
from zerofuse.zero.options import NAME


class GradNorms:
    def _global_sumsq(self, local: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks' shards (stage 0: each rank holds everything)."""
        if self.engine.stage != 0:
            self.engine.comm.all_reduce_coalesced([local], op="sum").wait()
        return local

    def _grad_norm(self) -> torch.Tensor:
        """Global 2-norm of the averaged, unscaled gradient (1-element fp32 on the device); with
        tensor parallelism over the whole model: TP-sharded params add up over the TP group,
        replicated ones count once."""
        eng = self.engine
        eng.finish_grad_sync()
        kept = self.__dict__.setdefault("_norm_prepared", (Prepared(), Prepared(), Prepared()))
        if eng.tp_comm is None and eng.edp_comm is None:
            total, _ = l2norm([u.grad_shard() for u in eng.units], prepared=kept[0])
            sq = self._global_sumsq(total.reshape(1).to(torch.float32) ** 2)
        else:
            parts: tuple[list, list, list] = ([], [], [])  # (replicated over TP, TP-sharded, expert) pieces
            for u in eng.units:
                g = u.grad_shard()
                if eng.edp_comm is not None and u.comm is eng.edp_comm:  # (experts: never TP-sharded)
                    parts[2].append(g)
                    continue
                if eng.tp_comm is None:
                    parts[0].append(g)
                    continue
                for s in u.segments:
                    sharded = eng.tp_sharded[eng.param_index[id(u.params[s.param])]]
                    parts[sharded].append(g.narrow(0, s.shard_offset, s.length))
            sums = torch.stack([l2norm(ts, prepared=pr)[0].to(torch.float32) ** 2 if ts else
                                torch.zeros((), dtype=torch.float32, device=self.scale.device)
                                for ts, pr in zip(parts, kept)]).to(self.scale.device)
            if eng.stage != 0:  # each rank's shards; the DP group's sum also adds up the ep ranks' experts
                eng.comm.all_reduce_coalesced([sums], op="sum").wait()
            elif eng.edp_comm is not None:
                # stage 0: dense grads whole on every rank; an expert grad on each rank of its edp
                # group: summed over the DP group, each counts edp times
                expert = sums[2:] / eng.edp_comm.world_size
                eng.comm.all_reduce_coalesced([expert], op="sum").wait()
                sums = torch.cat([sums[:2], expert])
            # TP-sharded pieces add up over the TP group; the replicated ones (experts too) count once
            sq = (sums[1] + (sums[0] + sums[2] if eng.tp_rank == 0 else 0.0)).reshape(1)
            if eng.tp_comm is not None:
                eng.tp_comm.all_reduce_coalesced([sq], op="sum").wait()
        if eng.pp_comm is not None:  # pipeline stages hold disjoint params
            sq = sq.reshape(1).clone()
            eng.pp_comm.all_reduce_coalesced([sq], op="sum").wait()
        return sq.sqrt() / self.scale

    def _fused_clip(self, max_norm: float):
        """(grad multiplier, skip flag, norm) of a step clipped to max_norm with torch's
        clip_grad_norm_ coefficient, by ops.clip_inputs (one sum-of-squares pass and one
        single-program kernel instead of l2norm and ~15 small ops) where the norm needs no
        collective: every grad whole here (stage 0) or one rank, no TP, PP or expert groups, on the
        kernels' direct path. None otherwise (the caller takes _grad_norm)."""
        eng = self.engine
        if eng.tp_comm is not None or eng.pp_comm is not None or eng.edp_comm is not None:
            return None
        if eng.stage != 0 and eng.world_size != 1:
            return None
        eng.finish_grad_sync()
        grads = [u.grad_shard() for u in eng.units]
        if not grads or not direct(grads):
            return None
        kept = self.__dict__.setdefault("_norm_prepared", (Prepared(), Prepared(), Prepared()))
        return clip_inputs(grads, max_norm, self.scale if self.fp16 else None, None, prepared=kept[0], eps=1e-6)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """Clip the gradient of the coming step to global norm max_norm (fused into the step; a later
        backward of the same step first folds it into the grads so far: fold_clip) and return the
        global norm before clipping, the same on every rank. torch's arguments: the
        2-norm only (norm_type 2); error_if_nonfinite raises, on every rank, before clipping (one
        host sync; without it a non-finite norm skips the step); foreach is accepted (the grads are
        flat buffers: one fused pass either way)."""
        if isinstance(max_norm, torch.Tensor) and max_norm.numel() == 1:  # (torch's clip takes one too)
            max_norm = float(max_norm)
        if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not max_norm > 0:
            raise ValueError(f"{NAME}.clip_grad_norm_: expected max_norm to be a number > 0, got {max_norm!r}")
        if isinstance(norm_type, torch.Tensor) and norm_type.numel() == 1:
            norm_type = float(norm_type)
        if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real) or float(norm_type) != 2.0:
            raise ValueError(f"{NAME}.clip_grad_norm_: expected norm_type 2 (the fused norm is the 2-norm), got "
                             f"{norm_type!r}")
        for name, v in (("error_if_nonfinite", error_if_nonfinite), ("foreach", foreach)):
            if not isinstance(v, bool) and not (name == "foreach" and v is None):
                raise TypeError(f"{NAME}.clip_grad_norm_: expected {name} to be a bool"
                                f"{' or None' if name == 'foreach' else ''}, got {v!r}")
        if self.host is not None and self.host.overlapped:
            raise RuntimeError(f"{NAME}.clip_grad_norm_: with offload='optimizer' and no max_grad_norm the host steps "
                               "start during backward, before this call could clip them: pass max_grad_norm to the "
                               "Optimizer instead (or offload_overlap=False)")
        norm = self._grad_norm()
        if error_if_nonfinite and not bool(torch.isfinite(norm).all()):  # (the norm is every rank's: all raise)
            raise RuntimeError(f"{NAME}.clip_grad_norm_: the total norm of order 2.0 of the gradients is non-finite "
                               f"({float(norm)}), so it cannot be clipped; with error_if_nonfinite=False the step "
                               "that follows is skipped instead")
        found = (~torch.isfinite(norm)).float()
        if self._clip_coef is not None:  # clipped already for this step: as torch's second call, on the
            # clipped grads (it replaced the first clip: a clip_grad_norm_(inf) to log the norm undid
            # it, and the Optimizer's max_grad_norm was skipped)
            norm = norm * self._clip_coef
            found = torch.maximum(found, self._found_inf)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        self._clip_coef = coef if self._clip_coef is None else self._clip_coef * coef
        self._clipped_norm = norm * coef  # the norm the step's grads have now (max_grad_norm clips that)
        self._found_inf = found
        self.last_grad_norm = norm
        self.engine.clip_pending = True
        if getattr(self.engine, "_views", None) is not None:  # .grad views: a next backward adds into the
            self.fold_clip()  # buffers themselves, nothing sees it begin: clipped now, as torch
        return norm

    @torch.no_grad()
    def fold_clip(self) -> None:
        """A backward after clip_grad_norm_ within one step (gradient accumulation): torch's clip
        scaled the grads it saw there and then, the later ones adding unscaled; the coefficient kept
        for step() scaled those too (a review's reproduction, 2026-12-07). Folded into the reduced
        shards before the new backward adds its own (called as it begins)."""
        self.engine.clip_pending = False
        if self._clip_coef is None:
            return
        if self.host is not None:
            raise RuntimeError(f"{NAME}: a backward after clip_grad_norm_ in the same step under offload (its host "
                               "copies of the grads are not rescaled): call clip_grad_norm_ after the step's last "
                               "backward, or pass max_grad_norm to the Optimizer")
        for u in self.engine.units:
            if u.has_grad():
                u.grad_shard().mul_(self._clip_coef)
        self._clip_coef = self._clipped_norm = None

    def _per_param_norms(self, sums: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
        """sums (pieces, k) of this rank's squares -> (pieces, k) summed over every rank's pieces
        of the same params; idx: the pieces' param indices on the device (None: no piece)."""
        eng = self.engine
        full = torch.zeros((len(eng.params), sums.shape[1]), dtype=torch.float32, device=sums.device)
        if idx is not None:
            full.index_add_(0, idx, sums)
        self._global_sumsq(full.reshape(-1))
        if eng.tp_comm is not None:
            # a TP-sharded param's norm adds up over its slices; a replicated one's is TP rank 0's on
            # every TP rank: the TP ranks' buffers are cut into DP pieces at other places where an
            # embedding's rows split unevenly (vocab 67 over tp 2), so the DP sums above add in other
            # orders there, and LAMB's trust ratios then moved a replicated param apart across the TP
            # ranks by an ulp a step (a review's reproduction, 2026-12-06)
            mask = self.__dict__.get("_tp_mask")
            if mask is None:  # made once
                mask = self._tp_mask = upload(torch.tensor(eng.tp_sharded), full.device).unsqueeze(1)
            if eng.tp_rank != 0:
                full = full * mask
            eng.tp_comm.all_reduce_coalesced([full], op="sum").wait()
        return full[idx] if idx is not None else sums
