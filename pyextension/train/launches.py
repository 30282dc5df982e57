"""Kernel launches and Python hooks of one training step, counted: what the job's summary reports
(the second step: the first builds the optimizer's plans) and what bench/profile_step.py measures
offline.

- Triton launches: every JITFunction / interpreted-function run (an autotuned kernel counts once)
  and every launch through a handle (kernels/launch.py: those bypass JITFunction.run).
- aten ops that launch a kernel on CUDA (views, metadata and allocations excluded) and zerofuse's
  C++ multi-tensor copies (flatten_into / unflatten_from: one kernel each), by a dispatch mode.
- Python hooks: the forward/backward hooks on the model's modules, the params' grad hooks and
  ZeRO's end-of-backward callback, wrapped for the step and restored after it.
Counting costs host time: the counted step is not a timed one on CUDA (the first log window, left
out of the steady step time) and is at most a few percent of a CPU run's windows.
"""
from __future__ import annotations

import contextlib

from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that launch nothing on CUDA (views, metadata, allocation)
NO_LAUNCH = {"view", "_unsafe_view", "as_strided", "slice", "select", "t", "transpose", "expand", "unsqueeze",
             "squeeze", "permute", "split", "split_with_sizes", "alias", "detach", "empty", "empty_strided",
             "empty_like", "_reshape_alias", "unbind", "narrow", "reshape", "lift_fresh", "set_", "resize_",
             "new_empty", "new_empty_strided", "chunk", "view_as", "unflatten", "flatten",
             "_record_function_enter_new", "_record_function_exit"}  # (profiler annotations)
CPP_LAUNCHES = {"flatten_into", "unflatten_from"}  # zerofuse:: C++ ops: one kernel per call on CUDA


class CountLaunches(TorchDispatchMode):
    """aten ops that would launch a kernel, and zerofuse's C++ copies, by name. Transparent: the
    optimizer ops take their direct Triton path under it, as they do uncounted (ops._optim.direct)."""

    zerofuse_transparent = True
    paused = False  # set while host-side work runs (bench/profile_step.py: the batch, the stop vote)

    def __init__(self):
        super().__init__()
        self.count = 0
        self.names: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and ((func.namespace == "aten" and name not in NO_LAUNCH) or name in CPP_LAUNCHES):
            self.count += 1
            self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_triton(counter: dict):
    """counter["triton"] += 1 for every Triton kernel run inside the block (compiled or interpreted),
    through the JIT or a launch handle (the handles' hits: they call the compiled launcher directly)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from zerofuse.kernels import launch

    saved = [(cls, cls.run) for cls in (JITFunction, InterpretedFunction)]
    hits = sum(h.hits for h in launch.HANDLES.values())

    def counted(real):
        def run(self, *args, **kwargs):
            counter["triton"] = counter.get("triton", 0) + 1
            return real(self, *args, **kwargs)
        return run

    try:
        for cls, real in saved:
            cls.run = counted(real)
        yield counter
    finally:
        for cls, real in saved:
            cls.run = real
        counter["triton"] = counter.get("triton", 0) + sum(h.hits for h in launch.HANDLES.values()) - hits


@contextlib.contextmanager
def count_hooks(model, counter: dict):
    """counter["hooks"] += 1 for every hook zerofuse (or anyone) put on the model's modules and params,
    and for ZeRO's end-of-backward callback, run inside the block; the hooks are restored after it."""
    restore, eng = [], getattr(model, "_zerofuse_zero", None)

    def wrap(fn):
        def counted(*args, **kwargs):
            counter["hooks"] = counter.get("hooks", 0) + 1
            return fn(*args, **kwargs)
        return counted

    tables = [h for m in model.modules()
              for h in (m._forward_pre_hooks, m._forward_hooks, m._backward_hooks, m._backward_pre_hooks)]
    tables += [getattr(p, "_post_accumulate_grad_hooks", None) or {} for p in model.parameters()]
    try:
        for table in tables:
            for k in list(table):
                restore.append((table, k, table[k]))
                table[k] = wrap(table[k])
        if eng is not None:
            eng._end_of_backward = wrap(type(eng)._end_of_backward.__get__(eng))
        yield counter
    finally:
        for table, k, fn in restore:
            table[k] = fn
        if eng is not None:
            del eng._end_of_backward  # back to the class's method


def count_step(step, model, n_layer: int, at: int) -> dict:
    """Runs step() once with every counter on: {launches, per_layer, triton, aten, hooks, top_aten,
    step}. n_layer: the transformer blocks this rank runs (a pipeline stage's, not the model's; 0:
    per_layer None); at: the step it is."""
    counter: dict = {}
    with CountLaunches() as aten, count_triton(counter), count_hooks(model, counter):
        step()
    total = counter.get("triton", 0) + aten.count
    return {"launches": total, "per_layer": total / n_layer if n_layer else None, "triton": counter.get("triton", 0),
            "aten": aten.count, "hooks": counter.get("hooks", 0),
            "top_aten": sorted(aten.names.items(), key=lambda kv: -kv[1])[:8], "step": at}
