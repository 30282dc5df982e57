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

import torch

from zerofuse import _C

from zerofuse.zero.engine import engine_of


def _bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    return t.untyped_storage().nbytes() if t._base is None else t.numel() * t.element_size()


def memory_report(model: torch.nn.Module, optimizer=None) -> dict:
    """{'params', 'grads', 'optimizer', 'total'}: bytes held by this rank now on the params' device
    (with offload also 'optimizer_host' and, 'optimizer+params', 'params_host': the host's bytes of
    the optimizer states with its copies of the grad shards, and of the param shards, not counted in
    'optimizer' / 'params'); 'formula':
    the same keys from ZeRO's formulas; 'psi', 'world_size', 'stage', 'K'."""
    eng = engine_of(model, "zerofuse.zero.memory_report")
    params = grads = params_host = 0
    for u in eng.units:
        params += u.full.untyped_storage().nbytes()
        if eng.stage == 3 and u.host_shard:  # parameter offload
            params_host += _bytes(u.shard)
        elif eng.stage == 3:
            params += _bytes(u.shard)
        if u.gflat is not None:
            grads += u.gflat.untyped_storage().nbytes()
        if eng.stage != 1 and u.gshard is not None and u.gshard is not u.gflat:  # stage 0 accumulates into last step's gshard
            grads += _bytes(u.gshard)
    grads += sum(_bytes(p.grad) for p in eng.params if not eng.is_grad_view(p))  # (views: counted in gflat)
    opt = opt_host = 0
    k = 0
    on_host = eng.host_units if optimizer is not None and optimizer.host is not None else set()
    if optimizer is not None:
        for u, st in zip(eng.units, optimizer.unit_states):
            b = sum(_bytes(t) for t in st.values())
            opt_host += b if u.index in on_host else 0
            opt += 0 if u.index in on_host else b
        k = 4 * len(optimizer.unit_states[0]) if optimizer.unit_states else 0
    if optimizer is not None and optimizer.host is not None:  # its copies of the grad shards: pinned buffers
        # (CUDA), a delayed update's clones (left out: 9.1 MiB of 63.7 unreported; a review's reproduction)
        held = {t.untyped_storage().data_ptr() for u in eng.units for t in (u.gshard, u.gflat) if t is not None}
        opt_host += sum(_bytes(g) for g in optimizer.host.grads
                        if g is not None and g.untyped_storage().data_ptr() not in held)
    psi = sum(p.numel() for p in eng.params)
    bp, bg = eng.dtype.itemsize, eng.reduce_dtype.itemsize
    formula = dict.fromkeys(("params", "grads", "optimizer", "optimizer_host"), 0.0)
    for u in eng.units:  # expert units shard over the expert-DP group; stage 0 replicates everything
        n = sum(p.numel() for p in u.params)
        nd = (u.comm or eng.comm).world_size if eng.stage != 0 else 1
        formula["params"] += bp * n / (nd if eng.stage == 3 else 1)
        formula["grads"] += bg * n / (1 if eng.stage in (0, 1) else nd)
        ku = 4 * len(optimizer.unit_states[u.index]) if optimizer is not None else 0
        formula["optimizer_host" if u.index in on_host else "optimizer"] += ku * n / nd
    host = {}
    if params_host:
        host["params_host"] = params_host
        formula["params_host"], formula["params"] = formula["params"], 0.0
    if optimizer is not None and optimizer.host is not None:  # offload: those states are host memory
        host["optimizer_host"] = opt_host
    else:
        del formula["optimizer_host"]
    formula["total"] = formula["params"] + formula["grads"] + formula["optimizer"]
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt, **host,
            "formula": formula, "psi": psi, "world_size": eng.world_size, "stage": eng.stage, "K": k}


class Peak:
    """Filled when a ``peak_memory`` block exits: ``peak`` (the most bytes allocated at once above
    the allocation at entry), ``end`` (bytes above it at exit) and, per ``mark(label)`` made inside,
    ``phases[label]`` = (bytes at the mark, the peak from the mark to the next one or the end), both
    above the entry. A block that builds the model itself sees every byte: absolute figures."""

    def __init__(self, device):
        self.device, self.peak, self.end, self.phases = device, 0, 0, {}
        self._label: str | None = None
        self._start = 0

    def _now(self) -> tuple[int, int]:
        """(allocated, peak since the last reset), both above the entry."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return (torch.cuda.memory_allocated(self.device) - self._start,
                    torch.cuda.max_memory_allocated(self.device) - self._start)
        return _C.cpu_memory_counter_current() - self._start, _C.cpu_memory_counter_peak() - self._start

    def _reset(self) -> None:
        # the counters' peak is one per device: blocks open around this one keep what they saw so far
        for other in _OPEN:
            if other is not self and other.device == self.device:
                other._close()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _C.cpu_memory_counter_reset_peak()

    def _close(self) -> tuple[int, int]:
        now, hi = self._now()
        self.peak = max(self.peak, hi)
        if self._label is not None:
            at, seen = self.phases[self._label]
            self.phases[self._label] = (at, max(seen, hi))
        return now, hi

    def mark(self, label: str) -> None:
        """Start a phase here (CUDA: synchronises to read the counters)."""
        now, _ = self._close()
        self._reset()
        self._label = label
        self.phases[label] = (now, now)


_OPEN: list[Peak] = []  # peak_memory blocks open now (they may nest)


@contextlib.contextmanager
def peak_memory(device=None):
    """Context manager yielding a :class:`Peak`: the most bytes allocated at once during the block,
    above what was allocated at entry, optionally per phase (``mark``). CUDA:
    ``torch.cuda.max_memory_allocated`` (the peak counter is reset at entry). CPU: a counting
    wrapper around torch's CPU allocator (zerofuse._C, csrc/memory_counter.h), installed for the
    block: exact for every thread (gloo's included). Blocks allocated before the block and freed
    inside it (an earlier block's, a reference cycle the collector frees in it) are not subtracted,
    so the figure errs high, never low (an earlier block's were subtracted: a 16 MiB tensor made
    in a block that freed one read 0; a review's reproduction, 2026-12-06)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    out = Peak(device)
    installed, enclosing = False, None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        out._start = torch.cuda.memory_allocated(device)
    else:
        if not _C.cpu_memory_counter_installed():
            _C.cpu_memory_counter_install(True)
            installed = True
        enclosing = _C.cpu_memory_counter_begin()  # (blocks from before the block: freed uncounted)
        out._start = _C.cpu_memory_counter_current()
    out._reset()
    _OPEN.append(out)
    try:
        yield out
        out.end, _ = out._close()
    finally:
        _OPEN.remove(out)
        if enclosing is not None:  # (an enclosing block's own blocks count again when freed)
            _C.cpu_memory_counter_end(enclosing)
        if installed:
            _C.cpu_memory_counter_install(False)
