"""LayerNorm / RMSNorm over wide rows, in column chunks: no whole row in registers.

kernels/norms.py holds a program's rows whole (BLOCK_N = the next power of two of N): compiled for
sm_90 (tools/kernel_asm.py --norms-wide), its backward spills registers from N = 16384 (352 bytes
at 16384, ~3.7 KB at 32768) and its forward from 32768. Here a row is walked in chunks of CHUNK
columns, with the same formulas (kernels/norms.py's docstring):

forward, one program per row:
    pass 1: h = x + residual stored (when fused), sum(h) -> mean;  pass 2: sum((h - mean)^2) -> rstd
    (RMS: sum(h^2) -> rstd in pass 1);  pass 3: y = (h - mean) * rstd * w + b.
    Passes 2 and 3 re-read the row just read (its 128 KB at 65536 bf16 stay in L2).
backward, a program per group of rows:
    pass 1, row by row: c1 = mean(xhat * wdy), c2 = mean(wdy), kept in a small scratch (8 B a row);
    pass 2, chunk by chunk, over the program's rows: dx = rstd (wdy - xhat c1 - c2) (+ dh), stored,
    and the chunk's dw / db (/ dr) partials summed in registers, then stored as colsum partials
    (kernels/colsum.py: the last program's sums in one launch, or the second launch).
x and dy are read twice (torch's CUDA backward reads them three times: twice for dx, once more for
dgamma/dbeta); the whole-row kernel reads them once but spills.
"""
from __future__ import annotations

import triton
import triton.language as tl

from zerofuse.kernels.colsum import _last_sums
from zerofuse.kernels.common import _cast

# Rows at least this wide (next power of two) take these kernels: backward from 16384, forward
# from 32768, where the whole-row kernels spill (measured with ptxas for sm_90, 2026-11-26).
BWD_MIN_BLOCK = 16384
FWD_MIN_BLOCK = 32768
CHUNK = 4096  # columns a step: 16 fp32 per thread at 8 warps


