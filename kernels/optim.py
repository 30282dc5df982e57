"""Multi-tensor optimizer kernels in Triton: Adam/AdamW, LAMB (two stages), LARS, and the 2-norm of
many tensors. The math is that of the C++ CPU kernels (csrc/cpu/adam.cpp, lamb.cpp, lars.cpp,
l2norm.cpp) and of zerofuse.reference, element for element in fp32 with IEEE-rounded division and
square root (div_rn / sqrt_rn; `/` and tl.sqrt are approximate on GPUs).

One launch covers every tensor of a list (of one param dtype and grad dtype). Each program handles
BLOCK elements of one tensor. A table in one int64 tensor ("meta") holds, per tensor, its first
block, element count, position in the caller's list (where its norms go) and data pointers; a
second int32 tensor ("own") names the tensor of each block, so a program finds its tensor with one
load (a binary search over block starts cost a chain of dependent loads per program). The
hyper-parameters come in a float64 tensor (Triton passes Python floats as fp32; bias corrections
want float64). Per-tensor sums (LAMB, norms) are written per block and added per tensor by a
second small kernel in a fixed order: deterministic. LAMB also has a one-launch form (lamb_fused,
[Note: one-launch LAMB]) whose programs synchronise per tensor through atomic counters, with the
same sums in the same order. Clipping inputs (norm, skip flag, grad multiplier) come from one
sum-of-squares pass and one single-program kernel (clip_inputs).

Vector access: a block that lies wholly inside its tensor runs unmasked, so with 16-byte aligned
addresses (`_Table.aligned`, told to the compiler by tl.multiple_of) its loads and stores are
16-byte vectors; only each tensor's last block is masked. (A mask against a runtime element count
makes every access a 4-byte one: checked in the PTX, tests/test_optim.py.) A skipped step
(found_inf != 0) is a uniform branch, not a mask, for the same reason.

Step counts live in 1-element fp32 tensors on the device (torch's fused optimizers do the same)
and are advanced by (found_inf == 0) before the update, so a skipped step needs no host sync;
bias corrections beta^step are computed in float64 by exponentiation by squaring.

The host side of a step is kept small because it runs every step over every tensor: a `Launch`
(tables, distinct step counters, scratch) is built per call by the ops, and kept between steps by
the optimizers (zerofuse.ops._optim.Prepared) while the tensors' addresses stay the same.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from zerofuse.kernels import interpreted
from zerofuse.kernels.common import _cast, cdiv, upload

BLOCK = 4096
_NUM_WARPS = 8
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# meta rows, each n + 1 entries: block starts (the last entry is the total), numels, positions in
# the caller's list, then one row of data pointers per list (PTR + k)
_STARTS, _NUMELS, _INDEX, PTR = 0, 1, 2, 3


# ------------------------------------------------------------------------------------ device helpers


@triton.jit
def _locate(META, OWN, n, BLOCK: tl.constexpr, BACKWARDS: tl.constexpr = False):
    """(tensor index, first element offset of this block, numel of the tensor); BACKWARDS: program
    0 takes the last block (a pass after another over the same data starts with what is in L2)."""
    pid = tl.program_id(0)
    if BACKWARDS:
        pid = tl.num_programs(0) - 1 - pid
    t = tl.load(OWN + pid)
    start = (pid - tl.load(META + t)) * BLOCK
    return t, start, tl.load(META + (n + 1) + t)


@triton.jit
def _ptr(META, row, n, t, TY: tl.constexpr, ALIGNED: tl.constexpr):
    ptr = tl.load(META + row * (n + 1) + t).to(tl.pointer_type(TY))
    if ALIGNED:
        # pointers read from the table carry no alignment the compiler can see
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _go(FOUND, HAS_FOUND: tl.constexpr):
    """Whether to update: found_inf == 0 (one uniform branch per program)."""
    if HAS_FOUND:
        go = tl.load(FOUND) == 0
    else:
        go = tl.program_id(0) >= 0
    return go


@triton.jit
def _pow(base, step):
    """base ** step for a float64 base and an integral float step (< 2^40), by squaring."""
    s = step.to(tl.int64)
    result = base * 0.0 + 1.0
    for _ in tl.static_range(40):
        result = tl.where((s & 1) == 1, result * base, result)
        base = base * base
        s = s >> 1
    return result


@triton.jit
def _ld(ptr, offs, mask, MASKED: tl.constexpr):
    if MASKED:
        x = tl.load(ptr + offs, mask=mask, other=0.0)
    else:
        x = tl.load(ptr + offs)
    return x.to(tl.float32)


@triton.jit
def _st(ptr, offs, x, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, x, mask=mask)
    else:
        tl.store(ptr + offs, x)


@triton.jit
def _store_param(P, W, offs, mask, p, HAS_MASTER: tl.constexpr, MASKED: tl.constexpr, EMULATE_RNE: tl.constexpr):
    if HAS_MASTER:
        _st(W, offs, p, mask, MASKED)
    _st(P, offs, _cast(p, P.dtype.element_ty, EMULATE_RNE), mask, MASKED)


@triton.jit
def _grad_mult(g, MULT, HAS_MULT: tl.constexpr):
    if HAS_MULT:
        g = g * tl.load(MULT)
    return g


# ------------------------------------------------------------------------------------ Adam / AdamW

# pointer rows: params, grads, exp_avgs, exp_avg_sqs, masters, steps; consts: lr, beta1, beta2, eps,
# weight_decay
@triton.jit
def _adam_block(P, G, M, V, W, offs, mask, MULT, step_size, bc2_sqrt, w1, w2, b1, b2, decay, wd, eps,
                HAS_MASTER: tl.constexpr, HAS_MULT: tl.constexpr, DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr,
                MASKED: tl.constexpr, EMULATE_RNE: tl.constexpr):
    g = _grad_mult(_ld(G, offs, mask, MASKED), MULT, HAS_MULT)
    if MAXIMIZE:
        g = -g
    p = _ld(W, offs, mask, MASKED) if HAS_MASTER else _ld(P, offs, mask, MASKED)
    if DECOUPLED:
        p = p * decay
    else:
        g = g + wd * p
    m = _ld(M, offs, mask, MASKED)
    v = _ld(V, offs, mask, MASKED)
    # torch's lerp for weights < 0.5 (1 - beta1 for any usual beta1): m + w * (g - m)
    m = tl.where(w1 < 0.5, m + w1 * (g - m), g - (g - m) * b1)
    v = v * b2 + w2 * g * g
    p = p - step_size * tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
    _st(M, offs, m, mask, MASKED)
    _st(V, offs, v, mask, MASKED)
    _store_param(P, W, offs, mask, p, HAS_MASTER, MASKED, EMULATE_RNE)


@triton.jit
def _adam_kernel(META, OWN, CONSTS, n, MULT, FOUND, P_TY: tl.constexpr, G_TY: tl.constexpr,
                 HAS_MASTER: tl.constexpr, HAS_MULT: tl.constexpr, HAS_FOUND: tl.constexpr, DECOUPLED: tl.constexpr,
                 MAXIMIZE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr, EMULATE_RNE: tl.constexpr):
    t, start, numel = _locate(META, OWN, n, BLOCK)
    if _go(FOUND, HAS_FOUND):
        P = _ptr(META, 3, n, t, P_TY, ALIGNED)
        G = _ptr(META, 4, n, t, G_TY, ALIGNED)
        M = _ptr(META, 5, n, t, tl.float32, ALIGNED)
        V = _ptr(META, 6, n, t, tl.float32, ALIGNED)
        W = _ptr(META, 7, n, t, tl.float32, ALIGNED)
        step = tl.load(_ptr(META, 8, n, t, tl.float32, False)).to(tl.float64)
        lr, beta1, beta2 = tl.load(CONSTS), tl.load(CONSTS + 1), tl.load(CONSTS + 2)
        eps, wd = tl.load(CONSTS + 3).to(tl.float32), tl.load(CONSTS + 4)
        # scalars derived in float64 and rounded once, like the Python floats torch.optim passes
        step_size = (lr / (1.0 - _pow(beta1, step))).to(tl.float32)
        bc2_sqrt = tl.sqrt(1.0 - _pow(beta2, step)).to(tl.float32)
        w1, w2 = (1.0 - beta1).to(tl.float32), (1.0 - beta2).to(tl.float32)
        decay = (1.0 - lr * wd).to(tl.float32)
        b1, b2, wd = beta1.to(tl.float32), beta2.to(tl.float32), wd.to(tl.float32)
        offs = start + tl.arange(0, BLOCK)
        if start + BLOCK <= numel:
            _adam_block(P, G, M, V, W, offs, offs < numel, MULT, step_size, bc2_sqrt, w1, w2, b1, b2, decay, wd,
                        eps, HAS_MASTER, HAS_MULT, DECOUPLED, MAXIMIZE, False, EMULATE_RNE)
        else:
            _adam_block(P, G, M, V, W, offs, offs < numel, MULT, step_size, bc2_sqrt, w1, w2, b1, b2, decay, wd,
                        eps, HAS_MASTER, HAS_MULT, DECOUPLED, MAXIMIZE, True, EMULATE_RNE)


# ------------------------------------------------------------------------------------ LAMB

# pointer rows as Adam's; consts: beta1, beta2, eps, weight_decay, lr, min_trust, max_trust
@triton.jit
def _lamb_consts(META, CONSTS, n, t, BIAS_CORRECTION: tl.constexpr):
    """(beta1, beta2, w1, w2, eps, wd, bc1, bc2) in fp32."""
    beta1, beta2 = tl.load(CONSTS), tl.load(CONSTS + 1)
    if BIAS_CORRECTION:
        step = tl.load(_ptr(META, 8, n, t, tl.float32, False)).to(tl.float64)
        bc1 = (1.0 - _pow(beta1, step)).to(tl.float32)
        bc2 = (1.0 - _pow(beta2, step)).to(tl.float32)
    else:
        bc1 = tl.full((), 1.0, tl.float32)
        bc2 = bc1
    return (beta1.to(tl.float32), beta2.to(tl.float32), (1.0 - beta1).to(tl.float32),
            (1.0 - beta2).to(tl.float32), tl.load(CONSTS + 2).to(tl.float32),
            tl.load(CONSTS + 3).to(tl.float32), bc1, bc2)


@triton.jit
def _lamb_update(m, v, p, bc1, bc2, eps, wd):
    return tl.div_rn(tl.div_rn(m, bc1), tl.sqrt_rn(tl.div_rn(v, bc2)) + eps) + wd * p


@triton.jit
def _lamb1_block(P, G, M, V, offs, mask, MULT, beta1, beta2, w1, w2, eps, wd, bc1, bc2,
                 HAS_MULT: tl.constexpr, MASKED: tl.constexpr):
    """Updates the moments; returns (sum p^2, sum u^2) of the block."""
    g = _grad_mult(_ld(G, offs, mask, MASKED), MULT, HAS_MULT)
    p = _ld(P, offs, mask, MASKED)
    m = _ld(M, offs, mask, MASKED) * beta1 + w1 * g
    v = _ld(V, offs, mask, MASKED) * beta2 + w2 * g * g
    _st(M, offs, m, mask, MASKED)
    _st(V, offs, v, mask, MASKED)
    u = _lamb_update(m, v, p, bc1, bc2, eps, wd)
    if MASKED:
        u = tl.where(mask, u, 0.0)
    return tl.sum(p * p, axis=0), tl.sum(u * u, axis=0)


@triton.jit
def _lamb_stage1_kernel(META, OWN, CONSTS, n, MULT, FOUND, PART, P_TY: tl.constexpr, G_TY: tl.constexpr,
                        HAS_MASTER: tl.constexpr, HAS_MULT: tl.constexpr, HAS_FOUND: tl.constexpr,
                        BIAS_CORRECTION: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    t, start, numel = _locate(META, OWN, n, BLOCK)
    # a skipped step writes no sums: the segment sums leave the norms as they were
    if _go(FOUND, HAS_FOUND):
        beta1, beta2, w1, w2, eps, wd, bc1, bc2 = _lamb_consts(META, CONSTS, n, t, BIAS_CORRECTION)
        if HAS_MASTER:
            P = _ptr(META, 7, n, t, tl.float32, ALIGNED)
        else:
            P = _ptr(META, 3, n, t, P_TY, ALIGNED)
        G = _ptr(META, 4, n, t, G_TY, ALIGNED)
        M = _ptr(META, 5, n, t, tl.float32, ALIGNED)
        V = _ptr(META, 6, n, t, tl.float32, ALIGNED)
        offs = start + tl.arange(0, BLOCK)
        if start + BLOCK <= numel:
            pp, uu = _lamb1_block(P, G, M, V, offs, offs < numel, MULT, beta1, beta2, w1, w2, eps, wd, bc1, bc2,
                                  HAS_MULT, False)
        else:
            pp, uu = _lamb1_block(P, G, M, V, offs, offs < numel, MULT, beta1, beta2, w1, w2, eps, wd, bc1, bc2,
                                  HAS_MULT, True)
        pid = tl.program_id(0)
        tl.store(PART + 2 * pid, pp)
        tl.store(PART + 2 * pid + 1, uu)


@triton.jit
def _trust_ratio(NORMS, row, CONSTS, PAPER: tl.constexpr):
    """lr * trust ratio of the tensor at list position row, from its sums of squares (p, u)."""
    pn = tl.sqrt(tl.load(NORMS + 2 * row).to(tl.float64))
    un = tl.sqrt(tl.load(NORMS + 2 * row + 1).to(tl.float64))
    if PAPER:
        phi = tl.minimum(tl.maximum(pn, tl.load(CONSTS + 5)), tl.load(CONSTS + 6))
        trust = tl.where(un > 0, phi / un, 1.0)
    else:
        trust = tl.where((pn > 0) & (un > 0), pn / un, 1.0)
    return (tl.load(CONSTS + 4) * trust).to(tl.float32)


@triton.jit
def _lamb2_block(P, W, M, V, offs, mask, ratio, bc1, bc2, eps, wd, HAS_MASTER: tl.constexpr,
                 MASKED: tl.constexpr, EMULATE_RNE: tl.constexpr):
    p = _ld(W, offs, mask, MASKED) if HAS_MASTER else _ld(P, offs, mask, MASKED)
    m = _ld(M, offs, mask, MASKED)
    v = _ld(V, offs, mask, MASKED)
    p = p - ratio * _lamb_update(m, v, p, bc1, bc2, eps, wd)
    _store_param(P, W, offs, mask, p, HAS_MASTER, MASKED, EMULATE_RNE)


@triton.jit
def _lamb_stage2_kernel(META, OWN, CONSTS, n, NORMS, FOUND, P_TY: tl.constexpr, HAS_MASTER: tl.constexpr,
                        HAS_FOUND: tl.constexpr, BIAS_CORRECTION: tl.constexpr, PAPER: tl.constexpr,
                        ALIGNED: tl.constexpr, BLOCK: tl.constexpr, EMULATE_RNE: tl.constexpr):
    t, start, numel = _locate(META, OWN, n, BLOCK, BACKWARDS=True)  # stage 1's last blocks are in L2
    if _go(FOUND, HAS_FOUND):
        beta1, beta2, w1, w2, eps, wd, bc1, bc2 = _lamb_consts(META, CONSTS, n, t, BIAS_CORRECTION)
        ratio = _trust_ratio(NORMS, tl.load(META + 2 * (n + 1) + t), CONSTS, PAPER)
        P = _ptr(META, 3, n, t, P_TY, ALIGNED)
        W = _ptr(META, 7, n, t, tl.float32, ALIGNED)
        M = _ptr(META, 5, n, t, tl.float32, ALIGNED)
        V = _ptr(META, 6, n, t, tl.float32, ALIGNED)
        offs = start + tl.arange(0, BLOCK)
        if start + BLOCK <= numel:
            _lamb2_block(P, W, M, V, offs, offs < numel, ratio, bc1, bc2, eps, wd, HAS_MASTER, False, EMULATE_RNE)
        else:
            _lamb2_block(P, W, M, V, offs, offs < numel, ratio, bc1, bc2, eps, wd, HAS_MASTER, True, EMULATE_RNE)


@triton.jit
def _lamb_fused_kernel(META, OWN, SCHED, CONSTS, n, MULT, FOUND, PART, NORMS, SYNC, P_TY: tl.constexpr,
                       G_TY: tl.constexpr, HAS_MASTER: tl.constexpr, HAS_MULT: tl.constexpr, HAS_FOUND: tl.constexpr,
                       BIAS_CORRECTION: tl.constexpr, PAPER: tl.constexpr, ALIGNED: tl.constexpr,
                       BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """Both LAMB stages in one launch, tensor by tensor, so stage 2 re-reads a tensor that stage 1
    has just streamed through L2 (see [Note: one-launch LAMB])."""
    if _go(FOUND, HAS_FOUND):
        # tickets in start order: every block this one may wait for was started before it
        ticket = tl.atomic_add(SYNC, 1)
        code = tl.load(SCHED + ticket)
        b = code >> 1
        t = tl.load(OWN + b)
        first = tl.load(META + t)
        start = (b - first) * BLOCK
        b0 = first.to(tl.int32)
        numel = tl.load(META + (n + 1) + t)
        beta1, beta2, w1, w2, eps, wd, bc1, bc2 = _lamb_consts(META, CONSTS, n, t, BIAS_CORRECTION)
        M = _ptr(META, 5, n, t, tl.float32, ALIGNED)
        V = _ptr(META, 6, n, t, tl.float32, ALIGNED)
        W = _ptr(META, 7, n, t, tl.float32, ALIGNED)
        P = _ptr(META, 3, n, t, P_TY, ALIGNED)
        offs = start + tl.arange(0, BLOCK)
        row = tl.load(META + 2 * (n + 1) + t)
        if (code & 1) == 0:  # stage 1: moments, this block's sums of squares
            G = _ptr(META, 4, n, t, G_TY, ALIGNED)
            P1 = W if HAS_MASTER else P
            if start + BLOCK <= numel:
                pp, uu = _lamb1_block(P1, G, M, V, offs, offs < numel, MULT, beta1, beta2, w1, w2, eps, wd, bc1,
                                      bc2, HAS_MULT, False)
            else:
                pp, uu = _lamb1_block(P1, G, M, V, offs, offs < numel, MULT, beta1, beta2, w1, w2, eps, wd, bc1,
                                      bc2, HAS_MULT, True)
            tl.store(PART + 2 * b, pp)
            tl.store(PART + 2 * b + 1, uu)
            # acq_rel: the sums (and moments) above are seen by whoever sees the count
            done = tl.atomic_add(SYNC + 1 + t, 1)
            b1 = tl.load(META + t + 1).to(tl.int32)
            if done == b1 - b0 - 1:  # the tensor's last stage-1 block: its norms, in block order
                for k in tl.static_range(2):
                    tl.store(NORMS + row * 2 + k, _sum_blocks(PART, b0, b1, k, 2, BLOCK_P))
                tl.atomic_xchg(SYNC + 1 + n + t, 1)
        else:  # stage 2: wait for the tensor's norms, then the update
            ready = tl.atomic_add(SYNC + 1 + n + t, 0)
            while ready == 0:
                ready = tl.atomic_add(SYNC + 1 + n + t, 0)
            ratio = _trust_ratio(NORMS, row, CONSTS, PAPER)
            if start + BLOCK <= numel:
                _lamb2_block(P, W, M, V, offs, offs < numel, ratio, bc1, bc2, eps, wd, HAS_MASTER, False, EMULATE_RNE)
            else:
                _lamb2_block(P, W, M, V, offs, offs < numel, ratio, bc1, bc2, eps, wd, HAS_MASTER, True, EMULATE_RNE)


# ------------------------------------------------------------------------------------ LARS

# pointer rows: params, grads, momentum buffers, masters; consts: lr, momentum, weight_decay,
# trust_coefficient, eps
@triton.jit
def _lars_block(P, G, B, W, offs, mask, MULT, step, momentum, wd, HAS_MASTER: tl.constexpr, HAS_MULT: tl.constexpr,
                MASKED: tl.constexpr, EMULATE_RNE: tl.constexpr):
    g = _grad_mult(_ld(G, offs, mask, MASKED), MULT, HAS_MULT)
    p = _ld(W, offs, mask, MASKED) if HAS_MASTER else _ld(P, offs, mask, MASKED)
    b = _ld(B, offs, mask, MASKED) * momentum + step * (g + wd * p)
    _st(B, offs, b, mask, MASKED)
    _store_param(P, W, offs, mask, p - b, HAS_MASTER, MASKED, EMULATE_RNE)


@triton.jit
def _lars_kernel(META, OWN, CONSTS, n, PNORMS, GNORMS, MULT, FOUND, P_TY: tl.constexpr, G_TY: tl.constexpr,
                 HAS_MASTER: tl.constexpr, HAS_MULT: tl.constexpr, HAS_FOUND: tl.constexpr, ALIGNED: tl.constexpr,
                 BLOCK: tl.constexpr, EMULATE_RNE: tl.constexpr):
    t, start, numel = _locate(META, OWN, n, BLOCK)
    if _go(FOUND, HAS_FOUND):
        lr, momentum, wd = tl.load(CONSTS), tl.load(CONSTS + 1), tl.load(CONSTS + 2)
        tc, eps = tl.load(CONSTS + 3), tl.load(CONSTS + 4)
        row = tl.load(META + 2 * (n + 1) + t)
        pn = tl.load(PNORMS + row).to(tl.float64)
        gn = tl.load(GNORMS + row).to(tl.float64)
        if HAS_MULT:
            gn = gn * tl.abs(tl.load(MULT).to(tl.float64))
        local = tl.where((pn > 0) & (gn > 0), tc * pn / (gn + wd * pn + eps), 1.0)
        step = (lr * local).to(tl.float32)
        P = _ptr(META, 3, n, t, P_TY, ALIGNED)
        G = _ptr(META, 4, n, t, G_TY, ALIGNED)
        B = _ptr(META, 5, n, t, tl.float32, ALIGNED)
        W = _ptr(META, 6, n, t, tl.float32, ALIGNED)
        offs = start + tl.arange(0, BLOCK)
        m32, wd32 = momentum.to(tl.float32), wd.to(tl.float32)
        if start + BLOCK <= numel:
            _lars_block(P, G, B, W, offs, offs < numel, MULT, step, m32, wd32, HAS_MASTER, HAS_MULT, False,
                        EMULATE_RNE)
        else:
            _lars_block(P, G, B, W, offs, offs < numel, MULT, step, m32, wd32, HAS_MASTER, HAS_MULT, True,
                        EMULATE_RNE)


# ------------------------------------------------------------------------------------ norms


@triton.jit
def _sum_squares_kernel(META, OWN, n, PART, X_TY: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    t, start, numel = _locate(META, OWN, n, BLOCK)
    X = _ptr(META, 3, n, t, X_TY, ALIGNED)
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= numel:
        x = _ld(X, offs, offs < numel, False)
    else:
        x = _ld(X, offs, offs < numel, True)
    tl.store(PART + tl.program_id(0), tl.sum(x * x, axis=0))


@triton.jit
def _sum_blocks(PART, b0, b1, k, WIDTH: tl.constexpr, BLOCK_P: tl.constexpr):
    """sum of PART[b, k] over the blocks b0 <= b < b1 of one tensor (PART is (blocks, WIDTH)), in a
    fixed order."""
    acc = tl.zeros((BLOCK_P,), tl.float32)
    for s in range(b0, b1, BLOCK_P):
        idx = s + tl.arange(0, BLOCK_P)
        acc += tl.load(PART + idx * WIDTH + k, mask=idx < b1, other=0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _segment_sum_kernel(META, n, PART, OUT, FOUND, HAS_FOUND: tl.constexpr, WIDTH: tl.constexpr,
                        BLOCK_P: tl.constexpr):
    """OUT[index[t], k] = sum of PART[b, k] over the blocks b of tensor t (PART is (blocks, WIDTH));
    nothing written when found_inf != 0."""
    t = tl.program_id(0)
    if _go(FOUND, HAS_FOUND):
        b0 = tl.load(META + t).to(tl.int32)
        b1 = tl.load(META + t + 1).to(tl.int32)
        row = tl.load(META + 2 * (n + 1) + t)
        for k in tl.static_range(WIDTH):
            tl.store(OUT + row * WIDTH + k, _sum_blocks(PART, b0, b1, k, WIDTH, BLOCK_P))


@triton.jit
def _clip_kernel(PART, nblocks, OUT, SCALE, FOUND, max_norm, eps, HAS_SCALE: tl.constexpr, HAS_FOUND: tl.constexpr,
                 TORCH_RULE: tl.constexpr, BLOCK_P: tl.constexpr):
    """One program: OUT = (norm, found, mult, 1 - found) from the per-block sums of squares of the grads, in
    a fixed order. norm = sqrt(sum) / scale; found = 1 when norm is not finite or FOUND != 0;
    mult = (1 / scale) * max_norm / max(norm, max_norm): the grad multiplier of the update; with
    TORCH_RULE torch.nn.utils.clip_grad_norm_'s coefficient min(max_norm / (norm + eps), 1) instead."""
    norm = tl.sqrt_rn(_sum_blocks(PART, 0, nblocks, 0, 1, BLOCK_P))
    inv = tl.full((), 1.0, tl.float32)
    if HAS_SCALE:
        inv = tl.div_rn(inv, tl.load(SCALE))
        norm = norm * inv
    bad = ~(norm < float("inf"))  # inf or NaN (a NaN compares false)
    if HAS_FOUND:
        bad = bad | (tl.load(FOUND) != 0)
    if TORCH_RULE:
        clip = tl.minimum(tl.div_rn(tl.full((), 1.0, tl.float32) * max_norm, norm + eps), 1.0)
    else:
        clip = tl.div_rn(tl.full((), 1.0, tl.float32) * max_norm, tl.maximum(norm, max_norm))
    if HAS_SCALE:
        clip = inv * clip
    tl.store(OUT, norm)
    tl.store(OUT + 1, bad.to(tl.float32))
    tl.store(OUT + 2, clip)
    tl.store(OUT + 3, 1.0 - bad.to(tl.float32))  # what the step counters advance by


