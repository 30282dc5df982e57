"""Per-signature plans for the faces' eager calls: argument checks and path choices made once.

[Note: call signatures] A face (zerofuse.nn.functional.layer_norm, ...) spends most of its host
time per call, before any kernel runs, on work whose outcome depends only on its arguments'
metadata: checking shapes, dtypes and devices, choosing the path (Triton or not, contiguous or
not, autograd or not) and the kernel's configuration. ``signature(*args)`` (zerofuse._C, C++:
~0.35 us on this project's CPU) returns bytes that differ whenever any of that could: grad mode;
per argument None, a bool's, int's or float's value, a tuple or list of ints, or a tensor's dtype,
device, requires_grad, sizes and strides. A face keeps, per signature, the plan its first (slow,
checked) call worked out, and a later call with the same signature runs the plan: allocate the
outputs, launch. The signature is None (no plan: the slow path, every call) for an argument of
any other kind, a tensor subclass other than Parameter (it may override what a plan skips), a
non-strided, conjugate or negative-bit tensor, and while a TorchFunctionMode is active; faces
also take the slow path while torch.compile traces them (the ops, not the plans).

A plan holds nothing of the tensors it was made for (no data pointers, no values), so what it
skips must not depend on them: a face records a plan only on paths whose checks and choices read
metadata alone, and puts into the signature any global its path reads (e.g. whether CPU tensors
go through the Triton interpreter). Bad arguments never get a plan: the slow path raises first.
"""
from __future__ import annotations

import torch
import torch.autograd.forward_ad as _forward_ad
from torch._C import _functorch as _ft

from zerofuse._C import signature

__all__ = ["Plans", "autograd_modes", "clear_plans", "needs_autograd", "signature"]


def torch_only() -> bool:
    """Whether a face computes with torch's own ops: under torch.func transforms (grad, vmap, jacrev,
    functional_call) and torch.jit.trace. zerofuse's autograd Functions have no functorch rules and
    its Triton kernels read storage the transforms' wrappers lack (both raised); a jit trace baked
    the shape its outputs were viewed to into the graph (another input's shape came back wrong; a
    review's reproductions, 2026-12-06). Also inside forward AD's dual level: torch's ops carry the
    tangents (the Functions have no jvp: torch's generic "implement the jvp" error named no face,
    where torch's own norms and attention take forward AD; a review's reproduction, 2026-12-07)."""
    if torch.compiler.is_compiling():  # (dynamo: the compiled ops; nothing for it to trace here)
        return False
    return (_forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active()
            or torch._C._get_tracing_state() is not None)


def batched(t) -> bool:
    """Whether t is a functorch-wrapped tensor (vmap's, grad's) or a legacy batched one: what a
    backward gets under ``torch.autograd.grad(..., is_grads_batched=True)`` (jacobian(vectorize=True))
    or torch.func.vmap over a vjp of a graph built outside it. Such tensors have no storage for a
    kernel to read and no in-place op may write a batched operand into an unbatched one."""
    return isinstance(t, torch.Tensor) and (_ft.is_legacy_batchedtensor(t) or _ft.is_functorch_wrapped_tensor(t))


def autograd_modes() -> int:
    """What decides, besides grad mode and requires_grad, whether a face's call records autograd:
    forward AD's dual level (-1 outside ``forward_ad.dual_level()``) and inference mode. The faces
    put it in their signatures."""
    return (_forward_ad._current_level + 1) * 2 + torch.is_inference_mode_enabled()


def needs_autograd(*tensors) -> bool:
    """Whether a face's call goes through its autograd Function: grad mode on outside inference
    mode and a tensor requiring grad (torch records no graph in inference mode, even under
    enable_grad), or forward AD active (the faces take torch's ops there first, torch_only; the
    Functions have no jvp, and the kernels alone would drop the tangents silently)."""
    if _forward_ad._current_level >= 0:
        return True
    return torch.is_grad_enabled() and not torch.is_inference_mode_enabled() and any(
        t is not None and t.requires_grad for t in tensors)


class Plans(dict):
    """signature -> plan, bounded: emptied when it holds ``limit`` plans (a model calls a face with
    a few signatures; a caller whose shapes change every call pays the slow path, never memory)."""

    ALL: list[Plans] = []  # every face's, for clear_plans

    def __init__(self, limit: int = 1024):
        super().__init__()
        self.limit = limit
        Plans.ALL.append(self)

    def put(self, key: bytes | None, plan) -> None:
        if key is None:
            return
        if len(self) >= self.limit:
            self.clear()
        self[key] = plan


def clear_plans() -> None:
    """Forgets every face's plans (a plan keeps what a module setting was when it was made: the
    tests that patch one start with none)."""
    for plans in Plans.ALL:
        plans.clear()
