"""The host side of the attention kernels' launches (kernels/attention.py's forward, kernels/
attention_bwd.py's two backward kernels): ``Launches``, their arguments for one signature worked
out once, and ``attention_fwd`` / ``attention_bwd``, which check what they are given, make one and
launch (re-exported by kernels/attention.py).

[Note: call signatures] (zerofuse/ops/signatures.py): the eager faces (scaled_dot_product_attention,
qkv_attention) keep a Launches per call signature, with the layouts of the outputs they allocate,
so that a later call with the same signature allocates and launches with nothing to check or
work out; the ops and these functions make one per call.
"""
from __future__ import annotations

import torch

from zerofuse.kernels import attention as A
from zerofuse.kernels import attention_bwd as B
from zerofuse.kernels.common import cdiv


class Launches:
    """The three attention kernels' launches for one signature: q, k, v's shapes and strides (checked,
    a unit stride along D, row strides within [Note: 64-bit offsets]), out's strides, causal, scale
    and whether documents come ([Note: documents]). The tensors, and the strides of the tensors a
    backward call is given (dout, dq, dk, dv), are passed per call; the kernels are read from their
    modules at each launch (bench/profile_host.py stubs them there)."""

    __slots__ = ("qkv_strides", "out_strides", "fwd_sizes", "bwd_sizes", "fwd_grid", "dq_grid", "dkdv_grid",
                 "consts", "tune_key", "lse_shape")

    def __init__(self, q, k, v, out_strides, causal: bool, scale: float, docs: bool):
        b, hq, nq, d = q.shape
        hkv, nk = k.shape[1], k.shape[2]
        g = hq // hkv
        self.qkv_strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3])
        self.out_strides = tuple(out_strides[:3])
        self.fwd_sizes = (hq, g, nq, nk, d, scale * A.LOG2E)
        self.bwd_sizes = (hkv, g, nq, nk, d, scale)
        self.lse_shape = (b, hq, nq)
        self.fwd_grid = self.dq_grid = lambda meta: (cdiv(nq, meta["BLOCK_M"]), hq, b)
        self.dkdv_grid = lambda meta: (cdiv(nk, meta["BLOCK_N"]), hkv, b)
        self.consts = dict(CAUSAL=causal, BLOCK_D=A._block_d(d), DOCS=docs)
        self.tune_key = (A.length_class(nq), A.length_class(nk), d, causal, q.dtype, docs)

    def forward(self, q, k, v, out, lse, docs) -> None:
        """Writes out (at out_strides) and lse (B, Hq, Nq) fp32 contiguous."""
        A._launch(A._attn_fwd_kernel, A._attn_fwd_tuned, self.fwd_grid, q, k, v, out, lse,
                  lse if docs is None else docs, *self.qkv_strides, *self.out_strides, *self.fwd_sizes,
                  tune_key=self.tune_key, **self.consts)

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv, docs) -> None:
        """Writes dq, dk, dv (any strides with a unit one along D and row strides within [Note:
        64-bit offsets], as dout's); out at out_strides, lse contiguous."""
        hkv, g, nq, nk, d, scale = self.bwd_sizes
        hq = hkv * g
        delta = torch.empty(self.lse_shape, device=q.device, dtype=torch.float32)  # written by the dq kernel
        strides = (*self.qkv_strides, *dout.stride()[:3])
        doc = lse if docs is None else docs  # (not read without documents)
        A._launch(B._attn_bwd_dq_kernel, B._attn_bwd_dq_tuned, self.dq_grid, q, k, v, dout, out, lse, delta, dq, doc,
                  *strides, *self.out_strides, *dq.stride()[:3], hq, g, nq, nk, d, scale, tune_key=self.tune_key,
                  **self.consts)
        A._launch(B._attn_bwd_dkdv_kernel, B._attn_bwd_dkdv_tuned, self.dkdv_grid, q, k, v, dout, lse, delta, dk, dv,
                  doc, *strides, *dk.stride()[:3], *dv.stride()[:3], hq, *self.bwd_sizes, tune_key=self.tune_key,
                  **self.consts)


def attention_fwd(q, k, v, causal: bool, scale: float, out=None, checked: bool = False, docs=None):
    """(out (B, Hq, Nq, D) like q, lse (B, Hq, Nq) fp32 natural log-sum-exp of the scaled scores).
    out: where to write it (any strides with a unit one along D, e.g. a (B, Nq, Hq, D) buffer seen
    as (B, Hq, Nq, D)); default a new contiguous tensor. checked: the caller ran _check (or made
    q, k, v as views of one checked qkv tensor). docs: document bounds ([Note: documents])."""
    if not checked:
        A._check(q, k, v, "zerofuse.kernels.attention.attention_fwd")
    if docs is not None:
        A.check_docs(docs, q, k, causal, "zerofuse.kernels.attention.attention_fwd")
        docs = docs.contiguous()
    q, k, v = A._tileable(q), A._tileable(k), A._tileable(v)
    b, hq, nq, d = q.shape
    A._check_grid(b, hq)
    given = out
    out = A._writable(out, q.shape, q)
    if out is None:
        out = torch.empty((b, hq, nq, d), device=q.device, dtype=q.dtype)
    lse = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
    Launches(q, k, v, out.stride(), causal, scale, docs is not None).forward(q, k, v, out, lse, docs)
    if given is not None and given is not out:
        given.copy_(out)
        out = given
    return out, lse


def attention_bwd(dout, q, k, v, out, lse, causal: bool, scale: float, dq=None, dk=None, dv=None, docs=None):
    """(dq, dk, dv) in the inputs' dtypes; written into dq/dk/dv when given (any strides with a unit
    one along D: e.g. views of one packed qkv gradient), else into new contiguous tensors. docs:
    the forward's document bounds ([Note: documents] in kernels/attention.py)."""
    if docs is not None:
        A.check_docs(docs, q, k, causal, "zerofuse.kernels.attention.attention_bwd")
        docs = docs.contiguous()
    A._check_grid(q.shape[0], q.shape[1])
    dout, out = (A._tileable(t if t.stride(-1) == 1 else t.contiguous()) for t in (dout, out))  # (read along D)
    q, k, v = A._tileable(q), A._tileable(k), A._tileable(v)
    lse = lse.contiguous()
    given = (dq, dk, dv)
    outs = [A._writable(t, like.shape, like) for t, like in zip(given, (q, k, v))]
    dq, dk, dv = (t if t is not None else torch.empty(like.shape, device=like.device, dtype=like.dtype)
                  for t, like in zip(outs, (q, k, v)))
    Launches(q, k, v, out.stride(), causal, scale, docs is not None).backward(dout, q, k, v, out, lse, dq, dk, dv, docs)
    res = [dq, dk, dv]
    for i, (g, o) in enumerate(zip(given, outs)):
        if g is not None and o is None:  # given but not writable in place: copied in
            g.copy_(res[i])
            res[i] = g
    return tuple(res)
