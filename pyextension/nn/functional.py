"""Functional faces with torch.nn.functional's signatures, plus the fused residual-add variants.

    layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-05)
    rms_norm(input, normalized_shape, weight=None, eps=None)
    add_layer_norm(input, residual, normalized_shape, weight=None, bias=None, eps=1e-05) -> (y, h)
    add_rms_norm(input, residual, normalized_shape, weight=None, eps=None) -> (y, h)

with h = input + residual, y = norm(h): the pre-norm transformer step in one pass. On CPU (without
ZEROFUSE_TRITON_ON_CPU=1) these call torch's native kernels directly (fp16/bf16 LayerNorm goes
through the op for an fp32 backward, see _native); CUDA tensors run the fused Triton kernels
through the zerofuse ops.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from zerofuse import kernels
from zerofuse.ops import norms as _ops

_ShapeLike = int | Sequence[int] | torch.Size


def _shape(normalized_shape: _ShapeLike) -> tuple[int, ...]:
    return (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)


def _check(fn, input, shape, weight, bias, residual) -> None:
    where = f"zerofuse.nn.functional.{fn}"
    if not isinstance(input, Tensor) or not input.is_floating_point():
        got = input.dtype if isinstance(input, Tensor) else type(input).__name__
        raise TypeError(f"{where}: expected input to be a floating-point tensor, got {got}")
    if len(shape) == 0 or len(shape) > input.dim() or tuple(input.shape[-len(shape):]) != shape:
        raise ValueError(
            f"{where}: expected input whose trailing dimensions equal normalized_shape={list(shape)}, "
            f"got input of shape {list(input.shape)}"
        )
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if tuple(p.shape) != shape:
            raise ValueError(f"{where}: expected {name} of shape {list(shape)} (normalized_shape), got {list(p.shape)}")
        if not p.is_floating_point():
            raise TypeError(f"{where}: expected {name} to be a floating-point tensor, got {p.dtype}")
        if p.device != input.device:
            raise ValueError(f"{where}: expected {name} on the device of input ({input.device}), got {p.device}")
    if residual is not None:
        if residual.shape != input.shape:
            raise ValueError(f"{where}: expected residual of the input's shape {list(input.shape)}, got {list(residual.shape)}")
        if not residual.is_floating_point() or residual.device != input.device:
            raise ValueError(
                f"{where}: expected residual to be a floating-point tensor on {input.device}, "
                f"got {residual.dtype} on {residual.device}"
            )


def _native(input: Tensor, norm: str) -> bool:
    """Whether to call torch's functional directly (CPU, no interpreter): always for RMSNorm and
    fp32/fp64 LayerNorm. fp16/bf16 LayerNorm takes the zerofuse op, whose CPU backward runs torch's
    kernel in fp32, because torch's own low-precision CPU backward loses ~10 ulps on dweight/dbias."""
    if input.device.type != "cpu" or kernels.triton_on_cpu():
        return False
    return norm == "rms" or input.dtype not in (torch.float16, torch.bfloat16)


def _flat(t: Tensor | None, n: int) -> Tensor | None:
    return None if t is None else t.reshape(n)


def _layer_norm(fn, input, residual, normalized_shape, weight, bias, eps):
    shape = _shape(normalized_shape)
    _check(fn, input, shape, weight, bias, residual)
    if _native(input, "layer"):
        h = input if residual is None else input + residual
        return F.layer_norm(h, shape, weight, bias, eps), h
    n = math.prod(shape)
    x = input.reshape(*input.shape[: input.dim() - len(shape)], n)
    r = None if residual is None else residual.reshape(x.shape)
    y, h, _, _ = _ops.layer_norm(x, _flat(weight, n), _flat(bias, n), r, eps)
    return y.view(input.shape), (input if residual is None else h.view(input.shape))


def _rms_norm(fn, input, residual, normalized_shape, weight, eps):
    shape = _shape(normalized_shape)
    _check(fn, input, shape, weight, None, residual)
    if _native(input, "rms"):
        h = input if residual is None else input + residual
        return F.rms_norm(h, shape, weight, eps), h
    if eps is None:
        eps = torch.finfo(input.dtype).eps
    n = math.prod(shape)
    x = input.reshape(*input.shape[: input.dim() - len(shape)], n)
    r = None if residual is None else residual.reshape(x.shape)
    y, h, _ = _ops.rms_norm(x, _flat(weight, n), r, eps)
    return y.view(input.shape), (input if residual is None else h.view(input.shape))


def layer_norm(input: Tensor, normalized_shape: _ShapeLike, weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Drop-in for torch.nn.functional.layer_norm."""
    return _layer_norm("layer_norm", input, None, normalized_shape, weight, bias, eps)[0]


def rms_norm(input: Tensor, normalized_shape: _ShapeLike, weight: Tensor | None = None,
             eps: float | None = None) -> Tensor:
    """Drop-in for torch.nn.functional.rms_norm (eps=None means torch.finfo(input.dtype).eps)."""
    return _rms_norm("rms_norm", input, None, normalized_shape, weight, eps)[0]


def add_layer_norm(input: Tensor, residual: Tensor, normalized_shape: _ShapeLike, weight: Tensor | None = None,
                   bias: Tensor | None = None, eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """(layer_norm(h), h) with h = input + residual, fused; gradients flow to input and residual."""
    return _layer_norm("add_layer_norm", input, residual, normalized_shape, weight, bias, eps)


def add_rms_norm(input: Tensor, residual: Tensor, normalized_shape: _ShapeLike, weight: Tensor | None = None,
                 eps: float | None = None) -> tuple[Tensor, Tensor]:
    """(rms_norm(h), h) with h = input + residual, fused; gradients flow to input and residual."""
    return _rms_norm("add_rms_norm", input, residual, normalized_shape, weight, eps)
