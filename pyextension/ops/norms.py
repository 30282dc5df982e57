"""``zerofuse::layer_norm`` / ``zerofuse::rms_norm`` (+ their backward ops), Triton custom ops.

Forward ops take x (..., N) with the normalised dims already flattened into N, optional weight /
bias (N,), an optional residual (same shape as x, fused as ``h = x + residual``) and eps; they
return (y, h, mean, rstd) / (y, h, rstd), with h an empty tensor when there is no residual
(custom ops may not return their inputs) and per-row statistics for backward (fp32; fp64 for
fp64 inputs).

CUDA tensors run kernels/norms.py. CPU tensors run the C++ kernels of csrc/cpu/norms.cpp
(zerofuse::norm_fwd_cpu / norm_bwd_cpu: fp32 math, one rounding, deterministic; their fakes in
ops/norms_cpu.py), float64 runs torch's native kernels, and under ZEROFUSE_TRITON_ON_CPU=1 CPU
tensors go through the Triton kernels in the interpreter.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from zerofuse import kernels, reference
from zerofuse.kernels import norms as K
from zerofuse.ops import eager_apply, first_order, register

_EMPTY = (0,)
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _cpu_kernel(*ts: Tensor | None) -> bool:  # csrc/cpu/norms.cpp takes them (fp32/fp16/bf16; fp64: aten's)
    return all(t is None or (t.device.type == "cpu" and t.dtype in _KERNEL_DTYPES) for t in ts)


def _use_triton(x: Tensor, residual: Tensor | None = None) -> bool:
    # float64 (computed in float64; a float64 residual too: h = x + residual is float64) and rows
    # wider than one program's block take torch's native kernels: correct, not fused.
    fits = 0 < x.shape[-1] <= K.MAX_HIDDEN and x.dtype in _KERNEL_DTYPES
    fits = fits and (residual is None or residual.dtype in _KERNEL_DTYPES)
    return fits and (x.is_cuda or (x.device.type == "cpu" and kernels.triton_on_cpu()))


def _stat_dtype(x: Tensor) -> torch.dtype:  # mean/rstd: fp32, fp64 for fp64 inputs
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _2d(t: Tensor | None, n: int) -> Tensor | None:
    return None if t is None else t.reshape(-1, n).contiguous()


def _empty(x: Tensor) -> Tensor:  # (custom ops may not return their inputs: an empty h)
    return x.new_empty(_EMPTY)


# ---------------------------------------------------------------- checks
# Run by the ops before any kernel, on every path, and by their fake impls: the Triton kernels read
# weight/bias as N values and mean/rstd as one per row, unchecked (csrc/cpu/norms.cpp checks its
# own inputs). EagerNorm skips them: the faces (nn/functional.py _check) checked the same first.


def _check_like_x(fn: str, name: str, t: Tensor | None, x: Tensor) -> None:
    if t is not None and (t.shape != x.shape or t.device != x.device or not t.is_floating_point()):
        raise RuntimeError(f"{fn}: expected {name} to be a floating-point tensor of x's shape {list(x.shape)} on "
                           f"{x.device}, got {t.dtype} {list(t.shape)} on {t.device}")


def _check_fwd(fn: str, x: Tensor, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None) -> None:
    if x.dim() == 0 or not x.is_floating_point() or x.shape[-1] == 0:
        raise RuntimeError(f"{fn}: expected x to be a floating-point tensor (..., hidden) with a hidden size >= 1 "
                           f"(the faces take 0), got {x.dtype} {list(x.shape)}")
    n = x.shape[-1]
    for name, p in (("weight", weight), ("bias", bias)):
        # (1-D: the gradients are (n,); a (2, 8) weight's were refused by autograd: a review, 2026-12-07)
        if p is not None and (p.shape != (n,) or p.device != x.device or not p.is_floating_point()):
            raise RuntimeError(f"{fn}: expected {name} to be a 1-D floating-point tensor of {n} elements (the hidden "
                               f"size) on {x.device}, got {p.dtype} {list(p.shape)} on {p.device}")
    _check_like_x(fn, "residual", residual, x)


def _check_bwd(fn: str, dy: Tensor, dh: Tensor | None, x: Tensor, weight: Tensor | None, bias: Tensor | None,
               mean: Tensor | None, rstd: Tensor) -> None:
    _check_fwd(fn, x, weight, bias, None)
    _check_like_x(fn, "dy", dy, x)
    _check_like_x(fn, "dh", dh, x)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else math.prod(x.shape[:-1])
    for name, t in (("mean", mean), ("rstd", rstd)):
        if t is not None and (t.numel() != rows or t.device != x.device or not t.is_floating_point()):
            raise RuntimeError(f"{fn}: expected {name} to be a floating-point tensor of {rows} elements (one per "
                               f"row of x) on {x.device}, got {t.dtype} {list(t.shape)} on {t.device}")


def _fn(is_rms: bool, backward: bool = False) -> str:
    return ("zerofuse::rms_norm" if is_rms else "zerofuse::layer_norm") + ("_backward" if backward else "")


# ---------------------------------------------------------------- forward ops


def _contiguous(t: Tensor | None) -> Tensor | None:
    return t if t is None or t.is_contiguous() else t.contiguous()


def _shaped(t: Tensor, shape) -> Tensor:
    """``t`` (a fresh 2-D output) in ``shape``, as a tensor of its own rather than a view: a view made
    inside the eager autograd Function made an in-place change of y or h (y.mul_(2), h += ...)
    raise where torch's norms allow it (a review's reproduction, 2026-12-06; the Triton path
    returns x's shape directly)."""
    return torch.ops.aten._unsafe_view(t, shape)


