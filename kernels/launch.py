"""Launching a Triton kernel: ``launch_triton(kernel, grid, *args, **consts)`` is ``kernel[grid](*args,
**consts)``, and on CUDA (``MODE == "handles"``) the compiled kernel's own launcher called directly
once the JIT has compiled and launched the kernel for that specialization.

[Note: launch handles] ``JITFunction.run`` spends per call, before the compiled launcher runs,
~10 us on this project's CPU for the LayerNorm forward's 11 arguments (Triton 3.6; about half in
its generated binder, which specializes each argument, and the cache key it builds from that and
``str(options)``; the rest in device/stream queries, the options dict and the launch-metadata dict
it makes for Triton 3.6's launch hooks, which are HookChain objects, never None). A handle is
the ``CompiledKernel`` the JIT returned for the first call of a key of ours, with the constant
tail of its argument list: later calls with the same key call its launcher with
(grid, stream, function, metadata, args..., tail...) as the JIT would, ~2 us of Python in all
(bench/results/cpu-2026-11-26/host_launch.md).

Our key must change whenever Triton's specialization would (else a kernel compiled for 16-byte
aligned pointers would run on unaligned ones): per argument (zerofuse._C.launch_key, in C++: the
same in Python took 2.5 us for 11 arguments), a tensor's dtype and whether its address is a
multiple of 16; an int's range class (i32 / i64 / u64) and whether it is 1 or a multiple of 16; a
bool's value; for floats and None the type; and the constexprs and options verbatim.
That is every property Triton 3.6's specializer reads and some it does not (more keys, never
fewer): tests/test_launch.py holds the key against Triton's own binder on CPU for the kernels'
argument kinds, and the argument list handed to the launcher against the binder's. Anything else
(a launch hook set, a tensor descriptor, an argument type not listed) goes through the JIT.
Without a hook the launcher gets None for the hooks and their metadata; the JIT passes Triton
3.6's empty hook chains, which the launcher then calls, after building the metadata dict.

``MODE`` ("handles" by default; ``ZEROFUSE_TRITON_LAUNCH=jit`` launches every call through the
JIT) ran on one H200 (2026-11-27: the doctor's every op through the handles, ok; its per-call host
time not measured on a GPU yet). The argument lists are
checked on CPU for every launch site against Triton's binder; tests/test_launch.py's GPU test
compares the outputs bit for bit with the JIT's, and bench/profile_host.py times both on CUDA.
A handle also ignores later changes of ``triton.knobs.runtime.debug`` and
``knobs.compilation.instrumentation_mode`` (the JIT keys both), skips the JIT's pre-run hooks (none
set here) and its check that the globals a kernel reads have not changed.
"""
from __future__ import annotations

import inspect

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

from zerofuse import _C
from zerofuse.kernels import _INTERPRETED, env

MODE = env.choice("ZEROFUSE_TRITON_LAUNCH", "handles", {"jit": "every launch through Triton's JIT",
                                                        "handles": "compiled launchers called directly"})


def _hooked(chain) -> bool:
    """Whether a launch hook (a profiler's) is set: then the JIT launches, with its metadata."""
    return chain is not None and bool(getattr(chain, "calls", True))


class Handle:
    """One compiled specialization of a kernel: its launcher and the constant end of its argument list."""

    __slots__ = ("kernel", "run", "function", "packed", "tail", "hits")

    def __init__(self, kernel, compiled, tail: tuple):
        self.kernel = kernel
        self.run, self.function, self.packed = compiled.run, compiled.function, compiled.packed_metadata
        self.tail, self.hits = tail, 0


HANDLES: dict[tuple, Handle] = {}  # (id(kernel), device, consts, argument keys) -> Handle


def handle_key(kernel, device: int, args: tuple, consts: dict) -> tuple:
    """The key of the handle a launch may use; TypeError for an argument kind without a key. id:
    a JITFunction hashes its source's cache key, and the Handle keeps the kernel alive. The
    constexprs' types too: 1, True and 1.0 are equal keys, not the same specialization."""
    return id(kernel), device, tuple(consts.items()), tuple(map(type, consts.values())), _C.launch_key(args)


def tail_args(kernel, n_args: int, consts: dict) -> tuple:
    """The values the JIT binds to the parameters after the ``n_args`` positional ones (from
    ``consts``, which may also hold launch options, or the parameter's default), in signature
    order: the end of the launcher's argument list."""
    out = []
    for p in kernel.params[n_args:]:
        if p.name in consts:
            out.append(consts[p.name])
        elif p.default is not inspect.Parameter.empty:
            out.append(p.default)
        else:
            raise TypeError(f"{kernel.__name__}: missing argument {p.name!r}")
    return tuple(out)


_MULTI_GPU: bool | None = None  # more than one CUDA device visible (read at the first launch)


def other_device(args) -> int | None:
    """The CUDA device of the first tensor in ``args`` where it is not the current device, else
    None. A launch (the JIT's and a handle's) goes to the current device's stream: a patched HF
    model loaded with device_map over several GPUs runs its layers on cuda:1 while the current
    device is cuda:0, and every op launched there, unordered after cuda:1's work that made its
    inputs (found by reading, 2026-12-07; no op sets a device guard). With one device visible,
    nothing to look at (the look costs ~0.5 us of a launch's ~2 us on this project's CPU)."""
    global _MULTI_GPU
    if _MULTI_GPU is None:
        _MULTI_GPU = torch.cuda.device_count() > 1
    if not _MULTI_GPU:
        return None
    for a in args:
        if isinstance(a, torch.Tensor):
            i = a.get_device()
            return i if i >= 0 and i != torch._C._cuda_getDevice() else None
    return None


def launch_triton(kernel, grid, *args, **consts):
    """``kernel[grid](*args, **consts)`` on the first tensor argument's device; on CUDA under MODE
    "handles", through a handle after the first call of each specialization ([Note: launch handles])."""
    if _INTERPRETED:
        return kernel[grid](*args, **consts)
    if (i := other_device(args)) is not None:
        with torch.cuda.device(i):
            return launch_triton(kernel, grid, *args, **consts)
    if MODE == "jit":
        return kernel[grid](*args, **consts)
    return _launch_handle(kernel, grid, args, consts)


def _launch_handle(kernel, grid, args, consts):
    if not isinstance(kernel, JITFunction) or callable(grid):
        return kernel[grid](*args, **consts)
    device = torch._C._cuda_getDevice()  # torch.cuda.current_device() less its Python wrapper
    try:
        key = handle_key(kernel, device, args, consts)
        h = HANDLES.get(key)  # (an unhashable constexpr: TypeError, the JIT)
    except (TypeError, RuntimeError):
        return kernel[grid](*args, **consts)
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook  # Triton 3.6: HookChains
    if h is None or _hooked(enter) or _hooked(leave):
        compiled = kernel[grid](*args, **consts)
        if h is None and compiled is not None and not any(isinstance(v, torch.Tensor) for v in consts.values()):
            # (a tensor passed by keyword would key by identity: a handle per call, never hit)
            HANDLES[key] = Handle(kernel, compiled, tail_args(kernel, len(args), consts))
        return compiled
    h.hits += 1
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    h.run(grid[0], g1, g2, torch._C._cuda_getCurrentRawStream(device), h.function, h.packed, None, None, None,
          *args, *h.tail)
    return None
