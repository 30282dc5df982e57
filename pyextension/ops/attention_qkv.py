"""``zerofuse::attention_qkv`` / ``zerofuse::attention_qkv_backward``: attention straight from a fused
QKV projection, Triton custom ops.

attention_qkv(qkv, num_heads, num_kv_heads, is_causal, scale, docs=None) -> (out, lse): qkv (B, N,
(Hq + 2 Hkv) * D) is the projection's output, [q heads | k heads | v heads] along the last dim; out
(B, N, Hq * D) is ready for the output projection; lse (B, Hq, N) and docs (packed documents) as
zerofuse::attention's. The backward returns the gradient of qkv as one (B, N, (Hq + 2 Hkv) * D)
tensor.

Why: taking q, k, v as slices of qkv and the output through a transpose costs, per layer, a copy of
the output into (B, N, Hq * D), a copy of dout, and in backward three zero-filled qkv-sized
buffers (autograd's slice_backward) summed by two adds, plus a copy of each of dq, dk, dv into
(B, N, H * D): ~11 launches and ~1 GB of traffic per GPT-2-small layer at batch 16 x 1024. Here the
kernels read q, k, v through strided views of qkv, write out in (B, N, Hq, D) order, and write dq,
dk, dv into strided views of one packed gradient: none of those copies is made.

CUDA tensors (and CPU tensors under ZEROFUSE_TRITON_ON_CPU=1) run kernels/attention.py through those
views; other CPU tensors run zerofuse::attention's torch path on the views and pack the results
(copies: the CPU path is not the fast one). Eager calls go through EagerQKVAttention (no custom_op
dispatch, as ops.norms.EagerNorm); compiled graphs trace the ops.
"""
from __future__ import annotations

import torch
from torch import Tensor

from zerofuse import reference
from zerofuse.kernels import attention as K
from zerofuse.ops import eager_apply, first_order, register
from zerofuse.ops.attention import _check_docs, _empty, _lse_dtype, use_triton

_FN = "zerofuse::attention_qkv"


def check(qkv: Tensor, num_heads: int, num_kv_heads: int, fn: str = _FN) -> int:
    """The head_dim D, after checking that qkv is a (B, N, (Hq + 2 Hkv) * D) floating-point tensor
    with a unit stride along its last dim and Hkv dividing Hq."""
    if not isinstance(qkv, Tensor) or qkv.dim() != 3 or not qkv.is_floating_point():
        got = f"{qkv.dtype} of shape {list(qkv.shape)}" if isinstance(qkv, Tensor) else type(qkv).__name__
        raise ValueError(f"{fn}: expected qkv to be a 3-D (batch, seq, (num_heads + 2 * num_kv_heads) * head_dim) "
                         f"floating-point tensor, got {got}")
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{fn}: expected num_kv_heads ({num_kv_heads}) >= 1 to divide num_heads ({num_heads})")
    width = num_heads + 2 * num_kv_heads
    if qkv.shape[-1] % width or qkv.shape[-1] == 0:
        raise ValueError(f"{fn}: expected qkv's last dim ({qkv.shape[-1]}) to be a positive multiple of num_heads + "
                         f"2 * num_kv_heads = {width}")
    if qkv.stride(-1) != 1:
        raise ValueError(f"{fn}: expected qkv's last dim to be contiguous, got strides {list(qkv.stride())}")
    return qkv.shape[-1] // width


def heads(qkv: Tensor, hq: int, hkv: int, d: int) -> tuple[Tensor, Tensor, Tensor]:
    """q (B, Hq, N, D), k and v (B, Hkv, N, D): strided views of qkv (no copy)."""
    b, n, _ = qkv.shape
    q = qkv[..., :hq * d].view(b, n, hq, d).transpose(1, 2)
    k = qkv[..., hq * d:(hq + hkv) * d].view(b, n, hkv, d).transpose(1, 2)
    v = qkv[..., (hq + hkv) * d:].view(b, n, hkv, d).transpose(1, 2)
    return q, k, v


def _fwd(qkv, hq, hkv, is_causal, scale, docs=None):
    d = qkv.shape[-1] // (hq + 2 * hkv)
    b, n, _ = qkv.shape
    q, k, v = heads(qkv, hq, hkv, d)
    if use_triton(q) and not _empty(q, k):
        out = qkv.new_empty((b, n, hq * d))
        _, lse = K.attention_fwd(q, k, v, is_causal, scale, out=out.view(b, n, hq, d).transpose(1, 2), checked=True,
                                 docs=docs)
        return out, lse
    out4, lse = torch.ops.zerofuse.attention(q, k, v, is_causal, scale, docs)  # (in q's layout: (B, N, H, D)
    return out4.transpose(1, 2).reshape(b, n, hq * d).contiguous(), lse  # for a contiguous qkv, so a view here)


