"""The pipeline runtime: executes one rank's action list (zerofuse.pipeline.schedules) on its stages.

    pipe = Pipeline(stages, schedule="1f1b", microbatches=8, group=pp_group)
    loss = pipe.step(idx, targets)   # forward + backward of every micro-batch; then optimizer.step()

Every rank of the pipeline group calls ``step`` with a batch of the same shape (only the first
stage reads ``idx``, only the last ``targets``); the batch is cut into ``microbatches`` along dim 0
and the loss returned (on every rank) is the mean of the micro-batches' losses, the backward
scaled by 1/m, so the grads equal single-process training on the whole batch where each
micro-batch's loss is a mean over the same number of items (as torch.distributed.pipelining and
Megatron: with ignore_index targets spread unevenly over the micro-batches it is the mean of their
means, not the whole batch's token mean). ``step`` trains (grad enabled); ``forward_only``
evaluates, both under the caller's autocast (the stage boundaries are agreed per mode).

Transfers between stages: zerofuse.pipeline.transfers ([Note: pipeline transfers]).
The actions: zerofuse/pipeline/forward.py (F) and backward.py (B, I, W).

[Note: zero-bubble split] For "zb" a backward is split into I (input grads) and W (weight grads).
During forward every module with params of its own records its outputs. I computes the grads of
the stage inputs and of those outputs (graph kept); W asks autograd, module by module, for the
grads of that module's own params from its outputs' saved grads: the engine runs only the edges
that lead to those params (the weight GEMMs, no input grad again). The grads are added to .grad
and handed to a ZeRO stage as one backward's (ZeroEngine.grads_ready). A fused loss head, whose
grads are made in its forward and backward once, gets its weight grads in I, and so does every
param W would not give its whole grad ([Note: zero-bubble coverage] in zerofuse/pipeline/zb.py).

ZeRO: a stage made data-parallel by zerofuse.zero.parallelize accumulates its grads over the
micro-batches under no_sync() and reduces them during its last backward (the action before the
schedule's REDUCE_GRAD), overlapping the rest of the pipeline's backward.
"""
from __future__ import annotations

import contextlib
import numbers
import time

import torch

from zerofuse.comm import Communicator
from zerofuse.pipeline.backward import Backwards
from zerofuse.pipeline.forward import NAME, Forwards
from zerofuse.pipeline.schedules import SCHEDULES, build_schedule, stage_to_rank
from zerofuse.pipeline.stage import Stage
from zerofuse.pipeline.transfers import Transfers
from zerofuse.pipeline.zb import ZeroBubble

_current: list = [None]


def _check_batch(who: str, idx, targets) -> None:
    for what, t in (("idx", idx), ("targets", targets)):
        if (t is not None or what == "idx") and not isinstance(t, torch.Tensor):
            raise ValueError(f"{NAME}.{who}: expected {what} as a tensor (the whole batch, every rank passes it), "
                             f"got {type(t).__name__}")
    if targets is None or targets.shape[0] != idx.shape[0]:
        raise ValueError(f"{NAME}.{who}: expected targets with the batch's {idx.shape[0]} rows (the last stage "
                         f"computes the loss, every rank passes them), got "
                         f"{None if targets is None else list(targets.shape)}")


def current_action():
    """The schedule action (zerofuse.pipeline.Action: kind F/B/I/W, stage, micro-batch) this
    process is running now, None outside a pipeline step's compute; for instrumentation."""
    return _current[0]


