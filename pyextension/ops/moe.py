"""``zerofuse::moe_permute`` / ``moe_unpermute`` (+ their backward ops): the token movement of a
Mixture-of-Experts layer.

    out, pos, src, counts = moe_permute(x, experts, num_experts)   x [T, d], experts [T, k] int
    y = experts' outputs on out's rows (grouped by expert: counts[e] rows each, in order)
    z = moe_unpermute(y, pos, src, weights)                        z [T, d] = sum_s weights[t, s] * y[pos[t, s]]

The order is a stable sort of the T x k choices by expert (token, then slot order within an
expert), the same on every device; choices with expert -1 (dropped over an expert's capacity) go
past the kept ones, as zero rows in ``out`` and nothing in ``z``. Shapes are fixed by T, k, d
(out has T * k rows whatever is dropped: no host sync, capturable). pos [T, k] int64 is each
choice's row (-1 dropped), src [T * k] int64 each row's choice t * k + s (-1 past the kept),
counts [E] int64. unpermute combines in fp32 and returns the weights' dtype when it is wider
than y's (the router's fp32 weights: Megatron's fp32 combine), else y's.

CUDA tensors run kernels/moe.py; CPU tensors torch's index_select / sums, or the Triton kernels in
the interpreter under ZEROFUSE_TRITON_ON_CPU=1. The index math is torch on every device.
"""
from __future__ import annotations

import torch
from torch import Tensor

from zerofuse import kernels, reference
from zerofuse.kernels import moe as K
from zerofuse.ops import eager_apply, first_order, register
from zerofuse.ops.ids import check_ids

_P, _U = "zerofuse::moe_permute", "zerofuse::moe_unpermute"


def _use_triton(x: Tensor, *others) -> bool:
    """The Triton kernels: x on CUDA (or the interpreter), none of x and ``others`` (tensors or
    dtypes, None skipped) float64 (the kernels accumulate in fp32; fp64 takes torch's path in fp64)."""
    dtypes = [x.dtype] + [o if isinstance(o, torch.dtype) else o.dtype for o in others if o is not None]
    return torch.float64 not in dtypes and (x.is_cuda or (x.device.type == "cpu" and kernels.triton_on_cpu()))


def _check_permute(fn: str, x: Tensor, experts: Tensor, num_experts: int) -> None:
    if x.dim() != 2 or not x.is_floating_point():
        raise RuntimeError(f"{fn}: expected x to be a 2-D floating-point tensor [tokens, dim], got {x.dim()}-D {x.dtype}")
    if experts.dim() != 2 or experts.shape[0] != x.shape[0] or experts.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(f"{fn}: expected experts to be an int32/int64 tensor [tokens={x.shape[0]}, top_k], got "
                           f"{list(experts.shape)} {experts.dtype}")
    if experts.device != x.device:
        raise RuntimeError(f"{fn}: expected experts on x's device {x.device}, got {experts.device}")
    if num_experts < 1:
        raise RuntimeError(f"{fn}: expected num_experts >= 1, got {num_experts}")


def _check_unpermute(fn: str, y: Tensor, pos: Tensor, src: Tensor, weights: Tensor) -> None:
    if y.dim() != 2 or not y.is_floating_point():
        raise RuntimeError(f"{fn}: expected y to be a 2-D floating-point tensor [tokens * top_k, dim], got "
                           f"{y.dim()}-D {y.dtype}")
    if pos.dim() != 2 or weights.shape != pos.shape or not weights.is_floating_point():
        raise RuntimeError(f"{fn}: expected weights to be a floating-point tensor of pos's shape {list(pos.shape)}, got "
                           f"{list(weights.shape)} {weights.dtype}")
    if y.shape[0] != pos.numel() or src.shape != (pos.numel(),):
        raise RuntimeError(f"{fn}: expected y and src with tokens * top_k = {pos.numel()} rows (moe_permute's), got "
                           f"y {list(y.shape)}, src {list(src.shape)}")
    for name, t in (("pos", pos), ("src", src), ("weights", weights)):
        if t.device != y.device:
            raise RuntimeError(f"{fn}: expected {name} on y's device {y.device}, got {t.device}")
    for name, t in (("pos", pos), ("src", src)):
        if t.dtype != torch.int64:
            raise RuntimeError(f"{fn}: expected {name} to be int64 (moe_permute's), got {t.dtype}")


