"""Rotary position embedding (RoPE; Su et al. 2021) in Triton, for q or k of shape (B, H, N, D) with
any strides but a unit one along D.

Position p of row n is n, or positions[b, n] (packed sequences, offsets, a KV cache). With the
table cos[p, i], sin[p, i] for i < R/2 (R <= D rotary dims; dims from R on are left as they are,
GPT-NeoX's partial rotary), each pair (x1, x2) of the row is rotated by the angle of i:
    half-split (GPT-NeoX, Llama):  x1 = x[i],      x2 = x[i + R/2]
    interleaved (GPT-J, RoFormer): x1 = x[2i],     x2 = x[2i + 1]
    out1 = x1 cos - x2 sin,   out2 = x2 cos + x1 sin          (in fp32, one rounding)
The backward is the inverse rotation (sin negated): INVERSE. One program per (b, n) row loads
that position's cos/sin once and rotates every head.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zerofuse.kernels import interpreted
from zerofuse.kernels.common import _cast, next_power_of_2
from zerofuse.kernels.launch import launch_triton


@triton.jit
def _rope_kernel(
    X, OUT, COS, SIN, POS,
    N, n_heads, sxb, sxh, sxn, sob, soh, son, s_tab, s_pb, s_pn, all_heads, D,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_POS: tl.constexpr, INVERSE: tl.constexpr, EMULATE_RNE: tl.constexpr,
    COPY: tl.constexpr = False, BLOCK_D: tl.constexpr = 16,
):
    row = tl.program_id(0)
    b = (row // N).to(tl.int64)
    n = (row % N).to(tl.int64)
    if COPY:  # the rest of OUT from X: heads n_heads..all_heads, and the rotated heads' dims past 2 * HALF
        d = tl.arange(0, BLOCK_D)
        # the rotated heads hold nothing to copy where the rotary dims are all of head_dim
        first = (n_heads // BLOCK_H) * BLOCK_H if 2 * HALF == D else 0
        for h0 in range(first, all_heads, BLOCK_H):
            h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
            keep = (h < all_heads)[:, None] & (d < D)[None, :] & ((h >= n_heads)[:, None] | (d >= 2 * HALF)[None, :])
            v = tl.load(X + b * sxb + n * sxn + h[:, None] * sxh + d[None, :], mask=keep, other=0.0)
            tl.store(OUT + b * sob + n * son + h[:, None] * soh + d[None, :], v, mask=keep)
    if HAS_POS:
        p = tl.load(POS + b * s_pb + n * s_pn).to(tl.int64)
    else:
        p = n
    r = tl.arange(0, BLOCK_R)
    rmask = r < HALF
    c = tl.load(COS + p * s_tab + r, mask=rmask, other=0.0).to(tl.float32)
    s = tl.load(SIN + p * s_tab + r, mask=rmask, other=0.0).to(tl.float32)
    if INVERSE:
        s = -s
    if INTERLEAVED:
        i1 = 2 * r
        i2 = 2 * r + 1
    else:
        i1 = r
        i2 = r + HALF
    for h0 in range(0, n_heads, BLOCK_H):
        h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        mask = (h < n_heads)[:, None] & rmask[None, :]
        xrow = X + b * sxb + n * sxn + h[:, None] * sxh
        orow = OUT + b * sob + n * son + h[:, None] * soh
        x1 = tl.load(xrow + i1[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xrow + i2[None, :], mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * c[None, :] - x2 * s[None, :]
        o2 = x2 * c[None, :] + x1 * s[None, :]
        tl.store(orow + i1[None, :], _cast(o1, OUT.dtype.element_ty, EMULATE_RNE), mask=mask)
        tl.store(orow + i2[None, :], _cast(o2, OUT.dtype.element_ty, EMULATE_RNE), mask=mask)


def rope(x: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None,
         interleaved: bool, inverse: bool, rotate_heads: int | None = None) -> None:
    """Rotates x (B, H, N, D) into out (same shape; may be x itself), rotary dims 2 * cos.shape[1];
    out's other dims are not written. With rotate_heads (< H; out not x): the first rotate_heads
    heads are rotated and out gets the rest of x as it is (one pass: a rotated copy). cos/sin
    (L, R/2) with a unit last stride; positions (B, N) or None."""
    b, h, n, d = x.shape
    if x.numel() == 0:
        return
    half = cos.shape[1]
    block_r = next_power_of_2(half)
    copy = rotate_heads is not None
    block_d = next_power_of_2(d) if copy else 16
    width = max(block_r, block_d) if copy else block_r  # the widest tile a head takes
    block_h = max(1, min(next_power_of_2(h), 64 if interpreted() else max(1, 4096 // width)))
    pos = positions if positions is not None else cos
    launch_triton(_rope_kernel, (b * n,),
        x, out, cos, sin, pos, n, rotate_heads if copy else h, *x.stride()[:3], *out.stride()[:3], cos.stride(0),
        *(positions.stride() if positions is not None else (0, 0)), h, d,
        HALF=half, BLOCK_H=block_h, BLOCK_R=block_r, INTERLEAVED=interleaved, HAS_POS=positions is not None,
        INVERSE=inverse, EMULATE_RNE=interpreted(), COPY=copy, BLOCK_D=block_d, num_warps=4,
    )
