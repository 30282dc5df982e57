"""LayerNorm and RMSNorm in Triton, forward and backward, with an optional fused residual add.

Forward (per row of N elements, statistics in fp32; Ba et al. 2016, Zhang & Sennrich 2019):
    h    = x + residual                                   (only with a residual; stored, dtype of h)
    LN:  mean = sum(h) / N,  rstd = 1 / sqrt(sum((h - mean)^2) / N + eps),  y = (h - mean) * rstd * w + b
    RMS: rstd = 1 / sqrt(sum(h^2) / N + eps),                                y = h * rstd * w
Only mean (LN) and rstd per row are saved for backward. Backward, with xhat = (h - mean) * rstd and
wdy = w * dy (the standard derivation, as in Apex / Triton's layer-norm tutorial):
    LN:  dh = rstd * (wdy - xhat * mean(xhat * wdy) - mean(wdy))
    RMS: dh = rstd * (wdy - xhat * mean(xhat * wdy))
plus the incoming gradient of the h output when the residual add was fused (that sum is the
gradient of both x and residual). dw = sum over rows of dy * xhat, db = sum of dy: each program
accumulates its rows' partial sums in fp32 and the partials are added in a fixed order, so gradients
are deterministic (kernels/colsum.py): by the last program of the same launch while the partials
are few (the whole backward is one launch), else by a second small kernel.

Each program handles BLOCK_M rows of the whole hidden size at once (BLOCK_N = next power of two of
N, up to 65536): every byte is read once and written once.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from zerofuse.kernels import interpreted
from zerofuse.kernels import colsum, norms_wide
from zerofuse.kernels.colsum import _last_sums
from zerofuse.kernels.common import _cast, cdiv, next_power_of_2, sm_count
from zerofuse.kernels.launch import launch_triton

MAX_HIDDEN = 65536


@triton.jit
def _norm_fwd_kernel(
    X, R, H, Y, W, B, Mean, Rstd,
    M, N, eps,
    HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, IS_RMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE_RNE: tl.constexpr, STATS: tl.constexpr = True,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h = _cast(x + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32), H.dtype.element_ty, EMULATE_RNE)
        tl.store(H + offs, h, mask=mask)
        x = h.to(tl.float32)  # normalise the stored (rounded) sum, as unfused code would
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / N
        if STATS:
            tl.store(Mean + rows, mean, mask=row_mask)
        xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
    if STATS:
        tl.store(Rstd + rows, rstd, mask=row_mask)
    y = xc * rstd[:, None]
    if HAS_W:
        y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, _cast(y, Y.dtype.element_ty, EMULATE_RNE), mask=mask)


@triton.jit
def _norm_bwd_kernel(
    DY, DH, X, W, Mean, Rstd, DX, DW_part, DB_part, DR_part, DW, DB, DR, Counter,
    M, N, rows_per_program, n_parts,
    HAS_DH: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_DR: tl.constexpr, IS_RMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE_RNE: tl.constexpr,
    ONE_LAUNCH: tl.constexpr, SUM_P: tl.constexpr, SUM_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    dr_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid * rows_per_program
    for start in range(first, first + rows_per_program, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(Mean + rows, mask=row_mask, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_W:
            wdy = dy * w[None, :]
        else:
            wdy = dy
        c1 = tl.sum(xhat * wdy, axis=1) / N
        if IS_RMS:
            dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(wdy, axis=1) / N
            dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
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
        tl.store(DW_part + pid * N + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    if HAS_B:
        tl.store(DB_part + pid * N + cols, tl.sum(db_acc, axis=0), mask=col_mask)
    if HAS_DR:
        tl.store(DR_part + pid * N + cols, tl.sum(dr_acc, axis=0), mask=col_mask)
    if ONE_LAUNCH and (HAS_W or HAS_B or HAS_DR):
        _last_sums(Counter, n_parts, n_parts, N, DW_part, DW, DB_part, DB, DR_part, DR, HAS_W, HAS_B, HAS_DR,
                   SUM_P, SUM_N, EMULATE_RNE)


@functools.lru_cache(maxsize=None)
def _config(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for hidden size n."""
    block_n = next_power_of_2(n)
    # The interpreter pays per program, so it takes many rows at once; on a GPU small rows are
    # grouped to give each program ~4K elements.
    block_m = max(1, min(256 if interpreted() else 16, (65536 if interpreted() else 4096) // block_n))
    elems = block_m * block_n
    num_warps = 4 if elems <= 2048 else 8 if elems <= 8192 else 16 if elems <= 32768 else 32
    return block_m, block_n, num_warps


def _bwd_programs(m: int, n: int, block_m: int, device: torch.device) -> int:
    blocks = cdiv(m, block_m)
    if interpreted() or device.type != "cuda":
        return min(blocks, 4)
    return min(blocks, colsum.max_parts(n, 4 * sm_count(device)))



def norm_fwd(x, weight, bias, residual, eps: float, is_rms: bool, stats: bool = True):
    """x, residual: contiguous, rows of N = x.shape[-1] elements (M = numel / N rows, any leading
    shape). Returns (y and h shaped like x (h None without a residual), mean (M,) fp32 or None,
    rstd (M,) fp32 or None); stats=False (no backward to come) stores neither mean nor rstd."""
    return FwdLaunch(x, residual, weight, bias, eps, is_rms, stats)(x, weight, bias, residual)


class FwdLaunch:
    """norm_fwd for one signature of its arguments (x's shape and dtype, residual's dtype, which
    of weight/bias/residual are given, eps, is_rms, stats), its configuration worked out once:
    calling it allocates the outputs and launches. The faces keep one per call signature
    ([Note: call signatures], zerofuse/ops/signatures.py); norm_fwd makes one per call."""

    __slots__ = ("wide", "grid", "m", "n", "eps", "consts", "h_dtype", "stats", "has_mean")

    def __init__(self, x, residual, weight, bias, eps: float, is_rms: bool, stats: bool):
        n = x.shape[-1]
        self.m, self.n, self.eps, self.stats, self.has_mean = x.numel() // n, n, eps, stats, stats and not is_rms
        self.h_dtype = None if residual is None else torch.result_type(x, residual)
        block_m, block_n, num_warps = _config(n)
        flags = dict(HAS_RES=residual is not None, HAS_W=weight is not None, HAS_B=bias is not None, IS_RMS=is_rms,
                     EMULATE_RNE=interpreted(), STATS=stats)
        if block_n >= norms_wide.FWD_MIN_BLOCK:  # a row in chunks (kernels/norms_wide.py)
            self.wide, self.grid = True, (self.m,)
            self.consts = dict(CHUNK=norms_wide.CHUNK, num_warps=8, **flags)
        else:
            self.wide, self.grid = False, (cdiv(self.m, block_m),)
            self.consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, **flags)

    def __call__(self, x, weight, bias, residual):
        if self.h_dtype is None:
            y, h = torch.empty_like(x), None
        else:
            y, h = torch.empty_like(x, dtype=self.h_dtype), torch.empty_like(x, dtype=self.h_dtype)
        mean = x.new_empty(self.m, dtype=torch.float32) if self.has_mean else None  # new_empty: 0.2 us less a call
        rstd = x.new_empty(self.m, dtype=torch.float32) if self.stats else None
        # the kernels by their module names, read at each launch (bench/profile_host.py stubs them)
        kernel = norms_wide._norm_fwd_wide_kernel if self.wide else _norm_fwd_kernel
        launch_triton(kernel, self.grid, x, residual, h, y, weight, bias, mean, rstd, self.m, self.n, self.eps,
                      **self.consts)
        return y, h, mean, rstd


def norm_bwd(dy, dh, x, weight, bias, mean, rstd, is_rms: bool, dr_dtype: torch.dtype | None = None):
    """dy, dh, x: contiguous, rows of N (x is the normalised input, h when the residual was fused);
    bias only tells whether (and in which dtype) db is wanted; dr_dtype whether dr, the sum over
    rows of dx (the gradient of a bias added into the input by its producer), is.
    Returns (dx in x.dtype, shaped like x; dw in weight.dtype or None, db in bias.dtype or None,
    dr in dr_dtype or None). Any leading shape, as norm_fwd."""
    n = x.shape[-1]
    m = x.numel() // n
    if m == 0:  # no rows: an empty dx, zero parameter gradients (no launch)
        def zeros(dtype):
            return None if dtype is None else torch.zeros(n, device=x.device, dtype=dtype)

        return (torch.empty_like(x), zeros(weight.dtype if weight is not None else None),
                zeros(bias.dtype if bias is not None else None), zeros(dr_dtype))
    block_m, block_n, num_warps = _config(n)
    wide = block_n >= norms_wide.BWD_MIN_BLOCK  # a row in chunks (kernels/norms_wide.py)
    if wide:
        block_m = 1
    progs = _bwd_programs(m, n, block_m, x.device)
    rows_per_program = cdiv(cdiv(m, block_m), progs) * block_m
    progs = cdiv(m, rows_per_program)
    dx = torch.empty_like(x)
    dw_part = colsum.partials(progs, n, x.device, weight is not None)
    db_part = colsum.partials(progs, n, x.device, bias is not None)
    dr_part = colsum.partials(progs, n, x.device, dr_dtype is not None)
    one = colsum.one_launch(progs, n) and (weight is not None or bias is not None or dr_dtype is not None)
    counter = colsum.arrival_counter(x.device) if one else None
    one = counter is not None  # (none while capturing a graph on a stream that has none yet)
    dw = db = dr = None
    if one:
        dw = torch.empty(n, device=x.device, dtype=weight.dtype) if weight is not None else None
        db = torch.empty(n, device=x.device, dtype=bias.dtype) if bias is not None else None
        dr = torch.empty(n, device=x.device, dtype=dr_dtype) if dr_dtype is not None else None
    sum_p, sum_n = colsum.blocks(progs, n)
    flags = dict(HAS_DH=dh is not None, HAS_W=weight is not None, HAS_B=bias is not None, HAS_DR=dr_dtype is not None,
                 IS_RMS=is_rms, EMULATE_RNE=interpreted(), ONE_LAUNCH=one, SUM_P=sum_p, SUM_N=sum_n)
    if wide:
        terms = torch.empty(2 * m, device=x.device, dtype=torch.float32)  # c1, c2 of each row
        launch_triton(norms_wide._norm_bwd_wide_kernel, (progs,),
            dy, dh, x, weight, mean, rstd, dx, dw_part, db_part, dr_part, dw, db, dr, counter, terms, m, n,
            rows_per_program, progs, CHUNK=norms_wide.CHUNK, num_warps=8, **flags)
    else:
        launch_triton(_norm_bwd_kernel, (progs,),
            dy, dh, x, weight, mean, rstd, dx, dw_part, db_part, dr_part, dw, db, dr, counter, m, n,
            rows_per_program, progs, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, **flags)
    if one:
        return dx, dw, db, dr
    return (
        dx,
        colsum.sum_partials(dw_part, weight.dtype if weight is not None else None),
        colsum.sum_partials(db_part, bias.dtype if bias is not None else None),
        colsum.sum_partials(dr_part, dr_dtype),
    )
