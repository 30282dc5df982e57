"""Cross-entropy over rows of logits in Triton: per-row statistics and the logits' gradient written in
place, the row kernel of the chunked ``linear_cross_entropy`` (zerofuse/ops/linear_cross_entropy.py).

Per row r of the logits chunk Z (rows, V) whose columns are the vocabulary ids
[vocab_start, vocab_start + V) of a vocabulary of V_total (V_total > V under vocabulary parallelism),
with c = softcap (Gemma-2; off when 0) and everything in fp32:
    z'   = c * tanh(z / c)   (or z)
    STATS:  lse = log(sum_j exp(z'_j)),  tz = z'_t (0 if t is outside the columns),  sz = sum_j z'_j
    GRAD:   with the (global) lse, the label-smoothing eps, the z-loss coefficient and a row scale s:
            dz_j = s * (exp(z'_j - lse) * (1 + 2 * z_loss * lse) - eps / V_total - (1 - eps) * [j == t])
                     * sech^2(z_j / c)             (the softcap's derivative; 1 without one)
The per-token loss (1 - eps) * (lse - tz) + eps * (lse - sz / V_total) + z_loss * lse^2 is formed from
the statistics by the caller (tiny per-token arithmetic). This is the loss of
F.cross_entropy(z', t, label_smoothing=eps) plus PaLM's z-loss; the gradient follows by
differentiation (as in Liger-Kernel's and FlashAttention's Triton cross-entropies).

One program per row loops over the vocabulary in blocks of BLOCK_V with an online max/sum of exp
(Milakov & Gimelshein 2018; the sums kept per lane, [Note: one reduction a block]), sz summed only
with label smoothing (0 without): STATS reads the row once, GRAD reads and writes it once; with both, the
gradient overwrites the logits, so the chunk's logits buffer becomes its gradient.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zerofuse.kernels import interpreted
from zerofuse.kernels.common import _cast, _tanh, _tanh_sech2, next_power_of_2
from zerofuse.kernels.launch import launch_triton


@triton.jit
def _capped(z, softcap, HAS_SOFTCAP: tl.constexpr):
    if HAS_SOFTCAP:
        return softcap * _tanh(z / softcap)
    else:
        return z


@triton.jit
def _ce_kernel(
    Z, stride_z, Target, stride_t, Scale, Lse, TZ, SZ,
    V, V_total, vocab_start, smoothing, z_loss, softcap,
    STATS: tl.constexpr, GRAD: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    BLOCK_V: tl.constexpr, EMULATE_RNE: tl.constexpr,
):
    row = tl.program_id(0)
    z_row = Z + row.to(tl.int64) * stride_z
    t_local = tl.load(Target + row.to(tl.int64) * stride_t).to(tl.int64) - vocab_start
    if STATS:
        # [Note: one reduction a block] the running max is a scalar (one tl.max a block: a
        # cross-warp reduction), the sums of exp(z - m) and of z are kept per lane and reduced once
        # after the loop, and z_t is one load: four reductions a block were three too many.
        m = -float("inf")
        s_vec = tl.zeros((BLOCK_V,), tl.float32)
        sz_vec = tl.zeros((BLOCK_V,), tl.float32)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < V
            z = _capped(tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32), softcap, HAS_SOFTCAP)
            if HAS_SMOOTHING:
                sz_vec += tl.where(mask, z, 0.0)
            z = tl.where(mask, z, -float("inf"))
            m_new = tl.maximum(m, tl.max(z, axis=0))
            # (every logit so far -inf: exp(-inf - -inf) was NaN; a -inf block then a finite one is a
            # -inf-masked vocabulary's first 4096 ids, or a TP shard's; an all -inf row: lse -inf)
            m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
            s_vec = s_vec * tl.exp(m - m_use) + tl.exp(z - m_use)
            m = m_new
        lse = m + tl.log(tl.sum(s_vec, axis=0))
        t_in = (t_local >= 0) & (t_local < V)  # the target in this shard's columns (never an ignored one)
        tz = tl.where(t_in, _capped(tl.load(z_row + t_local, mask=t_in, other=0.0).to(tl.float32), softcap,
                                    HAS_SOFTCAP), 0.0)
        tl.store(Lse + row, lse)
        tl.store(TZ + row, tz)
        tl.store(SZ + row, tl.sum(sz_vec, axis=0))  # 0 without label smoothing (the loss reads it only with)
    else:
        lse = tl.load(Lse + row)
    if GRAD:
        scale = tl.load(Scale + row)
        p_scale = 1.0 + 2.0 * z_loss * lse
        uniform = smoothing / V_total
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < V
            z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                t, cap_grad = _tanh_sech2(z / softcap)
                z = softcap * t
            g = tl.exp(z - lse) * p_scale - uniform
            g = tl.where(cols == t_local, g - (1.0 - smoothing), g)
            if HAS_SOFTCAP:
                g = g * cap_grad
            tl.store(z_row + cols, _cast(g * scale, Z.dtype.element_ty, EMULATE_RNE), mask=mask)


def _block_v(v: int) -> int:
    # the interpreter's cost is per program and per loop step: one block per row where it fits
    return min(next_power_of_2(v), 65536 if interpreted() else 4096)


def ce_rows(z: torch.Tensor, target: torch.Tensor, scale: torch.Tensor | None, lse: torch.Tensor,
            tz: torch.Tensor | None, sz: torch.Tensor | None, *, vocab_start: int, vocab_total: int,
            smoothing: float, z_loss: float, softcap: float, stats: bool, grad: bool) -> None:
    """The kernel on z (rows, V) (unit stride along V), in place; target (rows,) at any stride (a
    column or a last-token slice of the labels: a strided view). stats: writes lse/tz/sz (fp32,
    one per row); else lse is read. grad: overwrites z with its gradient times scale (fp32, one per
    row)."""
    rows, v = z.shape
    if rows == 0:
        return
    block = _block_v(v)
    launch_triton(_ce_kernel, (rows,),
        z, z.stride(0), target, target.stride(0), scale if grad else lse, lse, tz if stats else lse, sz if stats else lse,
        v, vocab_total, vocab_start, float(smoothing), float(z_loss), float(softcap or 1.0),
        STATS=stats, GRAD=grad, HAS_SOFTCAP=bool(softcap), HAS_SMOOTHING=smoothing != 0, BLOCK_V=block,
        EMULATE_RNE=interpreted(),
        num_warps=8 if block >= 2048 else 4,
    )
