"""The 2-norm of many tensors (l2norm) and the inputs of a clipped step (clip_inputs: norm, skip
flag, grad multiplier) in Triton, over the multi-tensor tables of multi_tensor.py: one
sum-of-squares pass per dtype group (the persistent grid, [Note: persistent grid]) writes a partial
per block; per-tensor sums (segment_sums) or one single-program kernel (_clip_kernel) add them in a
fixed order: deterministic, no host sync.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zerofuse.kernels.multi_tensor import KEEP, Launch, _blocks, _go, _ld, _ptr, _Table, _visit, flag
from zerofuse.kernels.launch import launch_triton


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
def _sum_squares_kernel(META, OWN, n, nblocks, PART, MULT, mult_from, X_TY: tl.constexpr, ALIGNED: tl.constexpr,
                        BLOCK: tl.constexpr, HAS_MULT: tl.constexpr, INVERT: tl.constexpr):
    """PART[b] = the sum of squares of block b (the grads of a clipped step: read again by the
    step, so left in L2 with the default policy). HAS_MULT: the tensors from index mult_from on
    are multiplied by MULT[0] (1 / MULT[0] with INVERT) before they are squared: a loss-scaled
    grad's squares overflowed fp32 where the unscaled grad's did not."""
    m = tl.full((), 1.0, tl.float32)
    if HAS_MULT:
        m = tl.load(MULT)
        if INVERT:
            m = tl.div_rn(tl.full((), 1.0, tl.float32), m)
    first, stride, t_next = _blocks(OWN, nblocks)
    for i in range(first, nblocks, stride):
        b, t, t_next, start, numel = _visit(META, OWN, n, i, stride, nblocks, t_next, BLOCK, False)
        X = _ptr(META, 3, n, t, X_TY, ALIGNED)
        offs = start + tl.arange(0, BLOCK)
        if start + BLOCK <= numel:
            x = _ld(X, offs, offs < numel, False, KEEP)
        else:
            x = _ld(X, offs, offs < numel, True, KEEP)
        if HAS_MULT:
            x = x * tl.where(tl.load(META + 2 * (n + 1) + t) >= mult_from, m, 1.0)
        tl.store(PART + b, tl.sum(x * x, axis=0))


@triton.jit
def _clip_kernel(PART, nblocks, OUT, SCALE, FOUND, max_norm, eps, HAS_SCALE: tl.constexpr, HAS_FOUND: tl.constexpr,
                 TORCH_RULE: tl.constexpr, BLOCK_P: tl.constexpr):
    """One program: OUT = (norm, found, mult) from the per-block sums of squares of the grads
    divided by the scale (_sum_squares_kernel's INVERT), in a fixed order. norm = sqrt(sum); found
    = 1 when norm is not finite or FOUND != 0;
    mult = (1 / scale) * max_norm / max(norm, max_norm): the grad multiplier of the update; with
    TORCH_RULE torch.nn.utils.clip_grad_norm_'s coefficient min(max_norm / (norm + eps), 1) instead."""
    norm = tl.sqrt_rn(_sum_blocks(PART, 0, nblocks, 0, 1, BLOCK_P))
    inv = tl.full((), 1.0, tl.float32)
    if HAS_SCALE:
        inv = tl.div_rn(inv, tl.load(SCALE))
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


def segment_sums(table: _Table, part: torch.Tensor, out: torch.Tensor, found: torch.Tensor | None) -> None:
    """out[index[t]] = the sums of part's rows over each tensor t's blocks (_segment_sum_kernel)."""
    if table.n:
        # the fused LAMB's warps: the same per-thread grouping of the block sums, so the same bits
        launch_triton(_segment_sum_kernel, (table.n,), table.meta, table.n, part, out, found,
                      HAS_FOUND=found is not None, WIDTH=part.shape[1], BLOCK_P=1024, num_warps=table.warps)


def block_sums(launch: Launch, mult: torch.Tensor | None = None, mult_from: int = 0,
               invert: bool = False) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """Per-block sums of squares of every group's tensors of a norm_launch, in one buffer (at least
    one entry, kept on the launch between calls): (buffer, each group's (blocks, 1) view of it,
    number of blocks). l2norm sums the views per tensor, clip_inputs the whole buffer. mult: a
    1-element fp32 tensor on the device the tensors from index mult_from on are multiplied by
    (divided by, with invert) before they are squared."""
    if launch.block_sum_buf is None:
        total = sum(table.blocks for table, _, _ in launch.groups)
        flat = torch.empty(max(1, total), device=launch.device, dtype=torch.float32)
        views, off = [], 0
        for table, _, _ in launch.groups:
            views.append(flat[off:off + table.blocks].view(-1, 1))
            off += table.blocks
        launch.block_sum_buf = (flat, views, total)
    flat, views, total = launch.block_sum_buf
    for (table, x_ty, _), part in zip(launch.groups, views):
        if table.blocks:
            launch_triton(_sum_squares_kernel, (table.programs,), table.meta, table.own, table.n, table.blocks, part,
                          mult, int(mult_from), X_TY=x_ty, ALIGNED=table.aligned, BLOCK=table.block,
                          HAS_MULT=mult is not None, INVERT=invert, num_warps=table.warps)
    return flat, views, total


def norm_launch(tensors) -> Launch:
    """The Launch of l2norm: one group per dtype."""
    return Launch(tensors, None, [])


def l2norm(launch: Launch, per_tensor: bool, mult: torch.Tensor | None = None, mult_from: int = 0):
    """(norm of all, (n,) norms or (0,)), fp32 on the tensors' device; mult: block_sums'."""
    device = launch.device
    sums = torch.zeros(launch.n, device=device, dtype=torch.float32)
    for (table, _, _), part in zip(launch.groups, block_sums(launch, flag(mult, "mult", device), mult_from)[1]):
        if table.blocks:
            segment_sums(table, part, sums, None)
    total = sums.sum().sqrt()
    return total, sums.sqrt() if per_tensor else sums.new_empty(0)


def clip_inputs(launch: Launch, max_norm: float, grad_scale: torch.Tensor | None,
                found_inf: torch.Tensor | None, eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad multiplier, skip flag, norm), 1-element fp32 views on the device: the global norm of
    the tensors of a norm_launch divided by grad_scale, the flag (norm not finite, or found_inf !=
    0) and (1 / grad_scale) * max_norm / max(norm, max_norm). One sum-of-squares launch per dtype
    group and one single-program launch, no host sync."""
    device = launch.device
    scale, found = flag(grad_scale, "grad_scale", device), flag(found_inf, "found_inf", device)
    flat, _, nblocks = block_sums(launch, scale, 0, invert=True)  # (the grads unscaled before their squares)
    out = torch.empty(3, device=device, dtype=torch.float32)
    launch_triton(_clip_kernel, (1,), flat, nblocks, out, scale, found, float(max_norm), float(eps or 0.0),
           HAS_SCALE=scale is not None, HAS_FOUND=found is not None, TORCH_RULE=eps is not None, BLOCK_P=1024,
           num_warps=4)
    return out[2:3], out[1:2], out[0:1]