def _bwd(dout, qkv, out, lse, hq, hkv, is_causal, scale, docs=None):
    d = qkv.shape[-1] // (hq + 2 * hkv)
    b, n, _ = qkv.shape
    q, k, v = heads(qkv, hq, hkv, d)
    dout4 = (dout if dout.stride(-1) == 1 else dout.contiguous()).reshape(b, n, hq, d).transpose(1, 2)
    out4 = out.reshape(b, n, hq, d).transpose(1, 2)
    if use_triton(q) and not _empty(q, k):
        dqkv = torch.empty((b, n, qkv.shape[-1]), dtype=qkv.dtype, device=qkv.device)
        K.attention_bwd(dout4, q, k, v, out4, lse, is_causal, scale, *heads(dqkv, hq, hkv, d), docs=docs)
        return dqkv
    grads = torch.ops.zerofuse.attention_backward(dout4, q, k, v, out4, lse, is_causal, scale, docs)
    return torch.cat([g.transpose(1, 2).reshape(b, n, g.shape[1] * d) for g in grads], dim=-1)


def _check_bwd(dout, qkv, out, lse, hq, hkv, is_causal, docs):
    fn = "zerofuse::attention_qkv_backward"
    d = _check_all(qkv, hq, hkv, is_causal, docs, fn)
    b, n, _ = qkv.shape
    for name, t, shape, dtype in (("dout", dout, (b, n, hq * d), qkv.dtype), ("out", out, (b, n, hq * d), qkv.dtype),
                                  ("lse", lse, (b, hq, n), None)):
        if (tuple(t.shape) != shape or t.device != qkv.device or not t.is_floating_point()
                or dtype is not None and t.dtype != dtype):
            want = f"a {dtype} tensor (qkv's dtype)" if dtype is not None else "a floating-point tensor"
            raise ValueError(f"{fn}: expected {name} to be {want} of shape {list(shape)} on "
                             f"{qkv.device}, got {t.dtype} {list(t.shape)} on {t.device}")


@torch.library.custom_op("zerofuse::attention_qkv", mutates_args=())
def attention_qkv(qkv: Tensor, num_heads: int, num_kv_heads: int, is_causal: bool,
                  scale: float, docs: Tensor | None = None) -> tuple[Tensor, Tensor]:
    _check_all(qkv, num_heads, num_kv_heads, is_causal, docs)
    return _fwd(qkv, num_heads, num_kv_heads, is_causal, scale, docs)


def _check_all(qkv, hq, hkv, is_causal, docs, fn: str = _FN) -> int:
    d = check(qkv, hq, hkv, fn)
    if docs is not None:
        _check_docs(docs, *heads(qkv, hq, hkv, d)[:2], is_causal, fn)
    return d


@attention_qkv.register_fake
def _(qkv, num_heads, num_kv_heads, is_causal, scale, docs=None):
    d = _check_all(qkv, num_heads, num_kv_heads, is_causal, docs)
    b, n, _ = qkv.shape
    return qkv.new_empty((b, n, num_heads * d)), qkv.new_empty((b, num_heads, n), dtype=_lse_dtype(qkv))


@torch.library.custom_op("zerofuse::attention_qkv_backward", mutates_args=())
def attention_qkv_backward(dout: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, num_heads: int, num_kv_heads: int,
                           is_causal: bool, scale: float, docs: Tensor | None = None) -> Tensor:
    """The gradient of qkv, packed as qkv."""
    _check_bwd(dout, qkv, out, lse, num_heads, num_kv_heads, is_causal, docs)
    return _bwd(dout, qkv, out, lse, num_heads, num_kv_heads, is_causal, scale, docs)


@attention_qkv_backward.register_fake
def _(dout, qkv, out, lse, num_heads, num_kv_heads, is_causal, scale, docs=None):
    _check_bwd(dout, qkv, out, lse, num_heads, num_kv_heads, is_causal, docs)
    return torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)


def _setup_context(ctx, inputs, output):
    qkv, hq, hkv, is_causal, scale, docs = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)  # (its gradient was dropped silently: the op does not differentiate it)
    ctx.save_for_backward(qkv, out, lse, docs)
    ctx.args = (hq, hkv, is_causal, scale)


def _backward(ctx, dout, _dlse):
    qkv, out, lse, docs = ctx.saved_tensors
    return attention_qkv_backward(dout, qkv, out, lse, *ctx.args, docs), None, None, None, None, None


attention_qkv.register_autograd(_backward, setup_context=_setup_context)


class EagerQKVAttention(torch.autograd.Function):
    """The ops above for eager mode without custom_op's Python dispatch (the face checked the
    arguments). apply(qkv, num_heads, num_kv_heads, is_causal, scale, docs=None, plan=None) -> out
    (B, N, Hq * D); plan: the face's Plan for these arguments' signature ([Note: call signatures]),
    which then allocates and launches forward and backward."""

    @staticmethod
    def forward(ctx, qkv, hq, hkv, is_causal, scale, docs=None, plan=None):
        out, lse = _fwd(qkv, hq, hkv, is_causal, scale, docs) if plan is None else plan.forward(qkv, docs)
        ctx.save_for_backward(qkv, out, lse, docs)
        ctx.args, ctx.plan = (hq, hkv, is_causal, scale), plan
        return out

    @staticmethod
    @first_order
    def backward(ctx, dout):
        qkv, out, lse, docs = ctx.saved_tensors
        if ctx.plan is not None:
            return ctx.plan.backward(dout, qkv, out, lse, docs), None, None, None, None, None, None
        return _bwd(dout, qkv, out, lse, *ctx.args, docs), None, None, None, None, None, None


