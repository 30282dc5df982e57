"""Multi-tensor optimizer kernels in Triton: Adam/AdamW and LARS here, LAMB in lamb.py, the 2-norm
of many tensors and the clipping inputs in l2norm.py, all over the tables, persistent grid and step
scalars of multi_tensor.py (see its notes). This module is the one the ops import
(``from zerofuse.kernels import optim as K``): it re-exports the launchers of the others.

Adam streams p, g, m, v (and fp32 masters) once each: loads and stores carry evict_first, as
nothing in the step reads them again (L2 is left to what does).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zerofuse.kernels import interpreted
from zerofuse.kernels.l2norm import (_clip_kernel, _segment_sum_kernel, _sum_squares_kernel, block_sums,  # noqa: F401
                                     clip_inputs, l2norm, norm_launch)
from zerofuse.kernels.lamb import (LAMB_ONE_LAUNCH, _lamb_fused_kernel, _lamb_one_launch_from_env,  # noqa: F401
                                   _lamb_stage1_kernel, _lamb_stage2_kernel, _schedule, lamb_fused, lamb_stage1,
                                   lamb_stage2)
from zerofuse.kernels.launch import launch_triton
from zerofuse.kernels.multi_tensor import (BLOCK, STREAM, _NUM_WARPS, Launch, _blocks, _go, _grad_mult, _ld,  # noqa: F401
                                           _ptr, _st, _steps_kernel, _store_param, _Table, _visit, flag)

# ------------------------------------------------------------------------------------ Adam / AdamW

# pointer rows: params, grads, exp_avgs, exp_avg_sqs, masters, step scalars; consts: lr, beta1,
# beta2, eps, weight_decay



@triton.jit
def _adam_block(P, G, M, V, W, offs, mask, MULT, step_size, bc2_sqrt, w1, w2, b1, b2, decay, wd, eps,
                HAS_MASTER: tl.constexpr, HAS_MULT: tl.constexpr, DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr,
                MASKED: tl.constexpr, EMULATE_RNE: tl.constexpr):
    g = _grad_mult(_ld(G, offs, mask, MASKED, STREAM), MULT, HAS_MULT)
    if MAXIMIZE:
        g = -g
    p = _ld(W, offs, mask, MASKED, STREAM) if HAS_MASTER else _ld(P, offs, mask, MASKED, STREAM)
    if DECOUPLED:
        p = p * decay
    else:  # (no term at wd 0, as torch and the C++ kernel: 0 * inf made an inf param NaN, its moments too)
        g = tl.where(wd != 0, g + wd * p, g)
    m = _ld(M, offs, mask, MASKED, STREAM)
    v = _ld(V, offs, mask, MASKED, STREAM)
    # torch's lerp for weights < 0.5 (1 - beta1 for any usual beta1): m + w * (g - m)
    m = tl.where(w1 < 0.5, m + w1 * (g - m), g - (g - m) * b1)
    v = v * b2 + w2 * g * g
    p = p - step_size * tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
    _st(M, offs, m, mask, MASKED, STREAM)
    _st(V, offs, v, mask, MASKED, STREAM)
    _store_param(P, W, offs, mask, p, HAS_MASTER, MASKED, EMULATE_RNE, STREAM)


@triton.jit
def _adam_kernel(META, OWN, CONSTS, n, nblocks, MULT, FOUND, P_TY: tl.constexpr, G_TY: tl.constexpr,
                 HAS_MASTER: tl.constexpr, HAS_MULT: tl.constexpr, HAS_FOUND: tl.constexpr, DECOUPLED: tl.constexpr,
                 MAXIMIZE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr, EMULATE_RNE: tl.constexpr):
    if _go(FOUND, HAS_FOUND):
        # scalars of the launch, rounded once from float64 as the Python floats torch.optim passes
        lr, beta1, beta2 = tl.load(CONSTS), tl.load(CONSTS + 1), tl.load(CONSTS + 2)
        eps, wd = tl.load(CONSTS + 3).to(tl.float32), tl.load(CONSTS + 4)
        w1, w2 = (1.0 - beta1).to(tl.float32), (1.0 - beta2).to(tl.float32)
        decay = (1.0 - lr * wd).to(tl.float32)
        b1, b2, wd = beta1.to(tl.float32), beta2.to(tl.float32), wd.to(tl.float32)
        first, stride, t_next = _blocks(OWN, nblocks)
        for i in range(first, nblocks, stride):
            b, t, t_next, start, numel = _visit(META, OWN, n, i, stride, nblocks, t_next, BLOCK, False)
            P = _ptr(META, 3, n, t, P_TY, ALIGNED)
            G = _ptr(META, 4, n, t, G_TY, ALIGNED)
            M = _ptr(META, 5, n, t, tl.float32, ALIGNED)
            V = _ptr(META, 6, n, t, tl.float32, ALIGNED)
            W = _ptr(META, 7, n, t, tl.float32, ALIGNED)
            S = _ptr(META, 8, n, t, tl.float32, False)  # [Note: step scalars]
            step_size, bc2_sqrt = tl.load(S + 2), tl.load(S + 3)
            offs = start + tl.arange(0, BLOCK)
            if start + BLOCK <= numel:
                _adam_block(P, G, M, V, W, offs, offs < numel, MULT, step_size, bc2_sqrt, w1, w2, b1, b2, decay,
                            wd, eps, HAS_MASTER, HAS_MULT, DECOUPLED, MAXIMIZE, False, EMULATE_RNE)
            else:
                _adam_block(P, G, M, V, W, offs, offs < numel, MULT, step_size, bc2_sqrt, w1, w2, b1, b2, decay,
                            wd, eps, HAS_MASTER, HAS_MULT, DECOUPLED, MAXIMIZE, True, EMULATE_RNE)


# ------------------------------------------------------------------------------------ LARS

# pointer rows: params, grads, momentum buffers, masters; consts: lr, momentum, weight_decay,
# trust_coefficient, eps
@triton.jit
def _lars_block(P, G, B, W, offs, mask, MULT, step, momentum, wd, HAS_MASTER: tl.constexpr, HAS_MULT: tl.constexpr,
                MASKED: tl.constexpr, EMULATE_RNE: tl.constexpr):
    g = _grad_mult(_ld(G, offs, mask, MASKED, STREAM), MULT, HAS_MULT)
    p = _ld(W, offs, mask, MASKED, STREAM) if HAS_MASTER else _ld(P, offs, mask, MASKED, STREAM)
    b = _ld(B, offs, mask, MASKED, STREAM) * momentum + step * (g + wd * p)
    _st(B, offs, b, mask, MASKED, STREAM)
    _store_param(P, W, offs, mask, p - b, HAS_MASTER, MASKED, EMULATE_RNE, STREAM)


@triton.jit
def _lars_kernel(META, OWN, CONSTS, n, nblocks, PNORMS, GNORMS, MULT, FOUND, P_TY: tl.constexpr, G_TY: tl.constexpr,
                 HAS_MASTER: tl.constexpr, HAS_MULT: tl.constexpr, HAS_FOUND: tl.constexpr, ALIGNED: tl.constexpr,
                 BLOCK: tl.constexpr, EMULATE_RNE: tl.constexpr):
    if _go(FOUND, HAS_FOUND):
        lr, momentum, wd = tl.load(CONSTS), tl.load(CONSTS + 1), tl.load(CONSTS + 2)
        tc, eps = tl.load(CONSTS + 3), tl.load(CONSTS + 4)
        m32, wd32 = momentum.to(tl.float32), wd.to(tl.float32)
        first, stride, t_next = _blocks(OWN, nblocks)
        for i in range(first, nblocks, stride):
            b, t, t_next, start, numel = _visit(META, OWN, n, i, stride, nblocks, t_next, BLOCK, False)
            row = tl.load(META + 2 * (n + 1) + t)
            pn = tl.load(PNORMS + row).to(tl.float64)
            gn = tl.load(GNORMS + row).to(tl.float64)  # |grad * grad_mult| (l2norm's mult, before the squares)
            scaled = (pn > 0) & (gn > 0)
            local = tl.where(scaled, tc * pn / (gn + wd * pn + eps), 1.0)
            step = (lr * local).to(tl.float32)
            wd_t = tl.where(scaled, wd32, 0.0)  # (LARC's: decay only with the ratio; csrc/cpu/lars.cpp)
            P = _ptr(META, 3, n, t, P_TY, ALIGNED)
            G = _ptr(META, 4, n, t, G_TY, ALIGNED)
            B = _ptr(META, 5, n, t, tl.float32, ALIGNED)
            W = _ptr(META, 6, n, t, tl.float32, ALIGNED)
            offs = start + tl.arange(0, BLOCK)
            if start + BLOCK <= numel:
                _lars_block(P, G, B, W, offs, offs < numel, MULT, step, m32, wd_t, HAS_MASTER, HAS_MULT, False,
                            EMULATE_RNE)
            else:
                _lars_block(P, G, B, W, offs, offs < numel, MULT, step, m32, wd_t, HAS_MASTER, HAS_MULT, True,
                            EMULATE_RNE)


# ------------------------------------------------------------------------------------ host side


def moment_launch(params, grads, exp_avgs, exp_avg_sqs, masters, steps) -> Launch:
    """The Launch of the Adam and LAMB kernels (stage 2: grads=None)."""
    return Launch(params, grads, [exp_avgs, exp_avg_sqs, masters or None], steps)


def adam(launch: Launch, *, lr, beta1, beta2, eps, weight_decay, decoupled, maximize, has_master, grad_mult=None,
         found_inf=None):
    """The step-scalars launch, then one launch per group of a moment_launch; lists already
    checked by the op layer."""
    if not launch.n:
        return
    device = launch.device
    mult, found = flag(grad_mult, "grad_mult", device), flag(found_inf, "found_inf", device)
    consts = launch.consts((lr, beta1, beta2, eps, weight_decay))
    launch.advance(consts, found, b1_at=1, lr_at=0)
    for table, p_ty, g_ty in launch.groups:
        if table.blocks:
            launch_triton(_adam_kernel, (table.programs,),
                table.meta, table.own, consts, table.n, table.blocks, mult, found, P_TY=p_ty, G_TY=g_ty,
                HAS_MASTER=has_master, HAS_MULT=mult is not None, HAS_FOUND=found is not None, DECOUPLED=decoupled,
                MAXIMIZE=maximize, ALIGNED=table.aligned, BLOCK=table.block, EMULATE_RNE=interpreted(),
                num_warps=table.warps,
            )


def lars_launch(params, grads, momentum_buffers, masters) -> Launch:
    return Launch(params, grads, [momentum_buffers, masters or None])


def lars(launch: Launch, norms: torch.Tensor, *, lr, momentum, weight_decay, trust_coefficient, eps, has_master,
         grad_mult, found_inf):
    """norms: (2n,) fp32, the norms of the params (or masters) then of the grads times grad_mult."""
    if not launch.n:
        return
    device = launch.device
    mult, found = flag(grad_mult, "grad_mult", device), flag(found_inf, "found_inf", device)
    consts = launch.consts((lr, momentum, weight_decay, trust_coefficient, eps))
    pnorms, gnorms = norms[:launch.n], norms[launch.n:]
    for table, p_ty, g_ty in launch.groups:
        if table.blocks:
            launch_triton(_lars_kernel, (table.programs,),
                table.meta, table.own, consts, table.n, table.blocks, pnorms, gnorms, mult, found, P_TY=p_ty,
                G_TY=g_ty, HAS_MASTER=has_master, HAS_MULT=mult is not None, HAS_FOUND=found is not None,
                ALIGNED=table.aligned, BLOCK=table.block, EMULATE_RNE=interpreted(), num_warps=table.warps,
            )