def _check_permute_bwd(fn: str, dout: Tensor, pos: Tensor) -> None:
    """moe_permute_backward's arguments (none were checked: a short dout was read past its end on the
    Triton path, a bare IndexError on torch's; a review's reproduction, 2026-12-07)."""
    if pos.dim() != 2 or pos.dtype != torch.int64:
        raise RuntimeError(f"{fn}: expected pos to be int64 [tokens, top_k] (moe_permute's), got {pos.dim()}-D "
                           f"{pos.dtype}")
    if dout.dim() != 2 or not dout.is_floating_point() or dout.shape[0] != pos.numel() or dout.device != pos.device:
        raise RuntimeError(f"{fn}: expected dout to be a floating-point tensor [tokens * top_k = {pos.numel()}, dim] "
                           f"on {pos.device}, got {dout.dtype} {list(dout.shape)} on {dout.device}")


def _check_unpermute_bwd(fn: str, dout: Tensor, y: Tensor, src: Tensor, weights: Tensor) -> None:
    """moe_unpermute_backward's arguments (as _check_permute_bwd's)."""
    if weights.dim() != 2 or not weights.is_floating_point():
        raise RuntimeError(f"{fn}: expected weights to be a floating-point tensor [tokens, top_k], got "
                           f"{weights.dim()}-D {weights.dtype}")
    t, k = weights.shape
    if y.dim() != 2 or not y.is_floating_point() or y.shape[0] != t * k:
        raise RuntimeError(f"{fn}: expected y to be a floating-point tensor [tokens * top_k = {t * k}, dim], got "
                           f"{y.dtype} {list(y.shape)}")
    if src.dtype != torch.int64 or tuple(src.shape) != (t * k,):
        raise RuntimeError(f"{fn}: expected src to be int64 [{t * k}] (moe_permute's), got {src.dtype} "
                           f"{list(src.shape)}")
    if dout.dim() != 2 or not dout.is_floating_point() or tuple(dout.shape) != (t, y.shape[1]):
        raise RuntimeError(f"{fn}: expected dout to be a floating-point tensor [{t}, {y.shape[1]}], got {dout.dtype} "
                           f"{list(dout.shape)}")
    for name, x in (("dout", dout), ("src", src), ("weights", weights)):
        if x.device != y.device:
            raise RuntimeError(f"{fn}: expected {name} on y's device {y.device}, got {x.device}")


def routing_indices(experts: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """(pos [T, k], src [T * k], counts [E]) of a stable grouping of the choices by expert."""
    t, k = experts.shape
    flat = experts.reshape(-1).long()
    key = torch.where(flat >= 0, flat, num_experts)
    order = torch.argsort(key, stable=True)  # row -> choice
    rows = torch.arange(t * k, device=experts.device)
    pos = torch.empty_like(order).scatter_(0, order, rows)  # choice -> row
    pos = torch.where(flat >= 0, pos, -1).view(t, k)
    src = torch.where(key.gather(0, order) < num_experts, order, -1)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    return pos, src, counts


def _gather(x: Tensor, src: Tensor, k: int) -> Tensor:
    if _use_triton(x):  # (the kernels read the index tensors as contiguous)
        return K.gather_rows(x.contiguous(), src.contiguous(), k, x.dtype)
    rows = x.index_select(0, src.clamp(min=0) // k)
    return rows.masked_fill_((src < 0).unsqueeze(1), 0)


def _out_dtype(y: Tensor, weights: Tensor) -> torch.dtype:
    return weights.dtype if weights.dtype.itemsize > y.dtype.itemsize else y.dtype


def _combine(y: Tensor, pos: Tensor, w: Tensor | None, dtype: torch.dtype) -> Tensor:
    if _use_triton(y, w, dtype):
        return K.combine_rows(y.contiguous(), pos.contiguous(), None if w is None else w.contiguous(), dtype)
    acc = torch.float64 if torch.float64 in (y.dtype, dtype) else torch.float32
    t, k = pos.shape
    rows = y.index_select(0, pos.clamp(min=0).reshape(-1)).view(t, k, y.shape[1]).to(acc)
    # a dropped choice reads row 0 as a stand-in: zeroed, not scaled by 0 (0 * inf is NaN: another
    # token's overflow made the dropped tokens NaN; a review's reproduction, 2026-12-07)
    rows = rows.masked_fill_((pos < 0).unsqueeze(-1), 0)
    scale = (pos >= 0).to(acc) if w is None else torch.where(pos >= 0, w.to(acc), 0)
    return torch.einsum("tkd,tk->td", rows, scale).to(dtype)


@torch.library.custom_op(_P, mutates_args=())
def moe_permute(x: Tensor, experts: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out [T * k, d], pos [T, k], src [T * k], counts [E]): see the module docstring."""
    return _permute(x, experts, num_experts)


def _permute(x, experts, num_experts):
    """moe_permute's body (also EagerPermute's forward)."""
    _check_permute(_P, x, experts, num_experts)
    check_ids(_P, "experts", experts, num_experts, allowed=-1)  # the values (another id was taken as dropped)
    pos, src, counts = routing_indices(experts, num_experts)
    return _gather(x, src, experts.shape[1]), pos, src, counts


@moe_permute.register_fake
def _(x, experts, num_experts):
    _check_permute(_P, x, experts, num_experts)
    t, k = experts.shape
    i64 = dict(dtype=torch.int64, device=x.device)
    return (x.new_empty(t * k, x.shape[1]), torch.empty(t, k, **i64), torch.empty(t * k, **i64),
            torch.empty(num_experts, **i64))


@torch.library.custom_op(_P + "_backward", mutates_args=())
def moe_permute_backward(dout: Tensor, pos: Tensor) -> Tensor:
    """dx [T, d] = sum over kept choices of dout at the choice's row."""
    _check_permute_bwd(_P + "_backward", dout, pos)
    check_ids(_P + "_backward", "pos", pos, dout.shape[0], allowed=-1)
    return _combine(dout, pos, None, dout.dtype)


@moe_permute_backward.register_fake
def _(dout, pos):
    _check_permute_bwd(_P + "_backward", dout, pos)
    return dout.new_empty(pos.shape[0], dout.shape[1])


def _permute_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])


