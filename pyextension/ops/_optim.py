"""Shared by the optimizer ops (adam.py, lamb.py, lars.py, l2norm.py): routing to the Triton
kernels, and the list checks of csrc/cpu/optim.h in Python (same messages and exception types)
for the paths that do not go through C++ (CUDA, Triton on CPU, fake tensors).
"""
from __future__ import annotations

import operator

from collections.abc import Sequence

import torch

from zerofuse import kernels

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

# Python-registered device impls of the C++ schemas (CUDA runs the Triton kernels)
LIB = torch.library.Library("zerofuse", "IMPL")


def use_triton(tensors: Sequence[torch.Tensor]) -> bool:
    """CUDA tensors run the Triton kernels; CPU tensors do under ZEROFUSE_TRITON_ON_CPU=1."""
    return bool(tensors) and (tensors[0].is_cuda or (tensors[0].device.type == "cpu" and kernels.triton_on_cpu()))


def call(op: str, triton_impl, args: tuple):
    """Runs torch.ops.zerofuse.<op>(*args) (C++ on CPU, Triton on CUDA), or triton_impl(*args)
    directly for CPU tensors under ZEROFUSE_TRITON_ON_CPU=1 (args[0] is the params list)."""
    if use_triton(args[0]) and not args[0][0].is_cuda:
        return triton_impl(*args)
    return getattr(torch.ops.zerofuse, op)(*args)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def direct(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether an op may run its Triton launcher without the dispatcher: Triton tensors of plain
    types, eagerly (no torch.compile tracing, no dispatch mode such as FakeTensorMode). The
    dispatcher's list conversions cost ~40 us per call of 5 lists of 91 tensors, which is about
    the whole budget of a small optimizer step."""
    return (use_triton(tensors) and type(tensors[0]) in _PLAIN and not torch.compiler.is_compiling()
            and (torch._C._len_torch_dispatch_stack() == 0 or _only_counting_modes()))


def _only_counting_modes() -> bool:
    """Whether every active dispatch mode only watches (``zerofuse_transparent``: the launch
    counters of zerofuse.train.launches), so a step counted takes the path an uncounted one takes."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return all(getattr(m, "zerofuse_transparent", False) for m in _get_current_dispatch_mode_stack())


_DATA_PTR = torch.Tensor.data_ptr
_DTYPE = operator.attrgetter("dtype")


def lr_arg(lr):
    """The lr a direct launch takes: a device tensor as it is (read by the kernels' constants
    every step, so a CUDA graph of the step follows a schedule: Launch.consts), else a float."""
    return lr if isinstance(lr, torch.Tensor) else float(lr)


class Prepared:
    """Launch tables (zerofuse.kernels.optim.Launch) that an optimizer keeps for one param group
    between steps, so a step does not rebuild and re-check them (on an H100 that host work was
    ~1 ms per step for 91 tensors, longer than the kernel of a 10M-param step).

    The caller promises that the other lists (states, masters, step counters) hold the same
    tensors at every call; zerofuse.optim's optimizers rebuild their Prepared when one changes.
    The params' and grads' addresses are compared at every call (a grad is often reallocated
    between steps; ``p.data = ...`` moves a param), and the launch is rebuilt, with the op's full
    checks, when any changed."""

    def __init__(self):
        self._launches: dict[str, tuple[tuple, object]] = {}

    def launch(self, name: str, params, grads, build):
        # (the dtypes too: a launch fixes them, and a grad of another dtype at the same address was
        # read as the old one, bf16 bits as fp32 - the update and l2norm's clipping norm, whose
        # tensors come as ``params``; a review's reproduction, 2026-12-06)
        key = (tuple(map(_DATA_PTR, params)), tuple(map(_DTYPE, params)),
               (tuple(map(_DATA_PTR, grads)), tuple(map(_DTYPE, grads))) if grads else ())
        hit = self._launches.get(name)
        if hit is not None and hit[0] == key:
            return hit[1]
        launch = build()
        self._launches[name] = (key, launch)
        return launch


class StepPlans:
    """The one cache of optimizer step plans ([Note: step plans] in zerofuse/optim/_base.py), used by
    zerofuse.optim's fused optimizers and zerofuse.zero.Optimizer alike: per param group, what a step
    hands the ops (lists of tensors, their Prepared launch tables), kept while the key it was built
    under (identities and addresses of what it was built from) is unchanged and ``valid(plan)``
    agrees. ``clear()`` is the one invalidation of everything (a param's state dict added, replaced
    or loaded)."""

    __slots__ = ("_plans",)

    def __init__(self):
        self._plans: dict = {}

    def get(self, index, key, build, valid=None):
        hit = self._plans.get(index)
        if hit is not None and hit[0] == key and (valid is None or valid(hit[1])):
            return hit[1]
        plan = build()
        self._plans[index] = (key, plan)
        return plan

    def values(self):
        """The plans kept now (to drop what they hold of buffers that are being freed)."""
        return [plan for _, plan in self._plans.values()]

    def clear(self) -> None:
        self._plans.clear()


def mutated(params: Sequence[torch.Tensor]) -> None:
    """What the dispatcher does for a mutated argument (a direct launch bypasses it): bump the
    version counters, so autograd still catches a param changed after being saved for backward."""
    torch.autograd.graph.increment_version(params)


def check_norms(op: str, norms: torch.Tensor, shape: tuple, device: torch.device | None) -> None:
    """Given norms (LAMB's sums of squares, LARS's norms): a contiguous float32 tensor of this shape
    on the params' device (None: no params to compare with)."""
    if norms.dtype != torch.float32 or tuple(norms.shape) != shape or not norms.is_contiguous():
        raise RuntimeError(f"zerofuse::{op}: expected norms to be a contiguous float32 tensor of shape {list(shape)}, "
                           f"got {norms.dtype} {list(norms.shape)}")
    if device is not None and norms.device != device:
        raise RuntimeError(f"zerofuse::{op}: expected norms on the params' device ({device}), got {norms.device}")


def selftest_tensors(device: torch.device):
    """(params, reference copies, two zero states, two zero reference states, zero step counters)
    of odd shapes (an empty tensor and a 1-element one included), for the op self-tests."""
    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(s, generator=g).to(device) for s in [(37, 5), (1,), (0,), (4099,)]]
    zeros = lambda: [torch.zeros_like(p) for p in ps]  # noqa: E731
    return ps, [p.clone() for p in ps], [zeros(), zeros()], [zeros(), zeros()], [torch.tensor(0.0, device=device) for _ in ps]


