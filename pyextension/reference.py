"""Pure-PyTorch references of every zerofuse op: the same math, written for clarity.

Tests and benchmarks import these; nothing else copies them. They run on any device and dtype
(float64 included), in place where the op is in place.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def flatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets: Sequence[int]) -> None:
    """flat[offsets[i] : offsets[i] + tensors[i].numel()] = tensors[i] in row-major order, cast to flat.dtype."""
    for t, off in zip(tensors, offsets):
        flat[off : off + t.numel()].copy_(t.reshape(-1))


def unflatten_from(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """tensors[i][...] = flat[offsets[i] : offsets[i] + tensors[i].numel()].view(tensors[i].shape), cast."""
    for t, off in zip(tensors, offsets):
        t.copy_(flat[off : off + t.numel()].view(t.shape))


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, residual=None):
    """(y, h): h = x + residual (or x), y = (h - mean) / sqrt(var + eps) * weight + bias over the
    trailing normalized_shape dims (biased variance). Computed in the inputs' dtype: pass float64
    tensors for a float64 reference."""
    h = x + residual if residual is not None else x
    dims = tuple(range(-len(normalized_shape), 0))
    mean = h.mean(dims, keepdim=True)
    var = (h - mean).square().mean(dims, keepdim=True)
    y = (h - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y, h


def rms_norm(x, normalized_shape, weight=None, eps=None, residual=None):
    """(y, h): h = x + residual (or x), y = h / sqrt(mean(h^2) + eps) * weight; eps defaults to
    torch.finfo(x.dtype).eps, as in torch.nn.functional.rms_norm."""
    h = x + residual if residual is not None else x
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    dims = tuple(range(-len(normalized_shape), 0))
    y = h * torch.rsqrt(h.square().mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    return y, h


def adam_step(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
              decoupled=True, maximize=False):
    """One Adam (decoupled=False: L2 decay added to the gradient, as torch.optim.Adam) or AdamW
    (decoupled=True: param *= 1 - lr * weight_decay, as torch.optim.AdamW) step, in place, in the
    tensors' dtype (Kingma & Ba 2015; Loshchilov & Hutter 2019). `step` counts from 1."""
    g = -grad if maximize else grad
    if weight_decay:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            g = g + weight_decay * param
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))
