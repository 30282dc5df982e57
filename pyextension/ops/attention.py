"""``zerofuse::attention`` / ``zerofuse::attention_backward``: fused attention, Triton custom ops.

attention(q, k, v, is_causal, scale, docs=None) -> (out, lse): (B, H, N, D) shapes, grouped-query
attention when k/v have fewer heads (Hq a multiple of Hkv), torch's top-left causal mask; lse is the
natural log-sum-exp per query row (fp32; fp64 for fp64 inputs). Not differentiable through lse.
docs: packed documents (causal only): a query sees only the keys of its own document
(document_bounds below; [Note: documents] in kernels/attention.py). docs must be document_bounds'
output: other values give wrong results (not checked: that would read the device; the kernels clamp
them so as never to read outside q, k and v). out and
the gradients dq/dk/dv are laid out as q/k/v are ([Note: outputs follow their inputs' layout] in
zerofuse/ops/__init__.py): for (B, H, N, D) views of (B, N, H, D) projections, (B, N, H, D) memory.

CUDA tensors (and CPU tensors under ZEROFUSE_TRITON_ON_CPU=1) run kernels/attention.py; other
CPU tensors run torch's CPU flash-attention kernels (k/v heads repeated for GQA; their gradients
summed back over the group; documents as an additive (B, 1, N, N) mask).

Empty input (B, H or Nq of 0, or no keys) runs no kernel, on any path (torch's CPU flash kernels
divide by zero on it: SIGFPE): out is zeros, as torch's sdpa gives (a query that sees no key
averages nothing), lse is -inf (the log of an empty sum), and every gradient is zero.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from zerofuse import kernels, reference
from zerofuse.kernels import attention as K
from zerofuse.ops import eager_apply, first_order, empty_in_layout, in_layout, layout_strides, register

# head_dim the Triton kernels take (one program holds a whole head_dim row block)
MAX_HEAD_DIM = 256
MAX_GRID_YZ = K._MAX_GRID_YZ  # batches and heads the kernels' grid takes
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def use_triton(q: Tensor) -> bool:
    fits = q.shape[-1] <= MAX_HEAD_DIM and q.dtype in _DTYPES
    return fits and (q.is_cuda or (q.device.type == "cpu" and kernels.triton_on_cpu()))


def _refuse_on_cuda(q: Tensor, fn: str) -> None:
    """What the kernels do not take, on CUDA (the faces fall back to torch's sdpa first; the CPU
    flash kernels are cpu-only)."""
    if q.device.type != "cpu":
        raise ValueError(f"{fn}: the fused kernels take head_dim <= {MAX_HEAD_DIM} in float32, float16 or "
                         f"bfloat16 on {q.device}, got head_dim {q.shape[-1]} in {q.dtype} (use torch's "
                         "scaled_dot_product_attention, or zerofuse.nn.functional's, which falls back to it)")


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _groups(q: Tensor, k: Tensor) -> int:
    return q.shape[1] // k.shape[1]


def _empty(q: Tensor, k: Tensor) -> bool:
    """No query row, or no key: nothing for a kernel to compute (head_dim 0 is computed: its scores
    are 0, so lse = log(keys seen))."""
    b, h, nq, _ = q.shape
    return b * h * nq == 0 or k.shape[2] == 0


def document_bounds(document_ids: Tensor) -> Tensor:
    """The ops' docs argument from per-token document ids (B, N) of any integer dtype: int32 (2, B, N),
    per token its document's first token and the one past its last. A document is a run of equal
    ids along N (as transformers' packed-sequence indices); the same id in two runs is two documents."""
    if not isinstance(document_ids, Tensor) or document_ids.dim() != 2 or document_ids.is_floating_point() \
            or document_ids.is_complex() or document_ids.dtype == torch.bool:
        got = (f"{document_ids.dtype} {list(document_ids.shape)}" if isinstance(document_ids, Tensor)
               else type(document_ids).__name__)
        raise ValueError(f"zerofuse document_bounds: expected document_ids as a (batch, sequence) integer tensor, "
                         f"got {got}")
    b, n = document_ids.shape
    dev = document_ids.device
    idx = torch.arange(n, device=dev, dtype=torch.int32).expand(b, n)
    first = torch.ones((b, n), dtype=torch.bool, device=dev)  # a document's first token
    first[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    last = torch.ones((b, n), dtype=torch.bool, device=dev)  # a document's last token
    last[:, :-1] = first[:, 1:]
    start = torch.where(first, idx, 0).cummax(1).values
    end = torch.where(last, idx + 1, n).flip(1).cummin(1).values.flip(1)
    return torch.stack((start, end)).to(torch.int32)


def document_mask(docs: Tensor) -> Tensor:
    """The documents as torch's sdpa mask: bool (B, 1, N, N), True where a query sees a key (causal
    included). N x N: for torch's kernels only."""
    n = docs.shape[2]
    keys = torch.arange(n, device=docs.device)
    return ((keys[None, None, :] >= docs[0][:, :, None]) & (keys[None, None, :] <= keys[None, :, None]))[:, None]


def _doc_mask(docs: Tensor, dtype: torch.dtype) -> Tensor:
    """document_mask as an additive mask (torch's CPU flash kernels take one of the query's dtype)."""
    seen = document_mask(docs)
    return torch.zeros(seen.shape, dtype=dtype, device=docs.device).masked_fill_(~seen, -math.inf)


def _check_docs(docs, q: Tensor, k: Tensor, is_causal: bool, fn: str) -> None:
    if docs is not None:
        K.check_docs(docs, q, k, is_causal, fn)


def _check_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor) -> None:
    fn = "zerofuse::attention_backward"
    K._check(q, k, v, fn)
    for name, t, shape in (("dout", dout, q.shape), ("out", out, q.shape), ("lse", lse, q.shape[:3])):
        if t.shape != shape or t.device != q.device or not t.is_floating_point():
            raise ValueError(f"{fn}: expected {name} to be a floating-point tensor of shape {list(shape)} on "
                             f"{q.device}, got {t.dtype} {list(t.shape)} on {t.device}")
    for name, t in (("dout", dout), ("out", out)):  # (the kernels multiply them with v and q as q's dtype)
        if t.dtype != q.dtype:
            raise TypeError(f"{fn}: expected {name} of the dtype of query ({q.dtype}), got {t.dtype}")


@torch.library.custom_op("zerofuse::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float,
              docs: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return _fwd(q, k, v, is_causal, scale, docs)


def _fwd(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float, docs=None) -> tuple[Tensor, Tensor]:
    """zerofuse::attention's body (also EagerAttention's)."""
    K._check(q, k, v)
    _check_docs(docs, q, k, is_causal, "zerofuse::attention")
    if _empty(q, k):
        return empty_in_layout(q).zero_(), torch.full(q.shape[:3], -math.inf, dtype=_lse_dtype(q), device=q.device)
    if use_triton(q):
        return K.attention_fwd(q, k, v, is_causal, scale, out=empty_in_layout(q), checked=True, docs=docs)
    _refuse_on_cuda(q, "zerofuse::attention")
    g = _groups(q, k)
    kk, vv = (k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)) if g > 1 else (k, v)
    mask = None if docs is None else _doc_mask(docs, q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kk, vv, 0.0, is_causal and mask is None,
                                                                          attn_mask=mask, scale=scale)
    # in q's layout as the Triton path's and the fake's (torch.compile asserts the strides the fake
    # promised; torch's CPU kernel returns a (B, N, H, D) layout)
    return in_layout(out, q), lse.to(_lse_dtype(q)).contiguous()


@attention.register_fake
def _(q, k, v, is_causal, scale, docs=None):
    K._check(q, k, v)
    _check_docs(docs, q, k, is_causal, "zerofuse::attention")
    return empty_in_layout(q), q.new_empty(q.shape[:3], dtype=_lse_dtype(q))


@torch.library.custom_op("zerofuse::attention_backward", mutates_args=())
def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, is_causal: bool,
                       scale: float, docs: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    _check_backward(dout, q, k, v, out, lse)
    _check_docs(docs, q, k, is_causal, "zerofuse::attention_backward")
    return _bwd(dout, q, k, v, out, lse, is_causal, scale, docs)


def _bwd(dout, q, k, v, out, lse, is_causal: bool, scale: float, docs=None) -> tuple[Tensor, Tensor, Tensor]:
    """zerofuse::attention_backward's body after its checks (also EagerAttention's, whose saved
    tensors need none)."""
    if _empty(q, k):
        return tuple(empty_in_layout(t).zero_() for t in (q, k, v))
    if use_triton(q):
        return K.attention_bwd(dout, q, k, v, out, lse, is_causal, scale, *map(empty_in_layout, (q, k, v)), docs=docs)
    _refuse_on_cuda(q, "zerofuse::attention_backward")
    g = _groups(q, k)
    kk, vv = (k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)) if g > 1 else (k, v)
    mask = None if docs is None else _doc_mask(docs, q.dtype)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q, kk, vv, out, lse.to(_lse_dtype(q)), 0.0, is_causal and mask is None, attn_mask=mask,
        scale=scale)
    if g > 1:
        b, hkv, nk, d = k.shape
        dk = dk.view(b, hkv, g, nk, d).sum(2)
        dv = dv.view(b, hkv, g, nk, d).sum(2)
    return tuple(in_layout(g.to(t.dtype), t) for g, t in ((dq, q), (dk, k), (dv, v)))


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, is_causal, scale, docs=None):
    _check_backward(dout, q, k, v, out, lse)
    _check_docs(docs, q, k, is_causal, "zerofuse::attention_backward")
    return tuple(map(empty_in_layout, (q, k, v)))


