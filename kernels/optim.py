"""Multi-tensor optimizer kernels in Triton: Adam/AdamW, LAMB (two stages), LARS, and the 2-norm of
many tensors. The math is that of the C++ CPU kernels (csrc/cpu/adam.cpp, lamb.cpp, lars.cpp,
l2norm.cpp) and of zerofuse.reference, element for element in fp32 with IEEE-rounded division and
square root (div_rn / sqrt_rn; `/` and tl.sqrt are approximate on GPUs).

One launch covers every tensor of a list (of one param dtype and grad dtype): a table in one int64
tensor ("meta") holds, per tensor, its first block, element count and data pointers, followed by
the float64 hyper-parameters bit-cast to int64 (Triton passes Python floats as fp32; bias
corrections want float64). Each program handles BLOCK elements of one tensor, found by binary
search over the block offsets. Per-tensor sums (LAMB, norms) are written per block and added per
tensor by a second small kernel in a fixed order: deterministic, no atomics.

Step counts live in 1-element fp32 tensors on the device (torch's fused optimizers do the same)
and are advanced by (1 - found_inf) before the update, so a step skipped on an inf/NaN flag
(found_inf, read by the kernel) needs no host sync; bias corrections beta^step are computed in
float64 by exponentiation by squaring.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from zerofuse.kernels import interpreted
from zerofuse.kernels.common import _cast, cdiv

BLOCK = 4096
_NUM_WARPS = 8
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# ------------------------------------------------------------------------------------ device helpers


@triton.jit
def _locate(META, n, LOG_N: tl.constexpr, BLOCK: tl.constexpr):
    """(tensor index, element offsets, in-bounds mask) of this program."""
    pid = tl.program_id(0)
    lo = pid * 0
    hi = lo + n  # invariant: block_start[lo] <= pid < block_start[hi]
    for _ in tl.static_range(LOG_N):
        mid = (lo + hi) // 2
        go = tl.load(META + mid) <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    offs = (pid - tl.load(META + lo)) * BLOCK + tl.arange(0, BLOCK)
    return lo, offs, offs < tl.load(META + (n + 1) + lo)


@triton.jit
def _ptr(META, row, n, t, TY: tl.constexpr, ALIGNED: tl.constexpr):
    ptr = tl.load(META + row * (n + 1) + t).to(tl.pointer_type(TY))
    if ALIGNED:
        # Pointers read from the table carry no alignment the compiler can see (pointer arguments
        # get it from launch-time specialisation): without the hint every access is a 4-byte load.
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _const(META, rows, n, k):
    return tl.load(META + rows * (n + 1) + k).to(tl.float64, bitcast=True)


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
def _load_f32(ptr, offs, mask):
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_param(P, W, offs, mask, p, HAS_MASTER: tl.constexpr, EMULATE_RNE: tl.constexpr):
    if HAS_MASTER:
        tl.store(W + offs, p, mask=mask)
    tl.store(P + offs, _cast(p, P.dtype.element_ty, EMULATE_RNE), mask=mask)


@triton.jit
def _skip_mask(mask, FOUND, HAS_FOUND: tl.constexpr):
    if HAS_FOUND:
        # the flag loaded as a block (one address, one cached load) so the mask stays a block
        mask = mask & (tl.load(FOUND + tl.zeros_like(mask).to(tl.int32)) == 0)
    return mask


@triton.jit
def _grad_mult(g, MULT, HAS_MULT: tl.constexpr):
    if HAS_MULT:
        g = g * tl.load(MULT)
    return g


# ------------------------------------------------------------------------------------ kernels

# meta rows of the Adam kernel: 0 block starts, 1 numels, 2 params, 3 grads, 4 exp_avgs,
# 5 exp_avg_sqs, 6 masters, 7 steps; constants: lr, beta1, beta2, eps, weight_decay
@triton.jit
def _adam_kernel(META, n, MULT, FOUND, P_TY: tl.constexpr, G_TY: tl.constexpr, HAS_MASTER: tl.constexpr,
                 HAS_MULT: tl.constexpr, HAS_FOUND: tl.constexpr, DECOUPLED: tl.constexpr,
                 MAXIMIZE: tl.constexpr, LOG_N: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
                 EMULATE_RNE: tl.constexpr):
    t, offs, mask = _locate(META, n, LOG_N, BLOCK)
    mask = _skip_mask(mask, FOUND, HAS_FOUND)
    P = _ptr(META, 2, n, t, P_TY, ALIGNED)
    G = _ptr(META, 3, n, t, G_TY, ALIGNED)
    M = _ptr(META, 4, n, t, tl.float32, ALIGNED)
    V = _ptr(META, 5, n, t, tl.float32, ALIGNED)
    W = _ptr(META, 6, n, t, tl.float32, ALIGNED)
    step = tl.load(_ptr(META, 7, n, t, tl.float32, False)).to(tl.float64)
    lr, beta1, beta2 = _const(META, 8, n, 0), _const(META, 8, n, 1), _const(META, 8, n, 2)
    eps, wd = _const(META, 8, n, 3).to(tl.float32), _const(META, 8, n, 4)
    # scalars derived in float64 and rounded once, like the Python floats torch.optim passes
    step_size = (lr / (1.0 - _pow(beta1, step))).to(tl.float32)
    bc2_sqrt = tl.sqrt(1.0 - _pow(beta2, step)).to(tl.float32)
    w1, w2 = (1.0 - beta1).to(tl.float32), (1.0 - beta2).to(tl.float32)
    decay = (1.0 - lr * wd).to(tl.float32)
    b1, b2, wd = beta1.to(tl.float32), beta2.to(tl.float32), wd.to(tl.float32)

    g = _grad_mult(_load_f32(G, offs, mask), MULT, HAS_MULT)
    if MAXIMIZE:
        g = -g
    p = _load_f32(W, offs, mask) if HAS_MASTER else _load_f32(P, offs, mask)
    if DECOUPLED:
        p = p * decay
    else:
        g = g + wd * p
    m = _load_f32(M, offs, mask)
    v = _load_f32(V, offs, mask)
    # torch's lerp for weights < 0.5 (1 - beta1 for any usual beta1): m + w * (g - m)
    m = tl.where(w1 < 0.5, m + w1 * (g - m), g - (g - m) * b1)
    v = v * b2 + w2 * g * g
    p = p - step_size * tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)
    _store_param(P, W, offs, mask, p, HAS_MASTER, EMULATE_RNE)


@triton.jit
def _lamb_consts(META, n, t, BIAS_CORRECTION: tl.constexpr):
    """(beta1, beta2, w1, w2, eps, wd, bc1, bc2) in fp32; meta rows as the LAMB kernels'."""
    beta1, beta2 = _const(META, 8, n, 0), _const(META, 8, n, 1)
    if BIAS_CORRECTION:
        step = tl.load(_ptr(META, 7, n, t, tl.float32, False)).to(tl.float64)
        bc1 = (1.0 - _pow(beta1, step)).to(tl.float32)
        bc2 = (1.0 - _pow(beta2, step)).to(tl.float32)
    else:
        bc1 = tl.full((), 1.0, tl.float32)
        bc2 = bc1
    return (beta1.to(tl.float32), beta2.to(tl.float32), (1.0 - beta1).to(tl.float32),
            (1.0 - beta2).to(tl.float32), _const(META, 8, n, 2).to(tl.float32),
            _const(META, 8, n, 3).to(tl.float32), bc1, bc2)


