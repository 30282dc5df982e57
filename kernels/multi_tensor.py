"""The multi-tensor machinery of the optimizer kernels (optim.py: Adam/AdamW and LARS, lamb.py,
l2norm.py): launch tables, the persistent grid, step counters, per-tensor sums. The math is that of
the C++ CPU kernels (csrc/cpu/adam.cpp, lamb.cpp, lars.cpp, l2norm.cpp) and of zerofuse.reference,
element for element in fp32 with IEEE-rounded division and square root (div_rn / sqrt_rn; `/` and
tl.sqrt are approximate on GPUs).

One launch covers every tensor of a list (of one param dtype and grad dtype), in blocks of BLOCK
elements of one tensor. A table in one int64 tensor ("meta") holds, per tensor, its first block,
element count, position in the caller's list (where its norms go) and data pointers; a second int32
tensor ("own") names the tensor of each block, so a program finds its tensor with one load. The
hyper-parameters come in a float64 tensor (Triton passes Python floats as fp32). Per-tensor sums
(LAMB, norms) are written per block and added per tensor by a second small kernel in a fixed order:
deterministic.

[Note: persistent grid] A streaming kernel launched with one program per block pays, per block, a
chain of dependent loads before its data loads can start (own -> the tensor's table row -> data),
plus the block's scalar set-up; on an H100/H200 those ~1-2 us per block of 4096 fp32 params (114 KB
of AdamW traffic) were of the order of its streaming time, with one 196-register program resident
per SM (AdamW reached 0.47-0.60 of the copy bandwidth). So blocks are BLOCK = 2048 elements (64-128
registers: two 8-warp programs resident per SM) and the launches run `programs()` programs
(PROGRAMS_PER_SM per SM, as many as stay resident together: checked from ptxas's register counts by
tests/test_optim_grid.py), each looping over blocks pid, pid + programs, ...
and loading the next block's tensor index while the current block streams. ZEROFUSE_OPTIM_GRID=flat
gives one program per block (the loop then runs once: the same code, the same results bit for bit).

Vector access: a block that lies wholly inside its tensor runs unmasked, so with 16-byte aligned
addresses (`_Table.aligned`, told to the compiler by tl.multiple_of) its loads and stores are
16-byte vectors; only each tensor's last block is masked. (A mask against a runtime element count
makes every access a 4-byte one: checked in the PTX, tests/test_optim_flat.py.) A skipped step
(found_inf != 0) is a uniform branch, not a mask, for the same reason.

[Note: step scalars] Step counts live in 1-element fp32 tensors on the device (torch's fused
optimizers do the same). One tiny launch per step (`Launch.advance`, `_steps_kernel`) advances every
distinct counter by (found_inf == 0) and writes, per counter, the fp32 scalars derived from it in
float64 (bias corrections 1 - beta^step by exponentiation by squaring, lr / bc1, sqrt(bc2)) into a
row the table points to; the streaming kernels load those four floats instead of running the
40-step float64 power chain in every program (ptxas for sm_90: 258 float64 instructions in the Adam
kernel before, 10 after: the constants' loads and conversions).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from zerofuse.kernels import env
from zerofuse.kernels.common import _cast, cdiv, sm_count, upload
from zerofuse.kernels.launch import launch_triton

BLOCK = 2048
_NUM_WARPS = 8
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# meta rows, each n + 1 entries: 0 block starts (the last entry is the total), 1 numels, 2 positions
# in the caller's list, then one row of data pointers per list (3 + k); the last row of a Launch with
# step counters points at each tensor's step-scalars row ([Note: step scalars])

# [Note: persistent grid]: resident programs per SM (8 warps each; tests/test_optim_grid.py checks that
# ptxas's register counts for sm_90 let this many stay resident: 2 x 256 threads x <= 128 registers)
PROGRAMS_PER_SM = 2
_INTERPRETER_PROGRAMS = 3  # on CPU (the interpreter): enough to run the loop with a stride

# cache hints of the streaming loads and stores (tl.load's eviction_policy): STREAM for data the
# step does not read again, KEEP (the default policy) for what a later pass re-reads from L2
STREAM = tl.constexpr("evict_first")
KEEP = tl.constexpr("")


def _grid_from_env() -> str:
    return env.choice("ZEROFUSE_OPTIM_GRID", "persistent", {"persistent": "a few programs per SM looping over blocks",
                                                            "flat": "one program per block"})


GRID = _grid_from_env()


def programs(blocks: int, device: torch.device) -> int:
    """How many programs a streaming launch over `blocks` blocks runs ([Note: persistent grid])."""
    if GRID == "flat" or blocks <= 1:
        return blocks
    if device.type == "cuda":
        return min(blocks, PROGRAMS_PER_SM * sm_count(device))
    return min(blocks, _INTERPRETER_PROGRAMS)


# ------------------------------------------------------------------------------------ device helpers


@triton.jit
def _blocks(OWN, nblocks, BACKWARDS: tl.constexpr = False):
    """(first block, stride, tensor of the first block) of this program's loop over blocks; the
    loop runs b = first, first + stride, ... < nblocks and visits block b (BACKWARDS: nblocks - 1
    - b, so a pass after another over the same data starts with what is in L2)."""
    pid = tl.program_id(0)
    return pid, tl.num_programs(0), tl.load(OWN + _block(pid, nblocks, BACKWARDS))


@triton.jit
def _block(b, nblocks, BACKWARDS: tl.constexpr):
    if BACKWARDS:
        b = nblocks - 1 - b
    return b


@triton.jit
def _next_owner(OWN, b, stride, nblocks, BACKWARDS: tl.constexpr):
    """The tensor of this program's next block (loaded while this block streams)."""
    return tl.load(OWN + _block(tl.minimum(b + stride, nblocks - 1), nblocks, BACKWARDS))


