"""Bias + GELU (tanh), the first half of GPT-2's MLP after its matmul, forward and backward in Triton.

    forward:   y  = gelu(x + b)                 x (M, N) the matmul's output, b (N,); fp32 inside
    backward:  dh = dy * gelu'(x + b)           (the gradient of x, and of the pre-activation)
               db = sum over rows of dh         fp32 partials per program, summed in a fixed order

gelu(h) = 0.5 h (1 + tanh(k (h + 0.044715 h^3))), its derivative as kernels/swiglu.py's. Only x and b
are kept for backward (not x + b, not y). The backward is one launch: its programs each own a group
of rows of a column block and the last to arrive sums the bias partials (kernels/colsum.py); wide
rows with many partials take colsum's second launch instead. Against addmm + gelu + (backward)
gelu_backward + sum: the same launches forward (mm + this), one fewer backward, and the bias sum
read from the dh being written instead of read back. ``column_sum`` is the same backward without
the GELU (dy's column sums alone: a linear layer's bias gradient), benchmarked against torch's
reduction by bench_llama_ops.bench_bias_grad before any layer uses it.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from zerofuse.kernels import colsum, interpreted
from zerofuse.kernels.colsum import _last_sums
from zerofuse.kernels.common import _cast, cdiv, next_power_of_2, sm_count
from zerofuse.kernels.swiglu import _act_and_grad
from zerofuse.kernels.launch import launch_triton


@triton.jit
def _bias_gelu_fwd_kernel(X, B, Y, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE_RNE: tl.constexpr):
    # (rows, columns) tiles: the bias read by column (a flat index modulo N would hide the
    # contiguity the 16-byte accesses need: 2-byte loads in the PTX for sm_90)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = (rows < M)[:, None] & col_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
    h = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) + b[None, :]
    y, _ = _act_and_grad(h, True, False)
    tl.store(Y + offs, _cast(y, Y.dtype.element_ty, EMULATE_RNE), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(
    DY, X, B, DX, DB_part, DB, Counter, M, N, rows_per_program, n_parts,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE_RNE: tl.constexpr,
    ONE_LAUNCH: tl.constexpr, SUM_P: tl.constexpr, SUM_N: tl.constexpr, GELU: tl.constexpr = True,
):
    """dx = dy * gelu'(x + b) and db = its column sums; GELU False: db = dy's column sums alone
    (column_sum: a linear layer's bias gradient), X, B and DX unused."""
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if GELU:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
    else:
        b = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = pid_m * rows_per_program
    for start in range(first, first + rows_per_program, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        dh = tl.where(mask, tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32), 0.0)
        if GELU:
            h = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) + b[None, :]
            _, d = _act_and_grad(h, True, True)
            dh = dh * d
            tl.store(DX + offs, _cast(dh, DX.dtype.element_ty, EMULATE_RNE), mask=mask)
        db_acc += tl.sum(dh, axis=0)
    tl.store(DB_part + pid_m * N + cols, db_acc, mask=col_mask)
    if ONE_LAUNCH:
        _last_sums(Counter, n_parts * tl.num_programs(1), n_parts, N, DB_part, DB, DB_part, DB, DB_part, DB,
                   True, False, False, SUM_P, SUM_N, EMULATE_RNE)


@functools.lru_cache(maxsize=None)
def _bwd_tiles(n: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of both kernels: ~4K elements a tile on a GPU, whole rows in the interpreter."""
    block_n = min(next_power_of_2(n), 65536 if interpreted() else 1024)
    return max(1, (65536 if interpreted() else 4096) // block_n), block_n



def bias_gelu_fwd(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu(x + bias) for contiguous x (..., N) and bias (N,)."""
    y = torch.empty_like(x)
    n = x.shape[-1]
    m = x.numel() // n if n else 0
    if m:
        block_m, block_n = _bwd_tiles(n)
        launch_triton(_bias_gelu_fwd_kernel, (cdiv(m, block_m), cdiv(n, block_n)), x, bias, y, m, n, BLOCK_M=block_m,
                      BLOCK_N=block_n, EMULATE_RNE=interpreted(), num_warps=4)
    return y


def bias_gelu_bwd(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x.dtype, db in bias.dtype) for contiguous dy, x (..., N) and bias (N,)."""
    dx = torch.empty_like(x)
    return dx, _bwd(dy, x, bias, dx, bias.dtype)


def column_sum(dy: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The sums of contiguous dy (..., N) over every leading dim, in fp32, returned in ``dtype``
    (default dy's): a linear layer's bias gradient, by the bias + GELU backward without the GELU
    (one launch while the partials fit kernels/colsum.py's one-launch sum)."""
    return _bwd(dy, None, None, None, dtype or dy.dtype)


def _bwd(dy, x, bias, dx, db_dtype):
    n = dy.shape[-1]
    m = dy.numel() // n if n else 0
    if m == 0:
        return torch.zeros(n, device=dy.device, dtype=db_dtype)
    block_m, block_n = _bwd_tiles(n)
    col_blocks = cdiv(n, block_n)
    if interpreted() or dy.device.type != "cuda":
        cap = 4
    else:
        cap = colsum.max_parts(n, max(1, 4 * sm_count(dy.device) // col_blocks))
    rows_per_program = cdiv(cdiv(m, block_m), min(cdiv(m, block_m), cap)) * block_m
    parts = cdiv(m, rows_per_program)
    part = colsum.partials(parts, n, dy.device, True)
    counter = colsum.arrival_counter(dy.device) if colsum.one_launch(parts, n) else None
    one = counter is not None  # (none while capturing a graph on a stream that has none yet)
    db = torch.empty(n, device=dy.device, dtype=db_dtype) if one else None
    sum_p, sum_n = colsum.blocks(parts, n)
    launch_triton(_bias_gelu_bwd_kernel, (parts, col_blocks),
        dy, x, bias, dx, part, db, counter, m, n, rows_per_program, parts,
        BLOCK_M=block_m, BLOCK_N=block_n, EMULATE_RNE=interpreted(), ONE_LAUNCH=one, SUM_P=sum_p, SUM_N=sum_n,
        GELU=x is not None, num_warps=4 if block_m * block_n <= 4096 else 8,
    )
    return db if one else colsum.sum_partials(part, db_dtype)
