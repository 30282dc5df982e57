"""ZeRO-Offload (``zerofuse.zero.parallelize(..., offload="optimizer")``): the fp32 master weights,
exp_avg and exp_avg_sq of this rank's shards live in host memory (pinned when the params are on a
GPU) and the C++ CPU Adam/AdamW kernel steps them there, unit by unit. ``"optimizer+params"``
(stage 3) also keeps the param shards in host memory (Bucket.offload_shard: each gather copies
the shard up first; the host step writes it in place).

[Note: offloaded steps]
- A unit's grad shard goes to the host as soon as its reduction completes (BucketGroup.on_reduced,
  during backward): on CUDA a copy on a side stream into a pinned fp32 buffer, after an event on
  the stream that reduced it; on a CPU the grad shard already is host memory and is read in place.
- Without clipping and fp16 loss scaling nothing global stands between a unit's grad and its
  step, so the host step of that unit starts then, on the offload thread, while backward goes on
  (the overlap ZeRO-Offload lacks; ``Optimizer(offload_overlap=False)`` turns it off, e.g. to call
  clip_grad_norm_ on some steps). With clipping or fp16 the global grad norm (computed on the
  device from the shards, as without offload) must come first: every unit is stepped at
  ``step()``: on a GPU one after another on the offload thread, each unit's updated params copied
  back to the device (side stream) while the next is stepped; on a CPU all in one kernel call (the
  write-back is a plain copy there, and each call costs ~0.1 ms of its own: 3% of a 300M-param
  step in 25 MiB units, bench/results/cpu-2026-11-26/offload.md). A skipped step (fp16
  overflow) steps nothing.
- The step reads lr and the other options of its param groups when it starts: during backward in
  the overlapped case, so a change made between backward and step() applies from the next step.
- One reduction per unit and step: a second backward outside ``no_sync()`` before ``step()`` would
  add grads to a unit already stepped, and is refused; so is ``zero_grad()`` between such a
  backward and ``step()`` (the backward has committed the step: discarding it needs
  offload_overlap=False; then zero_grad drops the grads and their reductions, and a grad changed in
  ``full_grads`` is copied to the host again).
- Step counters advance once per step (each unit's kernel call advances a copy).

[Note: delayed parameter update]
``Optimizer(delayed_update=True)`` is ZeRO-Offload's DPU (Ren et al. 2021, section 5.2): step()
starts the host step of this step's grads on the offload thread and returns without waiting; the
next step() waits for it and writes its params back (then starts its own), so the host step of
step t runs during the forward and backward of step t+1 instead of between them. Numerics: the
masters follow Adam exactly, but each gradient is taken one update late: with w_t the masters
after t steps, w_{t+1} = w_t - lr * adam(g(w_{t-1})) (w_{-1} = w_0), where undelayed ZeRO-Offload
has g(w_t). The paper starts DPU after a few dozen undelayed steps, when the gradients change
slowly; the first ``delayed_update_warmup`` steps taken run undelayed (a skipped step is not one;
a resumed run counts the checkpoint's). The host step reads the param groups' options (lr) as
they were at its step(), not as the scheduler left them after it returned. A pending update is applied (waited
for and written to the params) by ``Optimizer.apply_pending()``, by ``state_dict()`` and
``load_state_dict()``: a checkpoint holds applied params, and a run resumed from it equals the run
that saved it from there on. Not with offload_ratio < 1 (the device's part would not be delayed).
"""
from __future__ import annotations

import concurrent.futures

import torch

from zerofuse.ops import adam_
from zerofuse.zero.options import NAME

OFFLOAD_MODES = (None, "optimizer", "optimizer+params")


def host_units(units, ratio: float) -> set[int]:
    """Twin flow (parallelize's offload_ratio): the units stepped on the host, the first ready in
    backward (``units`` in that order) until they hold ``ratio`` of the shard's elements; the rest step
    on the device with its own kernel, while the host steps the others."""
    total, out, acc = sum(u.shard_numel for u in units), set(), 0
    for u in units:
        if acc >= ratio * total:
            break
        out.add(u.index)
        acc += u.shard_numel
    return out


