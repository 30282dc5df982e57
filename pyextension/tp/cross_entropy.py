"""Vocabulary-parallel cross-entropy: from sharded logits (``vocab_parallel_cross_entropy``) and fused with
the output layer (``vocab_parallel_linear_cross_entropy``).

Each rank of the TP group holds rows [vocab_start, vocab_end) of the output weight (as
ColumnParallelLinear and VocabParallelEmbedding split it). The chunk loop of
zerofuse/ops/linear_cross_entropy.py runs on this rank's shard; between each chunk's statistics and
its gradient, two all-reduces (the max of the per-rank logsumexps; then the sums of exp(lse_r - max),
the target logit and the logits' sum) make the statistics global, so neither the full-vocabulary
logits nor any rank's whole shard of them ever exist. The input gradient each rank computes is its
shard's share: the hidden states enter through copy_to_tp (sequence parallelism: gather_from_seq),
whose backward sums the shares (all-reduce; reduce-scatter back to the sequence shard).
"""
from __future__ import annotations

import torch
from torch import Tensor

from zerofuse.nn.loss import autocast_inputs, check_face_args, check_loss_options, wants_grad
from zerofuse.ops import first_order
from zerofuse.ops import linear_cross_entropy as ops
from zerofuse.ops.ids import check_ids
from zerofuse.tp import comm as C
from zerofuse.tp.layers import ColumnParallelLinear, _group
from zerofuse.tp.spec import vocab_range