class Pipeline(Transfers, Forwards, Backwards):
    """One rank's part of a pipeline: its stages, the schedule's action list for this rank, and
    the transfers to its neighbours (see the module docstring). ``step`` trains one batch,
    ``forward_only`` evaluates one (both with the batch's ``document_ids`` for packed documents,
    chunked into micro-batches as the batch: every rank passes them); after a step, ``compute_seconds`` / ``step_seconds`` give this
    rank's busy and wall time, ``timeline`` its compute actions, ``peak_live`` the most
    micro-batches each stage held."""

    def __init__(self, stages, *, schedule: str = "1f1b", microbatches: int, group=None, comm: Communicator | None = None,
                 zero_module=None, zero3_reshard: str = "microbatch"):
        """stages: this rank's stages (ids rank, rank + p, ...); group: the pipeline group (None:
        the default group); zero_module: the module zerofuse.zero.parallelize made data-parallel
        when it is not each stage itself (e.g. ``merge_stages`` of a rank's virtual stages): its
        grads reduce during the rank's last backward of the step. zero3_reshard, for ZeRO-3
        stages: "microbatch" (default: each unit gathered for each micro-batch's forward and again
        for its backward and freed after, as without a pipeline: the least memory, 2 all-gathers
        per unit and micro-batch) or "step" (a unit gathered at its first use stays gathered until
        the stage's last backward of the step: 1 all-gather per unit and step, the stage's params
        whole for the step, as torchtitan does under PP)."""
        if isinstance(stages, torch.nn.Module):  # one stage (torch.distributed.pipelining's schedules take one)
            stages = [stages]
        stages = list(stages)
        if not stages:
            raise ValueError(f"{NAME}: expected at least one stage, got none")
        # (a bare AttributeError before; a torch.compile'd Stage is one)
        if bad := [type(s).__name__ for s in stages if not isinstance(getattr(s, "_orig_mod", s), Stage)]:
            raise ValueError(f"{NAME}: expected stages to be zerofuse.pipeline.Stage (from split_gpt or split_modules), "
                             f"got {bad}")
        self.group = group
        self.comm = comm or Communicator(group)
        p, r = self.comm.world_size, self.comm.rank
        v = len(stages)
        num = stages[0].num_stages
        held = self._agree_settings(schedule, microbatches, v, num,  # before any check one rank alone may fail
                                    [s.index for s in stages])
        if isinstance(microbatches, bool) or not isinstance(microbatches, numbers.Integral) or microbatches < 1:
            raise ValueError(f"{NAME}: expected microbatches to be an int >= 1, got {microbatches!r}")
        if num != p * v:
            raise ValueError(f"{NAME}: expected {p} (pipeline size) x {v} (stages on this rank) = {p * v} stages in the "
                             f"model, got a split into {num}")
        # every rank's stages, checked on every rank (one rank's own check left its peers waiting in
        # the first step's transfers: split_gpt(model, p, [0]) on each, a review, 2026-12-07)
        if bad := [f"rank {q} of {p} must hold stages {[q + k * p for k in range(v)]} (stage s on rank s % p), got "
                   f"{idx}" for q, idx in enumerate(held) if idx != [q + k * p for k in range(v)]]:
            raise ValueError(f"{NAME}: {'; '.join(bad)}")
        self.stages = {s.index: s for s in stages}
        self.p, self.v, self.m, self.num_stages, self.rank = p, v, microbatches, num, r
        self._broken: str | None = None  # the error of a step that raised midway (_refuse_broken)
        self._tag_base = 0  # (Transfers._tag: forward_only's tags after step's)
        self.schedule = schedule
        self.actions = build_schedule(schedule, p, microbatches, v)[r]
        last = {}
        for i, a in enumerate(self.actions):
            if a.kind in ("B", "W"):
                last[a.stage] = i
        self._last_backward = last
        self._engine = getattr(zero_module, "_zerofuse_zero", None) if zero_module is not None else None
        if zero_module is not None and self._engine is None:
            raise ValueError(f"{NAME}: expected zero_module to be made data-parallel by zerofuse.zero.parallelize, got "
                             f"a plain {type(zero_module).__name__}")
        self._last_any = max(last.values(), default=-1)
        # compute action index -> the receives due right after it ([Note: pipeline transfers])
        self._ahead: dict[int, list] = {}
        compute_i = None
        for i, a in enumerate(self.actions):
            if a.kind.startswith("RECV") and compute_i is not None:
                self._ahead.setdefault(compute_i, []).append(a)
            elif not a.kind.startswith(("SEND", "RECV")):
                compute_i = i
        engines = [self._engine] if self._engine is not None else [getattr(s, "_zerofuse_zero", None) for s in stages]
        if self._engine is not None and self._engine.stage == 3:
            raise ValueError(f"{NAME}: zero_module is never run itself (its stages are): ZeRO-3 gathers the params "
                             "outside its blocks (embeddings, final norm, head) in its forward, and the stages read "
                             "them unfilled (NaN losses: a review's reproduction, 2026-12-07); expected zero_module "
                             "made data-parallel with ZeRO stage 0, 1 or 2, got ZeRO-3")
        if sum(e is not None for e in engines) > 1:
            raise ValueError(f"{NAME}: {v} stages on this rank each made data-parallel on its own: each one's "
                             "optimizer would clip (and check fp16 overflow, LAMB/LARS trust ratios) by its own "
                             "stages' part of the grad norm (a review's reproduction, 2026-12-07); expected them "
                             "merged, zerofuse.zero.parallelize(zerofuse.pipeline.merge_stages(stages), ...) passed "
                             "as zero_module")
        if schedule == "zb" and any(e is not None and e.stage == 3 for e in engines):
            raise ValueError(f"{NAME}: schedule 'zb' needs the stage's weights whole until its W pass; expected ZeRO "
                             "stage 0, 1 or 2 with it, got ZeRO-3 (use '1f1b')")
        if zero3_reshard not in ("microbatch", "step"):
            raise ValueError(f"{NAME}: expected zero3_reshard 'microbatch' or 'step', got {zero3_reshard!r}")
        self._hold = [e for e in engines if e is not None and e.stage == 3] if zero3_reshard == "step" else []
        # tied embeddings over two ranks ([Note: tied embeddings across stages], transfers.py)
        tied = {s.tied[0]: (s.tied_mirror() if s.tied[0] == "mirror" else s.tied[1])
                for s in stages if getattr(s, "tied", None) is not None}
        self._tied_source, self._tied_mirror = tied.get("source"), tied.get("mirror")
        if tied and any(e is not None and e.stage == 3 for e in engines):
            raise ValueError(f"{NAME}: tied embeddings split over two pipeline ranks need the first stage's weight "
                             "whole to send it; expected ZeRO stage 0, 1 or 2, got ZeRO-3 (or untie them: "
                             "GPTConfig(tie_embeddings=False))")
        if tied:
            self._agree_tied()
        for e in engines:  # (the norm of a stage alone clipped each stage by its own: a review's reproduction)
            if e is not None and e.pp_size != p:
                raise ValueError(f"{NAME}: expected the stages made data-parallel with the pipeline group, "
                                 "zerofuse.zero.parallelize(stage, ..., pp_group=<the pipeline group>): the grad "
                                 "norm (clipping), LAMB/LARS trust ratios and the fp16 overflow check span every "
                                 f"stage; got a stage parallelized with a pipeline group of {e.pp_size} rank(s) in "
                                 f"a pipeline of {p}")
        self._specs: dict = {}  # (stage, micro-batch shape, mode) -> [(shape, dtype, requires_grad)] of its output
        self._saved_outputs: dict = {}  # (stage, micro-batch shape, mode, training) -> per output: saved by autograd
        self._mode: tuple = ()  # what an output's dtype and flags depend on besides the shape (_set_batch)
        self._split = schedule == "zb"
        # [Note: zero-bubble coverage] (pipeline/zb.py): which params W gives grads to
        self._zb = ZeroBubble(stages, self._tied_mirror, num) if self._split else None
        # per step, measured: seconds of compute (F/B/I/W) and of the whole step, live activations
        self.compute_seconds = 0.0
        self.step_seconds = 0.0
        self.timeline: list[tuple[str, float, float]] = []
        self.peak_live: dict[int, int] = {}

    # ------------------------------------------------------------------ zero-bubble hooks


    def _agree_settings(self, schedule, m, v: int, num: int, mine: list[int]) -> list[list[int]]:
        """At construction, before any check one rank alone may fail, the pipeline's ranks compare
        their schedule, micro-batch count and stages: ranks built apart (microbatches 4 and 2, or
        1f1b and gpipe) waited out the communicator's timeout on a receive that never came, or gloo
        aborted a process on a transfer's tag reused for another size (a review's reproduction,
        2026-12-07). One all-gather, refused on every rank; the same bad value on every rank is then
        refused by name by each. Returns each rank's stage indices (mine: this rank's; a second
        all-gather, its length agreed by the first)."""
        if self.comm.world_size == 1:
            return [mine]
        from zerofuse.zero.layout import gather_rows  # noqa: PLC0415
        known = isinstance(schedule, str) and schedule in SCHEDULES
        whole = isinstance(m, numbers.Integral) and not isinstance(m, bool) and -2 ** 62 < m < 2 ** 62
        settings = torch.tensor([SCHEDULES.index(schedule) if known else -1, m if whole else -2 ** 62, v, num],
                                dtype=torch.int64)
        rows = gather_rows(settings, self.comm).tolist()
        if any(row != rows[0] for row in rows):
            seen = "; ".join(f"rank {r}: schedule {repr(SCHEDULES[s]) if s >= 0 else 'unknown'}, microbatches "
                             f"{m if m != -2 ** 62 else 'not an int'}, {v} stage(s) of {n}"
                             for r, (s, m, v, n) in enumerate(rows))
            raise ValueError(f"{NAME}: expected the same schedule, microbatches and split on every pipeline rank, got "
                             f"{seen}")
        return gather_rows(torch.tensor(mine, dtype=torch.int64), self.comm).tolist()

    def _check_no_recompute(self) -> None:
        """'zb' and activation checkpointing: its W pass is a second backward through each block,
        module by module: full checkpointing recomputed every block once per module with params
        (8 forwards of a GPT block per micro-batch, measured: 1f1b's 2), and selective
        checkpointing allows one backward only (the step raised torch's error at the first W)."""
        from zerofuse.models.recompute import mode_of
        for s in self.stages.values():
            mode = mode_of(s.checkpointing()) if hasattr(s, "checkpointing") else "none"
            if mode != "none":
                raise ValueError(f"{NAME}: schedule 'zb' with activation_checkpointing {mode!r}: its weight-grad "
                                 "pass is a second backward through each block (recomputing the block once per "
                                 "module, or refused by selective checkpointing); expected activation_checkpointing "
                                 "'none' with 'zb', or schedule '1f1b' or 'interleaved' with checkpointing")

    # ------------------------------------------------------------------ the step

    def step(self, idx: torch.Tensor, targets: torch.Tensor, *, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        t_step = time.perf_counter()
        m = self.m
        _check_batch("step", idx, targets)
        if idx.shape[0] % m or not idx.shape[0]:
            raise ValueError(f"{NAME}.step: expected the batch size ({idx.shape[0]}) to be a positive multiple of the "
                             f"number of micro-batches ({m})")
        if not torch.is_grad_enabled():
            raise RuntimeError(f"{NAME}.step trains (forward and backward): called with grad disabled "
                               "(torch.no_grad()); evaluate with forward_only")
        if self._split:
            self._check_no_recompute()
        mbs, tgts, docs = idx.chunk(m), targets.chunk(m), self._documents(idx, document_ids, m)
        self._refuse_broken("step")
        try:
            return self._step(mbs, tgts, docs, idx.device, t_step)
        except BaseException as e:  # the other ranks are left inside the step: its transfers no longer pair
            self._mark_broken(e)
            raise

    def _step(self, mbs, tgts, docs, device, t_step) -> torch.Tensor:
        m = self.m
        self._set_batch(mbs[0])
        for k, stage in self.stages.items():  # the gradient of the last stage's loss, for the MoE router
            if stage.moe_layers:  # losses other stages train through their outputs (stage.py)
                opt = self._optimizer_of(k)
                stage.loss_weight = opt.scale_loss(torch.full((), 1.0 / m, device=self._device)) \
                    if opt is not None and opt.fp16 else 1.0 / m
        self._inputs, self._outputs, self._grads_in, self._ys, self._losses = {}, {}, {}, {}, {}
        self._recv, self._sends, self._posted = {}, [], {}
        early = device.type == "cpu"  # gloo: receives may be posted ahead ([Note: pipeline transfers])
        self.timeline = []  # (action, start, end) in seconds from the step's start: this rank's compute
        for eng in self._hold:
            eng.hold_params = True
        live = {s: 0 for s in self.stages}
        self.peak_live = dict(live)
        compute = 0.0
        pending_comm = []
        for i, a in enumerate(self.actions):
            if a.kind.startswith(("SEND", "RECV")):
                pending_comm.append(a)
                continue
            if pending_comm:
                self._communicate(pending_comm)
                pending_comm = []
            if early and i in self._ahead:
                self._post_early(self._ahead[i])
            t0 = time.perf_counter()
            _current[0] = a
            if a.kind == "F":
                self._forward(a, mbs, tgts, docs)
                live[a.stage] += 1
                self.peak_live[a.stage] = max(self.peak_live[a.stage], live[a.stage])
            elif a.kind in ("B", "I", "W"):
                if self._tied_source is not None and a.stage == 0 and i == self._last_backward[0]:
                    self._add_tied_grad()
                with self._sync_ctx(a.stage, i):
                    getattr(self, "_backward_" + a.kind)(a)
                if a.kind != "W":
                    live[a.stage] -= 1
            _current[0] = None
            t1 = time.perf_counter()
            compute += t1 - t0
            self.timeline.append((str(a), t0 - t_step, t1 - t_step))
        if pending_comm:
            self._communicate(pending_comm)
        if self._tied_mirror is not None:
            self._send_tied_grad()
        for w in self._sends:
            w.wait()
        self._sends = []
        if self._tied_mirror is not None:
            self._tied_mirror.grad = None  # sent: the first stage's weight holds the sum
        # the schedule's time: the loss's all-reduce below is reporting, not part of it
        self.compute_seconds, self.step_seconds = compute, time.perf_counter() - t_step
        return self._mean_loss()

    def _set_batch(self, mb: torch.Tensor) -> None:
        """The micro-batch shape, device and mode the boundaries' headers are agreed for
        ([Note: pipeline transfers]): every rank computes the same key without communicating."""
        self._mb_shape, self._device = tuple(mb.shape), mb.device
        dev = mb.device.type
        self._mode = (torch.is_grad_enabled(), torch.is_autocast_enabled(dev),
                      torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None)

    def _sync_ctx(self, stage: int, i: int):
        if self._engine is not None:
            eng, last = self._engine, self._last_any
        else:
            eng, last = getattr(self.stages[stage], "_zerofuse_zero", None), self._last_backward[stage]
        if eng is None or last == i:
            if eng is not None:
                eng.hold_params = False  # zero3_reshard="step": the last backward frees the units
            return contextlib.nullcontext()
        return eng.no_sync()

    @torch.no_grad()
    def forward_only(self, idx: torch.Tensor, targets: torch.Tensor, *,
                     document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The loss of one batch through every stage (evaluation: no micro-batches, no backward),
        on every rank."""
        from zerofuse.pipeline.schedules import Action

        _check_batch("forward_only", idx, targets)
        docs = self._documents(idx, document_ids, 1)
        self._refuse_broken("forward_only")
        self._set_batch(idx)
        self._inputs, self._outputs, self._losses, self._recv, self._sends, self._posted = {}, {}, {}, {}, [], {}
        m, self.m = self.m, 1
        self._tag_base = 4 * self.num_stages * m + 3  # (after step's tags and _tied_tag's)
        try:
            for s in sorted(self.stages):
                if s > 0 and s - 1 not in self.stages:
                    self._communicate([Action("RECV_F", s, 0, stage_to_rank(s - 1, self.p))])
                self._forward(Action("F", s, 0), [idx], [targets], docs)
                if s < self.num_stages - 1 and s + 1 not in self.stages:
                    self._communicate([Action("SEND_F", s, 0, stage_to_rank(s + 1, self.p))])
            for w in self._sends:
                w.wait()
            self._sends = []
            return self._mean_loss()
        except BaseException as e:  # (as step's)
            self._mark_broken(e)
            raise
        finally:
            self.m, self._tag_base = m, 0
            self._inputs, self._outputs = {}, {}

    def _mark_broken(self, e: BaseException) -> None:
        if self.p > 1:  # (one rank: no peer is left waiting; the next step starts afresh)
            self._broken = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def _refuse_broken(self, what: str) -> None:
        """A step that raised on this rank midway left the other ranks inside it, waiting for
        transfers that will not come (they raise at the communicator's timeout): the next step here
        would pair its transfers with theirs, hang or mix micro-batches. Refused at once."""
        if self._broken is not None:
            raise RuntimeError(f"{NAME}.{what}: an earlier step raised on this rank midway ({self._broken}); the "
                               "other ranks' steps wait for it until the communicator's timeout. Expected a new "
                               "Pipeline (and process group) on every rank after an error in a step")

    def remove_hooks(self) -> None:
        if self._zb is not None:
            self._zb.remove()
