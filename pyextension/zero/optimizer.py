"""``zerofuse.zero.Optimizer``: the optimizer of a ZeRO model; each rank steps only its shard.

Per unit the rank holds fp32 states for its shard (m and v for Adam/AdamW/LAMB, the momentum
buffer for LARS) and, when params are bf16/fp16, an fp32 master copy; fp32 params are stepped in
place. A step is one fused launch per param group over every unit's shard (Adam/AdamW: adjacent
pieces of the same group are merged into one flat view; LAMB/LARS: one view per param piece, with
the per-param norms summed over the ranks between the passes). Grads arrive averaged (the
engine pre-divides); the loss-scale unscale and the clip coefficient are one device tensor read by
the kernel, so nothing waits on the host.

Torch's surfaces hold: ``state[p]`` is populated for every param with a piece on this rank
(``step``, the moments and, for bf16/fp16 params, ``master``: 1-D views of this rank's piece of the
flat states, so writing them writes the optimizer's state), ``zero_grad(set_to_none=...)`` frees or
zero-fills the grad shards, and ``state_dict()`` has torch.optim's layout (``state[index]`` holding
this rank's pieces, ``param_groups`` with param indices) plus a ``zerofuse`` entry with the layout
it belongs to. Unlike torch.optim (as DeepSpeed's ZeRO): a param that got no grad in a step is
stepped with a zero grad (its decay applied, its moments advanced; one step count per group), the
groups are fixed at construction (add_param_group refused), and torch options it does not implement
(maximize, amsgrad, ...) are refused in param groups.

fp16: ``scale_loss(loss)`` multiplies by the dynamic loss scale; every step computes the global
grad norm (one all-reduce of a scalar): inf/NaN on any rank gives inf/NaN on every rank, so every
rank skips the same step (the kernels read the flag: [Note: skipped steps] in optim/_base.py) and
the scale backs off; after ``growth_interval`` clean steps it grows.
"""
from __future__ import annotations

import weakref

import torch

from zerofuse.ops._optim import StepPlans
from zerofuse.optim._base import check_real
from zerofuse.zero.engine import engine_of
from zerofuse.zero.grad_norm import GradNorms
from zerofuse.zero.grads import check_step_grads
from zerofuse.zero.torch_guards import stepped_grads_added
from zerofuse.zero.group_steps import GroupSteps
from zerofuse.zero.options import DEFAULTS, NAME, STATE_KEYS, check_group_keys, check_options, check_scaler
from zerofuse.zero.optimizer_state import OptimizerState


class _Piece:
    """[start, start + length) of one unit's shard, owned by one param group; ``param`` is the
    global param index for a single param's piece (LAMB/LARS), None for a merged run (Adam)."""

    __slots__ = ("unit", "start", "length", "param")

    def __init__(self, unit, start, length, param):
        self.unit, self.start, self.length, self.param = unit, start, length, param