@triton.jit
def _span(META, n, t, blk, BLOCK: tl.constexpr):
    """(first element offset of block blk in tensor t, numel of t)."""
    return (blk - tl.load(META + t)) * BLOCK, tl.load(META + (n + 1) + t)


@triton.jit
def _visit(META, OWN, n, i, stride, nblocks, t_next, BLOCK: tl.constexpr, BACKWARDS: tl.constexpr):
    """Step i of a program's loop (for i in range(first, nblocks, stride), after _blocks):
    (block, its tensor, the next step's tensor (prefetched), first element offset, numel)."""
    b = _block(i, nblocks, BACKWARDS)
    start, numel = _span(META, n, t_next, b, BLOCK)
    return b, t_next, _next_owner(OWN, i, stride, nblocks, BACKWARDS), start, numel


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
def _ld(ptr, offs, mask, MASKED: tl.constexpr, EVICT: tl.constexpr):
    if MASKED:
        x = tl.load(ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT)
    else:
        x = tl.load(ptr + offs, eviction_policy=EVICT)
    return x.to(tl.float32)


@triton.jit
def _st(ptr, offs, x, mask, MASKED: tl.constexpr, EVICT: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, x, mask=mask, eviction_policy=EVICT)
    else:
        tl.store(ptr + offs, x, eviction_policy=EVICT)


@triton.jit
def _store_param(P, W, offs, mask, p, HAS_MASTER: tl.constexpr, MASKED: tl.constexpr, EMULATE_RNE: tl.constexpr,
                 EVICT: tl.constexpr):
    if HAS_MASTER:
        _st(W, offs, p, mask, MASKED, EVICT)
    _st(P, offs, _cast(p, P.dtype.element_ty, EMULATE_RNE), mask, MASKED, EVICT)


@triton.jit
def _grad_mult(g, MULT, HAS_MULT: tl.constexpr):
    if HAS_MULT:
        g = g * tl.load(MULT)
    return g


@triton.jit
def _steps_kernel(STEPS, k, CONSTS, ROWS, FOUND, B1_AT: tl.constexpr, LR_AT: tl.constexpr, ADVANCE: tl.constexpr,
                  HAS_FOUND: tl.constexpr, BLOCK_K: tl.constexpr):
    """[Note: step scalars] One program: for each of the k step counters (addresses in STEPS),
    step += (FOUND == 0) when ADVANCE, and ROWS[i] = (bc1, bc2, lr / bc1, sqrt(bc2)) in fp32 from
    float64, with bc = 1 - beta^step, beta1 = CONSTS[B1_AT], beta2 = CONSTS[B1_AT + 1], lr =
    CONSTS[LR_AT] (LR_AT < 0: no lr, entry 2 is 0)."""
    beta1, beta2 = tl.load(CONSTS + B1_AT), tl.load(CONSTS + B1_AT + 1)
    if HAS_FOUND:
        inc = (tl.load(FOUND) == 0).to(tl.float32)
    else:
        inc = tl.full((), 1.0, tl.float32)
    for s0 in range(0, k, BLOCK_K):
        i = s0 + tl.arange(0, BLOCK_K)
        mask = i < k
        ptr = tl.load(STEPS + i, mask=mask, other=0).to(tl.pointer_type(tl.float32))
        step = tl.load(ptr, mask=mask, other=0.0)
        if ADVANCE:
            step = step + inc
            tl.store(ptr, step, mask=mask)
        s = step.to(tl.float64)
        bc1 = 1.0 - _pow(beta1, s)
        bc2 = 1.0 - _pow(beta2, s)
        if LR_AT >= 0:  # (bc1 is 0 at step 0: only where no update reads it, a skipped first step or a mask)
            step_size = (tl.load(CONSTS + LR_AT) / tl.where(bc1 != 0.0, bc1, 1.0)).to(tl.float32)
        else:
            step_size = tl.zeros((BLOCK_K,), tl.float32)
        tl.store(ROWS + 4 * i, bc1.to(tl.float32), mask=mask)
        tl.store(ROWS + 4 * i + 1, bc2.to(tl.float32), mask=mask)
        tl.store(ROWS + 4 * i + 2, step_size, mask=mask)
        tl.store(ROWS + 4 * i + 3, tl.sqrt(bc2).to(tl.float32), mask=mask)