@triton.jit
def _lamb_update(m, v, p, bc1, bc2, eps, wd):
    return tl.div_rn(tl.div_rn(m, bc1), tl.sqrt_rn(tl.div_rn(v, bc2)) + eps) + wd * p


# meta rows of the LAMB kernels: 0 block starts, 1 numels, 2 params, 3 grads, 4 exp_avgs,
# 5 exp_avg_sqs, 6 masters, 7 steps; constants: beta1, beta2, eps, weight_decay, lr, min_trust,
# max_trust
@triton.jit
def _lamb_stage1_kernel(META, n, MULT, FOUND, PART, P_TY: tl.constexpr, G_TY: tl.constexpr,
                        HAS_MASTER: tl.constexpr, HAS_MULT: tl.constexpr, HAS_FOUND: tl.constexpr,
                        BIAS_CORRECTION: tl.constexpr, LOG_N: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    t, offs, mask = _locate(META, n, LOG_N, BLOCK)
    mask = _skip_mask(mask, FOUND, HAS_FOUND)
    beta1, beta2, w1, w2, eps, wd, bc1, bc2 = _lamb_consts(META, n, t, BIAS_CORRECTION)
    M = _ptr(META, 4, n, t, tl.float32, ALIGNED)
    V = _ptr(META, 5, n, t, tl.float32, ALIGNED)
    g = _grad_mult(_load_f32(_ptr(META, 3, n, t, G_TY, ALIGNED), offs, mask), MULT, HAS_MULT)
    if HAS_MASTER:
        p = _load_f32(_ptr(META, 6, n, t, tl.float32, ALIGNED), offs, mask)
    else:
        p = _load_f32(_ptr(META, 2, n, t, P_TY, ALIGNED), offs, mask)
    m = _load_f32(M, offs, mask) * beta1 + w1 * g
    v = _load_f32(V, offs, mask) * beta2 + w2 * g * g
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)
    u = tl.where(mask, _lamb_update(m, v, p, bc1, bc2, eps, wd), 0.0)
    pid = tl.program_id(0)
    tl.store(PART + 2 * pid, tl.sum(p * p, axis=0))
    tl.store(PART + 2 * pid + 1, tl.sum(u * u, axis=0))