def check_param_lists(op: str, params, like: dict, fp32: dict, masters=(), steps=None, params_name="params") -> None:
    """csrc/cpu/optim.h's check_param_lists: params (named params_name in the messages: l2norm's are
    "tensors") and the lists of one tensor per param."""
    pre = f"zerofuse::{op}: "
    n = len(params)
    for name, lst in (*like.items(), *fp32.items()):
        if len(lst) != n:
            raise ValueError(f"{pre}expected {name} to have one tensor per param ({n}), got {len(lst)}")
    if masters and len(masters) != n:
        raise ValueError(f"{pre}expected masters to be empty or of length {n}, got {len(masters)}")
    if steps is not None and len(steps) != n:
        raise ValueError(f"{pre}expected steps to have one tensor per param ({n}), got {len(steps)}")
    dev = params[0].device if n else None
    numels = []
    for i, p in enumerate(params):
        if p.device != dev:
            raise RuntimeError(f"{pre}expected {params_name}[{i}] on {dev} like {params_name}[0], got {p.device}")
        if p.dtype not in _FLOATS:
            raise RuntimeError(f"{pre}expected {params_name}[{i}] in float32, bfloat16 or float16, got {p.dtype}")
        if not p.is_contiguous():
            raise RuntimeError(f"{pre}expected {params_name}[{i}] to be contiguous, got strides {list(p.stride())}")
        numels.append(p.numel())
    lists = [(name, lst, False) for name, lst in like.items()] + [(name, lst, True) for name, lst in fp32.items()]
    if masters:
        lists.append(("masters", masters, True))
    # one cheap combined test per tensor; the message is built only for a tensor that fails (this
    # runs every optimizer step over every param: formatting names eagerly cost ~0.5 ms per step)
    for name, lst, must_fp32 in lists:
        for i, (t, numel) in enumerate(zip(lst, numels)):
            bad_dtype = t.dtype != torch.float32 if must_fp32 else t.dtype not in _FLOATS
            if bad_dtype or not t.is_contiguous() or t.numel() != numel or t.device != dev:
                _tensor_error(pre, f"{name}[{i}]", t, numel, i, dev, must_fp32)


def check_no_overlap(op: str, lists: dict) -> None:
    """csrc/cpu/optim.h's check_no_overlap: the tensors an op updates in place (params, states,
    masters) must not share memory, or one would be updated twice in an order that depends on the
    launch. Step counts are exempt (a flat shard's segments share one). Tensors without storage
    (fake, meta: shape propagation) are skipped."""
    ranges = []
    for name, lst in lists.items():
        for i, t in enumerate(lst):
            if type(t) not in _PLAIN or t.device.type == "meta" or not t.numel():
                continue
            begin = t.data_ptr()
            ranges.append((begin, begin + t.numel() * t.element_size(), name, i))
    # stable: of two tensors at one address the message names the later-listed one as the repeat
    ranges.sort(key=lambda r: r[0])
    for (_, end, name0, i0), (begin, _, name1, i1) in zip(ranges, ranges[1:]):
        if begin < end:
            raise ValueError(f"zerofuse::{op}: expected {name1}[{i1}] not to share memory with {name0}[{i0}] (each "
                             "tensor is updated in place once), got overlapping tensors")


def _tensor_error(pre: str, name: str, t: torch.Tensor, numel: int, i: int, dev, must_fp32: bool):
    if must_fp32 and t.dtype != torch.float32:
        raise RuntimeError(f"{pre}expected {name} in float32, got {t.dtype}")
    if not must_fp32 and t.dtype not in _FLOATS:
        raise RuntimeError(f"{pre}expected {name} in float32, bfloat16 or float16, got {t.dtype}")
    if not t.is_contiguous():
        raise RuntimeError(f"{pre}expected {name} to be contiguous, got strides {list(t.stride())}")
    if t.numel() != numel:
        raise ValueError(f"{pre}expected {name} to have {numel} elements like params[{i}], got {t.numel()}")
    raise RuntimeError(f"{pre}expected {name} on the device of params[{i}] ({dev}), got {t.device}")