class Optimizer(GroupSteps, GradNorms, OptimizerState, torch.optim.Optimizer):
    """Optimizer(model, optimizer="adamw"|"adam"|"lamb"|"lars", *, param_groups=None,
    max_grad_norm=None, initial_scale=2**16, growth_interval=1000, min_scale=None, offload_overlap=True,
    delayed_update=False, delayed_update_warmup=0, **hyperparameters).

    param_groups: None (one group) or torch-style dicts {"params": [model params], **overrides},
    e.g. no weight decay for norms and biases. max_grad_norm: clip every step (None or 0: no clipping;
    LAMB's None is 1.0, as Apex); or call clip_grad_norm_ before step. lr schedulers work unchanged.
    fp16's dynamic loss scale: as torch.amp.GradScaler's (initial_scale, growth_factor, backoff_factor,
    growth_interval), never below min_scale (default 1, DeepSpeed's min_loss_scale, or initial_scale
    when that is lower; zerofuse-train stops with an error when every step of a log window was
    skipped at it).
    offload_overlap (a model parallelized with offload): True steps each unit on the host during
    backward when nothing global stands in the way (no max_grad_norm, no fp16); False always waits
    for step() (e.g. to call clip_grad_norm_ on some steps) ([Note: offloaded steps]).
    delayed_update (offload): ZeRO-Offload's one-step-delayed update after delayed_update_warmup
    undelayed steps ([Note: delayed parameter update])."""

    def __init__(self, model: torch.nn.Module, optimizer: str = "adamw", *, param_groups=None, max_grad_norm=None,
                 initial_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, min_scale: float | None = None, offload_overlap: bool = True,
                 delayed_update: bool = False, delayed_update_warmup: int = 0, **hyperparameters):
        eng = engine_of(model, NAME)
        if optimizer not in DEFAULTS:
            raise ValueError(f"{NAME}: expected optimizer 'adamw', 'adam', 'lamb' or 'lars', got {optimizer!r}")
        unknown = set(hyperparameters) - set(DEFAULTS[optimizer])
        if unknown:
            raise TypeError(f"{NAME}: unknown hyperparameter(s) {sorted(unknown)} for {optimizer!r}; expected some of "
                            f"{sorted(DEFAULTS[optimizer])}")
        defaults = {**DEFAULTS[optimizer], **hyperparameters}
        if optimizer in ("lamb", "lars") and eng.edp_comm is not None:  # a trust ratio per stacked-experts param
            raise ValueError(f"{NAME}: expected optimizer 'adamw' or 'adam' with expert-parallel params (a "
                             f"{optimizer} trust ratio over this rank's experts would differ from one process's "
                             f"over all of them), got {optimizer!r}")
        if eng.offload is not None and optimizer not in ("adam", "adamw"):
            raise ValueError(f"{NAME}: expected optimizer 'adamw' or 'adam' with offload={eng.offload!r} (the host "
                             f"steps run unit by unit; {optimizer}'s trust ratios need every unit's norms), got "
                             f"{optimizer!r}")
        if optimizer == "lamb" and max_grad_norm is None:  # as Apex; 0 turns it off (zerofuse-train --clip 0
            max_grad_norm = 1.0  # with LAMB clipped at 1.0 when 0 was taken as "not given")
        check_options(defaults, "")
        check_real(NAME, "max_grad_norm", max_grad_norm, none=True)
        if max_grad_norm is not None and not max_grad_norm >= 0:
            raise ValueError(f"{NAME}: expected max_grad_norm >= 0 or None (0: no clipping), got {max_grad_norm}")
        max_grad_norm = max_grad_norm or None
        if min_scale is None:  # (1, DeepSpeed's min_loss_scale; an initial scale below it is its own floor)
            min_scale = min(1.0, initial_scale) if isinstance(initial_scale, (int, float)) else 1.0
        check_scaler(initial_scale, growth_factor, backoff_factor, growth_interval, min_scale)
        self.engine, self.kind, self.max_grad_norm = eng, optimizer, max_grad_norm
        eng.optimizer_ref = weakref.ref(self)
        groups = self._groups(eng, param_groups)
        for i, g in enumerate(groups):  # a group's own options (the defaults are checked above)
            check_options({k: v for k, v in g.items() if k != "params"}, f"param_groups[{i}]")
            check_group_keys(g, optimizer, f"param_groups[{i}]")
        super().__init__(groups, defaults)
        self._built = True  # (add_param_group: refused from here on)
        self._group_of = {}
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                self._group_of[id(p)] = gi
        self._plans = StepPlans()
        self._build_states()
        dev = eng.params[0].device
        self._steps = [torch.zeros(1, dtype=torch.float32, device=dev) for _ in self.param_groups]
        self._expose_states()
        self._clip_coef = None
        self.last_grad_norm: torch.Tensor | None = None
        self.fp16 = eng.dtype == torch.float16
        self.scale = torch.full((1,), float(initial_scale) if self.fp16 else 1.0, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.zeros(1, dtype=torch.int32, device=dev)
        self._scaler_cfg = (float(growth_factor), float(backoff_factor), int(growth_interval))
        self.min_scale = float(min_scale)
        self._found_inf: torch.Tensor | None = None
        self.last_step_skipped: torch.Tensor | None = None  # found_inf of the last step (fp16 / clipping)
        self.host = None
        self._device_lr: list[torch.Tensor] | None = None  # sync_lr's, per group
        if not isinstance(offload_overlap, bool):
            raise TypeError(f"{NAME}: expected offload_overlap to be a bool, got {offload_overlap!r}")
        self.offload_overlap = offload_overlap
        from zerofuse.zero.offload import HostSteps, check_delayed
        check_delayed(eng, delayed_update, delayed_update_warmup)
        self.delayed_update, self.delayed_update_warmup = delayed_update, delayed_update_warmup
        if eng.offload is not None:
            self.host = HostSteps(self)
            eng.buckets.on_reduced = self.host.grad_ready

    @staticmethod
    def _groups(eng, param_groups):
        if param_groups is None:
            return [{"params": list(eng.params)}]
        seen: dict[int, int] = {}  # id(param) -> its group
        out = []
        for i, g in enumerate(param_groups):
            if not isinstance(g, dict) or "params" not in g:
                got = f"a dict with keys {sorted(g)}" if isinstance(g, dict) else type(g).__name__
                raise TypeError(f"{NAME}: expected param_groups[{i}] to be a dict with 'params', got {got}")
            ps = list(g["params"])
            for p in ps:
                if id(p) not in eng.param_index:
                    raise ValueError(f"{NAME}: param_groups[{i}] holds a tensor of shape {list(p.shape)} that is not a "
                                     "trainable parameter of the model")
                if id(p) in seen:
                    name = eng.names[eng.param_index[id(p)]]
                    where = "twice" if seen[id(p)] == i else f"and in param_groups[{seen[id(p)]}]"
                    raise ValueError(f"{NAME}: expected each parameter in one param group once, got {name} in "
                                     f"param_groups[{i}] {where}")
                seen[id(p)] = i
            out.append({**g, "params": ps})
        rest = [p for p in eng.params if id(p) not in seen]
        if rest:
            raise ValueError(f"{NAME}: {len(rest)} trainable parameter(s) are in no param group, e.g. "
                             f"{eng.names[eng.param_index[id(rest[0])]]}")
        return out

    # ------------------------------------------------------------------ layout and states

    def _build_states(self) -> None:
        eng = self.engine
        low = eng.dtype != torch.float32
        self.unit_states = []
        for u in eng.units:
            host = u.index in eng.host_units  # in host memory (pinned for a GPU's copies), with fp32 masters
            kw = dict(device="cpu", pin_memory=eng.device.type == "cuda") if host else {}
            st = {k: torch.zeros(u.shard_numel, dtype=torch.float32, **(kw or dict(device=u.device)))
                  for k in STATE_KEYS[self.kind]}
            if low or host:
                st["master"] = torch.empty(u.shard_numel, dtype=torch.float32, **kw) if host else u.shard.float()
                if host:
                    st["master"].copy_(u.shard)
            self.unit_states.append(st)
        self._runs = [[] for _ in self.param_groups]  # merged runs (Adam/AdamW)
        self._pieces = [[] for _ in self.param_groups]  # one per param piece (LAMB/LARS)
        for u in eng.units:
            for s in u.segments:
                p = u.params[s.param]
                gi = self._group_of[id(p)]
                self._pieces[gi].append(_Piece(u, s.shard_offset, s.length, eng.param_index[id(p)]))
                runs = self._runs[gi]
                if runs and runs[-1].unit is u and runs[-1].start + runs[-1].length == s.shard_offset:
                    runs[-1].length += s.length
                else:
                    runs.append(_Piece(u, s.shard_offset, s.length, None))
        # the runs the device steps (with offload, the host's units are HostSteps' business)
        self._device_runs = [[r for r in runs if r.unit.index not in eng.host_units] for runs in self._runs]

    def _expose_states(self) -> None:
        """state[p]: views of this rank's piece of p in the flat states (see the module doc)."""
        eng = self.engine
        self.state.clear()
        for u, st in zip(eng.units, self.unit_states):
            for sg in u.segments:
                p = u.params[sg.param]
                # (LARS counts no steps, as FusedLARS and torch's SGD: a "step" that stayed 0 before)
                entry = {"step": self._steps[self._group_of[id(p)]].view(())} if self.kind != "lars" else {}
                entry.update({k: t.narrow(0, sg.shard_offset, sg.length) for k, t in st.items()})
                self.state[p] = entry

    # ------------------------------------------------------------------ step

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss times the dynamic loss scale (fp16; 1 otherwise): call backward on this."""
        # (the product in fp32, as GradScaler's: cast to an fp16 loss the scale 2**16 made the scaled
        # loss inf. Its backward still hands an fp16 loss the scale as its gradient, inf in fp16 at
        # 2**16, as GradScaler's does: a loss computed in fp16 skips steps until the scale is 2**15
        # or less; compute the loss in fp32, as zerofuse's models do)
        return (loss * self.scale).reshape(loss.shape) if self.fp16 else loss

    def abandon_step(self) -> None:
        """Forget a step begun and not finished (a failed CUDA graph capture, which ran nothing):
        the backward's bookkeeping, the grads, the clipping state (zero/grads.py abandon_backward)."""
        from zerofuse.zero.grads import abandon_backward
        abandon_backward(self.engine)
        self._clip_coef = self._found_inf = None
        self.engine.clip_pending = False
        for plan in self._plans.values():
            plan.release_grads()
        # what a capture built (launch tables, constants) holds device memory its uploads and fills
        # never reached: built again by the next eager step
        self._plans = StepPlans()
        self.__dict__.pop("_norm_prepared", None)

    @property
    def loss_scale(self) -> float:
        return float(self.scale.item())

    # torch.amp.GradScaler then hands its scale and found_inf to step() (grad_scale / found_inf),
    # which refuses them by name: its unscale_ reads .grad, None here (its bare "No inf checks were
    # recorded" AssertionError after a backward of x65536 grads, a review's reproduction, 2026-12-07)
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):
        if "found_inf" in self.__dict__ or "grad_scale" in self.__dict__:
            self.__dict__.pop("found_inf", None)  # (GradScaler's, left behind: a step without it goes on)
            self.__dict__.pop("grad_scale", None)
            raise RuntimeError(f"{NAME}.step: torch.amp.GradScaler cannot unscale a ZeRO model's gradients (they live "
                               "in zerofuse's shards, .grad is None: it saw none and the step would take them still "
                               "multiplied by its scale); train with parallelize(model, precision='fp16') and "
                               "opt.scale_loss(loss).backward(), the Optimizer's own dynamic loss scale (GradScaler's "
                               "rules), or in bf16, which needs none")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, g in enumerate(self.param_groups):  # options set on a group since (or loaded): as at construction
            check_group_keys(g, self.kind, f"param_groups[{gi}]")
            check_options(g, f"param_groups[{gi}]")
        eng = self.engine
        eng.check_trainable()
        # inside full_params: the block's writes so far reach the shards and masters first (the step ran
        # on those of before them, and stage 3's refresh of the gathered units then dropped them, stage
        # 1/2 bf16's masters put them back: a review's reproduction, 2026-12-07); outside it: nothing
        eng.flush_full_params()
        eng.finish_grad_sync()
        check_step_grads(eng, f"{NAME}.step")
        if eng.stale_added:  # (warned here, where the stale grads are used: a GAN's D, whose grads G's
            stepped_grads_added()  # backward adds to, zero_grads them before its next step)
        found = self._found_inf
        fused = None
        if self._clip_coef is None and self.max_grad_norm is not None:
            fused = self._fused_clip(self.max_grad_norm)  # one rank / stage 0: two kernels
        if fused is not None:
            mult, found, self.last_grad_norm = fused
        else:
            mult = self.scale.reciprocal()
            if self._clip_coef is None and (self.max_grad_norm is not None or self.fp16):
                norm = self._grad_norm()
                self.last_grad_norm = norm
                found = (~torch.isfinite(norm)).float()
                if self.max_grad_norm is not None:
                    self._clip_coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            elif self._clip_coef is not None and self.max_grad_norm is not None:  # on top of the caller's clip
                self._clip_coef = self._clip_coef * torch.clamp(self.max_grad_norm / (self._clipped_norm + 1e-6),
                                                                max=1.0)
            if self._clip_coef is not None:
                mult = mult * self._clip_coef
        for gi, group in enumerate(self.param_groups):  # (advances the step counters, offload or not)
            self._step_group(gi, group, mult, found)
        if self.host is not None:
            self.host.step(mult, found)
        if self.fp16:
            torch._amp_update_scale_(self.scale, self._growth_tracker, found, *self._scaler_cfg)
            self.scale.clamp_(min=self.min_scale)  # (backed off without a floor it reached 0: every later step skipped)
        self.last_step_skipped = found
        eng.stepped, eng.stale_added = True, False
        self._clip_coef = None
        self._found_inf = None
        eng.clip_pending = False
        if eng.stage != 3:
            eng.start_param_sync()
        else:
            eng._refresh_gathered()
        return loss

    @torch.no_grad()
    def apply_pending(self, who: str | None = None) -> None:
        """delayed_update: the last step's host update waited for and written to the params (a
        no-op without one); the next step's gradients are then taken at the updated params. Run
        before anything reads or writes the masters and states whole (state_dict, a load, a
        checkpoint): refused while the last backward's offloaded host steps run (offload_overlap:
        they are moving the masters and moments to the next step, whose count step() advances; a
        checkpoint saved then held the new values under the old count, a load was written over by
        them, or counted a step it never took: a review's reproduction, 2026-12-06)."""
        if self.host is not None and self.host.futures:
            raise RuntimeError(f"{who or NAME + '.Optimizer.apply_pending'}: the last backward started this step's "
                               "offloaded host steps (offload_overlap) and step() has not run: call step() first, or "
                               "build the Optimizer with offload_overlap=False to save or load between backward and step")
        if self.host is not None and self.host.apply_pending():
            self.engine.params_written()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """set_to_none=True (torch's default): the grad shards are freed until the next backward
        (except where a bucket keeps its buffer at a fixed address: stage 0, and stage 2 over one
        rank, as DDP keeps its buckets; over one rank without hooks autograd's .grad then lives
        beside it during backward: two copies of the grads, [Note: a world of one]); False: they
        are filled with zeros."""
        if self.host is not None and self.host.futures:
            raise RuntimeError(f"{NAME}.zero_grad: with offload the last backward already started its host steps "
                               "(offload_overlap): call step() before zero_grad(), or build the Optimizer with "
                               "offload_overlap=False to decide after backward")
        if self.host is not None:
            self.host.discard()
        self.engine.zero_grad(set_to_none)
        # a clip_grad_norm_ of the grads dropped here is dropped with them (torch's clipping edits
        # the grads; ours is applied by step() or the next backward's fold_clip: a stale one skipped
        # or scaled the next step)
        self._clip_coef = self._found_inf = None
        self.engine.clip_pending = False
        if set_to_none and self.engine.stage in (2, 3):  # the shards are freed: so are the plans' views of them
            for plan in self._plans.values():
                plan.release_grads()