@triton.jit
def _lamb_stage2_kernel(META, n, NORMS, FOUND, P_TY: tl.constexpr, HAS_MASTER: tl.constexpr,
                        HAS_FOUND: tl.constexpr, BIAS_CORRECTION: tl.constexpr, PAPER: tl.constexpr,
                        LOG_N: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr, EMULATE_RNE: tl.constexpr):
    t, offs, mask = _locate(META, n, LOG_N, BLOCK)
    mask = _skip_mask(mask, FOUND, HAS_FOUND)
    beta1, beta2, w1, w2, eps, wd, bc1, bc2 = _lamb_consts(META, n, t, BIAS_CORRECTION)
    pn = tl.sqrt(tl.load(NORMS + 2 * t).to(tl.float64))
    un = tl.sqrt(tl.load(NORMS + 2 * t + 1).to(tl.float64))
    if PAPER:
        phi = tl.minimum(tl.maximum(pn, _const(META, 8, n, 5)), _const(META, 8, n, 6))
        trust = tl.where(un > 0, phi / un, 1.0)
    else:
        trust = tl.where((pn > 0) & (un > 0), pn / un, 1.0)
    ratio = (_const(META, 8, n, 4) * trust).to(tl.float32)
    P = _ptr(META, 2, n, t, P_TY, ALIGNED)
    W = _ptr(META, 6, n, t, tl.float32, ALIGNED)
    p = _load_f32(W, offs, mask) if HAS_MASTER else _load_f32(P, offs, mask)
    m = _load_f32(_ptr(META, 4, n, t, tl.float32, ALIGNED), offs, mask)
    v = _load_f32(_ptr(META, 5, n, t, tl.float32, ALIGNED), offs, mask)
    p = p - ratio * _lamb_update(m, v, p, bc1, bc2, eps, wd)
    _store_param(P, W, offs, mask, p, HAS_MASTER, EMULATE_RNE)


# meta rows of the LARS kernel: 0 block starts, 1 numels, 2 params, 3 grads, 4 momentum buffers,
# 5 masters; constants: lr, momentum, weight_decay, trust_coefficient, eps
@triton.jit
def _lars_kernel(META, n, NORMS, MULT, FOUND, P_TY: tl.constexpr, G_TY: tl.constexpr, HAS_MASTER: tl.constexpr,
                 HAS_MULT: tl.constexpr, HAS_FOUND: tl.constexpr, LOG_N: tl.constexpr, ALIGNED: tl.constexpr,
                 BLOCK: tl.constexpr, EMULATE_RNE: tl.constexpr):
    t, offs, mask = _locate(META, n, LOG_N, BLOCK)
    mask = _skip_mask(mask, FOUND, HAS_FOUND)
    lr, momentum, wd = _const(META, 6, n, 0), _const(META, 6, n, 1), _const(META, 6, n, 2)
    tc, eps = _const(META, 6, n, 3), _const(META, 6, n, 4)
    pn = tl.load(NORMS + t).to(tl.float64)
    gn = tl.load(NORMS + n + t).to(tl.float64)
    if HAS_MULT:
        gn = gn * tl.abs(tl.load(MULT).to(tl.float64))
    local = tl.where((pn > 0) & (gn > 0), tc * pn / (gn + wd * pn + eps), 1.0)
    step = (lr * local).to(tl.float32)
    P = _ptr(META, 2, n, t, P_TY, ALIGNED)
    W = _ptr(META, 5, n, t, tl.float32, ALIGNED)
    B = _ptr(META, 4, n, t, tl.float32, ALIGNED)
    g = _grad_mult(_load_f32(_ptr(META, 3, n, t, G_TY, ALIGNED), offs, mask), MULT, HAS_MULT)
    p = _load_f32(W, offs, mask) if HAS_MASTER else _load_f32(P, offs, mask)
    d = g + wd.to(tl.float32) * p
    b = _load_f32(B, offs, mask) * momentum.to(tl.float32) + step * d
    tl.store(B + offs, b, mask=mask)
    _store_param(P, W, offs, mask, p - b, HAS_MASTER, EMULATE_RNE)