def _like_h(t: Tensor | None, h: Tensor) -> Tensor | None:
    """A layer-norm param for aten's kernels on h: in h's dtype (a float64 residual promoted h past
    bf16/fp32 params, which aten's CPU layer_norm refused), fp32 params kept with a bf16/fp16 h (as
    aten takes them; nn.functional's torch path casts the same way)."""
    if t is None or t.dtype == h.dtype or (t.dtype == torch.float32 and h.dtype in (torch.bfloat16, torch.float16)):
        return t
    return t.to(h.dtype)


def _norm_fwd(x, weight, bias, residual, eps, is_rms, stats=True):
    """(y, h or None without a residual, mean or None, rstd): y and h shaped like x. stats=False
    (nothing to differentiate): the Triton kernels store no mean/rstd (None); the others may."""
    n = x.shape[-1]
    w, b = _contiguous(weight), _contiguous(bias)
    if _use_triton(x, residual):  # any leading shape: the kernel takes rows of n (no reshape, no view)
        return K.norm_fwd(_contiguous(x), w, b, _contiguous(residual), eps, is_rms, stats)
    if _cpu_kernel(x, residual, w, b):
        y, h, mean, rstd = torch.ops.zerofuse.norm_fwd_cpu(_2d(x, n), w, b, _2d(residual, n), eps, is_rms)
        return _shaped(y, x.shape), (_shaped(h, x.shape) if residual is not None else None), \
            (None if is_rms else mean), rstd
    # float64, a residual of a wider dtype on the CPU, and rows wider than the Triton kernel on CUDA:
    # torch's native kernels. h contiguous and the stats in _stat_dtype(h), as on the other paths and
    # in the fake (h took a transposed x's strides: a compiled call failed on the fake's promise; the
    # stats of a float64 h rounded to fp32 put fp32 error into its float64 grads: a review's
    # reproduction, 2026-12-06)
    h = (x + residual).contiguous() if residual is not None else x
    h2 = h.reshape(-1, n)
    if is_rms:
        y, rstd = torch.ops.aten._fused_rms_norm(h2, [n], w, eps)
        mean = None
    else:
        y, mean, rstd = torch.ops.aten.native_layer_norm(h2, [n], _like_h(w, h), _like_h(b, h), eps)
        mean = mean.view(-1).to(_stat_dtype(h))
    return _shaped(y, h.shape), (h if residual is not None else None), mean, rstd.view(-1).to(_stat_dtype(h))


