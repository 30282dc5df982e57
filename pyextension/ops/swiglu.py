"""``zerofuse::swiglu`` / ``swiglu_backward``: act(gate) * up (SwiGLU with 'silu', GeGLU with
'gelu_tanh'), fp32 inside and one rounding; backward recomputes act(gate) from the saved inputs, so
only gate and up are kept (not the product, not the activation).

CUDA tensors run kernels/swiglu.py; CPU tensors aten's silu/gelu and their backward kernels on fp32
copies (float64 for float64), or the Triton kernels in the interpreter under ZEROFUSE_TRITON_ON_CPU=1.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from zerofuse import kernels, reference
from zerofuse.kernels import swiglu as K
from zerofuse.ops import eager_apply, first_order, register

_NAME = "zerofuse::swiglu"
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_args(fn: str, gate: Tensor, up: Tensor, activation: str, dy: Tensor | None = None) -> None:
    if not gate.is_floating_point():
        raise RuntimeError(f"{fn}: expected gate to be a floating-point tensor, got {gate.dtype}")
    for name, t in (("up", up), ("dy", dy)):
        if t is not None and (t.shape != gate.shape or t.dtype != gate.dtype or t.device != gate.device):
            raise RuntimeError(f"{fn}: expected {name} of gate's shape, dtype and device ({list(gate.shape)}, "
                               f"{gate.dtype}, {gate.device}), got {list(t.shape)}, {t.dtype}, {t.device}")
    if activation not in K.ACTIVATIONS:
        raise RuntimeError(f"{fn}: expected activation 'silu' or 'gelu_tanh', got {activation!r}")


def _use_triton(x: Tensor) -> bool:
    return x.dtype in _KERNEL_DTYPES and (x.is_cuda or (x.device.type == "cpu" and kernels.triton_on_cpu()))


def _acc(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _act(g: Tensor, activation: str) -> Tensor:
    return torch.nn.functional.silu(g) if activation == "silu" else torch.nn.functional.gelu(g, approximate="tanh")


def _act_backward(grad: Tensor, g: Tensor, activation: str) -> Tensor:
    """grad * act'(g) by aten's fused backward kernels."""
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, g)
    return torch.ops.aten.gelu_backward(grad, g, approximate="tanh")


def _fwd(gate, up, activation):
    if _use_triton(gate):  # rows at any even spacing: a fused projection's halves are read in place
        return K.swiglu_fwd(gate, up, activation)
    # aten's kernels on fp32 (float64) copies of low-precision inputs: fp32 inside, one rounding;
    # contiguous as the Triton path's and the fakes' (aten's elementwise ops follow gate's layout)
    acc = _acc(gate)
    return _act(gate.to(acc), activation).mul_(up.to(acc)).to(gate.dtype).contiguous()


def _bwd(dy, gate, up, activation):
    if _use_triton(gate):
        return K.swiglu_bwd(dy.contiguous(), gate, up, activation)
    acc = _acc(gate)
    dyf, g = dy.to(acc), gate.to(acc)
    dg = _act_backward(dyf * up.to(acc), g, activation)
    # (out of place: under a batched backward dy is batched and gate not; mul_ into act(gate) raised)
    return dg.to(gate.dtype).contiguous(), (_act(g, activation) * dyf).to(up.dtype).contiguous()


@torch.library.custom_op(_NAME, mutates_args=())
def swiglu(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    """act(gate) * up, gate and up of one shape and dtype."""
    check_args(_NAME, gate, up, activation)
    return _fwd(gate, up, activation)


@swiglu.register_fake
def _(gate, up, activation):
    check_args(_NAME, gate, up, activation)
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op(_NAME + "_backward", mutates_args=())
def swiglu_backward(dy: Tensor, gate: Tensor, up: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    """(dgate, dup) of swiglu, act(gate) recomputed."""
    check_args(_NAME + "_backward", gate, up, activation, dy)
    return _bwd(dy, gate, up, activation)


@swiglu_backward.register_fake
def _(dy, gate, up, activation):
    check_args(_NAME + "_backward", gate, up, activation, dy)
    return (torch.empty_like(gate, memory_format=torch.contiguous_format),
            torch.empty_like(up, memory_format=torch.contiguous_format))


def _setup(ctx, inputs, output):
    gate, up, activation = inputs
    ctx.activation = activation
    ctx.save_for_backward(gate, up)


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dg, du = swiglu_backward(dy.contiguous(), gate, up, ctx.activation)
    return dg, du, None


swiglu.register_autograd(_backward, setup_context=_setup)


# ---------------------------------------------------------------- packed: x = [gate | up]


def _halves(fn: str, x: Tensor) -> tuple[Tensor, Tensor]:
    if x.dim() == 0 or x.shape[-1] % 2:
        raise RuntimeError(f"{fn}: expected x to hold [gate | up] along an even last dim, got shape {list(x.shape)}")
    return x.chunk(2, -1)


def _packed_bwd(dy: Tensor, x: Tensor, activation: str) -> Tensor:
    """The gradient of x = [gate | up] written whole: the kernels write both halves of one buffer
    (no concatenation of the halves' gradients); the torch path concatenates."""
    gate, up = x.chunk(2, -1)
    if _use_triton(x):
        dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
        K.swiglu_bwd(dy.contiguous(), gate, up, activation, dgrad=dx)
        return dx
    return torch.cat(_bwd(dy, gate, up, activation), -1)


@torch.library.custom_op(_NAME + "_packed", mutates_args=())
def swiglu_packed(x: Tensor, activation: str) -> Tensor:
    """act(gate) * up of x = [gate | up] along its last dim (a fused gate/up projection's output):
    the halves read in place; the op torch.compile traces for ``swiglu(x)``."""
    gate, up = _halves(_NAME + "_packed", x)
    check_args(_NAME + "_packed", gate, up, activation)
    return _fwd(gate, up, activation)


@swiglu_packed.register_fake
def _(x, activation):
    gate, up = _halves(_NAME + "_packed", x)
    check_args(_NAME + "_packed", gate, up, activation)
    return torch.empty(gate.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op(_NAME + "_packed_backward", mutates_args=())
def swiglu_packed_backward(dy: Tensor, x: Tensor, activation: str) -> Tensor:
    """The gradient of x (its shape, contiguous) from dy (of the output's shape)."""
    gate, up = _halves(_NAME + "_packed_backward", x)
    check_args(_NAME + "_packed_backward", gate, up, activation, dy)
    return _packed_bwd(dy, x, activation)


@swiglu_packed_backward.register_fake
def _(dy, x, activation):
    gate, up = _halves(_NAME + "_packed_backward", x)
    check_args(_NAME + "_packed_backward", gate, up, activation, dy)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _packed_setup(ctx, inputs, output):
    x, activation = inputs
    ctx.activation = activation
    ctx.save_for_backward(x)


def _packed_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return swiglu_packed_backward(dy, x, ctx.activation), None


swiglu_packed.register_autograd(_packed_backward, setup_context=_packed_setup)


class EagerSwiGLU(torch.autograd.Function):
    """The op's forward/backward without custom_op's Python dispatch, for eager mode (as
    ops.norms.EagerNorm); the face checked the arguments first."""

    @staticmethod
    def forward(ctx, gate, up, activation):
        ctx.activation = activation
        ctx.save_for_backward(gate, up)
        return _fwd(gate, up, activation)

    @staticmethod
    @first_order
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dg, du = _bwd(dy, gate, up, ctx.activation)
        return dg, du, None


eager_swiglu = eager_apply(EagerSwiGLU)


class EagerSwiGLUPacked(torch.autograd.Function):
    """act(gate) * up of the two halves of x = [gate | up] along its last dim (a fused gate/up
    projection's output), eagerly: the kernels read the halves in place and write the gradient of x
    whole (no chunk, no concatenation of the halves' gradients). The face checked x first."""

    @staticmethod
    def forward(ctx, x, activation):
        ctx.activation = activation
        ctx.save_for_backward(x)
        return _fwd(*x.chunk(2, -1), activation)

    @staticmethod
    @first_order
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return _packed_bwd(dy, x, ctx.activation), None


eager_swiglu_packed = eager_apply(EagerSwiGLUPacked)


def _selftest(device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    gate64, up64, dy = (torch.randn(3, 37, 123, generator=g, dtype=torch.float64) * 3 for _ in range(3))
    for activation in K.ACTIVATIONS:
        ours = [t.to(device=device, dtype=torch.float32).requires_grad_() for t in (gate64, up64)]
        refs = [t.clone().requires_grad_() for t in (gate64, up64)]
        y = swiglu(ours[0], ours[1], activation)
        y_ref = reference.swiglu(refs[0], refs[1], activation)
        torch.testing.assert_close(y.double().cpu(), y_ref, atol=1e-5, rtol=1e-5)
        (y.double().cpu() * dy).sum().backward()
        (y_ref * dy).sum().backward()
        for a, r in zip(ours, refs):
            torch.testing.assert_close(a.grad.double().cpu(), r.grad, atol=1e-4, rtol=1e-5)
        packed = torch.cat([t.detach() for t in ours], -1).requires_grad_()  # [gate | up]: the packed op
        yp = swiglu_packed(packed, activation)  # (its halves are strided views: aten's cpu kernels round
        torch.testing.assert_close(yp.double().cpu(), y_ref, atol=1e-5, rtol=1e-5)  # otherwise: vs the reference)
        (yp.double().cpu() * dy).sum().backward()
        torch.testing.assert_close(packed.grad.double().cpu(), torch.cat([r.grad for r in refs], -1), atol=1e-4,
                                   rtol=1e-5)
    assert math.isfinite(float(swiglu(torch.tensor([-1e4, 1e4], device=device), torch.ones(2, device=device),
                                      "gelu_tanh").sum()))


register(_NAME, "Triton", _selftest)
register(_NAME + "_backward", "Triton", _selftest)
register(_NAME + "_packed", "Triton", _selftest)
register(_NAME + "_packed_backward", "Triton", _selftest)
