"""``zerofuse::linear_cross_entropy`` (+ its backward op): the output layer and the cross-entropy in
chunks of tokens, so the (tokens, vocab) logits never exist whole.

For each chunk of rows of hidden (T, D): z = hidden_chunk @ weight.T (+ bias) in the inputs' dtype
(one GEMM, as the unfused head computes it), then the row kernel (kernels/cross_entropy.py on CUDA
or under ZEROFUSE_TRITON_ON_CPU=1; the same formulas in torch ops on the cpu) takes the per-token
statistics in fp32 and overwrites z with dloss/dz. With ``grad=True`` (reduction 'mean' or 'sum')
the chunk's gradients follow at once: dhidden_chunk = dz @ weight, dweight += dz.T @ hidden_chunk
(accumulated in fp32), dbias += sum(dz); backward only scales them by the incoming gradient (3 GEMMs
per chunk in all, Liger-Kernel's scheme). With ``grad=False`` (reduction 'none', a recompute mode,
or no gradient wanted) the forward keeps the per-token logsumexp and the backward op recomputes each
chunk's logits (4 GEMMs).

The chunk loop is shared with the vocabulary-parallel version (zerofuse/tp/cross_entropy.py): there
each rank holds rows [vocab_start, vocab_start + V) of a vocabulary of vocab_total, and a
``combine`` callback turns each chunk's per-rank statistics into the global ones between the
statistics and gradient passes.

Peak memory beyond inputs and gradients: one chunk of logits (chunk × V in the inputs' dtype), the
fp32 dweight accumulator (plus, for low-precision weights on the cpu, one dweight-sized product per
chunk), and 3 fp32 values per token.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from zerofuse import kernels, reference
from zerofuse.kernels import cross_entropy as K
from zerofuse.ops import first_order, register
from zerofuse.ops.signatures import batched
from zerofuse.ops.ids import check_ids

_NAME = "zerofuse::linear_cross_entropy"
_REDUCTIONS = ("mean", "sum", "none")
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def default_chunk(tokens: int, vocab: int, dim: int) -> int:
    """Rows per chunk, a power of two: up to 1/8 of the tokens (the chunk's logits at most 1/8 of the
    full ones) and up to 2^26 logits, but at least Liger-Kernel's rule (as many logits as hidden
    has elements, next_power_of_2(tokens / ceil(vocab / dim))). Liger's rule alone made 8-row chunks
    at 1024 tokens, dim 256, vocab 32768: GEMMs of 8 rows and a full read+write of the fp32 weight
    gradient per 8 tokens, 3.6x slower than the unfused head on the cpu (measured 2026-11-25)."""
    liger = _pow2_at_least(-(-tokens // max(1, -(-vocab // dim))))
    cap = max(1, min(-(-tokens // 8), (1 << 26) // vocab))
    return max(liger, 1 << (cap.bit_length() - 1))


def _pow2_at_least(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


# ---------------------------------------------------------------- checks


def check_backward_args(fn: str, dloss: Tensor, lse: Tensor, hidden: Tensor, reduction: str) -> None:
    """The backward's dloss and lse (read per token by the kernels: a short lse or a (2, T) dloss
    segfaulted the interpreter's kernels, and the torch path broadcast or took a per-token dloss for
    'mean'; a review's reproduction, 2026-12-07)."""
    t = hidden.shape[0]
    want = (t,) if reduction == "none" else ()
    if tuple(dloss.shape) != want or not dloss.is_floating_point() or dloss.device != hidden.device:
        raise RuntimeError(f"{fn}: expected dloss to be a floating-point tensor of shape {want} (reduction "
                           f"{reduction!r}) on {hidden.device}, got {dloss.dtype} {list(dloss.shape)} on {dloss.device}")
    stat = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    if tuple(lse.shape) != (t,) or lse.dtype != stat or lse.device != hidden.device:
        raise RuntimeError(f"{fn}: expected lse to be the forward's, {stat} of shape ({t},) on {hidden.device}, got "
                           f"{lse.dtype} {list(lse.shape)} on {lse.device}")


