"""LAMB in Triton over the multi-tensor tables of multi_tensor.py: stage 1 (moments, per-tensor sums
of squares of p and of the update u), the per-tensor sums, stage 2 (p -= lr * trust * u); or both
stages in one launch ([Note: one-launch LAMB]). Bias corrections come from the step-scalars rows
([Note: step scalars]); stage 1 streams with the persistent grid ([Note: persistent grid]) and
leaves p, m and v in L2 for stage 2, which walks the blocks backwards and streams them out
(evict_first).
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import triton
import triton.language as tl

from zerofuse.kernels import env, interpreted
from zerofuse.kernels.l2norm import _sum_blocks, segment_sums
from zerofuse.kernels.launch import launch_triton
from zerofuse.kernels.multi_tensor import (KEEP, STREAM, Launch, _blocks, _go, _grad_mult, _kept, _ld,
                                           _ptr, _st, _store_param, _visit, flag, upload)

# pointer rows as Adam's (kernels/optim.py); consts: beta1, beta2, eps, weight_decay, lr, min_trust, max_trust
_B1_AT = 0


@triton.jit
def _lamb_consts(CONSTS):
    """(beta1, beta2, w1, w2, eps, wd) in fp32: the launch's, loaded once per program."""
    beta1, beta2 = tl.load(CONSTS), tl.load(CONSTS + 1)
    return (beta1.to(tl.float32), beta2.to(tl.float32), (1.0 - beta1).to(tl.float32),
            (1.0 - beta2).to(tl.float32), tl.load(CONSTS + 2).to(tl.float32),
            tl.load(CONSTS + 3).to(tl.float32))


@triton.jit
def _bias_corrections(META, n, t, BIAS_CORRECTION: tl.constexpr):
    """(bc1, bc2) of tensor t, from its step-scalars row ([Note: step scalars]); 1 without."""
    if BIAS_CORRECTION:
        S = _ptr(META, 8, n, t, tl.float32, False)
        bc1, bc2 = tl.load(S), tl.load(S + 1)
    else:
        bc1 = tl.full((), 1.0, tl.float32)
        bc2 = bc1
    return bc1, bc2


@triton.jit
def _lamb_update(m, v, p, bc1, bc2, eps, wd):
    return tl.div_rn(tl.div_rn(m, bc1), tl.sqrt_rn(tl.div_rn(v, bc2)) + eps) + wd * p


@triton.jit
def _lamb1_block(P, G, M, V, offs, mask, MULT, beta1, beta2, w1, w2, eps, wd, bc1, bc2,
                 HAS_MULT: tl.constexpr, MASKED: tl.constexpr):
    """Updates the moments; returns (sum p^2, sum u^2) of the block."""
    g = _grad_mult(_ld(G, offs, mask, MASKED, STREAM), MULT, HAS_MULT)
    p = _ld(P, offs, mask, MASKED, KEEP)
    m = _ld(M, offs, mask, MASKED, KEEP) * beta1 + w1 * g
    v = _ld(V, offs, mask, MASKED, KEEP) * beta2 + w2 * g * g
    _st(M, offs, m, mask, MASKED, KEEP)
    _st(V, offs, v, mask, MASKED, KEEP)
    u = _lamb_update(m, v, p, bc1, bc2, eps, wd)
    if MASKED:
        u = tl.where(mask, u, 0.0)
    return tl.sum(p * p, axis=0), tl.sum(u * u, axis=0)


@triton.jit
def _lamb1_span(P, G, M, V, start, numel, MULT, beta1, beta2, w1, w2, eps, wd, bc1, bc2,
                HAS_MULT: tl.constexpr, BLOCK: tl.constexpr):
    """_lamb1_block over elements start .. start + BLOCK of a tensor of numel: unmasked when whole."""
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= numel:
        pp, uu = _lamb1_block(P, G, M, V, offs, offs < numel, MULT, beta1, beta2, w1, w2, eps, wd, bc1, bc2,
                              HAS_MULT, False)
    else:
        pp, uu = _lamb1_block(P, G, M, V, offs, offs < numel, MULT, beta1, beta2, w1, w2, eps, wd, bc1, bc2,
                              HAS_MULT, True)
    return pp, uu