# ------------------------------------------------------------------------------------ host side


def _int64_on(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of values on device; on CUDA copied from pinned memory without a host sync."""
    return upload(torch.tensor(values, dtype=torch.int64), device)


# tables that depend only on a layout (the tensors' sizes) and the device, kept for recent layouts
_LAYOUTS_KEPT = 64
_OWNERS: OrderedDict = OrderedDict()  # the block -> tensor map: 4 bytes per block
_SCHEDULES: OrderedDict = OrderedDict()  # the one-launch LAMB's block order


def _kept(cache: OrderedDict, key, make) -> torch.Tensor:
    """cache[key], made by make() when missing; the least recently used of more than
    _LAYOUTS_KEPT entries is dropped."""
    t = cache.get(key)
    if t is None:
        t = cache[key] = make()
        if len(cache) > _LAYOUTS_KEPT:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return t


def _owners(numels: tuple, blocks: list[int], device: torch.device) -> torch.Tensor:
    def make():
        counts = torch.tensor([b - a for a, b in zip(blocks, blocks[1:])], dtype=torch.int64)
        return upload(torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), counts), device)
    return _kept(_OWNERS, (numels, device), make)


def _schedule(numels: tuple, blocks: list[int], device: torch.device) -> torch.Tensor:
    """Per tensor, its stage-1 blocks, then its stage-2 blocks from last to first (the most recently
    streamed first: the likeliest in L2); codes 2 * block + stage."""
    def make():
        codes = []
        for a, b in zip(blocks, blocks[1:]):
            codes += range(2 * a, 2 * b, 2)
            codes += range(2 * b - 1, 2 * a, -2)
        return upload(torch.tensor(codes or [0], dtype=torch.int32), device)
    return _kept(_SCHEDULES, (numels, device), make)


class _Table:
    """The launch tables of one list of tensors: meta (rows above) and own (the tensor of each block)."""

    def __init__(self, lists: Sequence[Sequence[torch.Tensor] | None], device: torch.device,
                 index: Sequence[int] | None = None):
        first = lists[0]
        self.n = n = len(first)
        numels = tuple(t.numel() for t in first)
        blocks = [0]
        for k in numels:
            blocks.append(blocks[-1] + cdiv(k, BLOCK))
        self.blocks = blocks[-1]
        pad = [0]
        rows = blocks + list(numels) + pad + (list(index) if index is not None else list(range(n))) + pad
        # aligned: every address is a multiple of 16 bytes (fresh allocations are; views into flat
        # buffers may not be), so the full blocks may use 16-byte vector accesses
        self.aligned = True
        for lst in lists:
            ptrs = [t.data_ptr() for t in lst] if lst else [0] * n
            self.aligned = self.aligned and not any(p & 15 for p in ptrs)
            rows += ptrs + pad
        self.meta = _int64_on(rows, device)
        self.own = _owners(numels, blocks, device)
        self._numels, self._blocks = numels, blocks

    def schedule(self) -> torch.Tensor:
        return _schedule(self._numels, self._blocks, self.meta.device)


def _groups(params, grads) -> list[list[int]]:
    """Indices of the tensors sharing a param dtype and a grad dtype (one launch each)."""
    out: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        out.setdefault((p.dtype, grads[i].dtype if grads else None), []).append(i)
    return list(out.values())


class Launch:
    """What the launches over some lists need: per (param dtype, grad dtype) group a table and its
    dtypes, the distinct step counters, per-block scratch, and the constants tensor. Depends only
    on the tensors' dtypes, sizes and addresses, so a caller that knows those unchanged may reuse
    it across steps (zerofuse.ops._optim.Prepared)."""

    def __init__(self, params, grads, others: Sequence[Sequence[torch.Tensor] | None], steps=None):
        self.device = params[0].device if params else torch.device("cpu")
        self.n = len(params)
        self.groups = []
        for idx in _groups(params, grads):
            pick = lambda lst: [lst[i] for i in idx] if lst else None  # noqa: E731
            table = _Table([pick(params), pick(grads)] + [pick(lst) for lst in others], self.device, idx)
            self.groups.append((table, _TL[params[idx[0]].dtype], _TL[grads[idx[0]].dtype] if grads else None))
        self.steps = _check_steps(steps, self.device) if steps is not None else []
        self._consts: dict[int, tuple[tuple, torch.Tensor]] = {}
        self._part: dict[tuple[int, int], torch.Tensor] = {}
        self._block_sum_buf: tuple[torch.Tensor, list[torch.Tensor], int] | None = None
        self._sync: dict[int, torch.Tensor] = {}

    def consts(self, values: tuple) -> torch.Tensor:
        """The float64 constants on the device: one persistent tensor per kind of launch (keyed by
        the tuple's length: Adam/LARS 5, LAMB stage 1 4, LAMB 7), uploaded once; a value that changes
        (the lr every step under a schedule) is written in place by a fill whose value travels as a
        kernel argument: no host-to-device copy, no pinned allocation, ordered on the stream after
        the launches that read the old value. A value given as a 1-element device tensor (an lr kept
        on the device: zerofuse.zero.Optimizer.sync_lr) is copied in at every call, on the device,
        so that a captured CUDA graph of the step reads its value at each replay."""
        old = self._consts.get(len(values))
        if old is None:
            t = upload(torch.tensor([0.0 if torch.is_tensor(v) else v for v in values], dtype=torch.float64),
                       self.device)
            prev = tuple(None if torch.is_tensor(v) else v for v in values)
        else:
            prev, t = old
        for i, (a, b) in enumerate(zip(prev, values)):
            if torch.is_tensor(b):
                t[i:i + 1].copy_(b.reshape(1))
            elif a is None or a != b:
                t[i].fill_(b)
        self._consts[len(values)] = (tuple(None if torch.is_tensor(v) else v for v in values), t)
        return t

    def sync(self, g: int) -> torch.Tensor:
        """The one-launch LAMB's counters of group g (ticket, per tensor: stage-1 blocks done, norms
        ready), zeroed for a launch."""
        if g not in self._sync:
            self._sync[g] = torch.empty(1 + 2 * self.groups[g][0].n, device=self.device, dtype=torch.int32)
        return self._sync[g].zero_()

    def part(self, g: int, width: int) -> torch.Tensor:
        """Per-block partial sums of group g (every entry written by the kernel before it is read;
        one row at least, so the segment sums of a group of empty tensors get a real pointer)."""
        key = (g, width)
        if key not in self._part:
            rows = max(1, self.groups[g][0].blocks)
            self._part[key] = torch.empty((rows, width), device=self.device, dtype=torch.float32)
        return self._part[key]

    def block_sums(self) -> tuple[torch.Tensor, list[torch.Tensor], int]:
        """Per-block sums of squares of every group's tensors, in one buffer (at least one entry,
        kept between calls): (buffer, each group's (blocks, 1) view of it, number of blocks).
        l2norm sums the views per tensor, clip_inputs the whole buffer."""
        if self._block_sum_buf is None:
            total = sum(table.blocks for table, _, _ in self.groups)
            flat = torch.empty(max(1, total), device=self.device, dtype=torch.float32)
            views, off = [], 0
            for table, _, _ in self.groups:
                views.append(flat[off:off + table.blocks].view(-1, 1))
                off += table.blocks
            self._block_sum_buf = (flat, views, total)
        flat, views, total = self._block_sum_buf
        for (table, x_ty, _), part in zip(self.groups, views):
            if table.blocks:
                _sum_squares_kernel[(table.blocks,)](table.meta, table.own, table.n, part, X_TY=x_ty,
                                                     ALIGNED=table.aligned, BLOCK=BLOCK, num_warps=_NUM_WARPS)
        return flat, views, total


def _flag(t: torch.Tensor | None, name: str, device: torch.device) -> torch.Tensor | None:
    if t is None:
        return None
    if t.device != device or t.numel() != 1:
        raise RuntimeError(f"zerofuse: expected {name} to be a 1-element tensor on {device}, got shape "
                           f"{tuple(t.shape)} on {t.device}")
    return t.float() if t.dtype != torch.float32 else t


def _check_steps(steps: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The distinct step counters, checked."""
    for i, s in enumerate(steps):
        if s.device != device or s.dtype != torch.float32 or s.numel() != 1:
            raise RuntimeError(f"zerofuse: expected steps[{i}] to be a 1-element float32 tensor on {device} "
                               f"(the Triton kernels read step counts on the device), got {s.dtype} "
                               f"{tuple(s.shape)} on {s.device}")
    return list({s.data_ptr(): s for s in steps}.values())


def _advance(steps: list[torch.Tensor], found: torch.Tensor | None) -> None:
    """Adds 1 to each step counter (0 when found != 0), on the device: no host sync."""
    if not steps:
        return
    if found is None:
        torch._foreach_add_(steps, 1.0)
    else:
        # a list of device tensors: the scalar-tensor overload reads its scalar on the host (a sync,
        # caught by torch's sync debug mode on an H100); a flag from clip_inputs brings its increment
        inc = getattr(found, "_zerofuse_increment", None)
        if inc is None:
            inc = (found == 0).float().reshape(())
        torch._foreach_add_(steps, [inc] * len(steps))


def _segment_sums(table: _Table, part: torch.Tensor, out: torch.Tensor, found: torch.Tensor | None) -> None:
    if table.n:
        _segment_sum_kernel[(table.n,)](table.meta, table.n, part, out, found, HAS_FOUND=found is not None,
                                        WIDTH=part.shape[1], BLOCK_P=1024)


def moment_launch(params, grads, exp_avgs, exp_avg_sqs, masters, steps) -> Launch:
    """The Launch of the Adam and LAMB kernels (stage 2: grads=None)."""
    return Launch(params, grads, [exp_avgs, exp_avg_sqs, masters or None, steps], steps)


def adam(launch: Launch, *, lr, beta1, beta2, eps, weight_decay, decoupled, maximize, has_master, grad_mult=None,
         found_inf=None):
    """One launch per group of a moment_launch; lists already checked by the op layer."""
    if not launch.n:
        return
    device = launch.device
    mult, found = _flag(grad_mult, "grad_mult", device), _flag(found_inf, "found_inf", device)
    _advance(launch.steps, found)
    consts = launch.consts((lr, beta1, beta2, eps, weight_decay))
    for table, p_ty, g_ty in launch.groups:
        if table.blocks:
            _adam_kernel[(table.blocks,)](
                table.meta, table.own, consts, table.n, mult, found, P_TY=p_ty, G_TY=g_ty, HAS_MASTER=has_master,
                HAS_MULT=mult is not None, HAS_FOUND=found is not None, DECOUPLED=decoupled, MAXIMIZE=maximize,
                ALIGNED=table.aligned, BLOCK=BLOCK, EMULATE_RNE=interpreted(), num_warps=_NUM_WARPS,
            )


def lamb_stage1(launch: Launch, norms: torch.Tensor, *, beta1, beta2, eps, weight_decay, bias_correction,
                has_master, grad_mult, found_inf):
    """Advances the steps, updates the moments, writes norms[i] = (sum p^2, sum u^2)."""
    if not launch.n:
        return
    device = launch.device
    mult, found = _flag(grad_mult, "grad_mult", device), _flag(found_inf, "found_inf", device)
    _advance(launch.steps, found)
    consts = launch.consts((beta1, beta2, eps, weight_decay))
    for g, (table, p_ty, g_ty) in enumerate(launch.groups):
        part = launch.part(g, 2)
        if table.blocks:
            _lamb_stage1_kernel[(table.blocks,)](
                table.meta, table.own, consts, table.n, mult, found, part, P_TY=p_ty, G_TY=g_ty,
                HAS_MASTER=has_master, HAS_MULT=mult is not None, HAS_FOUND=found is not None,
                BIAS_CORRECTION=bias_correction, ALIGNED=table.aligned, BLOCK=BLOCK, num_warps=_NUM_WARPS,
            )
        _segment_sums(table, part, norms, found)  # tensors of no element get sums of 0


def lamb_stage2(launch: Launch, norms: torch.Tensor, *, lr, beta1, beta2, eps, weight_decay, bias_correction,
                trust_mode, min_trust, max_trust, has_master, found_inf):
    if not launch.n:
        return
    found = _flag(found_inf, "found_inf", launch.device)
    consts = launch.consts((beta1, beta2, eps, weight_decay, lr, min_trust, max_trust))
    for table, p_ty, _ in launch.groups:
        if table.blocks:
            _lamb_stage2_kernel[(table.blocks,)](
                table.meta, table.own, consts, table.n, norms, found, P_TY=p_ty, HAS_MASTER=has_master,
                HAS_FOUND=found is not None, BIAS_CORRECTION=bias_correction, PAPER=trust_mode == 0,
                ALIGNED=table.aligned, BLOCK=BLOCK, EMULATE_RNE=interpreted(), num_warps=_NUM_WARPS,
            )


def _lamb_one_launch_from_env() -> bool:
    value = os.environ.get("ZEROFUSE_LAMB_ONE_LAUNCH", "0")
    if value not in ("0", "1"):
        raise ValueError(f"ZEROFUSE_LAMB_ONE_LAUNCH must be '0' (two launches) or '1' (one launch), got {value!r}")
    return value == "1"


# [Note: one-launch LAMB] A LAMB step moves at least 44 bytes per fp32 param from memory in
# two launches (a grad-norm pass 4, stage 1 reads p, g, m, v and writes m, v 24, stage 2 reads p,
# m, v and writes p 16) against a clipped AdamW step's 32: 1.375x, over the 1.3x goal. Stage 2
# needs the norms of the whole tensor, so it cannot run in the same block as stage 1, but it can
# run right after the tensor's stage 1, while the tensor's p, m and v are still in L2 (50 MB on an
# H100): then its reads come from L2 and the step moves ~32 bytes per param from memory when the
# tensors fit. The launch runs 2 programs per block in the order of _schedule. Each program takes a
# ticket (an atomic counter) and runs the schedule's entry of that number, so a program never waits
# for one that has not started yet: no deadlock whatever the order the GPU starts programs in.
# A stage-1 program adds 1 to its tensor's count; the last one sums the tensor's block sums in block
# order (deterministic, the same sums as the two-launch path) and sets the tensor's ready flag; a
# stage-2 program waits for it (acquire), then updates. The interpreter runs programs one by one in
# ticket order, so there nothing ever waits.
# Measured on an H200 (bench/results/h200-2026-11-26): the one-launch form took 0.345 / 0.729 /
# 3.132 ms at 1M / 10M / 100M params against the two-launch form's 0.320 / 0.463 / 1.749 ms (the
# tickets and the stage-2 programs spinning on their tensor's flag cost more than the L2 reuse
# saves), so the two-launch form is the default and ZEROFUSE_LAMB_ONE_LAUNCH=1 selects this one.
# zerofuse's benchmark compares both.
LAMB_ONE_LAUNCH = _lamb_one_launch_from_env()


def lamb_fused(launch: Launch, *, lr, beta1, beta2, eps, weight_decay, bias_correction, trust_mode, min_trust,
               max_trust, has_master, grad_mult, found_inf):
    """Both LAMB stages (lamb_stage1 then lamb_stage2) in one launch per group; see [Note: one-launch LAMB]."""
    if not launch.n:
        return
    device = launch.device
    mult, found = _flag(grad_mult, "grad_mult", device), _flag(found_inf, "found_inf", device)
    _advance(launch.steps, found)
    consts = launch.consts((beta1, beta2, eps, weight_decay, lr, min_trust, max_trust))
    norms = torch.empty((launch.n, 2), device=device, dtype=torch.float32)
    for g, (table, p_ty, g_ty) in enumerate(launch.groups):
        if table.blocks:
            _lamb_fused_kernel[(2 * table.blocks,)](
                table.meta, table.own, table.schedule(), consts, table.n, mult, found, launch.part(g, 2), norms,
                launch.sync(g), P_TY=p_ty, G_TY=g_ty, HAS_MASTER=has_master, HAS_MULT=mult is not None,
                HAS_FOUND=found is not None, BIAS_CORRECTION=bias_correction, PAPER=trust_mode == 0,
                ALIGNED=table.aligned, BLOCK=BLOCK, BLOCK_P=1024, EMULATE_RNE=interpreted(), num_warps=_NUM_WARPS,
            )


def lars_launch(params, grads, momentum_buffers, masters) -> Launch:
    return Launch(params, grads, [momentum_buffers, masters or None])


def lars(launch: Launch, norms: torch.Tensor, *, lr, momentum, weight_decay, trust_coefficient, eps, has_master,
         grad_mult, found_inf):
    """norms: (2n,) fp32, the norms of the params (or masters) then of the grads."""
    if not launch.n:
        return
    device = launch.device
    mult, found = _flag(grad_mult, "grad_mult", device), _flag(found_inf, "found_inf", device)
    consts = launch.consts((lr, momentum, weight_decay, trust_coefficient, eps))
    pnorms, gnorms = norms[:launch.n], norms[launch.n:]
    for table, p_ty, g_ty in launch.groups:
        if table.blocks:
            _lars_kernel[(table.blocks,)](
                table.meta, table.own, consts, table.n, pnorms, gnorms, mult, found, P_TY=p_ty, G_TY=g_ty,
                HAS_MASTER=has_master, HAS_MULT=mult is not None, HAS_FOUND=found is not None,
                ALIGNED=table.aligned, BLOCK=BLOCK, EMULATE_RNE=interpreted(), num_warps=_NUM_WARPS,
            )


def norm_launch(tensors) -> Launch:
    """The Launch of l2norm: one group per dtype."""
    return Launch(tensors, None, [])


def l2norm(launch: Launch, per_tensor: bool):
    """(norm of all, (n,) norms or (0,)), fp32 on the tensors' device."""
    device = launch.device
    sums = torch.zeros(launch.n, device=device, dtype=torch.float32)
    for (table, _, _), part in zip(launch.groups, launch.block_sums()[1]):
        if table.blocks:
            _segment_sums(table, part, sums, None)
    total = sums.sum().sqrt()
    return total, sums.sqrt() if per_tensor else sums.new_empty(0)


def clip_inputs(launch: Launch, max_norm: float, grad_scale: torch.Tensor | None,
                found_inf: torch.Tensor | None, eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad multiplier, skip flag, norm), 1-element fp32 views on the device: the global norm of
    the tensors of a norm_launch divided by grad_scale, the flag (norm not finite, or found_inf !=
    0) and (1 / grad_scale) * max_norm / max(norm, max_norm). One sum-of-squares launch per dtype
    group and one single-program launch, no host sync. The flag carries its step-counter increment
    (1 - flag, written by the same kernel), so _advance needs no launch of its own to make it."""
    device = launch.device
    scale, found = _flag(grad_scale, "grad_scale", device), _flag(found_inf, "found_inf", device)
    flat, _, nblocks = launch.block_sums()
    out = torch.empty(4, device=device, dtype=torch.float32)
    _clip_kernel[(1,)](flat, nblocks, out, scale, found, float(max_norm), float(eps or 0.0), HAS_SCALE=scale is not None,
                       HAS_FOUND=found is not None, TORCH_RULE=eps is not None, BLOCK_P=1024, num_warps=4)
    flag = out[1:2]
    flag._zerofuse_increment = out[3]
    return out[2:3], flag, out[0:1]