# meta rows: 0 block starts, 1 numels, 2 tensors
@triton.jit
def _sum_squares_kernel(META, n, PART, X_TY: tl.constexpr, LOG_N: tl.constexpr, ALIGNED: tl.constexpr,
                        BLOCK: tl.constexpr):
    t, offs, mask = _locate(META, n, LOG_N, BLOCK)
    x = _load_f32(_ptr(META, 2, n, t, X_TY, ALIGNED), offs, mask)
    tl.store(PART + tl.program_id(0), tl.sum(x * x, axis=0))


@triton.jit
def _segment_sum_kernel(META, n, PART, OUT, WIDTH: tl.constexpr, BLOCK_P: tl.constexpr):
    """OUT[t, k] = sum of PART[b, k] over the blocks b of tensor t (PART is (blocks, WIDTH))."""
    t = tl.program_id(0)
    b0 = tl.load(META + t).to(tl.int32)
    b1 = tl.load(META + t + 1).to(tl.int32)
    for k in tl.static_range(WIDTH):
        acc = tl.zeros((BLOCK_P,), tl.float32)
        for s in range(b0, b1, BLOCK_P):
            idx = s + tl.arange(0, BLOCK_P)
            acc += tl.load(PART + idx * WIDTH + k, mask=idx < b1, other=0.0)
        tl.store(OUT + t * WIDTH + k, tl.sum(acc, axis=0))


# ------------------------------------------------------------------------------------ launchers


def _int64_on(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of values on device; on CUDA copied from pinned memory without a host sync."""
    t = torch.tensor(values, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


class _Table:
    """The meta tensor of one launch: rows of per-tensor entries, then float64 constants."""

    def __init__(self, lists: Sequence[Sequence[torch.Tensor] | None], consts: Sequence[float],
                 device: torch.device):
        first = lists[0]
        self.n = n = len(first)
        blocks = [0]
        for t in first:
            blocks.append(blocks[-1] + cdiv(t.numel(), BLOCK))
        self.blocks = blocks[-1]
        pad = [0]
        rows = blocks + [t.numel() for t in first] + pad
        # aligned: every address is a multiple of 16 bytes (fresh allocations are; views into flat
        # buffers may not be), so the kernels may use 16-byte vector accesses
        self.aligned = True
        for lst in lists:
            ptrs = [t.data_ptr() for t in lst] if lst else [0] * n
            self.aligned = self.aligned and not any(p & 15 for p in ptrs)
            rows += ptrs + pad
        rows += [_f64_bits(c) for c in consts]
        self.meta = _int64_on(rows, device)
        self.log_n = max(1, (n - 1).bit_length())


def _flag(t: torch.Tensor | None, name: str, device: torch.device) -> torch.Tensor | None:
    if t is None:
        return None
    if t.device != device or t.numel() != 1:
        raise RuntimeError(f"zerofuse: expected {name} to be a 1-element tensor on {device}, got shape "
                           f"{tuple(t.shape)} on {t.device}")
    return t.float() if t.dtype != torch.float32 else t


def _steps(steps: Sequence[torch.Tensor], device: torch.device, found: torch.Tensor | None = None,
           advance: bool = False) -> None:
    """Checks the step counters and, with advance, adds 1 to each distinct one (0 when found != 0),
    on the device: no host sync."""
    for i, s in enumerate(steps):
        if s.device != device or s.dtype != torch.float32 or s.numel() != 1:
            raise RuntimeError(f"zerofuse: expected steps[{i}] to be a 1-element float32 tensor on {device} "
                               f"(the Triton kernels read step counts on the device), got {s.dtype} "
                               f"{tuple(s.shape)} on {s.device}")
    if advance and steps:
        distinct = list({s.data_ptr(): s for s in steps}.values())
        if found is None:
            torch._foreach_add_(distinct, 1.0)
        else:
            # any nonzero flag skips; a list of device tensors, as the scalar-tensor overload reads
            # its scalar on the host (a sync, caught by torch's sync debug mode on an H100)
            inc = (found == 0).float().reshape(())
            torch._foreach_add_(distinct, [inc] * len(distinct))


def _moment_tables(params, grads, exp_avgs, exp_avg_sqs, masters, steps, consts, device):
    """(indices, table) per (param dtype, grad dtype) group, meta rows as the Adam / LAMB kernels'."""
    for idx in _groups(params, grads):
        pick = lambda lst: [lst[i] for i in idx] if lst else None  # noqa: E731
        yield idx, _Table([pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), pick(masters),
                           pick(steps)], consts, device)


