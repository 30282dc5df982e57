"""Functional optimizer steps on flat buffers: what ZeRO runs on each rank's shard.

A shard is one contiguous fp32 (or bf16 with an fp32 master) buffer holding the pieces of many
params; Adam/AdamW treat it as one tensor (one pass, one launch). LAMB needs one trust ratio per
param, so it takes the shard's segments (offset, length) and returns per-segment sums of squares
between its two passes, which ``norm_reduce`` (e.g. an all-reduce over the ranks that hold pieces
of the same params) can combine before the update.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from zerofuse.ops import adam_, l2norm, lamb_stage1_, lamb_stage2_


def _flat(name: str, t: torch.Tensor) -> None:
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"zerofuse.optim.functional: expected {name} to be a 1-D contiguous tensor, got shape "
                         f"{list(t.shape)} with strides {list(t.stride())}")


def adamw_flat(param, grad, exp_avg, exp_avg_sq, step, *, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
               decoupled=True, maximize=False, master=None, grad_mult=None, found_inf=None) -> None:
    """One AdamW (Adam with decoupled=False) step of a flat shard, in place. step: 1-element fp32
    tensor holding the step count, advanced by 1 here (not on a skipped step)."""
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _flat(name, t)
    adam_([param], [grad], [exp_avg], [exp_avg_sq], [step], lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
          weight_decay=weight_decay, decoupled=decoupled, maximize=maximize,
          masters=[master] if master is not None else [], grad_mult=grad_mult, found_inf=found_inf)


def segment_views(flat: torch.Tensor, segments: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """Views flat[off : off + length] of each (off, length) segment, checked to lie inside flat
    and not to overlap (an element in two segments would be stepped twice)."""
    out = []
    for i, (off, length) in enumerate(segments):
        if off < 0 or length < 0 or off + length > flat.numel():
            raise ValueError(f"zerofuse.optim.functional: segments[{i}] = ({off}, {length}) runs outside the "
                             f"flat buffer of {flat.numel()} elements")
        out.append(flat.narrow(0, off, length))
    spans = sorted((off, off + length, i) for i, (off, length) in enumerate(segments) if length)
    for (_, end, i), (off, _, j) in zip(spans, spans[1:]):
        if off < end:
            a, b = sorted((i, j))
            raise ValueError(f"zerofuse.optim.functional: expected disjoint segments, got segments[{a}] = "
                             f"{tuple(segments[a])} and segments[{b}] = {tuple(segments[b])} overlapping")
    return out


def lamb_flat(param, grad, exp_avg, exp_avg_sq, step, segments, *, lr, betas=(0.9, 0.999), eps=1e-6,
              weight_decay=0.01, bias_correction=True, mode="nvlamb", min_trust=0.0, max_trust=10.0, master=None,
              grad_mult=None, found_inf=None,
              norm_reduce: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """One LAMB step of a flat shard whose segments (offset, length) are the pieces of separate
    params (one trust ratio each). Between the passes norm_reduce(norms) may combine, in place,
    the (segments, 2) fp32 sums of squares (|p|^2, |u|^2) with other ranks'. step: as in
    adamw_flat (advanced by 1 here). Returns the norms."""
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _flat(name, t)
    views = [segment_views(t, segments) for t in (param, grad, exp_avg, exp_avg_sq)]
    masters = segment_views(master, segments) if master is not None else []
    steps = [step] * len(segments)
    norms = torch.zeros((len(segments), 2), device=param.device, dtype=torch.float32)
    kw = dict(beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
              masters=masters, found_inf=found_inf)
    lamb_stage1_(views[0], views[1], views[2], views[3], steps, norms, grad_mult=grad_mult, **kw)
    if norm_reduce is not None:
        norm_reduce(norms)
    lamb_stage2_(views[0], views[2], views[3], steps, norms, lr=lr, mode=mode, min_trust=min_trust,
                 max_trust=max_trust, **kw)
    return norms


def grad_norm(grads: Sequence[torch.Tensor], grad_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(global 2-norm of the unscaled grads, found_inf) as 1-element fp32 tensors on the grads'
    device, from one fused pass and without a host sync: found_inf is 1.0 when any grad holds an
    inf or NaN. Pass them to an optimizer's step (found_inf=...) or use the norm for clipping."""
    grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
    mult = None
    if grad_scale is not None and grads:  # unscaled before the squares (l2norm's mult)
        mult = torch.as_tensor(grad_scale, dtype=torch.float32, device=grads[0].device).reshape(1).reciprocal()
    norm, _ = l2norm(grads, mult=mult)
    norm = norm.reshape(1)
    return norm, (~torch.isfinite(norm)).float()
