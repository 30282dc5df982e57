"""``zerofuse::bias_gelu`` / ``bias_gelu_backward``: gelu_tanh(x + bias) over the last dim, fp32 inside
and one rounding; backward returns (dx, dbias) from one pass (x and bias saved, not x + bias).

CUDA tensors run kernels/bias_gelu.py (backward in one launch: its bias sum by the last program);
CPU tensors aten's gelu / gelu_backward on fp32 copies (float64 for float64), or the Triton kernels
in the interpreter under ZEROFUSE_TRITON_ON_CPU=1.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from zerofuse import kernels, reference
from zerofuse.kernels import bias_gelu as K
from zerofuse.ops import eager_apply, first_order, register

_NAME = "zerofuse::bias_gelu"
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_args(fn: str, x: Tensor, bias: Tensor, dy: Tensor | None = None) -> None:
    if not x.is_floating_point() or x.dim() == 0:
        raise RuntimeError(f"{fn}: expected x to be a floating-point tensor of at least 1 dim, got {x.dtype} of "
                           f"shape {list(x.shape)}")
    if bias.shape != (x.shape[-1],) or bias.dtype != x.dtype or bias.device != x.device:
        raise RuntimeError(f"{fn}: expected bias of shape [{x.shape[-1]}] (x's last dim) and x's dtype and device "
                           f"({x.dtype}, {x.device}), got {list(bias.shape)}, {bias.dtype}, {bias.device}")
    if dy is not None and (dy.shape != x.shape or dy.dtype != x.dtype or dy.device != x.device):
        raise RuntimeError(f"{fn}: expected dy of x's shape, dtype and device ({list(x.shape)}, {x.dtype}, "
                           f"{x.device}), got {list(dy.shape)}, {dy.dtype}, {dy.device}")


def _use_triton(x: Tensor) -> bool:
    return x.dtype in _KERNEL_DTYPES and (x.is_cuda or (x.device.type == "cpu" and kernels.triton_on_cpu()))


def _acc(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _fwd(x, bias):
    if _use_triton(x):
        return K.bias_gelu_fwd(x.contiguous(), bias.contiguous())
    acc = _acc(x)  # (contiguous as the Triton path's and the fakes': aten's follow x's layout)
    return torch.nn.functional.gelu(x.to(acc) + bias.to(acc), approximate="tanh").to(x.dtype).contiguous()


def _bwd(dy, x, bias):
    if _use_triton(x):
        return K.bias_gelu_bwd(dy.contiguous(), x.contiguous(), bias.contiguous())
    acc = _acc(x)
    dh = torch.ops.aten.gelu_backward(dy.to(acc), x.to(acc) + bias.to(acc), approximate="tanh")
    # (reshape(-1, 0) of an empty last dim is ambiguous: it raised)
    return dh.to(x.dtype).contiguous(), dh.reshape(math.prod(x.shape[:-1]), x.shape[-1]).sum(0).to(bias.dtype)


@torch.library.custom_op(_NAME, mutates_args=())
def bias_gelu(x: Tensor, bias: Tensor) -> Tensor:
    """gelu(x + bias, approximate='tanh'), bias (x.shape[-1],) of x's dtype."""
    check_args(_NAME, x, bias)
    return _fwd(x, bias)


@bias_gelu.register_fake
def _(x, bias):
    check_args(_NAME, x, bias)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op(_NAME + "_backward", mutates_args=())
def bias_gelu_backward(dy: Tensor, x: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """(dx, dbias) of bias_gelu: dx = dy * gelu'(x + bias), dbias its sum over every leading dim."""
    check_args(_NAME + "_backward", x, bias, dy)
    return _bwd(dy, x, bias)


@bias_gelu_backward.register_fake
def _(dy, x, bias):
    check_args(_NAME + "_backward", x, bias, dy)
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(bias)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    x, bias = ctx.saved_tensors
    return bias_gelu_backward(dy.contiguous(), x, bias)


bias_gelu.register_autograd(_backward, setup_context=_setup)


class EagerBiasGELU(torch.autograd.Function):
    """The op's forward/backward without custom_op's Python dispatch, for eager mode (as
    ops.swiglu.EagerSwiGLU); the face checked the arguments first."""

    @staticmethod
    def forward(ctx, x, bias):
        ctx.save_for_backward(x, bias)
        return _fwd(x, bias)

    @staticmethod
    @first_order
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        return _bwd(dy, x, bias)


eager_bias_gelu = eager_apply(EagerBiasGELU)


def _selftest(device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    x64, dy = (torch.randn(3, 37, 123, generator=g, dtype=torch.float64) * 3 for _ in range(2))
    b64 = torch.randn(123, generator=g, dtype=torch.float64)
    ours = [t.to(device=device, dtype=torch.float32).requires_grad_() for t in (x64, b64)]
    refs = [t.clone().requires_grad_() for t in (x64, b64)]
    y = bias_gelu(*ours)
    y_ref = reference.bias_gelu(*refs)
    torch.testing.assert_close(y.double().cpu(), y_ref, atol=1e-5, rtol=1e-5)
    (y.double().cpu() * dy).sum().backward()
    (y_ref * dy).sum().backward()
    for a, r in zip(ours, refs):
        torch.testing.assert_close(a.grad.double().cpu(), r.grad, atol=1e-4, rtol=1e-5)
    assert math.isfinite(float(bias_gelu(torch.tensor([-1e4, 1e4], device=device), torch.ones(2, device=device)).sum()))


register(_NAME, "Triton", _selftest)
register(_NAME + "_backward", "Triton", _selftest)