def check_args(fn: str, hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, label_smoothing: float,
               z_loss: float, softcap: float, reduction: str, chunk_size: int) -> None:
    """Shapes, dtypes, devices and options (no values: the ids are checked where the data is)."""
    if hidden.dim() != 2 or not hidden.is_floating_point():
        raise RuntimeError(f"{fn}: expected hidden to be a floating-point (tokens, dim) tensor, got {hidden.dtype} "
                           f"{list(hidden.shape)}")
    t, d = hidden.shape
    if weight.dim() != 2 or weight.shape[1] != d or weight.shape[0] < 1:
        raise RuntimeError(f"{fn}: expected weight of shape (vocab, {d}) (dim = hidden's last), got {list(weight.shape)}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise RuntimeError(f"{fn}: expected weight of hidden's dtype and device ({hidden.dtype} on {hidden.device}), "
                           f"got {weight.dtype} on {weight.device}")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.dtype != hidden.dtype
                             or bias.device != hidden.device):
        raise RuntimeError(f"{fn}: expected bias of shape ({weight.shape[0]},), {hidden.dtype} on {hidden.device}, "
                           f"got {bias.dtype} {list(bias.shape)} on {bias.device}")
    if tuple(target.shape) != (t,) or target.device != hidden.device or target.is_floating_point() \
            or target.dtype == torch.bool:
        raise RuntimeError(f"{fn}: expected target to be an integer tensor of shape ({t},) on {hidden.device}, got "
                           f"{target.dtype} {list(target.shape)} on {target.device}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise RuntimeError(f"{fn}: expected label_smoothing in [0, 1], got {label_smoothing}")
    if not 0.0 <= z_loss < math.inf:
        raise RuntimeError(f"{fn}: expected a finite z_loss >= 0, got {z_loss}")
    if not 0.0 <= softcap < math.inf:
        raise RuntimeError(f"{fn}: expected a finite softcap > 0 (or 0: none), got {softcap}")
    if reduction not in _REDUCTIONS:
        raise RuntimeError(f"{fn}: expected reduction 'mean', 'sum' or 'none', got {reduction!r}")
    if chunk_size < 0:
        raise RuntimeError(f"{fn}: expected chunk_size >= 1 (or 0: automatic), got {chunk_size}")


# ---------------------------------------------------------------- the row step, kernel or torch


def _rows_torch(z, target, scale, lse, tz, sz, *, vocab_start, vocab_total, smoothing, z_loss, softcap, stats, grad):
    """kernels/cross_entropy.py's formulas in torch ops (fp32; float64 for float64 logits), in place
    in z where its dtype allows (fp32 without a softcap: no chunk-sized temporary but logsumexp's)."""
    acc = torch.float64 if z.dtype == torch.float64 else torch.float32
    zc = z.to(acc)
    if softcap:
        zc = torch.tanh(zc / softcap).mul_(softcap)
    t_local = target.long() - vocab_start
    inside = (t_local >= 0) & (t_local < z.shape[1])
    t_col = t_local.masked_fill(~inside, 0).unsqueeze(1)
    if stats:
        lse.copy_(torch.logsumexp(zc, dim=1))
        tz.copy_(torch.where(inside, zc.gather(1, t_col).squeeze(1), 0.0))  # (not * inside: -inf * 0 is NaN)
        sz.copy_(zc.sum(1))
    if grad:
        row_lse = lse.to(acc).unsqueeze(1)
        # the softcap's derivative, sech^2(z / c) (1 - (z'/c)^2 would cancel where z' nears +-c)
        cap = torch.cosh(z.to(acc) / softcap).square_().reciprocal_() if softcap else None
        g = zc  # overwritten (z itself for fp32 without a softcap): zc is not needed after this
        g.sub_(row_lse).exp_().mul_(1.0 + 2.0 * z_loss * row_lse)
        if smoothing:
            g.sub_(smoothing / vocab_total)
        g.scatter_add_(1, t_col, -(1.0 - smoothing) * inside.to(acc).unsqueeze(1))
        if cap is not None:
            g.mul_(cap)
        g.mul_(scale.to(acc).unsqueeze(1))
        if g is not z:
            z.copy_(g)


def _rows(z, *args, **kw) -> None:
    on_triton = z.dtype in _KERNEL_DTYPES and (z.is_cuda or (z.device.type == "cpu" and kernels.triton_on_cpu()))
    (K.ce_rows if on_triton else _rows_torch)(z, *args, **kw)


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.addmm(bias, h, weight.t()) if bias is not None else h @ weight.t()


def _acc_weight_grad(dw: Tensor, dz: Tensor, h: Tensor) -> None:
    """dw (fp32, or the weight's dtype when that is fp64) += dz.T @ h."""
    if dz.dtype == dw.dtype:
        dw.addmm_(dz.t(), h)
    elif dz.is_cuda:  # cuBLAS accumulates the low-precision product straight into fp32
        torch.addmm(dw, dz.t(), h, out_dtype=dw.dtype, out=dw)
    else:
        dw.add_(dz.t() @ h)


def _grad_buffers(hidden, weight, bias):
    acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
    dh = torch.empty_like(hidden)
    dw = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    db = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if bias is not None else None
    return dh, dw, db


def _finish_grads(dh, dw, db, weight, bias):
    return dh, dw.to(weight.dtype), (db.to(bias.dtype) if db is not None else dh.new_empty(0))


def forward_chunks(hidden, weight, bias, target, scale, *, chunk, vocab_start, vocab_total, smoothing, z_loss,
                   softcap, grad, combine=None):
    """The chunk loop -> (lse, tz, sz, dhidden, dweight, dbias): statistics per token (global ones
    when ``combine(lse, tz, sz)`` merges each chunk's over the vocabulary shards, in place) and, with
    ``grad``, the gradients of sum_i scale_i * loss_i (scale: fp32 per token)."""
    t = hidden.shape[0]
    stat = dict(dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32, device=hidden.device)
    lse, tz, sz = torch.empty(t, **stat), torch.empty(t, **stat), torch.empty(t, **stat)
    dh = dw = db = None
    if grad:
        dh, dw, db = _grad_buffers(hidden, weight, bias)
    kw = dict(vocab_start=vocab_start, vocab_total=vocab_total, smoothing=smoothing, z_loss=z_loss, softcap=softcap)
    for s in range(0, t, chunk):
        e = min(t, s + chunk)
        h = hidden[s:e]
        z = _logits(h, weight, bias)
        rows = (target[s:e], scale[s:e] if grad else None, lse[s:e], tz[s:e], sz[s:e])
        if combine is None:
            _rows(z, *rows, **kw, stats=True, grad=grad)
        else:
            _rows(z, *rows, **kw, stats=True, grad=False)
            combine(lse[s:e], tz[s:e], sz[s:e])
            if grad:
                _rows(z, *rows, **kw, stats=False, grad=True)
        if grad:
            torch.mm(z, weight, out=dh[s:e])
            _acc_weight_grad(dw, z, h)
            if db is not None:
                db.add_(z.sum(0, dtype=db.dtype))
    if grad:
        dh, dw, db = _finish_grads(dh, dw, db, weight, bias)
    return lse, tz, sz, dh, dw, db


def backward_chunks(scale, hidden, weight, bias, target, lse, *, chunk, vocab_start, vocab_total, smoothing, z_loss,
                    softcap):
    """(dhidden, dweight, dbias) of sum_i scale_i * loss_i, each chunk's logits recomputed."""
    dh, dw, db = _grad_buffers(hidden, weight, bias)
    kw = dict(vocab_start=vocab_start, vocab_total=vocab_total, smoothing=smoothing, z_loss=z_loss, softcap=softcap)
    for s in range(0, hidden.shape[0], chunk):
        e = min(hidden.shape[0], s + chunk)
        h = hidden[s:e]
        z = _logits(h, weight, bias)
        _rows(z, target[s:e], scale[s:e], lse[s:e], None, None, **kw, stats=False, grad=True)
        torch.mm(z, weight, out=dh[s:e])
        _acc_weight_grad(dw, z, h)
        if db is not None:
            db.add_(z.sum(0, dtype=db.dtype))
    return _finish_grads(dh, dw, db, weight, bias)


def token_losses(lse, tz, sz, valid, *, smoothing, z_loss, vocab_total) -> Tensor:
    """Per-token loss from the statistics, 0 where the target is ignored."""
    loss = (lse - tz) if smoothing == 0 else (1 - smoothing) * (lse - tz) + smoothing * (lse - sz / vocab_total)
    if z_loss:
        loss = loss + z_loss * lse * lse
    return torch.where(valid, loss, 0.0)  # (an ignored row's loss may be NaN: a -inf logit; * valid kept it)


def reduce(loss: Tensor, valid: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return loss
    total = loss.sum()
    return total if reduction == "sum" else total / valid.sum().clamp(min=1)


def row_scale(valid: Tensor, reduction: str, dtype: torch.dtype, dloss: Tensor | None = None) -> Tensor:
    """d(reduced loss)/d(loss_i), times the incoming gradient when given: the row scale of the
    gradient kernel (0 on ignored tokens), float64 for float64 inputs (dtype), else fp32."""
    scale = valid.to(torch.float64 if dtype == torch.float64 else torch.float32)
    if reduction == "mean":
        scale = scale / valid.sum().clamp(min=1)
    # (a select, not * 0: an ignored token's incoming NaN/inf, e.g. a masked per-sequence mean's 0/0,
    # stays out of the grads as F.cross_entropy keeps it; a review's reproduction, 2026-12-07)
    return scale if dloss is None else torch.where(valid, scale * dloss.to(scale.dtype), 0)


# ---------------------------------------------------------------- the ops


@torch.library.custom_op(_NAME, mutates_args=())
def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, ignore_index: int, label_smoothing: float,
    z_loss: float, softcap: float, reduction: str, chunk_size: int, grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse, dhidden, dweight, dbias) of the cross-entropy of hidden @ weight.T + bias against
    target (see the module doc; softcap 0 = none, chunk_size 0 = automatic). The gradients (those of
    the reduced loss) are computed only with grad=True (reduction 'mean'/'sum'), else empty."""
    check_args(_NAME, hidden, weight, target, bias, label_smoothing, z_loss, softcap, reduction, chunk_size)
    if grad and reduction == "none":
        raise RuntimeError(f"{_NAME}: grad=True needs reduction 'mean' or 'sum' (reduction 'none' recomputes in "
                           "backward)")
    v = weight.shape[0]
    check_ids(_NAME, "target", target, v, ignore_index)
    valid = target != ignore_index
    scale = row_scale(valid, reduction, hidden.dtype) if grad else None
    chunk = chunk_size or default_chunk(hidden.shape[0], v, hidden.shape[1])
    lse, tz, sz, dh, dw, db = forward_chunks(
        hidden, weight, bias, target, scale, chunk=chunk, vocab_start=0, vocab_total=v, smoothing=label_smoothing,
        z_loss=z_loss, softcap=softcap, grad=grad)
    loss = reduce(token_losses(lse, tz, sz, valid, smoothing=label_smoothing, z_loss=z_loss, vocab_total=v), valid,
                  reduction)
    if not grad:
        empty = hidden.new_empty(0)
        dh, dw, db = empty, empty.clone(), empty.clone()
    return loss, lse, dh, dw, db


@linear_cross_entropy.register_fake
def _(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap, reduction, chunk_size, grad):
    check_args(_NAME, hidden, weight, target, bias, label_smoothing, z_loss, softcap, reduction, chunk_size)
    if grad and reduction == "none":  # (as the op: the fake returned outputs)
        raise RuntimeError(f"{_NAME}: grad=True needs reduction 'mean' or 'sum' (reduction 'none' recomputes in "
                           "backward)")
    stat = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    t = hidden.shape[0]
    loss = hidden.new_empty((t,) if reduction == "none" else (), dtype=stat)
    lse = hidden.new_empty(t, dtype=stat)
    if not grad:
        return loss, lse, hidden.new_empty(0), hidden.new_empty(0), hidden.new_empty(0)
    db = torch.empty_like(bias) if bias is not None else hidden.new_empty(0)
    return loss, lse, torch.empty_like(hidden), torch.empty_like(weight), db


@torch.library.custom_op(_NAME + "_backward", mutates_args=())
def linear_cross_entropy_backward(
    dloss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, lse: Tensor, ignore_index: int,
    label_smoothing: float, z_loss: float, softcap: float, reduction: str, chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dhidden, dweight, dbias) of linear_cross_entropy for the incoming gradient dloss (a scalar,
    or one per token for reduction 'none'), each chunk's logits recomputed from hidden and weight."""
    check_args(_NAME + "_backward", hidden, weight, target, bias, label_smoothing, z_loss, softcap, reduction,
               chunk_size)
    check_backward_args(_NAME + "_backward", dloss, lse, hidden, reduction)
    v = weight.shape[0]
    scale = row_scale(target != ignore_index, reduction, hidden.dtype, dloss)
    chunk = chunk_size or default_chunk(hidden.shape[0], v, hidden.shape[1])
    return backward_chunks(scale, hidden, weight, bias, target, lse, chunk=chunk, vocab_start=0, vocab_total=v,
                           smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)


@linear_cross_entropy_backward.register_fake
def _(dloss, hidden, weight, target, bias, lse, ignore_index, label_smoothing, z_loss, softcap, reduction, chunk_size):
    check_args(_NAME + "_backward", hidden, weight, target, bias, label_smoothing, z_loss, softcap, reduction,
               chunk_size)
    check_backward_args(_NAME + "_backward", dloss, lse, hidden, reduction)
    db = torch.empty_like(bias) if bias is not None else hidden.new_empty(0)
    return torch.empty_like(hidden), torch.empty_like(weight), db


# ---------------------------------------------------------------- autograd


def scale_saved_grads(ctx, dloss: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients made in the forward times the incoming (scalar) gradient, in place: a second
    copy of dweight would be the largest buffer of the backward. So they serve one backward; a
    second one through the same graph (retain_graph=True) is refused rather than scaled twice."""
    if getattr(ctx, "consumed", False):
        raise RuntimeError(f"{_NAME}: the gradients made in the forward were used by an earlier backward through "
                           "this graph; to backward more than once, pass recompute=True")
    ctx.consumed = True
    grads = ctx.saved_tensors
    if type(dloss) is not torch.Tensor or batched(dloss):  # traced (torch.compile, opcheck): functional
        # tensors; batched (is_grads_batched=True, vmap over the backward): a batch of scalars. Out of place
        return tuple(g * dloss if g is not None else None for g in grads)
    # one multi-tensor launch (dloss: a 0-dim fp32 tensor read on the device; the gradients keep their
    # dtypes); empty ones (no bias) skipped
    torch._foreach_mul_([g for g in grads if g is not None and g.numel()], dloss)
    return grads


def _setup(ctx, inputs, output):
    hidden, weight, target, bias, ignore_index, smoothing, z_loss, softcap, reduction, chunk, grad = inputs
    _, lse, dh, dw, db = output
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the outputs that get none
    ctx.grad = grad
    ctx.has_bias = bias is not None
    ctx.opts = (ignore_index, smoothing, z_loss, softcap, reduction, chunk)
    if grad:  # the gradients were made in forward: only they are kept
        ctx.save_for_backward(dh, dw, db)
    else:
        ctx.save_for_backward(hidden, weight, target, bias, lse)


def _backward(ctx, dloss, _dlse, _ddh, _ddw, _ddb):
    if dloss is None:  # only the other outputs had gradients: none flows back
        return (None,) * 11
    if ctx.grad:
        dh, dw, db = scale_saved_grads(ctx, dloss)
    else:
        hidden, weight, target, bias, lse = ctx.saved_tensors
        dh, dw, db = linear_cross_entropy_backward(dloss, hidden, weight, target, bias, lse, *ctx.opts)
    return dh, dw, None, (db if ctx.has_bias else None), None, None, None, None, None, None, None


# (gradients made in forward: the backward scales them, no kernel; batched gradients are fine there)
linear_cross_entropy.register_autograd(first_order(_backward, name="linear_cross_entropy",
                                                   batched_ok=lambda ctx: ctx.grad), setup_context=_setup)


# ---------------------------------------------------------------- self-test (doctor)


def _selftest(device: torch.device) -> None:
    """Loss and gradients, both modes, vs the float64 reference on odd shapes with an ignored token,
    smoothing, z-loss and a softcap."""
    g = torch.Generator().manual_seed(0)
    h64, w64, b64 = (torch.randn(37, 24, generator=g, dtype=torch.float64), torch.randn(97, 24, generator=g,
                     dtype=torch.float64) * 0.3, torch.randn(97, generator=g, dtype=torch.float64))
    target = torch.randint(0, 97, (37,), generator=g)
    target[5] = -100
    kw = dict(label_smoothing=0.1, z_loss=1e-3, softcap=5.0)
    for grad in (True, False):
        leaves = [t.to(device=device, dtype=torch.float32).requires_grad_() for t in (h64, w64, b64)]
        refs = [t.clone().requires_grad_() for t in (h64, w64, b64)]
        loss = linear_cross_entropy(leaves[0], leaves[1], target.to(device), leaves[2], -100, kw["label_smoothing"],
                                    kw["z_loss"], kw["softcap"], "mean", 8, grad)[0]
        ref = reference.linear_cross_entropy(refs[0], refs[1], target, refs[2], **kw)
        torch.testing.assert_close(loss.double().cpu(), ref, atol=1e-5, rtol=1e-5)
        (loss * 3).backward()
        (ref * 3).backward()
        for a, r in zip(leaves, refs):
            torch.testing.assert_close(a.grad.double().cpu(), r.grad, atol=1e-5, rtol=1e-4)


register(_NAME, "Triton", _selftest)
register(_NAME + "_backward", "Triton", _selftest)