@torch.library.custom_op("zerofuse::layer_norm", mutates_args=())
def layer_norm(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_fwd(_fn(False), x, weight, bias, residual)
    y, h, mean, rstd = _norm_fwd(x, weight, bias, residual, eps, is_rms=False)
    return y, (h if h is not None else _empty(x)), mean, rstd  # (a custom op returns tensors)


@torch.library.custom_op("zerofuse::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor | None, residual: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    _check_fwd(_fn(True), x, weight, None, residual)
    y, h, _, rstd = _norm_fwd(x, weight, None, residual, eps, is_rms=True)
    return y, (h if h is not None else _empty(x)), rstd


def _fake_fwd(x, residual):
    dtype = torch.result_type(x, residual) if residual is not None else x.dtype
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    y = x.new_empty(x.shape, dtype=dtype)
    h = x.new_empty(x.shape, dtype=dtype) if residual is not None else _empty(x)
    return y, h, x.new_empty(rows, dtype=_stat_dtype(y))  # (y: h's dtype)


@layer_norm.register_fake
def _(x, weight, bias, residual, eps):
    _check_fwd(_fn(False), x, weight, bias, residual)
    y, h, stat = _fake_fwd(x, residual)
    return y, h, stat, torch.empty_like(stat)


@rms_norm.register_fake
def _(x, weight, residual, eps):
    _check_fwd(_fn(True), x, weight, None, residual)
    return _fake_fwd(x, residual)


# ---------------------------------------------------------------- backward ops


def _norm_bwd(dy, dh, x, weight, bias, mean, rstd, is_rms, dr_dtype=None):
    """(dx, dw, db) (empty tensors for absent params), and with dr_dtype also dr: the sum over rows
    of dx, the gradient of a bias its producer added into the input (EagerNorm's input_bias)."""
    n = x.shape[-1]
    w = None if weight is None else weight.contiguous()
    mean, rstd = _contiguous(mean), rstd.contiguous()  # the kernels read them flat, one per row
    dr = None
    if _use_triton(x):  # (the kernel sums dr from dx in fp32)
        dx, dw, db, dr = K.norm_bwd(_contiguous(dy), _contiguous(dh), _contiguous(x), w, bias, mean, rstd, is_rms,
                                    dr_dtype)
    elif _cpu_kernel(x, dy, dh, w, bias):
        empty = rstd.new_empty(_EMPTY)
        dx, dw, db = torch.ops.zerofuse.norm_bwd_cpu(
            _2d(dy, n), _2d(dh, n), _2d(x, n), w, bias, empty if mean is None else mean, rstd, is_rms
        )
        dx = dx.view(x.shape)
        return (dx, dw, db) if dr_dtype is None else (dx, dw, db, _row_sum(dx, dr_dtype))
    else:
        x2, dy2, stat = x.reshape(-1, n), dy.reshape(-1, n), rstd.view(-1, 1)
        if is_rms:  # aten._fused_rms_norm_backward has no CPU kernel: the same formula in torch ops
            acc = _stat_dtype(x)
            xhat, dyf = x2.to(acc) * stat, dy2.to(acc)
            wdy = dyf * w.to(acc) if w is not None else dyf
            dx = ((wdy - xhat * (xhat * wdy).mean(-1, keepdim=True)) * stat).to(x.dtype)
            dw = (dyf * xhat).sum(0).to(w.dtype) if w is not None else None
            db = None
        else:
            # (it takes the stats in x's dtype: h's, float64 after a float64 residual)
            dx, dw, db = torch.ops.aten.native_layer_norm_backward(
                dy2.to(x2.dtype), x2, [n], mean.view(-1, 1).to(x2.dtype), stat.to(x2.dtype), _like_h(w, x2),
                _like_h(bias, x2), [True, w is not None, bias is not None]
            )
            dw = dw.to(w.dtype) if dw is not None else None
        dx = dx.view(x.shape) if dh is None else dx.view(x.shape) + dh
        db = db.to(bias.dtype) if db is not None else None
    out = dx, (dw if dw is not None else _empty(x)), (db if db is not None else _empty(x))
    if dr_dtype is None:
        return out
    return (*out, dr if dr is not None else _row_sum(dx, dr_dtype))


def _row_sum(dx, dtype):
    return dx.reshape(-1, dx.shape[-1]).to(_stat_dtype(dx)).sum(0).to(dtype)


@torch.library.custom_op("zerofuse::layer_norm_backward", mutates_args=())
def layer_norm_backward(
    dy: Tensor, dh: Tensor | None, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias) of layer_norm; x is the normalised input (h when the residual was fused),
    dh the gradient of the h output (added to dx). Absent weight/bias give empty gradients."""
    _check_bwd(_fn(False, True), dy, dh, x, weight, bias, mean, rstd)
    return _norm_bwd(dy, dh, x, weight, bias, mean, rstd, is_rms=False)


@torch.library.custom_op("zerofuse::rms_norm_backward", mutates_args=())
def rms_norm_backward(
    dy: Tensor, dh: Tensor | None, x: Tensor, weight: Tensor | None, rstd: Tensor
) -> tuple[Tensor, Tensor]:
    """(dx, dweight) of rms_norm; see layer_norm_backward."""
    _check_bwd(_fn(True, True), dy, dh, x, weight, None, None, rstd)
    dx, dw, _ = _norm_bwd(dy, dh, x, weight, None, None, rstd, is_rms=True)
    return dx, dw


def _dx_fake(x):  # contiguous on every path, whatever x's layout
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _param_grad_fake(x, p):
    return torch.empty_like(p) if p is not None else _empty(x)


@layer_norm_backward.register_fake
def _(dy, dh, x, weight, bias, mean, rstd):
    _check_bwd(_fn(False, True), dy, dh, x, weight, bias, mean, rstd)
    return _dx_fake(x), _param_grad_fake(x, weight), _param_grad_fake(x, bias)


@rms_norm_backward.register_fake
def _(dy, dh, x, weight, rstd):
    _check_bwd(_fn(True, True), dy, dh, x, weight, None, None, rstd)
    return _dx_fake(x), _param_grad_fake(x, weight)


# ---------------------------------------------------------------- autograd


def _save(ctx, x, residual, h, *params_and_stats):
    ctx.has_residual = residual is not None
    ctx.x_dtype = x.dtype
    ctx.residual_dtype = residual.dtype if residual is not None else None
    ctx.save_for_backward(h if residual is not None else x, *params_and_stats)


def _input_grads(ctx, dx):
    return dx.to(ctx.x_dtype), (dx.to(ctx.residual_dtype) if ctx.has_residual else None)


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias, residual, _ = inputs
    _, h, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)  # (a loss through them got no gradient from them, silently)
    _save(ctx, x, residual, h, weight, bias, mean, rstd)


def _layer_norm_backward(ctx, dy, dh, _dmean, _drstd):
    xin, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = layer_norm_backward(dy, dh if ctx.has_residual else None, xin, weight, bias, mean, rstd)
    dx, dres = _input_grads(ctx, dx)
    return dx, (dw if weight is not None else None), (db if bias is not None else None), dres, None


def _rms_norm_setup(ctx, inputs, output):
    x, weight, residual, _ = inputs
    _, h, rstd = output
    ctx.mark_non_differentiable(rstd)
    _save(ctx, x, residual, h, weight, rstd)


def _rms_norm_backward(ctx, dy, dh, _drstd):
    xin, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward(dy, dh if ctx.has_residual else None, xin, weight, rstd)
    dx, dres = _input_grads(ctx, dx)
    return dx, (dw if weight is not None else None), dres, None


layer_norm.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)
rms_norm.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


class EagerNorm(torch.autograd.Function):
    """The same forward/backward as the ops above, for eager mode without custom_op's Python
    dispatch (measured on CPU: ~25 us per forward, ~70 us with autograd, vs ~6 us for the kernel
    on small rows). The faces use it outside torch.compile; compiled graphs use the ops.

    apply(x, weight, bias, residual, eps, is_rms, input_bias=None) -> (y, h) with h None when residual
    is None. input_bias: a bias x's producer already added into x without passing it a gradient
    (zerofuse.models.gpt.Block: the attention's output projection); never read, its gradient (the
    sum over rows of x's) comes out of the backward kernel with the others, instead of a separate
    sum in the producer's backward. It runs none of the ops' checks: its callers, the faces,
    checked the arguments first. launch: the face's kernels.norms.FwdLaunch for these arguments
    (stats=True; [Note: call signatures]), which forward calls instead of choosing the path.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, is_rms, input_bias=None, launch=None):
        if launch is not None:
            y, h, mean, rstd = launch(x, weight, bias, residual)
        else:
            y, h, mean, rstd = _norm_fwd(x, weight, bias, residual, eps, is_rms)
        ctx.is_rms = is_rms
        ctx.dr_dtype = input_bias.dtype if input_bias is not None else None
        ctx.set_materialize_grads(False)  # an unused h gets no zero-filled gradient (and no add)
        _save(ctx, x, residual, h, weight, bias, mean, rstd)
        return y, h

    @staticmethod
    @first_order
    def backward(ctx, dy, dh):
        if dy is None and dh is None:
            return None, None, None, None, None, None, None, None
        if dy is None:  # only h was used: dh passes through to both inputs, the params get nothing
            dx, dres = _input_grads(ctx, dh)
            return dx, None, None, dres, None, None, (_row_sum(dh, ctx.dr_dtype) if ctx.dr_dtype else None), None
        xin, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db, *dr = _norm_bwd(dy, dh if ctx.has_residual else None, xin, weight, bias, mean, rstd, ctx.is_rms,
                                    ctx.dr_dtype)
        dx, dres = _input_grads(ctx, dx)
        return (dx, (dw if weight is not None else None), (db if bias is not None else None), dres, None, None,
                dr[0] if dr else None, None)


eager_norm = eager_apply(EagerNorm)


# ---------------------------------------------------------------- self-tests (doctor)


def _selftest_case(device: torch.device, is_rms: bool):
    """Forward and gradients of the fused residual-add norm vs the float64 reference."""
    g = torch.Generator().manual_seed(0)
    x, res, dy = (torch.randn(3, 37, 123, generator=g, dtype=torch.float64) for _ in range(3))
    w, b = torch.randn(123, generator=g, dtype=torch.float64), torch.randn(123, generator=g, dtype=torch.float64)
    leaves = [x, res, w] if is_rms else [x, res, w, b]
    ours = [t.to(device=device, dtype=torch.float32).requires_grad_() for t in leaves]
    refs = [t.clone().requires_grad_() for t in leaves]
    if is_rms:
        y, h, _ = rms_norm(ours[0], ours[2], ours[1], 1e-6)
        y_ref, h_ref = reference.rms_norm(refs[0], (123,), refs[2], 1e-6, residual=refs[1])
    else:
        y, h, _, _ = layer_norm(ours[0], ours[2], ours[3], ours[1], 1e-5)
        y_ref, h_ref = reference.layer_norm(refs[0], (123,), refs[2], refs[3], 1e-5, residual=refs[1])
    torch.testing.assert_close(y.double().cpu(), y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(h.double().cpu(), h_ref, atol=1e-6, rtol=1e-6)
    (y.double().cpu() * dy).sum().backward()
    (y_ref * dy).sum().backward()
    for a, r in zip(ours, refs):
        torch.testing.assert_close(a.grad.double().cpu(), r.grad, atol=1e-3, rtol=1e-3)


def _selftest_cpu_kernels(device: torch.device) -> None:
    if device.type == "cpu":
        from unittest import mock

        with mock.patch.object(kernels, "TRITON_ON_CPU", False):
            _selftest_case(device, is_rms=False)
            _selftest_case(device, is_rms=True)


register("zerofuse::norm_fwd_cpu", "C++", _selftest_cpu_kernels)
register("zerofuse::norm_bwd_cpu", "C++", _selftest_cpu_kernels)
register("zerofuse::layer_norm", "Triton", lambda d: _selftest_case(d, is_rms=False))
register("zerofuse::layer_norm_backward", "Triton", lambda d: _selftest_case(d, is_rms=False))
register("zerofuse::rms_norm", "Triton", lambda d: _selftest_case(d, is_rms=True))
register("zerofuse::rms_norm_backward", "Triton", lambda d: _selftest_case(d, is_rms=True))