# ------------------------------------------------------------------------------------ host side


def _int64_on(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of values on device; on CUDA copied from pinned memory without a host sync."""
    return upload(torch.tensor(values, dtype=torch.int64), device)


# tables that depend only on a layout (the tensors' sizes) and the device, kept for recent layouts
_LAYOUTS_KEPT = 64
_OWNERS: OrderedDict = OrderedDict()  # the block -> tensor map: 4 bytes per block


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
    return _kept(_OWNERS, (numels, tuple(blocks), device), make)  # the block starts: BLOCK may change


class _Table:
    """The launch tables of one list of tensors: meta (rows above) and own (the tensor of each block)."""

    def __init__(self, lists: Sequence[Sequence[torch.Tensor] | None], device: torch.device,
                 index: Sequence[int] | None = None):
        first = lists[0]
        self.n = n = len(first)
        # the block size and warps of the launches over this table (module values read here, so
        # that bench_optimizers' sweep can set them before it builds an optimizer)
        self.block, self.warps = BLOCK, _NUM_WARPS
        numels = tuple(t.numel() for t in first)
        blocks = [0]
        for k in numels:
            blocks.append(blocks[-1] + cdiv(k, self.block))
        self.blocks = blocks[-1]
        self.programs = programs(self.blocks, device)
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
        self.numels, self.block_starts = numels, blocks


def _groups(params, grads) -> list[list[int]]:
    """Indices of the tensors sharing a param dtype and a grad dtype (one launch each)."""
    out: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        out.setdefault((p.dtype, grads[i].dtype if grads else None), []).append(i)
    return list(out.values())


class Launch:
    """What the launches over some lists need: per (param dtype, grad dtype) group a table and its
    dtypes, the distinct step counters and their scalars rows ([Note: step scalars]), per-block
    scratch, and the constants tensor. Depends only on the tensors' dtypes, sizes and addresses, so
    a caller that knows those unchanged may reuse it across steps (zerofuse.ops._optim.Prepared).
    With steps, the tables' last pointer row points at each tensor's scalars row."""

    def __init__(self, params, grads, others: Sequence[Sequence[torch.Tensor] | None], steps=None):
        self.device = params[0].device if params else torch.device("cpu")
        self.n = len(params)
        self.steps = _check_steps(steps, self.device) if steps is not None else []
        if steps is not None:
            where = {s.data_ptr(): j for j, s in enumerate(self.steps)}
            self.step_rows = torch.zeros((max(1, len(self.steps)), 4), device=self.device, dtype=torch.float32)
            self.step_ptrs = _int64_on([s.data_ptr() for s in self.steps] or [0], self.device)
            others = list(others) + [[self.step_rows[where[s.data_ptr()]] for s in steps]]
        self.groups = []
        for idx in _groups(params, grads):
            pick = lambda lst: [lst[i] for i in idx] if lst else None  # noqa: E731
            table = _Table([pick(params), pick(grads)] + [pick(lst) for lst in others], self.device, idx)
            self.groups.append((table, _TL[params[idx[0]].dtype], _TL[grads[idx[0]].dtype] if grads else None))
        self._consts: dict[int, tuple[tuple, torch.Tensor]] = {}
        self._part: dict[tuple[int, int], torch.Tensor] = {}
        self.block_sum_buf: tuple[torch.Tensor, list[torch.Tensor], int] | None = None  # l2norm.block_sums
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

    def advance(self, consts: torch.Tensor, found: torch.Tensor | None, *, b1_at: int, lr_at: int = -1,
                advance: bool = True) -> None:
        """[Note: step scalars]: one launch that adds 1 to each step counter (0 when found != 0,
        read on the device: no host sync; advance=False: none) and writes their scalars rows from
        consts (beta1 at b1_at, beta2 after it, lr at lr_at)."""
        if not self.steps:
            return
        launch_triton(_steps_kernel, (1,), self.step_ptrs, len(self.steps), consts, self.step_rows, found, B1_AT=b1_at,
                      LR_AT=lr_at, ADVANCE=advance, HAS_FOUND=found is not None, BLOCK_K=128, num_warps=4)

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


def flag(t: torch.Tensor | None, name: str, device: torch.device) -> torch.Tensor | None:
    """A 1-element flag or multiplier (found_inf, grad_mult, grad_scale) as fp32 on device, or None."""
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