def auto_ratio(device: torch.device, group, numel: int = 1 << 22) -> float:
    """offload_ratio="auto": r = t_device / (t_host + t_device) for one AdamW step of ``numel`` fp32
    elements on each (the best of 3, after a warm-up), so that the host's r and the device's 1 - r
    of the shard take equal time; the mean over the group's ranks (every rank splits alike). On a
    CPU the two are the same kernel on the same cores: about 0.5. Measured again in every run, so a
    run that must repeat bit for bit on a GPU (host and device kernels round alike, not always
    identically) gives a number instead."""
    import time

    import torch.distributed as dist

    def best(dev):
        p, g, m, v = (torch.rand(numel, device=dev) for _ in range(4))
        step = torch.zeros(1, device=dev)
        times = []
        for _ in range(4):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            adam_([p], [g], [m], [v], [step], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                  decoupled=True)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
        return min(times[1:])

    t_host, t_dev = best(torch.device("cpu")), best(device)
    r = torch.tensor([t_dev / (t_host + t_dev)], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(r, group=group)
        r /= dist.get_world_size(group)
    return float(r.item())


def check_delayed(eng, delayed_update, warmup) -> None:
    """Optimizer's delayed_update / delayed_update_warmup ([Note: delayed parameter update])."""
    if not isinstance(delayed_update, bool):
        raise TypeError(f"{NAME}: expected delayed_update to be a bool, got {delayed_update!r}")
    if not (isinstance(warmup, int) and not isinstance(warmup, bool) and warmup >= 0):
        raise ValueError(f"{NAME}: expected delayed_update_warmup to be an int >= 0, got {warmup!r}")
    if delayed_update and eng.offload is None:
        raise ValueError(f"{NAME}: delayed_update=True delays the host step of an offloaded optimizer: expected a "
                         "model parallelized with offload='optimizer' or 'optimizer+params', got offload=None")
    if delayed_update and eng.offload_ratio < 1.0:
        raise ValueError(f"{NAME}: delayed_update=True with offload_ratio={eng.offload_ratio} would delay only the "
                         "host's part of the step: expected offload_ratio=1")


class HostSteps:
    def __init__(self, opt):
        self.opt, self.eng = opt, opt.engine
        self.cuda = self.eng.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.eng.device) if self.cuda else None
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zerofuse-offload")
        # per unit: [(group index, [(start, length), ...])] of its Adam runs
        self.units = [u for u in self.eng.units if u.index in self.eng.host_units]
        self.by_unit: list[list] = [[] for _ in self.eng.units]
        for gi, runs in enumerate(opt._runs):
            for r in runs:
                if r.unit.index not in self.eng.host_units:
                    continue
                entry = self.by_unit[r.unit.index]
                if not entry or entry[-1][0] != gi:
                    entry.append((gi, []))
                entry[-1][1].append((r.start, r.length))
        self.host_steps = [torch.zeros(1, dtype=torch.float32) for _ in opt.param_groups]
        self.grads: list[torch.Tensor | None] = [None] * len(self.eng.units)  # pinned fp32 (CUDA)
        self.events: list = [None] * len(self.eng.units)
        self.futures: dict[int, tuple] = {}  # unit -> (future, the units its call steps)
        self.reduced = [False] * len(self.eng.units)
        self.log: list[tuple[int, str]] = []  # (unit, "backward" | "step"): when each host step was launched
        self.last_log: list[tuple[int, str]] = []  # the last step's
        self.pending: dict[int, tuple] = {}  # delayed update: the last step's futures, not yet written back

    @property
    def delayed(self) -> bool:
        """Whether this step's host steps are left running past step() ([Note: delayed parameter update])."""
        # the steps taken (skipped ones are none) against the warm-up: the host counters, which a
        # checkpoint restores (load_steps), so a resumed run delays as the uninterrupted one
        return self.opt.delayed_update and self.host_steps[0].item() >= self.opt.delayed_update_warmup

    @property
    def overlapped(self) -> bool:
        """Whether a unit is stepped as soon as its grads arrive (nothing global to wait for)."""
        return (self.opt.offload_overlap and self.opt.max_grad_norm is None and not self.opt.fp16
                and not self.delayed)

    # ------------------------------------------------------------------ during backward

    def grad_ready(self, u) -> None:
        """BucketGroup.on_reduced: unit u's grad shard is final for this step."""
        if u.index not in self.eng.host_units:  # twin flow: stepped on the device at step()
            return
        if self.reduced[u.index]:
            raise RuntimeError(f"{NAME}: with offload='optimizer' each unit's grads are reduced once per step; a "
                               f"second backward reduced {u.name!r} again before step() (accumulate inside "
                               "model.no_sync(), or call step() between)")
        self.reduced[u.index] = True
        if self.delayed:  # the last step's host step may still read the host grads: copied at step()
            return
        self._to_host(u)
        if self.overlapped:
            self._submit(u, None, "backward")

    def _to_host(self, u) -> None:
        g = u.grad_shard()
        if not self.cuda:  # read in place, unless the host step outlives step() (the next backward writes g)
            self.grads[u.index] = g.float() if g.dtype != torch.float32 else g.clone() if self.delayed else g
            return
        if self.grads[u.index] is None:
            self.grads[u.index] = torch.empty(u.shard_numel, dtype=torch.float32, pin_memory=True)
        ready = torch.cuda.current_stream(self.eng.device).record_event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            self.grads[u.index].copy_(g, non_blocking=True)
            g.record_stream(self.stream)  # the shard may be freed (zero_grad) while the copy runs
            self.events[u.index] = self.stream.record_event()

    def grads_changed(self, u) -> None:
        """full_grads wrote unit u's grad shard after its reduction (the caller's clipping; no host
        step has started: the caller checked): the host copy taken then is taken again (the copy of
        before the edit was stepped: a review's reproduction, 2026-12-07)."""
        if self.reduced[u.index] and self.grads[u.index] is not None and not self.delayed:
            self._to_host(u)

    def discard(self) -> None:
        """zero_grad before step() with no host step started: this backward's grads are dropped, its
        reductions forgotten (they were stepped, and a next backward refused as a second one)."""
        self.reduced = [False] * len(self.eng.units)
        self.log = []
        # (the pinned buffers stay for the next copies, ordered on the copy stream; a pending delayed
        # update's host steps read its copies still)
        if not self.cuda and not self.pending:
            self.grads = [None] * len(self.eng.units)

    def _submit(self, u, mult: torch.Tensor | None, when: str = "step", units=None) -> None:
        """Unit u's host step (or, with ``units``, theirs in one kernel call per group) queued on
        the offload thread; its future is u's."""
        units = units or [u]
        self.log.extend((v.index, when) for v in units)
        groups = {}
        for v in units:
            for gi, runs in self.by_unit[v.index]:
                groups.setdefault(gi, []).extend((v.index, a, n) for a, n in runs)
        opt = self.opt
        # the groups' options as of now: the thread may run after step() returned (a delayed
        # update) and the scheduler wrote the next step's lr into the group
        args = [(_options(opt.param_groups[gi]), self.host_steps[gi].clone(), runs) for gi, runs in groups.items()]
        # the copies' events as of now: read by the thread when it starts, they were gone for every
        # unit still queued once step() reset them (_finish), and its host step read a pinned buffer
        # the copy had not reached (garbage at step 1, the last step's grads after; a review, 2026-12-07)
        copies = [self.events[v.index] for v in units]
        self.futures[u.index] = (self.pool.submit(self._step_units, units, args, mult, copies), units)

    def _step_units(self, units, args, mult, copies=()) -> None:
        """On the offload thread: the units' host Adam step (master, m, v in place), after their
        grads' device-to-host copies (``copies``: their events, None on a CPU)."""
        for event in copies:
            if event is not None:
                event.synchronize()
        states, grads = self.opt.unit_states, self.grads
        decoupled = self.opt.kind == "adamw"
        for group, step, runs in args:
            def views(key):
                return [(grads[i] if key is None else states[i][key]).narrow(0, a, n) for i, a, n in runs]
            b1, b2 = group["betas"]
            adam_(views("master"), views(None), views("exp_avg"), views("exp_avg_sq"), [step] * len(runs),
                  lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"],
                  decoupled=decoupled, grad_mult=mult)

    # ------------------------------------------------------------------ step()

    def step(self, mult: torch.Tensor, found: torch.Tensor | None) -> None:
        """After the grads are reduced (and the norm known): every unit stepped on the host and
        its params written back (zerofuse.zero.Optimizer.step calls it)."""
        eng = self.eng
        skip = found is not None and bool(found.item())
        self.apply_pending()
        if self.delayed:
            self._start_delayed(mult, skip)
            return
        if not self.overlapped:
            for u in self.units:
                if not self.reduced[u.index]:
                    self._to_host(u)
            if not skip:
                self._queue_all(mult.to("cpu", torch.float32).reshape(1))
        else:
            for u in self.units:  # units that got no grad this step still take their (decay-only) step
                if u.index not in self.futures:
                    self._to_host(u)
                    self._submit(u, None)
        futures, self.futures = self.futures, {}
        try:
            self._finish(futures)
        finally:
            self.last_log, self.log = self.log, []
            self.reduced = [False] * len(eng.units)
            if not self.cuda:  # grad shards read in place: not held past the step (zero_grad frees them)
                self.grads = [None] * len(eng.units)
        if not skip:  # (the device's counters advance in the device step, which runs for every group;
            for s in self.host_steps:  # after the path was chosen: `overlapped` reads them)
                s += 1.0

    def _queue_all(self, host_mult) -> None:
        """Every host unit's step queued: on a GPU one by one (each written back as it ends), on a
        CPU in one kernel call."""
        if self.cuda:
            for u in self.units:
                self._submit(u, host_mult)
        elif self.units:
            self._submit(self.units[0], host_mult, units=self.units)

    def _finish(self, futures: dict) -> None:
        """The queued host steps waited for in the units' order and their params written back; an
        error in one: the others finish before it is raised."""
        try:
            for u in self.units:
                if u.index in futures:
                    fut, stepped = futures[u.index]
                    fut.result()
                    for v in stepped:
                        self._write_back(v)
        finally:
            for f, _ in futures.values():
                f.cancel() or f.exception()
            self.events = [None] * len(self.eng.units)

    def _start_delayed(self, mult, skip: bool) -> None:
        """Every unit's host step queued; its params are written back by the next step()."""
        for u in self.units:
            self._to_host(u)
        if not skip:
            # (always the multiplier: the caller's clip_grad_norm_ is in it too; dropped without
            # max_grad_norm or fp16, the run was the unclipped one: a review's reproduction, 2026-12-06)
            self._queue_all(mult.to("cpu", torch.float32).reshape(1))
            for s in self.host_steps:
                s += 1.0
        if self.cuda:  # the next backward may write the grad buffers the side stream is copying
            torch.cuda.current_stream(self.eng.device).wait_stream(self.stream)
        self.pending, self.futures = self.futures, {}
        self.last_log, self.log = self.log, []
        self.reduced = [False] * len(self.eng.units)

    def apply_pending(self) -> bool:
        """A delayed update's host steps waited for and their params written back (stage 1/2: the
        caller gathers them). Whether there was one."""
        pending, self.pending = self.pending, {}
        self._finish(pending)
        return bool(pending)

    def _write_back(self, u) -> None:
        """The unit's updated params from its masters. On CUDA after the work queued so far: a delayed
        update is written back while the next backward's kernels may still read the params, and its
        gathers copy host shards up (stage 3, "optimizer+params") (found by reading, 2026-12-07)."""
        master = self.opt.unit_states[u.index]["master"]
        if not self.cuda:
            u.shard.copy_(master)
            return
        current = torch.cuda.current_stream(self.eng.device)
        if u.host_shard:  # stage-3 parameter offload: the shard is host memory its last upload may be reading
            if u.uploaded is not None:
                u.uploaded.synchronize()
            u.shard.copy_(master)
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(current)
            u.shard.copy_(master, non_blocking=True)
        current.wait_stream(self.stream)

    def load_steps(self) -> None:
        """After the device step counters were set (a checkpoint load)."""
        for s, d in zip(self.host_steps, self.opt._steps):
            s.fill_(float(d.item()))


def _options(group: dict) -> dict:
    """A param group's options (not its params) as they are now; a tensor lr copied."""
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k != "params"}