def _permute_backward(ctx, dout, _dpos, _dsrc, _dcounts):
    (pos,) = ctx.saved_tensors
    return moe_permute_backward(dout.contiguous(), pos), None, None


moe_permute.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op(_U, mutates_args=())
def moe_unpermute(y: Tensor, pos: Tensor, src: Tensor, weights: Tensor) -> Tensor:
    """z [T, d] = sum_s weights[t, s] * y[pos[t, s]] in fp32 (see the module docstring)."""
    return _unpermute(y, pos, src, weights)


def _unpermute(y, pos, src, weights, values=True):
    """moe_unpermute's body (also EagerUnpermute's forward: values=False, its pos and src are
    moe_permute's own, so no check of their values launches on the layer's hot path)."""
    _check_unpermute(_U, y, pos, src, weights)
    if values:  # an index past y read another row's memory on the Triton path
        check_ids(_U, "pos", pos, y.shape[0], allowed=-1)
        check_ids(_U, "src", src, pos.numel(), allowed=-1)
    return _combine(y, pos, weights, _out_dtype(y, weights))


@moe_unpermute.register_fake
def _(y, pos, src, weights):
    _check_unpermute(_U, y, pos, src, weights)
    return y.new_empty(pos.shape[0], y.shape[1], dtype=_out_dtype(y, weights))


