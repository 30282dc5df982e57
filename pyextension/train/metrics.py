"""A training step that never waits for the device: what the host learns from a step is read at
log points only.

StepMetrics keeps each step's loss, grad norm and skipped-step flag as device tensors (the ones the
step made; nothing is copied) and turns them into per-step records at a log point with one
all-reduce (the loss mean over the world) and one device-to-host copy. Step time is the wall time
since the last log point (synchronised there) over the steps in between on a GPU, where the host
runs ahead of the device; on the CPU each step is timed by itself.

StopVote agrees on stopping without the device: every rank's signal flag goes into an all-reduce
on a CPU (gloo) group, launched asynchronously at the end of a step and read at the end of the
next one, by which time it is long done. Every rank reads the same result after the same step,
so they all stop together, one step after the signal arrived; a world of one reads its own flag.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .launch import STOP_SIGNALS

_NONE = -1.0  # an absent value (no clipping: no grad norm); a norm is >= 0 or not finite, a flag 0 or 1


class StepMetrics:
    def __init__(self, device: torch.device, world: int, tokens_per_step: int):
        self.device, self.world, self.tokens = device, world, tokens_per_step
        self.pending: list[dict] = []  # host-side fields of the steps since the last log point
        self.values: list[torch.Tensor] = []  # per step: (loss, grad norm, skipped) on the device
        self.t_last = time.perf_counter()
        self._absent = None  # the placeholder of an absent value (no clipping: no grad norm), made once
        self.windows = 0  # log points so far

    def record(self, host: dict, loss: torch.Tensor, norm: torch.Tensor | None, skipped: torch.Tensor | None,
               copy: bool = True) -> None:
        """One step: host fields (step, lr, comm_time, step_time on CPU) and device scalars; no sync.
        copy=False: the scalars are this step's own tensors, which nothing overwrites (an eager
        step): kept as they are, and stacked once at the log point instead of at every step; a
        CUDA graph's replay returns the same output buffers every step: copied (one launch)."""
        def scalar(t):
            if t is None:
                if self._absent is None:
                    self._absent = torch.full((), _NONE, device=self.device)
                return self._absent
            return t.detach().reshape(()).float()
        values = [loss.detach().reshape(()).float(), scalar(norm), scalar(skipped)]
        self.values.append(torch.stack(values).unbind() if copy else values)
        self.pending.append(host)

    def flush(self) -> list[dict]:
        """The records of the steps since the last log point (the same on every rank): the one
        device sync of those steps."""
        if not self.pending:
            return []
        vals = torch.stack([v for step in self.values for v in step]).view(-1, 3)
        if self.world > 1:  # the mean over the world = over DP (TP ranks agree)
            loss = vals[:, 0].contiguous()
            dist.all_reduce(loss)
            vals[:, 0] = loss / self.world
        host = vals.double().cpu().tolist()
        now = time.perf_counter()
        per_step = (now - self.t_last) / len(self.pending)
        self.windows += 1
        out = []
        for rec, (loss, norm, skipped) in zip(self.pending, host):
            m = dict(rec)
            m["loss"] = loss
            if not m.get("step_time"):  # CUDA: the window's wall time shared by its steps
                m["step_time"], m["log_window"] = per_step, self.windows
            m["tokens_per_s"] = self.tokens / m["step_time"]
            m["grad_norm"] = None if norm == _NONE else norm  # a NaN / inf norm stays (its step was skipped)
            if skipped > 0:  # fp16 overflow or a non-finite grad norm: the optimizer left the params
                m["skipped"] = True
            out.append(m)
        self.pending, self.values, self.t_last = [], [], now
        return out

    def restart_clock(self) -> None:
        """Exclude what follows a log point (validation, a checkpoint) from the next steps' time."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.t_last = time.perf_counter()


class StopVote:
    def __init__(self, world: int, device: torch.device):
        self.world = world
        # a CPU group for the flags (the default group on CPU): reading them never waits for the device
        self.group = dist.new_group(backend="gloo") if world > 1 and device.type != "cpu" else None
        self.flags = torch.zeros(len(STOP_SIGNALS), dtype=torch.int32)
        self.work = None

    def vote(self, signum: int) -> int:
        """Called by every rank after every step with its own signal (0: none); returns the signal
        every rank agrees to stop on (0: go on)."""
        mine = torch.zeros(len(STOP_SIGNALS), dtype=torch.int32)
        if signum:
            mine[STOP_SIGNALS.index(signum)] = 1
        if self.world == 1:
            agreed = mine
        else:
            agreed = torch.zeros_like(mine)
            if self.work is not None:  # last step's vote: done long ago
                self.work.wait()
                agreed = self.flags.clone()
            self.flags = mine
            self.work = dist.all_reduce(self.flags, group=self.group, async_op=True)
        hits = [s for s, v in zip(STOP_SIGNALS, agreed.tolist()) if v > 0]
        return int(hits[0]) if hits else 0

    def final(self, signum: int) -> int:
        """After the loop, on every rank: a signal got since the last step's vote (during the last
        log point: the final evaluation, checkpoint) agreed on too, waited for (it was dropped: the
        job sampled and exported and exited 0 after a SIGTERM, a review's reproduction, 2026-12-06)."""
        agreed = self.vote(signum)
        if self.world == 1 or agreed:
            return agreed
        self.close()
        hits = [s for s, v in zip(STOP_SIGNALS, self.flags.tolist()) if v > 0]
        return int(hits[0]) if hits else 0

    def close(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


SKIP_LIMIT = 10  # bf16/fp32: this many steps in a row skipped is a diverged run


def check_not_stuck(opt, records: list[dict], run: int = 0) -> int:
    """At a log point, with ``run`` the skipped steps in a row before this window: returns the run
    after it. A diverged run is stopped with an error (it went on skipping every step, the params
    never moving, and finished as a success): in fp16, a window skipped whole with the loss scale at
    its floor (above it, backing off may still recover); in bf16/fp32, SKIP_LIMIT steps in a row
    skipped (no loss scale backs off there: the params stay, so one bad batch's skip is ridden out
    and a diverged model's is not; counted across windows, whose length --log-every, evaluations and
    checkpoints set: a one-step window stopped at one skip, a review, 2026-12-07)."""
    for m in records:
        run = run + 1 if m.get("skipped") else 0
    if not records:
        return run
    if not getattr(opt, "fp16", False):
        if run >= SKIP_LIMIT:
            last = records[-1]["step"]
            raise RuntimeError(f"zerofuse-train: the last {run} steps ({last - run + 1}-{last}) were all skipped for a "
                               "non-finite gradient norm (bf16/fp32: no loss scale backs off): the run diverged "
                               "(lower the learning rate, or resume from a checkpoint)")
        return run
    if all(m.get("skipped") for m in records) and opt.loss_scale <= opt.min_scale:
        raise RuntimeError(f"zerofuse-train: every step since the last log point ({records[0]['step']}-"
                           f"{records[-1]['step']}) was skipped for a non-finite gradient with the fp16 loss scale at "
                           f"its minimum ({opt.loss_scale:g}): the run diverged (lower the learning rate, or train in "
                           "bf16)")
    return run