def adam(params, grads, exp_avgs, exp_avg_sqs, masters, steps, *, lr, beta1, beta2, eps, weight_decay,
         decoupled, maximize, grad_mult=None, found_inf=None):
    """One launch per (param dtype, grad dtype) group; lists already checked by the op layer."""
    if not params:
        return
    device = params[0].device
    mult, found = _flag(grad_mult, "grad_mult", device), _flag(found_inf, "found_inf", device)
    _steps(steps, device, found, advance=True)
    consts = [lr, beta1, beta2, eps, weight_decay]
    for idx, tab in _moment_tables(params, grads, exp_avgs, exp_avg_sqs, masters, steps, consts, device):
        if tab.blocks:
            _adam_kernel[(tab.blocks,)](
                tab.meta, tab.n, mult, found, P_TY=_TL[params[idx[0]].dtype], G_TY=_TL[grads[idx[0]].dtype],
                HAS_MASTER=bool(masters), HAS_MULT=mult is not None, HAS_FOUND=found is not None,
                DECOUPLED=decoupled, MAXIMIZE=maximize, LOG_N=tab.log_n, ALIGNED=tab.aligned, BLOCK=BLOCK,
                EMULATE_RNE=interpreted(), num_warps=_NUM_WARPS,
            )


def _rows(idx: list[int], device: torch.device):
    """An index for rows idx of a device tensor without a host sync: a slice when they are
    consecutive (one dtype group), else an index tensor copied from pinned memory."""
    if idx == list(range(idx[0], idx[0] + len(idx))):
        return slice(idx[0], idx[0] + len(idx))
    return _int64_on(idx, device)


def _groups(params, grads) -> list[list[int]]:
    """Indices of the tensors sharing a param dtype and a grad dtype (one launch each)."""
    out: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        out.setdefault((p.dtype, grads[i].dtype if grads else None), []).append(i)
    return list(out.values())


