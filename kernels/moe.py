"""Mixture-of-Experts token permutation in Triton: rows grouped by expert, and back with the
router's weights (the data movement of MegaBlocks / Megatron-Core's fused permute; the index math,
a stable sort of the T x K routing choices by expert, is done by torch in zerofuse.ops.moe).

Index tensors (made by zerofuse.ops.moe.moe_permute):
    src [R]    (R = T * K rows of the permuted buffer): the flat choice t * K + s that row r holds,
               -1 for the rows past the kept choices (dropped over an expert's capacity)
    pos [T, K] the permuted row of choice (t, s), -1 if dropped
Kernels (one program per row, BLOCK_D columns at a time, fp32 inside, one rounding):
    gather_rows      out[r] = x[src[r] // K]                    (0 where src[r] < 0)   permute
    combine_rows     out[t] = sum_s w[t, s] * y[pos[t, s]]      (dropped: 0; w = 1 without W)   unpermute,
                                                                                          and permute's backward
    unpermute_bwd    dy[r] = w[f] * dout[f // K],  dw[f] = <dout[f // K], y[r]>,  f = src[r]
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zerofuse.kernels import interpreted
from zerofuse.kernels.common import _cast, next_power_of_2
from zerofuse.kernels.launch import launch_triton


@triton.jit
def _gather_rows_kernel(X, SRC, OUT, D, K: tl.constexpr, BLOCK_D: tl.constexpr, EMULATE_RNE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    f = tl.load(SRC + r)
    t = tl.where(f >= 0, f // K, 0)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        m = cols < D
        v = tl.load(X + t * D + cols, mask=m & (f >= 0), other=0.0).to(tl.float32)
        tl.store(OUT + r * D + cols, _cast(v, OUT.dtype.element_ty, EMULATE_RNE), mask=m)


@triton.jit
def _combine_rows_kernel(Y, POS, W, OUT, D, K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr,
                         EMULATE_RNE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        m = cols < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for s in tl.static_range(K):
            p = tl.load(POS + t * K + s)
            v = tl.load(Y + tl.where(p >= 0, p, 0) * D + cols, mask=m & (p >= 0), other=0.0).to(tl.float32)
            if HAS_W:
                w = tl.load(W + t * K + s).to(tl.float32)
                v = v * tl.where(p >= 0, w, 0.0)
            acc += v
        tl.store(OUT + t * D + cols, _cast(acc, OUT.dtype.element_ty, EMULATE_RNE), mask=m)


@triton.jit
def _unpermute_bwd_kernel(DOUT, Y, SRC, W, DY, DW, D, K: tl.constexpr, BLOCK_D: tl.constexpr,
                          EMULATE_RNE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    f = tl.load(SRC + r)
    ok = f >= 0
    fs = tl.where(ok, f, 0)
    t = fs // K
    w = tl.where(ok, tl.load(W + fs).to(tl.float32), 0.0)
    dot = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        m = cols < D
        g = tl.load(DOUT + t * D + cols, mask=m & ok, other=0.0).to(tl.float32)
        y = tl.load(Y + r * D + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(DY + r * D + cols, _cast(g * w, DY.dtype.element_ty, EMULATE_RNE), mask=m)
        dot += g * y
    tl.store(DW + fs, tl.sum(dot, axis=0), mask=ok)


def _block_d(d: int) -> int:
    return min(next_power_of_2(max(d, 1)), 4096 if interpreted() else 1024)


def gather_rows(x: torch.Tensor, src: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """x [T, D] contiguous, src [R] int64 -> out [R, D] of dtype (permute)."""
    out = torch.empty(src.shape[0], x.shape[1], dtype=dtype, device=x.device)
    if out.numel():
        launch_triton(_gather_rows_kernel, (src.shape[0],), x, src, out, x.shape[1], K=k, BLOCK_D=_block_d(x.shape[1]),
                                            EMULATE_RNE=interpreted(), num_warps=4)
    return out


def combine_rows(y: torch.Tensor, pos: torch.Tensor, w: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """y [R, D] contiguous, pos [T, K] int64, w [T, K] or None -> out [T, D] of dtype (unpermute)."""
    t, k = pos.shape
    out = torch.empty(t, y.shape[1], dtype=dtype, device=y.device)
    if out.numel():
        launch_triton(_combine_rows_kernel, (t,), y, pos, w if w is not None else pos, out, y.shape[1], K=k,
                      HAS_W=w is not None, BLOCK_D=_block_d(y.shape[1]), EMULATE_RNE=interpreted(), num_warps=4)
    return out


def unpermute_bwd(dout: torch.Tensor, y: torch.Tensor, src: torch.Tensor, w: torch.Tensor):
    """dout [T, D], y [R, D], src [R], w [T, K] (all contiguous) -> (dy [R, D] of y's dtype, dw [T, K] fp32)."""
    dy = torch.empty_like(y)
    dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    if y.shape[0] and y.shape[1]:
        launch_triton(_unpermute_bwd_kernel, (y.shape[0],), dout, y, src, w, dy, dw, y.shape[1], K=w.shape[1],
                      BLOCK_D=_block_d(y.shape[1]), EMULATE_RNE=interpreted(), num_warps=4)
    return dy, dw