eager_qkv_attention = eager_apply(EagerQKVAttention)


class Plan:
    """zerofuse::attention_qkv's eager call for one signature of the face's arguments ([Note: call
    signatures]; nn/sdpa.py qkv_attention records it): the Triton path with nothing empty and the
    heads' rows within [Note: 64-bit offsets] of kernels/attention.py. q, k, v (and dq, dk, dv of
    the packed gradient) are made as one as_strided view each, out (B, N, Hq * D) and its gradient
    contiguous; calling it allocates and launches, with autograd through EagerQKVAttention when grad
    (from the signature's grad mode and requires_grad)."""

    __slots__ = ("launches", "grad", "args", "views", "grad_views", "out_shape", "out4", "qkv_strides", "dtype",
                 "device")

    def __init__(self, qkv: Tensor, hq: int, hkv: int, is_causal: bool, scale: float, docs: bool, grad: bool):
        b, n, width = qkv.shape
        d = width // (hq + 2 * hkv)
        q, k, v = heads(qkv, hq, hkv, d)
        base, self.qkv_strides = qkv.storage_offset(), qkv.stride()
        self.views = tuple((t.shape, t.stride(), t.storage_offset() - base) for t in (q, k, v))
        packed = torch.empty((b, n, width), device="meta")  # the gradient's layout: contiguous qkv
        self.grad_views = tuple((t.shape, t.stride(), t.storage_offset()) for t in heads(packed, hq, hkv, d))
        self.out_shape = (b, n, hq * d)
        self.out4 = ((b, hq, n, d), (n * hq * d, d, hq * d, 1))  # out (B, N, Hq * D) seen as (B, Hq, N, D)
        self.launches = K.Launches(q, k, v, self.out4[1], is_causal, scale, docs)
        self.grad, self.args, self.dtype, self.device = grad, (hq, hkv, is_causal, scale), qkv.dtype, qkv.device

    def __call__(self, qkv: Tensor, docs: Tensor | None) -> Tensor:
        if self.grad:
            return eager_qkv_attention(qkv, *self.args, docs, self)
        return self.forward(qkv, docs)[0]

    def _heads(self, t: Tensor, views, base: int) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(t.as_strided(shape, stride, base + off) for shape, stride, off in views)

    def forward(self, qkv: Tensor, docs: Tensor | None) -> tuple[Tensor, Tensor]:
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.launches.lse_shape, dtype=torch.float32, device=self.device)
        self.launches.forward(*self._heads(qkv, self.views, qkv.storage_offset()), out.as_strided(*self.out4), lse,
                              docs)
        return out, lse

    def backward(self, dout: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, docs: Tensor | None) -> Tensor:
        if (qkv.stride() != self.qkv_strides or not out.is_contiguous() or not lse.is_contiguous()
                or not (docs is None or docs.is_contiguous())):
            # saved-tensor hooks (torch.autograd.graph.save_on_cpu, activation offload) may give the
            # tensors back in other layouts than the forward's: the checked path reads their strides
            return _bwd(dout, qkv, out, lse, *self.args, docs)
        b, n, _ = self.out_shape
        hq, d = self.out4[0][1], self.out4[0][3]
        dout4 = (dout if dout.stride(-1) == 1 else dout.contiguous()).reshape(b, n, hq, d).transpose(1, 2)
        dqkv = torch.empty(qkv.shape, dtype=self.dtype, device=self.device)
        self.launches.backward(K._tileable(dout4), *self._heads(qkv, self.views, qkv.storage_offset()),
                               out.as_strided(*self.out4), lse, *self._heads(dqkv, self.grad_views, 0), docs)
        return dqkv


def _selftest(device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 37, (4 + 2 * 2) * 16, generator=g)  # 4 query heads, 2 kv heads, head_dim 16
    dout = torch.randn(2, 37, 4 * 16, generator=g)
    mine = qkv.to(device, copy=True).requires_grad_()
    out, _ = attention_qkv(mine, 4, 2, True, 0.3)
    out.backward(dout.to(device))
    ref = qkv.double().requires_grad_()
    want, _ = reference.attention_qkv(ref, 4, 2, is_causal=True, scale=0.3)
    want.backward(dout.double())
    torch.testing.assert_close(out.double().cpu(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mine.grad.double().cpu(), ref.grad, rtol=1e-4, atol=1e-4)


register("zerofuse::attention_qkv", "Triton", _selftest)
register("zerofuse::attention_qkv_backward", "Triton", _selftest)