def _segment_sums(tab: _Table, part: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.empty((tab.n, width), device=part.device, dtype=torch.float32)
    if tab.n:
        _segment_sum_kernel[(tab.n,)](tab.meta, tab.n, part, out, WIDTH=width, BLOCK_P=1024)
    return out


def lamb_stage1(params, grads, exp_avgs, exp_avg_sqs, masters, steps, *, beta1, beta2, eps, weight_decay,
                bias_correction, grad_mult, found_inf, norms):
    if not params:
        return
    device = params[0].device
    mult, found = _flag(grad_mult, "grad_mult", device), _flag(found_inf, "found_inf", device)
    _steps(steps, device, found, advance=True)
    consts = [beta1, beta2, eps, weight_decay]
    for idx, tab in _moment_tables(params, grads, exp_avgs, exp_avg_sqs, masters, steps, consts, device):
        part = torch.zeros((tab.blocks, 2), device=device, dtype=torch.float32)
        if tab.blocks:
            _lamb_stage1_kernel[(tab.blocks,)](
                tab.meta, tab.n, mult, found, part, P_TY=_TL[params[idx[0]].dtype], G_TY=_TL[grads[idx[0]].dtype],
                HAS_MASTER=bool(masters), HAS_MULT=mult is not None, HAS_FOUND=found is not None,
                BIAS_CORRECTION=bias_correction, LOG_N=tab.log_n, ALIGNED=tab.aligned, BLOCK=BLOCK,
                num_warps=_NUM_WARPS,
            )
        sums = _segment_sums(tab, part, 2)
        rows = _rows(idx, device)
        if found is None:
            norms[rows] = sums
        else:  # a skipped step leaves norms as they were, like the CPU kernel
            norms[rows] = torch.where(found != 0, norms[rows], sums)


def lamb_stage2(params, exp_avgs, exp_avg_sqs, masters, steps, norms, *, lr, beta1, beta2, eps, weight_decay,
                bias_correction, trust_mode, min_trust, max_trust, found_inf):
    if not params:
        return
    device = params[0].device
    _steps(steps, device)
    found = _flag(found_inf, "found_inf", device)
    consts = [beta1, beta2, eps, weight_decay, lr, min_trust, max_trust]
    for idx, tab in _moment_tables(params, None, exp_avgs, exp_avg_sqs, masters, steps, consts, device):
        sub = norms[_rows(idx, device)].contiguous()
        if tab.blocks:
            _lamb_stage2_kernel[(tab.blocks,)](
                tab.meta, tab.n, sub, found, P_TY=_TL[params[idx[0]].dtype], HAS_MASTER=bool(masters),
                HAS_FOUND=found is not None, BIAS_CORRECTION=bias_correction, PAPER=trust_mode == 0,
                LOG_N=tab.log_n, ALIGNED=tab.aligned, BLOCK=BLOCK, EMULATE_RNE=interpreted(), num_warps=_NUM_WARPS,
            )


def lars(params, grads, momentum_buffers, masters, norms, *, lr, momentum, weight_decay, trust_coefficient, eps,
         grad_mult, found_inf):
    if not params:
        return
    device = params[0].device
    n = len(params)
    mult, found = _flag(grad_mult, "grad_mult", device), _flag(found_inf, "found_inf", device)
    for idx in _groups(params, grads):
        tab = _Table([[params[i] for i in idx], [grads[i] for i in idx], [momentum_buffers[i] for i in idx],
                      [masters[i] for i in idx] if masters else None],
                     [lr, momentum, weight_decay, trust_coefficient, eps], device)
        sub = torch.cat([norms[_rows(idx, device)], norms[_rows([n + i for i in idx], device)]])
        if tab.blocks:
            _lars_kernel[(tab.blocks,)](
                tab.meta, tab.n, sub, mult, found, P_TY=_TL[params[idx[0]].dtype], G_TY=_TL[grads[idx[0]].dtype],
                HAS_MASTER=bool(masters), HAS_MULT=mult is not None, HAS_FOUND=found is not None,
                LOG_N=tab.log_n, ALIGNED=tab.aligned, BLOCK=BLOCK, EMULATE_RNE=interpreted(), num_warps=_NUM_WARPS,
            )


def l2norm(tensors, per_tensor: bool):
    """(norm of all, (n,) norms or (0,)), fp32 on the tensors' device."""
    device = tensors[0].device if tensors else torch.device("cpu")
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    parts = []
    for dtype, idx in by_dtype.items():
        tab = _Table([[tensors[i] for i in idx]], [], device)
        part = torch.empty(tab.blocks, device=device, dtype=torch.float32)
        if tab.blocks:
            _sum_squares_kernel[(tab.blocks,)](tab.meta, tab.n, part, X_TY=_TL[dtype], LOG_N=tab.log_n,
                                               ALIGNED=tab.aligned, BLOCK=BLOCK, num_warps=_NUM_WARPS)
        parts.append(_segment_sums(tab, part, 1).view(-1))
    # the sums in dtype-group order; no indexed writes (their index would be a synchronising copy)
    sums = torch.cat(parts) if parts else torch.zeros(0, device=device)
    total = sums.sum().sqrt()
    if not per_tensor:
        return total, sums.new_empty(0)
    order = [i for idx in by_dtype.values() for i in idx]
    if order != list(range(len(order))):  # dtypes interleave: each tensor's sum back at its index
        inverse = [0] * len(order)
        for pos, i in enumerate(order):
            inverse[i] = pos
        sums = sums[_rows(inverse, device)]
    return total, sums.sqrt()
