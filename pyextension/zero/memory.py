"""``zerofuse.zero.memory_report``: bytes of model states each rank holds, next to ZeRO's formulas.

Measured from the tensors themselves (storage actually allocated: a stage-3 unit that is not
gathered counts 0), so a test can hold an implementation against the paper's accounting:
params b_p Ψ (stage 0/1/2) or b_p Ψ / Nd (stage 3); grads b_g Ψ (stage 0/1) or b_g Ψ / Nd
(stage 2/3); optimizer K Ψ / Nd (K Ψ at stage 0), with b_p the param dtype's size, b_g the reduce
dtype's, and K = 4 bytes per fp32 state (m, v; the momentum buffer for LARS) + 4 for the fp32
master when params are bf16/fp16.
Ψ is the exact parameter count; the measured figures include each unit's padding.

``peak_memory(device)`` measures what a region needs at its peak (the figure ZeRO's promises are
about), not what is left after it.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from zerofuse.zero.engine import engine_of


def _bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    return t.untyped_storage().nbytes() if t._base is None else t.numel() * t.element_size()


def memory_report(model: torch.nn.Module, optimizer=None) -> dict:
    """{'params', 'grads', 'optimizer', 'total'}: bytes held by this rank now; 'formula': the
    same keys from ZeRO's formulas; 'psi', 'world_size', 'stage', 'K'."""
    eng = engine_of(model, "zerofuse.zero.memory_report")
    params = grads = 0
    for u in eng.units:
        params += u.full.untyped_storage().nbytes()
        if eng.stage == 3:
            params += _bytes(u.shard)
        if u.gflat is not None:
            grads += u.gflat.untyped_storage().nbytes()
        if eng.stage != 1 and u.gshard is not None and u.gshard is not u.gflat:  # stage 0 accumulates into last step's gshard
            grads += _bytes(u.gshard)
    grads += sum(_bytes(p.grad) for p in eng.params)
    opt = 0
    k = 0
    if optimizer is not None:
        for st in optimizer.unit_states:
            opt += sum(_bytes(t) for t in st.values())
        k = 4 * len(optimizer.unit_states[0]) if optimizer.unit_states else 0
    psi = sum(p.numel() for p in eng.params)
    nd = eng.world_size if eng.stage != 0 else 1  # stage 0 replicates everything
    bp, bg = eng.dtype.itemsize, eng.reduce_dtype.itemsize
    formula = {
        "params": bp * psi / (nd if eng.stage == 3 else 1),
        "grads": bg * psi / (1 if eng.stage in (0, 1) else nd),
        "optimizer": k * psi / nd,
    }
    formula["total"] = sum(formula.values())
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt, "formula": formula,
            "psi": psi, "world_size": eng.world_size, "stage": eng.stage, "K": k}


_MARK_BYTES = 7_340_033  # sentinel allocations of this size (+ the mark's number) split the event stream


class Peak:
    """Filled when a ``peak_memory`` block exits: ``peak`` (the most bytes allocated at once above
    the allocation at entry), ``end`` (bytes above it at exit) and, per ``mark(label)`` made inside,
    ``phases[label]`` = (bytes at the mark, the peak from the mark to the next one or the end), both
    above the entry. A block that builds the model itself sees every byte: absolute figures."""

    def __init__(self, device):
        self.device, self.peak, self.end, self.phases = device, 0, 0, {}
        self._labels: list[str] = []

    def mark(self, label: str) -> None:
        """Start a phase here (CPU: a sentinel allocation found in the event stream; CUDA: reads the
        counters, synchronising)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            now = torch.cuda.memory_allocated(self.device) - self._start
            if self._labels:
                self._close_cuda()
            self._labels.append(label)
            self.phases[label] = (now, now)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self._labels.append(label)
        torch.empty(_MARK_BYTES + len(self._labels), dtype=torch.uint8)

    def _close_cuda(self) -> None:
        at, _ = self.phases[self._labels[-1]]
        self.phases[self._labels[-1]] = (at, torch.cuda.max_memory_allocated(self.device) - self._start)


@contextlib.contextmanager
def peak_memory(device=None):
    """Context manager yielding a :class:`Peak`: the most bytes allocated at once during the block,
    above what was allocated at entry, optionally per phase (``mark``). CUDA:
    ``torch.cuda.max_memory_allocated`` (the peak counter is reset at entry). CPU: the CPU
    allocator's events recorded by torch.profiler, summed in order (allocations on threads other
    than the caller's, e.g. inside gloo, are not seen; frees of blocks allocated before the block
    are not counted, so the figure errs high)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    out = Peak(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        out._start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield out
        torch.cuda.synchronize(device)
        if out._labels:
            out._close_cuda()
        out.peak = max([torch.cuda.max_memory_allocated(device) - out._start] + [p for _, p in out.phases.values()])
        out.end = torch.cuda.memory_allocated(device) - out._start
        return
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield out
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    marks = {_MARK_BYTES + i + 1: label for i, label in enumerate(out._labels)}
    live = peak = 0
    phase = None
    for _, n in events:
        if n in marks:  # the sentinel itself is not counted
            phase = marks.pop(n)
            out.phases[phase] = (live, live)
            continue
        if -n - 1 - _MARK_BYTES in range(len(out._labels)):
            continue
        live += n
        peak = max(peak, live)
        if phase is not None:
            at, hi = out.phases[phase]
            out.phases[phase] = (at, max(hi, live))
    out.peak, out.end = peak, live
