"""Fused output layer + cross-entropy: ``linear_cross_entropy`` and ``LinearCrossEntropyLoss``.

    loss = linear_cross_entropy(hidden, lm_head.weight, target)

equals ``F.cross_entropy((hidden @ weight.T + bias).float().flatten(0, -2), target.flatten())`` (plus
label smoothing, PaLM's z-loss and Gemma-2's logit softcap when asked) without the (tokens, vocab)
logits: zerofuse::linear_cross_entropy computes them a chunk of tokens at a time, the logsumexp in
fp32, and (reduction 'mean' or 'sum') the gradients during the forward. For gradient accumulation
with a token count known only for the whole batch (Hugging Face's ``num_items_in_batch``), take
reduction='sum' and divide: ``linear_cross_entropy(..., reduction="sum") / num_items_in_batch``.

Unlike F.cross_entropy, 'mean' over a batch whose targets are all ignore_index is 0, not NaN.
Under autocast the GEMMs run in the autocast dtype, as the unfused head's F.linear would (hidden,
weight and bias cast to it; the logsumexp stays fp32).
Under tensor parallelism use zerofuse.tp.vocab_parallel_linear_cross_entropy (the weight sharded
over the vocabulary). Under ZeRO-3 call it inside the forward of a module the weight belongs to (or
of the model, whose root unit holds the head): the weight is gathered there. A weight whose storage
is freed (a ZeRO-3 shard not gathered) is refused rather than read.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import operator

import torch
from torch import Tensor

from zerofuse.nn.autocast import autocast_dtype, cast_all
from zerofuse.ops import linear_cross_entropy as _ops

_WHERE = "zerofuse.nn.functional.linear_cross_entropy"


def check_loss_options(where: str, ignore_index=-100, label_smoothing=0.0, z_loss=0.0) -> None:
    """ignore_index an int, label_smoothing / z_loss real numbers, as torch's cross_entropy takes them
    (ignore_index=1.5 was taken as 1, ignoring class 1; label_smoothing="0.1" was parsed)."""
    try:
        if isinstance(ignore_index, bool):
            raise TypeError
        operator.index(ignore_index)  # (an int, numpy's too)
    except TypeError:
        raise TypeError(f"{where}: expected ignore_index to be an int, got {ignore_index!r}") from None
    for name, v in (("label_smoothing", label_smoothing), ("z_loss", z_loss)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{where}: expected {name} to be a float, got {v!r}")


def check_face_args(hidden, weight, target, bias, reduction, softcap, chunk_size, where: str = _WHERE,
                    ignore_index=-100, label_smoothing=0.0, z_loss=0.0) -> None:
    """The face's checks (also zerofuse.tp.vocab_parallel_linear_cross_entropy's), named for ``where``."""
    check_loss_options(where, ignore_index, label_smoothing, z_loss)
    if torch._C._are_functorch_transforms_active():  # (the storage check below failed on its wrappers)
        raise RuntimeError(f"{where} does not support torch.func transforms (grad, vmap, jacrev): its fused "
                           "backward is made in the forward; use torch.autograd, or F.cross_entropy of the logits")
    for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if t is None and name == "bias":
            continue
        if not isinstance(t, Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(f"{where}: expected {name} to be a floating-point tensor, got {got}")
        if t.device.type != "meta" and t.numel() and t.untyped_storage().size() == 0:
            raise RuntimeError(f"{where}: {name} of shape {list(t.shape)} has no storage (a ZeRO-3 shard freed "
                               "outside its unit's forward?): call it inside the forward of the module that owns the "
                               "param, or of the model")
    if not isinstance(target, Tensor):
        raise TypeError(f"{where}: expected target to be an integer tensor, got {type(target).__name__}")
    if hidden.dim() < 1:
        raise ValueError(f"{where}: expected hidden of shape (..., dim), got a 0-dim tensor")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{where}: expected target of shape {list(hidden.shape[:-1])} (hidden's without the last "
                         f"dim), got {list(target.shape)}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{where}: expected reduction 'mean', 'sum' or 'none', got {reduction!r}")
    if softcap is not None and not 0 < softcap < math.inf:  # (inf caps nothing: None says so; tanh(z/inf)*inf is NaN)
        raise ValueError(f"{where}: expected a finite softcap > 0 or None, got {softcap}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"{where}: expected chunk_size to be an int >= 1 or None, got {chunk_size!r}")


def refuse_forward_ad(where: str, *tensors) -> None:
    """The op has no jvp: a dual input is refused (its tangent was dropped silently, the loss's None)."""
    if torch.autograd.forward_ad._current_level >= 0 and any(
            t is not None and torch.autograd.forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        raise NotImplementedError(f"{where}: forward-mode AD is not supported (no jvp); differentiate it with "
                                  "backward (reverse mode), or use the unfused F.linear + F.cross_entropy")


def autocast_inputs(hidden, weight, bias):
    """Under autocast (of hidden's device), as F.linear: (hidden, weight, bias) in the autocast dtype
    and a context with autocast off (the ops' out= GEMMs must not be cast again); else as given."""
    dt = autocast_dtype(hidden)
    if dt is None:
        return hidden, weight, bias, contextlib.nullcontext()
    return (*cast_all(dt, hidden, weight, bias), torch.autocast(hidden.device.type, enabled=False))


def wants_grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None,
                         ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                         z_loss: float = 0.0, softcap: float | None = None, *, chunk_size: int | None = None,
                         recompute: bool = False) -> Tensor:
    """Cross-entropy of ``hidden @ weight.T + bias`` (hidden (..., D), weight (V, D), target (...))
    without materialising the logits; see the module doc. The loss is fp32 (fp64 for fp64 inputs);
    reduction 'none' returns target's shape. chunk_size: tokens per chunk (default: about as many
    logits per chunk as hidden has elements). recompute=True keeps no gradients from the forward
    and recomputes each chunk's logits in backward (one more GEMM; always so for 'none')."""
    check_face_args(hidden, weight, target, bias, reduction, softcap, chunk_size, _WHERE, ignore_index, label_smoothing,
                    z_loss)
    refuse_forward_ad(_WHERE, hidden, weight, bias)
    hidden, weight, bias, autocast_off = autocast_inputs(hidden, weight, bias)
    grad = reduction != "none" and not recompute and wants_grad(hidden, weight, bias)
    h = hidden.reshape(-1, hidden.shape[-1])
    with autocast_off:
        loss = _ops.linear_cross_entropy(h, weight, target.reshape(-1), bias, int(ignore_index),
                                         float(label_smoothing), float(z_loss), float(softcap or 0.0), reduction,
                                         int(chunk_size or 0), grad)[0]
    return loss.view(target.shape) if reduction == "none" else loss


class LinearCrossEntropyLoss(torch.nn.Module):
    """Module form: ``LinearCrossEntropyLoss(ignore_index=-100, reduction="mean", ...)(hidden,
    weight, target, bias=None)`` (Liger-Kernel's LigerFusedLinearCrossEntropyLoss argument order
    differs: it takes the weight first)."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 z_loss: float = 0.0, softcap: float | None = None, chunk_size: int | None = None,
                 recompute: bool = False):
        super().__init__()
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.z_loss, self.softcap, self.chunk_size, self.recompute = z_loss, softcap, chunk_size, recompute

    def forward(self, hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None) -> Tensor:
        return linear_cross_entropy(hidden, weight, target, bias, self.ignore_index, self.reduction,
                                    self.label_smoothing, self.z_loss, self.softcap, chunk_size=self.chunk_size,
                                    recompute=self.recompute)


class LinearCrossEntropyHead(torch.nn.Linear):
    """An output layer: torch.nn.Linear (same params and state_dict) whose forward also takes the
    targets. ``head(hidden)`` -> logits; ``head(hidden, target, **loss_options)`` -> the fused loss
    (linear_cross_entropy with this layer's weight and bias). The loss is computed in this module's
    forward, so ZeRO's per-module hooks (stage 1/2: wait for the param all-gather; stage 3: gather the
    unit) run before the weight is read, as for the unfused head."""

    # the loss's grads are made in its forward (unless recompute=True): its graph backwards once
    # (zerofuse.pipeline's zero-bubble split takes this layer's weight grads with the input grads)
    backward_once = True

    def forward(self, input: Tensor, target: Tensor | None = None, **loss_options) -> Tensor:
        if target is None:
            return super().forward(input)
        return linear_cross_entropy(input, self.weight, target, self.bias, **loss_options)


# torch.fx records these as calls when it traces LinearCrossEntropyLoss / Head, as zerofuse.nn.functional's
# (fx patches a name in the namespace of the module that calls it)
for _name in ("linear_cross_entropy",):
    torch.fx.wrap(_name)
del _name