def _setup_context(ctx, inputs, output):
    q, k, v, is_causal, scale, docs = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)  # (its gradient was dropped silently: the op does not differentiate it)
    ctx.save_for_backward(q, k, v, out, lse, docs)
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, docs = ctx.saved_tensors
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, ctx.is_causal, ctx.scale, docs)
    return dq, dk, dv, None, None, None


attention.register_autograd(_backward, setup_context=_setup_context)


class EagerAttention(torch.autograd.Function):
    """The ops above for eager mode without custom_op's Python dispatch (as the norms' EagerNorm):
    apply(q, k, v, is_causal, scale, docs=None, plan=None) -> out. The op's checks run in forward
    unless a plan is given: the face's Plan for these arguments' signature ([Note: call
    signatures]), which then allocates and launches forward and backward. lse is not returned (not
    differentiable, as through the op)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale, docs=None, plan=None):
        out, lse = _fwd(q, k, v, is_causal, scale, docs) if plan is None else plan.forward(q, k, v, docs)
        ctx.save_for_backward(q, k, v, out, lse, docs)
        ctx.args, ctx.plan = (is_causal, scale), plan
        return out

    @staticmethod
    @first_order
    def backward(ctx, dout):
        q, k, v, out, lse, docs = ctx.saved_tensors
        if ctx.plan is not None:
            return *ctx.plan.backward(dout, q, k, v, out, lse, docs), None, None, None, None
        return *_bwd(dout, q, k, v, out, lse, *ctx.args, docs), None, None, None, None


eager_attention = eager_apply(EagerAttention)


class Plan:
    """zerofuse::attention's eager call for one signature of the face's arguments ([Note: call
    signatures]; nn/sdpa.py records it): the Triton path with nothing empty, q, k and v taken as
    given (a unit stride along D, rows within [Note: 64-bit offsets] of kernels/attention.py),
    out and the gradients in their inputs' layouts. Calling it allocates and launches; with
    autograd (grad: from the signature's grad mode and requires_grad) through EagerAttention."""

    __slots__ = ("launches", "grad", "args", "layouts", "saved", "dtype", "device")

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float, docs: bool, grad: bool):
        K._check(q, k, v)  # (what the op checks and the face does not: the shapes the kernels rely on)
        self.layouts = tuple((t.shape, layout_strides(t)) for t in (q, k, v))
        self.launches = K.Launches(q, k, v, self.layouts[0][1], is_causal, scale, docs)
        self.grad, self.args, self.dtype, self.device = grad, (is_causal, scale), q.dtype, q.device
        self.saved = (q.stride(), k.stride(), v.stride(), self.layouts[0][1])  # what Launches was made for

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, docs: Tensor | None) -> Tensor:
        if self.grad:
            return eager_attention(q, k, v, *self.args, docs, self)
        return self.forward(q, k, v, docs)[0]

    def _empty(self, i: int) -> Tensor:
        shape, strides = self.layouts[i]
        return torch.empty_strided(shape, strides, dtype=self.dtype, device=self.device)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, docs: Tensor | None) -> tuple[Tensor, Tensor]:
        out = self._empty(0)
        lse = torch.empty(self.launches.lse_shape, dtype=torch.float32, device=self.device)
        self.launches.forward(q, k, v, out, lse, docs)
        return out, lse

    def backward(self, dout: Tensor, q, k, v, out, lse, docs) -> tuple[Tensor, Tensor, Tensor]:
        if ((q.stride(), k.stride(), v.stride(), out.stride()) != self.saved or not lse.is_contiguous()
                or not (docs is None or docs.is_contiguous())):
            # saved-tensor hooks (torch.autograd.graph.save_on_cpu, activation offload) may give the
            # tensors back in other layouts than the forward's: the checked path reads their strides
            return _bwd(dout, q, k, v, out, lse, *self.args, docs)
        dout = K._tileable(dout if dout.stride(-1) == 1 else dout.contiguous())  # (read along D)
        dq, dk, dv = self._empty(0), self._empty(1), self._empty(2)
        self.launches.backward(dout, q, k, v, out, lse, dq, dk, dv, docs)
        return dq, dk, dv


def _selftest(device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 37, 32, generator=g).to(device) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # grouped-query: 2 kv heads for 4 query heads
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention(*leaves, True, 0.2)
    out.backward(torch.ones_like(out))
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    out64, lse64 = reference.attention(*ref, is_causal=True, scale=0.2)
    out64.backward(torch.ones_like(out64))
    torch.testing.assert_close(out.double(), out64, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse.double(), lse64, rtol=1e-4, atol=1e-4)
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-4)


register("zerofuse::attention", "Triton", _selftest)
register("zerofuse::attention_backward", "Triton", _selftest)