class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy from vocabulary-sharded logits: a max all-reduce, then one
    all-reduce of (sum of exp, target logit); the full-vocabulary logits never exist anywhere."""

    @staticmethod
    def forward(ctx, logits, targets, comm, vocab_start, ignore_index):
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (float64 stays: F.cross_entropy's)
        m = x.max(dim=-1).values
        C.all_reduce(m, comm, op="max")
        e = torch.exp(x - m.unsqueeze(-1))
        n_local = x.shape[-1]
        inside = (targets >= vocab_start) & (targets < vocab_start + n_local)
        local_t = (targets - vocab_start).masked_fill(~inside, 0)
        tl = torch.where(inside, x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1), 0.0)  # (-inf * 0 is NaN)
        both = torch.stack([e.sum(-1), tl])
        C.all_reduce(both, comm)
        sumexp, target_logit = both[0], both[1]
        loss = torch.log(sumexp) + m - target_logit
        ignored = targets == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        e.div_(sumexp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(e, local_t, inside, ignored)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        if getattr(ctx, "used", False):  # (an obscure "modified by an inplace operation" error before)
            raise RuntimeError("zerofuse.tp.vocab_parallel_cross_entropy: a second backward through the same graph "
                               "(retain_graph=True) is not supported: the first one turned the saved softmax into "
                               "the gradient in place (no second vocabulary-sized buffer); compute the loss again")
        ctx.used = True
        softmax, local_t, inside, ignored = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -inside.to(grad.dtype).unsqueeze(-1))
        # (a select, not * 0: an ignored row's incoming NaN/inf, e.g. a masked per-sequence mean's
        # 0/0, stays out of the logits' grad as F.cross_entropy keeps it; a review's reproduction)
        grad.mul_(torch.where(ignored, 0, g).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: Tensor, targets: Tensor, group=None, *, vocab_size: int | None = None,
                                 ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """F.cross_entropy(full_logits, targets) from this rank's vocabulary shard (..., V_r) of the
    logits, split over the TP group as ColumnParallelLinear / VocabParallelEmbedding split it
    (vocab_size: the full vocabulary; default: the group's shards summed, one small all-reduce
    more). reduction: 'mean' (over targets != ignore_index), 'sum' or 'none'."""
    comm = C.comm_for(_group(group))
    vocab_size, start, _ = vocab_range(logits_shard.shape[-1], vocab_size, comm,
                                       "zerofuse.tp.vocab_parallel_cross_entropy", logits_shard.device)
    if targets.shape != logits_shard.shape[:-1]:
        raise ValueError(f"zerofuse.tp.vocab_parallel_cross_entropy: expected targets of shape "
                         f"{list(logits_shard.shape[:-1])}, got {list(targets.shape)}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"zerofuse.tp.vocab_parallel_cross_entropy: expected reduction 'mean', 'sum' or 'none', "
                         f"got {reduction!r}")
    check_loss_options("zerofuse.tp.vocab_parallel_cross_entropy", ignore_index)
    check_ids("zerofuse.tp.vocab_parallel_cross_entropy", "targets", targets, vocab_size, ignore_index)
    loss = _VocabParallelCE.apply(logits_shard, targets, comm, start, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (targets != ignore_index).sum().clamp(min=1)


_WHERE = "zerofuse.tp.vocab_parallel_linear_cross_entropy"


def _combiner(comm):
    def combine(lse: Tensor, tz: Tensor, sz: Tensor) -> None:
        top = C.all_reduce(lse.clone(), comm, op="max")
        sums = torch.stack([torch.exp(lse - top), tz, sz])
        C.all_reduce(sums, comm)
        lse.copy_(top + torch.log(sums[0]))
        tz.copy_(sums[1])
        sz.copy_(sums[2])

    return combine


class _VocabParallelLCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, comm, vocab_start, vocab_total, opts, grad):
        ignore_index, smoothing, z_loss, softcap, reduction, chunk = opts
        valid = target != ignore_index
        scale = ops.row_scale(valid, reduction, hidden.dtype) if grad else None
        kw = dict(chunk=chunk, vocab_start=vocab_start, vocab_total=vocab_total, smoothing=smoothing, z_loss=z_loss,
                  softcap=softcap)
        lse, tz, sz, dh, dw, db = ops.forward_chunks(hidden, weight, bias, target, scale, grad=grad,
                                                     combine=_combiner(comm), **kw)
        loss = ops.reduce(ops.token_losses(lse, tz, sz, valid, smoothing=smoothing, z_loss=z_loss,
                                           vocab_total=vocab_total), valid, reduction)
        ctx.grad, ctx.kw, ctx.reduction, ctx.ignore_index = grad, kw, reduction, ignore_index
        ctx.has_bias = bias is not None
        if grad:
            ctx.save_for_backward(dh, dw, db if bias is not None else None)
        else:
            ctx.save_for_backward(hidden, weight, bias, target, lse)
        return loss

    @staticmethod
    @first_order(name="vocab_parallel_linear_cross_entropy", batched_ok=lambda ctx: ctx.grad)
    def backward(ctx, dloss):
        if ctx.grad:
            dh, dw, db = ops.scale_saved_grads(ctx, dloss)
            db = db if ctx.has_bias else None
        else:
            hidden, weight, bias, target, lse = ctx.saved_tensors
            scale = ops.row_scale(target != ctx.ignore_index, ctx.reduction, hidden.dtype, dloss)
            dh, dw, db = ops.backward_chunks(scale, hidden, weight, bias, target, lse, **ctx.kw)
            db = db if ctx.has_bias else None
        return dh, dw, db, None, None, None, None, None, None


def vocab_parallel_linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, group=None, *,
                                        bias: Tensor | None = None, vocab_size: int | None = None,
                                        sequence_parallel: bool = False, ignore_index: int = -100,
                                        reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                                        softcap: float | None = None, chunk_size: int | None = None,
                                        recompute: bool = False) -> Tensor:
    """zerofuse.nn.functional.linear_cross_entropy(hidden, full_weight, target, full_bias, ...) with the
    weight (and bias) split over the TP group by vocabulary rows: ``weight`` is this rank's (V_r, D)
    shard, ``vocab_size`` the full vocabulary (default: the group's shards summed, one small
    all-reduce more). hidden is
    replicated over the group (..., D), or with sequence_parallel=True this rank's sequence shard
    (b, s/tp, D) with target the whole (b, s). Every rank gets the same loss."""
    comm = C.comm_for(_group(group))
    tp = comm.world_size
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(f"{_WHERE}: expected weight to be this rank's (V_r, D) shard of the output layer, got "
                         f"{list(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__}")
    vocab_size, start, _ = vocab_range(weight.shape[0], vocab_size, comm, _WHERE, weight.device, "weight rows")
    if sequence_parallel:
        if not isinstance(hidden, Tensor) or hidden.dim() != 3 or not isinstance(target, Tensor) \
                or tuple(target.shape) != (hidden.shape[0], hidden.shape[1] * tp):
            raise ValueError(f"{_WHERE}: sequence parallelism takes hidden (b, s/tp, D) and target (b, s); got "
                             f"{list(getattr(hidden, 'shape', []))} and {list(getattr(target, 'shape', []))} at tp={tp}")
        h = C.gather_from_seq(hidden, comm)
    else:
        h = C.copy_to_tp(hidden, comm) if isinstance(hidden, Tensor) else hidden
    check_face_args(h, weight, target, bias, reduction, softcap, chunk_size, _WHERE, ignore_index, label_smoothing,
                    z_loss)
    h, weight, bias, autocast_off = autocast_inputs(h, weight, bias)  # (before the dtype checks: as F.linear)
    ops.check_args(_WHERE, h.reshape(-1, h.shape[-1]), weight, target.reshape(-1), bias, label_smoothing, z_loss,
                   float(softcap or 0.0), reduction, 0)
    check_ids(_WHERE, "target", target, vocab_size, ignore_index)
    h2, t1 = h.reshape(-1, h.shape[-1]), target.reshape(-1)
    # from the full vocabulary: every rank must run the same chunks (the same collectives)
    chunk = chunk_size or ops.default_chunk(h2.shape[0], vocab_size, h2.shape[1])
    opts = (int(ignore_index), float(label_smoothing), float(z_loss), float(softcap or 0.0), reduction, chunk)
    grad = reduction != "none" and not recompute and wants_grad(h2, weight, bias)
    with autocast_off:
        loss = _VocabParallelLCE.apply(h2, weight, bias, t1, comm, start, vocab_size, opts, grad)
    return loss.view(target.shape) if reduction == "none" else loss


class VocabParallelLinearCrossEntropyHead(ColumnParallelLinear):
    """ColumnParallelLinear over the vocabulary (same params) whose forward also takes the targets:
    ``head(hidden)`` -> this rank's logits shard; ``head(hidden, target, **loss_options)`` -> the
    vocabulary-parallel fused loss, computed in this module's forward (ZeRO's hooks run first)."""

    backward_once = True  # as zerofuse.nn.LinearCrossEntropyHead's

    def forward(self, x: Tensor, target: Tensor | None = None, **loss_options) -> Tensor:
        if target is None:
            return super().forward(x)
        return vocab_parallel_linear_cross_entropy(x, self.weight, target, self.group, bias=self.bias,
                                                   vocab_size=self.out_features,
                                                   sequence_parallel=self.sequence_parallel, **loss_options)