@triton.jit
def _lamb_stage1_kernel(META, OWN, CONSTS, n, nblocks, MULT, FOUND, PART, P_TY: tl.constexpr, G_TY: tl.constexpr,
                        HAS_MASTER: tl.constexpr, HAS_MULT: tl.constexpr, HAS_FOUND: tl.constexpr,
                        BIAS_CORRECTION: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    # a skipped step writes no sums: the segment sums leave the norms as they were
    if _go(FOUND, HAS_FOUND):
        beta1, beta2, w1, w2, eps, wd = _lamb_consts(CONSTS)
        first, stride, t_next = _blocks(OWN, nblocks)
        for i in range(first, nblocks, stride):
            b, t, t_next, start, numel = _visit(META, OWN, n, i, stride, nblocks, t_next, BLOCK, False)
            bc1, bc2 = _bias_corrections(META, n, t, BIAS_CORRECTION)
            if HAS_MASTER:
                P = _ptr(META, 7, n, t, tl.float32, ALIGNED)
            else:
                P = _ptr(META, 3, n, t, P_TY, ALIGNED)
            G = _ptr(META, 4, n, t, G_TY, ALIGNED)
            M = _ptr(META, 5, n, t, tl.float32, ALIGNED)
            V = _ptr(META, 6, n, t, tl.float32, ALIGNED)
            pp, uu = _lamb1_span(P, G, M, V, start, numel, MULT, beta1, beta2, w1, w2, eps, wd, bc1, bc2, HAS_MULT,
                                 BLOCK)
            tl.store(PART + 2 * b, pp)
            tl.store(PART + 2 * b + 1, uu)


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
    p = _ld(W, offs, mask, MASKED, STREAM) if HAS_MASTER else _ld(P, offs, mask, MASKED, STREAM)
    m = _ld(M, offs, mask, MASKED, STREAM)
    v = _ld(V, offs, mask, MASKED, STREAM)
    p = p - ratio * _lamb_update(m, v, p, bc1, bc2, eps, wd)
    _store_param(P, W, offs, mask, p, HAS_MASTER, MASKED, EMULATE_RNE, STREAM)


@triton.jit
def _lamb2_span(P, W, M, V, start, numel, ratio, bc1, bc2, eps, wd, HAS_MASTER: tl.constexpr,
                EMULATE_RNE: tl.constexpr, BLOCK: tl.constexpr):
    """_lamb2_block over elements start .. start + BLOCK of a tensor of numel: unmasked when whole."""
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= numel:
        _lamb2_block(P, W, M, V, offs, offs < numel, ratio, bc1, bc2, eps, wd, HAS_MASTER, False, EMULATE_RNE)
    else:
        _lamb2_block(P, W, M, V, offs, offs < numel, ratio, bc1, bc2, eps, wd, HAS_MASTER, True, EMULATE_RNE)


@triton.jit
def _lamb_stage2_kernel(META, OWN, CONSTS, n, nblocks, NORMS, FOUND, P_TY: tl.constexpr, HAS_MASTER: tl.constexpr,
                        HAS_FOUND: tl.constexpr, BIAS_CORRECTION: tl.constexpr, PAPER: tl.constexpr,
                        ALIGNED: tl.constexpr, BLOCK: tl.constexpr, EMULATE_RNE: tl.constexpr):
    if _go(FOUND, HAS_FOUND):
        beta1, beta2, w1, w2, eps, wd = _lamb_consts(CONSTS)
        first, stride, t_next = _blocks(OWN, nblocks, BACKWARDS=True)  # stage 1's last blocks are in L2
        for i in range(first, nblocks, stride):
            b, t, t_next, start, numel = _visit(META, OWN, n, i, stride, nblocks, t_next, BLOCK, True)
            bc1, bc2 = _bias_corrections(META, n, t, BIAS_CORRECTION)
            ratio = _trust_ratio(NORMS, tl.load(META + 2 * (n + 1) + t), CONSTS, PAPER)
            P = _ptr(META, 3, n, t, P_TY, ALIGNED)
            W = _ptr(META, 7, n, t, tl.float32, ALIGNED)
            M = _ptr(META, 5, n, t, tl.float32, ALIGNED)
            V = _ptr(META, 6, n, t, tl.float32, ALIGNED)
            _lamb2_span(P, W, M, V, start, numel, ratio, bc1, bc2, eps, wd, HAS_MASTER, EMULATE_RNE, BLOCK)


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
        beta1, beta2, w1, w2, eps, wd = _lamb_consts(CONSTS)
        bc1, bc2 = _bias_corrections(META, n, t, BIAS_CORRECTION)
        M = _ptr(META, 5, n, t, tl.float32, ALIGNED)
        V = _ptr(META, 6, n, t, tl.float32, ALIGNED)
        W = _ptr(META, 7, n, t, tl.float32, ALIGNED)
        P = _ptr(META, 3, n, t, P_TY, ALIGNED)
        row = tl.load(META + 2 * (n + 1) + t)
        if (code & 1) == 0:  # stage 1: moments, this block's sums of squares
            G = _ptr(META, 4, n, t, G_TY, ALIGNED)
            pp, uu = _lamb1_span(W if HAS_MASTER else P, G, M, V, start, numel, MULT, beta1, beta2, w1, w2, eps, wd,
                                 bc1, bc2, HAS_MULT, BLOCK)
            tl.store(PART + 2 * b, pp)
            tl.store(PART + 2 * b + 1, uu)
            # every thread's stores (moments, sums) before the count (colsum._arrive's order: the
            # atomic is one thread's; the barrier the compiler placed here was not the source's)
            tl.debug_barrier()
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
            _lamb2_span(P, W, M, V, start, numel, ratio, bc1, bc2, eps, wd, HAS_MASTER, EMULATE_RNE, BLOCK)


def lamb_stage1(launch: Launch, norms: torch.Tensor, *, beta1, beta2, eps, weight_decay, bias_correction,
                has_master, grad_mult, found_inf):
    """Advances the steps, updates the moments, writes norms[i] = (sum p^2, sum u^2)."""
    if not launch.n:
        return
    device = launch.device
    mult, found = flag(grad_mult, "grad_mult", device), flag(found_inf, "found_inf", device)
    consts = launch.consts((beta1, beta2, eps, weight_decay))
    launch.advance(consts, found, b1_at=_B1_AT)
    for g, (table, p_ty, g_ty) in enumerate(launch.groups):
        part = launch.part(g, 2)
        if table.blocks:
            launch_triton(_lamb_stage1_kernel, (table.programs,),
                table.meta, table.own, consts, table.n, table.blocks, mult, found, part, P_TY=p_ty, G_TY=g_ty,
                HAS_MASTER=has_master, HAS_MULT=mult is not None, HAS_FOUND=found is not None,
                BIAS_CORRECTION=bias_correction, ALIGNED=table.aligned, BLOCK=table.block, num_warps=table.warps,
            )
        segment_sums(table, part, norms, found)  # tensors of no element get sums of 0


def lamb_stage2(launch: Launch, norms: torch.Tensor, *, lr, beta1, beta2, eps, weight_decay, bias_correction,
                trust_mode, min_trust, max_trust, has_master, found_inf, rows_ready: bool = False):
    """p -= lr * trust * u. rows_ready: lamb_stage1 ran on this same launch just before (its
    step-scalars rows hold this step's bias corrections); else they are computed here first."""
    if not launch.n:
        return
    found = flag(found_inf, "found_inf", launch.device)
    consts = launch.consts((beta1, beta2, eps, weight_decay, lr, min_trust, max_trust))
    if bias_correction and not rows_ready:  # stage 1 ran on another Launch (ZeRO's separate op calls)
        launch.advance(consts, found, b1_at=_B1_AT, advance=False)
    for table, p_ty, _ in launch.groups:
        if table.blocks:
            launch_triton(_lamb_stage2_kernel, (table.programs,),
                table.meta, table.own, consts, table.n, table.blocks, norms, found, P_TY=p_ty, HAS_MASTER=has_master,
                HAS_FOUND=found is not None, BIAS_CORRECTION=bias_correction, PAPER=trust_mode == 0,
                ALIGNED=table.aligned, BLOCK=table.block, EMULATE_RNE=interpreted(), num_warps=table.warps,
            )


_SCHEDULES: OrderedDict = OrderedDict()  # the one-launch LAMB's block order, per recent layout


def _schedule(table, device: torch.device) -> torch.Tensor:
    """Per tensor of table (a multi_tensor._Table), its stage-1 blocks, then its stage-2 blocks from
    last to first (the most recently streamed first: the likeliest in L2); codes 2 * block + stage.
    The table keeps its schedule, as it keeps its own tables: a captured step (--cuda-graphs) reads
    it at every replay, so it must outlive _SCHEDULES's eviction of the least recently used layout
    (more than _LAYOUTS_KEPT layouts: e.g. one per ZeRO bucket), which would free it for reuse."""
    kept = getattr(table, "lamb_schedule", None)
    if kept is not None:
        return kept
    blocks = table.block_starts

    def make():
        codes = []
        for a, b in zip(blocks, blocks[1:]):
            codes += range(2 * a, 2 * b, 2)
            codes += range(2 * b - 1, 2 * a, -2)
        return upload(torch.tensor(codes or [0], dtype=torch.int32), device)
    # the block starts: BLOCK may change
    table.lamb_schedule = _kept(_SCHEDULES, (table.numels, tuple(blocks), device), make)
    return table.lamb_schedule


def _lamb_one_launch_from_env() -> bool:
    return env.flag("ZEROFUSE_LAMB_ONE_LAUNCH", False, "one launch", "two launches")


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
    mult, found = flag(grad_mult, "grad_mult", device), flag(found_inf, "found_inf", device)
    consts = launch.consts((beta1, beta2, eps, weight_decay, lr, min_trust, max_trust))
    launch.advance(consts, found, b1_at=_B1_AT)
    norms = torch.empty((launch.n, 2), device=device, dtype=torch.float32)
    for g, (table, p_ty, g_ty) in enumerate(launch.groups):
        if table.blocks:
            launch_triton(_lamb_fused_kernel, (2 * table.blocks,),
                table.meta, table.own, _schedule(table, device), consts, table.n, mult, found,
                launch.part(g, 2), norms,
                launch.sync(g), P_TY=p_ty, G_TY=g_ty, HAS_MASTER=has_master, HAS_MULT=mult is not None,
                HAS_FOUND=found is not None, BIAS_CORRECTION=bias_correction, PAPER=trust_mode == 0,
                ALIGNED=table.aligned, BLOCK=table.block, BLOCK_P=1024, EMULATE_RNE=interpreted(), num_warps=table.warps,
            )


