"""The backward of kernels/attention.py's flash attention, two launches: dq per query block, which
also forms delta = rowsum(o * do) of its rows (from one o tile: no pre-pass launch) and stores it,
then dk/dv per key block (every query head of its group), which reads every row's delta. Both use
the forward's LSE. dq/dk/dv are written at their own strides: contiguous, or views of one packed
qkv gradient (zerofuse::attention_qkv). Launched by kernels/attention_launch.py."""
from __future__ import annotations

import triton
import triton.language as tl

from zerofuse.kernels.attention import (_doc_starts, _dot, _heads, _key_tile, _query_block, _query_pid, _rows, _tuned,
                                        _unmasked_end)


@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DOC,
                          sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdb, sdh, sdn,
                          sdkb, sdkh, sdkn, sdvb, sdvh, sdvn, Hq, Hkv, G, Nq, Nk, D, scale,
                          CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, DOCS: tl.constexpr = False):
    pid_n = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    kv_mask = (offs_n[:, None] < Nk) & d_mask[None, :]
    k = tl.load(_rows(_heads(K, b, hk, skb, skh), pid_n * BLOCK_N, skn, offs_d, BLOCK_N), mask=kv_mask, other=0.0)
    v = tl.load(_rows(_heads(V, b, hk, svb, svh), pid_n * BLOCK_N, svn, offs_d, BLOCK_N), mask=kv_mask, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M  # rows before the block's first key see none of it
    hi = Nq
    doc_base = DOC + b.to(tl.int64) * Nq
    if DOCS:  # [Note: documents] rows from the end of the last key's document on see none of the block
        end = tl.load(doc_base + tl.num_programs(2).to(tl.int64) * Nq + tl.minimum(pid_n * BLOCK_N + BLOCK_N, Nk) - 1)
        hi = tl.minimum(end, Nq)  # (bounds not made by document_bounds: wrong results, no reads past Q)
    for g in range(0, G):
        h = hk * G + g
        q_base = _heads(Q, b, h, sqb, sqh)
        do_base = _heads(DO, b, h, sdb, sdh)
        stat_base = (b.to(tl.int64) * Hq + h) * Nq
        for start_m in range(lo, hi, BLOCK_M):
            rows = start_m + offs_m
            row_mask = (rows[:, None] < Nq) & d_mask[None, :]
            q = tl.load(_rows(q_base, start_m, sqn, offs_d, BLOCK_M), mask=row_mask, other=0.0)
            do = tl.load(_rows(do_base, start_m, sdn, offs_d, BLOCK_M), mask=row_mask, other=0.0)
            lse2 = tl.load(LSE + stat_base + rows, mask=rows < Nq, other=0.0) * 1.4426950408889634  # base 2
            delta = tl.load(DELTA + stat_base + rows, mask=rows < Nq, other=0.0)
            # scores transposed: (BLOCK_N keys, BLOCK_M rows)
            st = _dot(k, tl.trans(q), UPCAST) * (scale * 1.4426950408889634)  # log2(e) folded in: exp2
            keep = (offs_n[:, None] < Nk) & (rows[None, :] < Nq)
            if CAUSAL:
                keep = keep & (offs_n[:, None] <= rows[None, :])
            if DOCS:
                keep = keep & (offs_n[:, None] >= tl.load(doc_base + rows, mask=rows < Nq, other=0)[None, :])
            pt = tl.where(keep, tl.exp2(st - lse2[None, :]), 0.0)
            dv += _dot(pt.to(do.dtype), do, UPCAST)
            dpt = _dot(v, tl.trans(do), UPCAST)
            dst = pt * (dpt - delta[None, :])
            dk += _dot(dst.to(q.dtype), q, UPCAST)
    out_mask = (offs_n[:, None] < Nk) & d_mask[None, :]
    # dk and dv at their own strides (contiguous, or views of a packed qkv gradient)
    tl.store(_rows(_heads(DK, b, hk, sdkb, sdkh), pid_n * BLOCK_N, sdkn, offs_d, BLOCK_N),
             (dk * scale).to(DK.dtype.element_ty), mask=out_mask)
    tl.store(_rows(_heads(DV, b, hk, sdvb, sdvh), pid_n * BLOCK_N, sdvn, offs_d, BLOCK_N), dv.to(DV.dtype.element_ty),
             mask=out_mask)


@triton.jit
def _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, skn, svn, start, end, offs_m, offs_n, offs_d, d_mask, Nq, Nk,
               qk_scale, doc_lo, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
               UPCAST: tl.constexpr, DOCS: tl.constexpr = False):
    """dq over the key blocks [start, end): masked (the key tail, the causal diagonal, with DOCS the
    keys before each row's document) only when MASKED."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k = _key_tile(k_base, start_n, skn, offs_n, offs_d, d_mask, Nk, MASKED, BLOCK_N)
        v = _key_tile(v_base, start_n, svn, offs_n, offs_d, d_mask, Nk, MASKED, BLOCK_N)
        s = _dot(q, tl.trans(k), UPCAST) * qk_scale  # scale * log2(e): p = 2^(s - lse * log2(e))
        p = tl.exp2(s - lse2[:, None])
        if MASKED:
            keep = (cols[None, :] < Nk) & (offs_m[:, None] < Nq)
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            if DOCS:
                keep = keep & (cols[None, :] >= doc_lo[:, None])
            p = tl.where(keep, p, 0.0)
        dp = _dot(do, tl.trans(v), UPCAST)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, UPCAST)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, DO, O, LSE, DELTA, DQ, DOC,
                        sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdb, sdh, sdn, sob, soh, son,
                        sdqb, sdqh, sdqn, Hq, G, Nq, Nk, D, scale,
                        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, DOCS: tl.constexpr = False):
    pid_m = _query_pid(CAUSAL)
    b, h, hk, offs_m, offs_n, offs_d, d_mask, row_mask, q = _query_block(Q, sqb, sqh, sqn, G, Nq, D, BLOCK_M,
                                                                         BLOCK_N, BLOCK_D, CAUSAL)
    bh = b.to(tl.int64) * Hq + h
    do = tl.load(_rows(_heads(DO, b, h, sdb, sdh), pid_m * BLOCK_M, sdn, offs_d, BLOCK_M), mask=row_mask, other=0.0)
    # rows past Nq: lse 0 and delta 0 would make exp(s) overflow into inf * 0 = NaN in an unmasked
    # block: their lse is +inf instead (p = 0), and their dq is not stored
    lse2 = tl.load(LSE + bh * Nq + offs_m, mask=offs_m < Nq, other=float("inf")) * 1.4426950408889634
    qk_scale = scale * 1.4426950408889634
    # delta = rowsum(o * do) of these rows (0 past Nq), kept for the dk/dv kernel that runs next
    o = tl.load(_rows(_heads(O, b, h, sob, soh), pid_m * BLOCK_M, son, offs_d, BLOCK_M), mask=row_mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh * Nq + offs_m, delta, mask=offs_m < Nq)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    hi = Nk
    if CAUSAL:
        hi = tl.minimum(Nk, (pid_m + 1) * BLOCK_M)
    k_base = _heads(K, b, hk, skb, skh)
    v_base = _heads(V, b, hk, svb, svh)
    full = _unmasked_end(pid_m, Nk, CAUSAL, BLOCK_M, BLOCK_N)
    lo = 0
    doc_lo = offs_m
    if DOCS:  # the forward's key ranges ([Note: documents])
        doc_lo, lo, mid = _doc_starts(DOC, b, offs_m, Nq, BLOCK_M, BLOCK_N)
        mid = tl.minimum(mid, hi)
        dq = _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, skn, svn, lo, mid, offs_m, offs_n, offs_d, d_mask,
                        Nq, Nk, qk_scale, doc_lo, True, CAUSAL, BLOCK_N, UPCAST, DOCS)
        lo = mid
        full = tl.maximum(full, mid)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, skn, svn, lo, full, offs_m, offs_n, offs_d, d_mask, Nq,
                    Nk, qk_scale, doc_lo, False, CAUSAL, BLOCK_N, UPCAST)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, skn, svn, full, hi, offs_m, offs_n, offs_d, d_mask, Nq,
                    Nk, qk_scale, doc_lo, True, CAUSAL, BLOCK_N, UPCAST, DOCS)
    tl.store(_rows(_heads(DQ, b, h, sdqb, sdqh), pid_m * BLOCK_M, sdqn, offs_d, BLOCK_M),
             (dq * scale).to(DQ.dtype.element_ty), mask=row_mask)


_attn_bwd_dkdv_tuned = _tuned(_attn_bwd_dkdv_kernel, ["Nq", "Nk", "D", "CAUSAL", "DOCS"])
_attn_bwd_dq_tuned = _tuned(_attn_bwd_dq_kernel, ["Nq", "Nk", "D", "CAUSAL", "DOCS"])