@triton.jit
def _norm_fwd_wide_kernel(
    X, R, H, Y, W, B, Mean, Rstd, M, N, eps,
    HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, IS_RMS: tl.constexpr,
    CHUNK: tl.constexpr, EMULATE_RNE: tl.constexpr, STATS: tl.constexpr = True,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * N
    acc = tl.zeros((CHUNK,), dtype=tl.float32)
    for c0 in range(0, N, CHUNK):  # pass 1: the stored sum h, and sum(h) (RMS: sum(h^2))
        cols = c0 + tl.arange(0, CHUNK)
        mask = cols < N
        x = tl.load(X + base + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            h = _cast(x + tl.load(R + base + cols, mask=mask, other=0.0).to(tl.float32), H.dtype.element_ty,
                      EMULATE_RNE)
            tl.store(H + base + cols, h, mask=mask)
            x = h.to(tl.float32)
        if IS_RMS:
            acc += x * x
        else:
            acc += x
    if HAS_RES:
        tl.debug_barrier()  # this program's h stores before it reads them back
        SRC = H
    else:
        SRC = X
    mean = 0.0
    if IS_RMS:
        var = tl.sum(acc, axis=0) / N
    else:
        mean = tl.sum(acc, axis=0) / N
        if STATS:
            tl.store(Mean + row, mean)
        acc = tl.zeros((CHUNK,), dtype=tl.float32)
        for c0 in range(0, N, CHUNK):  # pass 2: sum((h - mean)^2)
            cols = c0 + tl.arange(0, CHUNK)
            mask = cols < N
            xc = tl.where(mask, tl.load(SRC + base + cols, mask=mask, other=0.0).to(tl.float32) - mean, 0.0)
            acc += xc * xc
        var = tl.sum(acc, axis=0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    if STATS:
        tl.store(Rstd + row, rstd)
    for c0 in range(0, N, CHUNK):  # pass 3: y
        cols = c0 + tl.arange(0, CHUNK)
        mask = cols < N
        y = (tl.load(SRC + base + cols, mask=mask, other=0.0).to(tl.float32) - mean) * rstd
        if HAS_W:
            y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + base + cols, _cast(y, Y.dtype.element_ty, EMULATE_RNE), mask=mask)


@triton.jit
def _row_terms(X, DY, W, Mean, Rstd, row, cols, mask, N, HAS_W: tl.constexpr, IS_RMS: tl.constexpr):
    """(xhat, dy, wdy, rstd) of one chunk of a row, fp32, zero outside the row."""
    base = tl.cast(row, tl.int64) * N
    x = tl.load(X + base + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + base + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(Rstd + row)
    if IS_RMS:
        xhat = x * rstd
    else:
        xhat = tl.where(mask, (x - tl.load(Mean + row)) * rstd, 0.0)
    if HAS_W:
        wdy = dy * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        wdy = dy
    return xhat, dy, wdy, rstd


@triton.jit
def _norm_bwd_wide_kernel(
    DY, DH, X, W, Mean, Rstd, DX, DW_part, DB_part, DR_part, DW, DB, DR, Counter, Terms,
    M, N, rows_per_program, n_parts,
    HAS_DH: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_DR: tl.constexpr, IS_RMS: tl.constexpr,
    CHUNK: tl.constexpr, EMULATE_RNE: tl.constexpr, ONE_LAUNCH: tl.constexpr, SUM_P: tl.constexpr,
    SUM_N: tl.constexpr,
):
    pid = tl.program_id(0)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for row in range(first, last):  # pass 1: c1, c2 of each row
        a1 = tl.zeros((CHUNK,), dtype=tl.float32)
        a2 = tl.zeros((CHUNK,), dtype=tl.float32)
        for c0 in range(0, N, CHUNK):
            cols = c0 + tl.arange(0, CHUNK)
            xhat, _, wdy, _ = _row_terms(X, DY, W, Mean, Rstd, row, cols, cols < N, N, HAS_W, IS_RMS)
            a1 += xhat * wdy
            a2 += wdy
        tl.store(Terms + 2 * row, tl.sum(a1, axis=0) / N)
        tl.store(Terms + 2 * row + 1, tl.sum(a2, axis=0) / N)
    tl.debug_barrier()  # this program's terms stores before it reads them back
    for c0 in range(0, N, CHUNK):  # pass 2: dx, and the chunk's column sums over the rows
        cols = c0 + tl.arange(0, CHUNK)
        mask = cols < N
        dw_acc = tl.zeros((CHUNK,), dtype=tl.float32)
        db_acc = tl.zeros((CHUNK,), dtype=tl.float32)
        dr_acc = tl.zeros((CHUNK,), dtype=tl.float32)
        for row in range(first, last):
            xhat, dy, wdy, rstd = _row_terms(X, DY, W, Mean, Rstd, row, cols, mask, N, HAS_W, IS_RMS)
            c1 = tl.load(Terms + 2 * row)
            if IS_RMS:
                dx = (wdy - xhat * c1) * rstd
            else:
                dx = (wdy - (xhat * c1 + tl.load(Terms + 2 * row + 1))) * rstd
            offs = tl.cast(row, tl.int64) * N + cols
            if HAS_DH:
                dx += tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + offs, _cast(dx, DX.dtype.element_ty, EMULATE_RNE), mask=mask)
            if HAS_W:
                dw_acc += dy * xhat
            if HAS_B:
                db_acc += dy
            if HAS_DR:
                dr_acc += tl.where(mask, dx, 0.0)
        if HAS_W:
            tl.store(DW_part + pid * N + cols, dw_acc, mask=mask)
        if HAS_B:
            tl.store(DB_part + pid * N + cols, db_acc, mask=mask)
        if HAS_DR:
            tl.store(DR_part + pid * N + cols, dr_acc, mask=mask)
    if ONE_LAUNCH and (HAS_W or HAS_B or HAS_DR):
        _last_sums(Counter, n_parts, n_parts, N, DW_part, DW, DB_part, DB, DR_part, DR, HAS_W, HAS_B, HAS_DR,
                   SUM_P, SUM_N, EMULATE_RNE)