@torch.library.custom_op(_U + "_backward", mutates_args=())
def moe_unpermute_backward(dout: Tensor, y: Tensor, src: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """(dy [T * k, d] in y's dtype, dweights [T, k] fp32)."""
    _check_unpermute_bwd(_U + "_backward", dout, y, src, weights)
    check_ids(_U + "_backward", "src", src, src.numel(), allowed=-1)
    return _unpermute_bwd(dout, y, src, weights)


def _unpermute_bwd(dout, y, src, weights):
    if _use_triton(y, dout, weights):
        return K.unpermute_bwd(dout.contiguous(), y.contiguous(), src.contiguous(), weights.contiguous())
    k = weights.shape[1]
    acc = torch.float64 if torch.float64 in (y.dtype, dout.dtype) else torch.float32
    f = src.clamp(min=0)
    g = dout.index_select(0, f // k).to(acc).masked_fill_((src < 0).unsqueeze(1), 0)  # (as _combine's rows)
    w = torch.where(src >= 0, weights.reshape(-1).to(acc).index_select(0, f), 0)
    dy = (g * w.unsqueeze(1)).to(y.dtype)
    dots = torch.where(src >= 0, (g * y.to(acc)).sum(1), 0)
    dw = torch.zeros(weights.numel(), dtype=torch.float32 if acc == torch.float32 else acc, device=y.device)
    dw.index_add_(0, f, dots.to(dw.dtype))
    return dy, dw.view(weights.shape)


@moe_unpermute_backward.register_fake
def _(dout, y, src, weights):
    _check_unpermute_bwd(_U + "_backward", dout, y, src, weights)
    acc = torch.float64 if torch.float64 in (y.dtype, dout.dtype) else torch.float32
    # dy contiguous on both paths, whatever y's layout
    return torch.empty(y.shape, dtype=y.dtype, device=y.device), weights.new_empty(weights.shape, dtype=acc)


def _unpermute_setup(ctx, inputs, output):
    y, pos, src, weights = inputs
    ctx.save_for_backward(y, src, weights)


def _unpermute_backward(ctx, dout):
    y, src, weights = ctx.saved_tensors
    dy, dw = moe_unpermute_backward(dout.contiguous(), y, src, weights)
    return dy, None, None, dw.to(weights.dtype)


moe_unpermute.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


class EagerPermute(torch.autograd.Function):
    """moe_permute's forward and backward for eager mode without custom_op's Python dispatch (as
    ops.norms.EagerNorm): apply(x, experts, num_experts) -> (out, pos, src, counts)."""

    @staticmethod
    def forward(ctx, x, experts, num_experts):
        out, pos, src, counts = _permute(x, experts, num_experts)
        ctx.mark_non_differentiable(pos, src, counts)
        ctx.set_materialize_grads(False)  # (no zero-filled gradients of the integer outputs)
        ctx.save_for_backward(pos)
        return out, pos, src, counts

    @staticmethod
    @first_order
    def backward(ctx, dout, _dpos, _dsrc, _dcounts):
        if dout is None:  # the rows took no part in the loss
            return None, None, None
        (pos,) = ctx.saved_tensors
        dout = dout.contiguous()
        return _combine(dout, pos, None, dout.dtype), None, None


class EagerUnpermute(torch.autograd.Function):
    """moe_unpermute's, likewise: apply(y, pos, src, weights) -> z."""

    @staticmethod
    def forward(ctx, y, pos, src, weights):
        ctx.save_for_backward(y, src, weights)
        return _unpermute(y, pos, src, weights, values=False)

    @staticmethod
    @first_order
    def backward(ctx, dout):
        y, src, weights = ctx.saved_tensors
        dy, dw = _unpermute_bwd(dout.contiguous(), y, src, weights)
        return dy, None, None, dw.to(weights.dtype)


_eager_permute, _eager_unpermute = eager_apply(EagerPermute), eager_apply(EagerUnpermute)


def permute(x: Tensor, experts: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """moe_permute for models: the op under torch.compile, its eager autograd path otherwise."""
    if torch.compiler.is_compiling():
        return moe_permute(x, experts, num_experts)
    return _eager_permute(x, experts, num_experts)


def unpermute(y: Tensor, pos: Tensor, src: Tensor, weights: Tensor) -> Tensor:
    """moe_unpermute for models, as permute; pos and src must be moe_permute's (eagerly their values
    are not checked again; the op checks them)."""
    if torch.compiler.is_compiling():
        return moe_unpermute(y, pos, src, weights)
    return _eager_unpermute(y, pos, src, weights)


def _selftest(device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(37, 123, generator=g, dtype=torch.float64)
    experts = torch.randint(-1, 5, (37, 2), generator=g)
    w64 = torch.rand(37, 2, generator=g, dtype=torch.float64)
    x = x64.to(device=device, dtype=torch.float32).requires_grad_()
    w = w64.to(device=device, dtype=torch.float32).requires_grad_()
    x64, w64 = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    out, pos, src, counts = moe_permute(x, experts.to(device), 5)
    ref_out, ref_counts = reference.moe_permute(x64, experts, 5)
    torch.testing.assert_close(out.double().cpu(), ref_out, atol=1e-6, rtol=1e-6)
    assert torch.equal(counts.cpu(), ref_counts)
    z = moe_unpermute(out, pos, src, w)
    ref_z = reference.moe_unpermute(ref_out, experts, w64, 5)
    torch.testing.assert_close(z.double().cpu(), ref_z, atol=1e-5, rtol=1e-5)
    # the backward ops (each op's self-test runs it: the doctor passed them without a call)
    dz = torch.randn(ref_z.shape, generator=g, dtype=torch.float64)
    z.backward(dz.float().to(device))
    ref_z.backward(dz)
    torch.testing.assert_close(x.grad.double().cpu(), x64.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad.double().cpu(), w64.grad, atol=1e-4, rtol=1e-5)


for _name in (_P, _P + "_backward", _U, _U + "_backward"):
    register(_name, "Triton", _selftest)
