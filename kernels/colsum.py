"""Column sums of per-program partials: the weight/bias gradients of the norms and of bias + GELU.

A kernel whose programs each own a group of rows accumulates its rows' column sums in fp32 and
stores them as one row of a partials array P (n_parts, N). The sums Out[c] = sum_p P[p, c] are
then formed in a fixed order (parts in chunks of BLOCK_P, each chunk by tl.sum), so the result is
deterministic, whichever program finishes last. Two ways to form them:

- in the same launch (``_arrive`` + ``_sum_cols``): each program, after storing its partials, takes
  a ticket from an arrival counter (one int32 per device and stream, zero between kernels); the
  program that draws the last ticket sums every column and puts the counter back to zero. One
  launch instead of two, at the cost of one program reading all of P: used while P is small
  (``one_launch``: at most ONE_LAUNCH_FLOATS partials);
- in a second launch (``sum_partials``): column blocks in parallel, for wide rows.

Ordering (CUDA sample "threadFenceReduction"; PTX memory model): every thread's partial stores
come before a CTA barrier, the ticket is an acq_rel atomic at GPU scope (release publishes the
CTA's stores, acquire in the last program makes every other program's visible), and the last
program reads the partials with ``.cg`` loads (L2, not a possibly stale L1 line).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from zerofuse.kernels import env, interpreted
from zerofuse.kernels.common import _cast, cdiv, next_power_of_2
from zerofuse.kernels.launch import launch_triton

# Partials one program may sum at the end of a kernel: 256K fp32 (1 MiB, from L2), e.g. 341 parts of
# a 768-wide row. Beyond it the second launch's parallel column blocks win. A first guess from the
# H200's per-SM L2 bandwidth (~100-200 GB/s: 5-10 µs for 1 MiB) against a launch's 15-25 µs of
# host time (bench/results/h200-2026-11-26); to be swept on a GPU. ZEROFUSE_ONE_LAUNCH_FLOATS sets
# it (0: every sum in a second launch, the way back should the one-launch form fail on a GPU).
ONE_LAUNCH_FLOATS = env.number("ZEROFUSE_ONE_LAUNCH_FLOATS", 1 << 18)


def one_launch(n_parts: int, n: int) -> bool:
    return n_parts * n <= ONE_LAUNCH_FLOATS


def max_parts(n: int, cap: int) -> int:
    """The most partial rows of width n a kernel should make, at most ``cap``: as many as fit in
    one program's final sum, but never fewer than the second launch would be given."""
    return max(1, min(cap, max(ONE_LAUNCH_FLOATS // max(n, 1), cap // 4)))


_COUNTERS: dict = {}


def arrival_counter(device: torch.device, stream=None) -> torch.Tensor | None:
    """The int32 arrival counter of ``stream`` (default: ``device``'s current stream): kernels of one
    stream run one after the other, and each leaves the counter at zero; another stream's kernel
    could overlap, so it gets its own. Made once, zero-filled. None when it does not exist yet and
    the stream is capturing a CUDA graph: made there, its zero-fill would run only when the graph
    is replayed, and an eager kernel on that stream before then would find garbage; the caller
    sums in a second launch instead (zerofuse.train's graphed step makes its capture stream's
    counter before capturing)."""
    if device.type == "cuda":
        stream = stream if stream is not None else torch.cuda.current_stream(device)
        key = (device.type, device.index, stream.cuda_stream)
    else:
        key = (device.type, device.index, 0)
    counter = _COUNTERS.get(key)
    if counter is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        with torch.cuda.stream(stream) if device.type == "cuda" else contextlib.nullcontext():
            counter = _COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


@triton.jit
def _arrive(Counter, n_parts):
    """Whether this program is the last of n_parts to arrive (call once per program, after its
    partials are stored). The last one resets the counter."""
    tl.debug_barrier()  # every thread's partial stores before the release
    ticket = tl.atomic_add(Counter, 1, sem="acq_rel", scope="gpu")
    last = ticket == n_parts - 1
    if last:
        tl.store(Counter, 0)
    return last


@triton.jit
def _sum_cols(P, Out, n_parts, N, col0, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """Out[c] = sum_p P[p, c] for the BLOCK_N columns from col0, parts in a fixed order."""
    cols = col0 + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        parts = p0 + tl.arange(0, BLOCK_P)
        mask = (parts < n_parts)[:, None] & col_mask[None, :]
        acc += tl.sum(tl.load(P + parts[:, None] * N + cols[None, :], mask=mask, other=0.0, cache_modifier=".cg"),
                      axis=0)
    tl.store(Out + cols, _cast(acc, Out.dtype.element_ty, EMULATE_RNE), mask=col_mask)


@triton.jit
def _sum_all_cols(P, Out, n_parts, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """Every column of Out, by one program (the last to arrive)."""
    for col0 in range(0, N, BLOCK_N):
        _sum_cols(P, Out, n_parts, N, col0, BLOCK_P, BLOCK_N, EMULATE_RNE)


@triton.jit
def _last_sums(Counter, arrivals, n_parts, N, P1, O1, P2, O2, P3, O3, HAS1: tl.constexpr, HAS2: tl.constexpr,
               HAS3: tl.constexpr, SUM_P: tl.constexpr, SUM_N: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """The end of a one-launch kernel whose programs stored up to three partial arrays (n_parts, N):
    the last of ``arrivals`` programs sums each present one into its output."""
    if _arrive(Counter, arrivals):
        if HAS1:
            _sum_all_cols(P1, O1, n_parts, N, SUM_P, SUM_N, EMULATE_RNE)
        if HAS2:
            _sum_all_cols(P2, O2, n_parts, N, SUM_P, SUM_N, EMULATE_RNE)
        if HAS3:
            _sum_all_cols(P3, O3, n_parts, N, SUM_P, SUM_N, EMULATE_RNE)


@triton.jit
def _sum_partials_kernel(P, Out, n_parts, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE_RNE: tl.constexpr):
    _sum_cols(P, Out, n_parts, N, tl.program_id(0) * BLOCK_N, BLOCK_P, BLOCK_N, EMULATE_RNE)


def blocks(n_parts: int, n: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_N) of a column sum, the same in one launch and two, so both add in one order.
    On a GPU: narrow column blocks, so that many programs share the second launch's reads. With 256
    columns a 768-wide LayerNorm's 528 x 768 partials were summed by 3 programs in ~42 µs a call on
    an H200 (bench/results/h200-2026-11-26: 2.1 ms of a gpt2-124m step); 32 columns give 24
    programs of 128 x 32 tiles (128-byte rows, coalesced). The interpreter pays per program: wide
    blocks."""
    block_n = min(next_power_of_2(n), 65536 if interpreted() else 32)
    block_p = min(next_power_of_2(n_parts), 64 if interpreted() else 128)
    return block_p, block_n


def partials(n_parts: int, n: int, device: torch.device, want: bool) -> torch.Tensor | None:
    return torch.empty((n_parts, n), device=device, dtype=torch.float32) if want else None


def sum_partials(part: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """The column sums of ``part`` (n_parts, N) fp32 in ``dtype``, by a second launch."""
    if part is None:
        return None
    n_parts, n = part.shape
    out = torch.empty(n, device=part.device, dtype=dtype)
    block_p, block_n = blocks(n_parts, n)
    launch_triton(_sum_partials_kernel, (cdiv(n, block_n),), part, out, n_parts, n, BLOCK_P=block_p, BLOCK_N=block_n,
                  EMULATE_RNE=interpreted())
    return out
