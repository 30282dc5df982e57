"""Flash attention in Triton, forward and backward (Dao et al. 2022; Dao 2023), never materialising
the N x N score matrix.

Layout (B, H, N, D) like torch.nn.functional.scaled_dot_product_attention; any strides. Grouped
query attention: Hq = G * Hkv, query head h reads key/value head h // G (no copies of k/v).
Causal masking is torch's (top-left aligned: query i sees keys 0..i, also when Nq != Nk).

Forward, per block of BLOCK_M query rows, over blocks of BLOCK_N keys (online softmax, base 2):
    s = q k^T * scale * log2(e);  m' = max(m, rowmax s);  p = 2^(s - m')
    l = l * 2^(m - m') + rowsum p;  acc = acc * 2^(m - m') + p v;  m = m'
    out = acc / l,  lse = (m + log2 l) * ln 2     (natural log-sum-exp of the scaled scores, fp32)
Backward recomputes p = exp(q k^T * scale - lse) blockwise, with delta = rowsum(dout * out) formed
by the dq kernel for its rows and read by the dk/dv kernel after it (kernels/attention_bwd.py):
    dv = p^T dout;  dp = dout v^T;  ds = p * (dp - delta);  dq = ds k * scale;  dk = ds^T q * scale
dk and dv are accumulated per key block over every query head of the group (no atomics), dq per
query block over the key blocks. All accumulation is fp32.

In the interpreter, tl.dot on fp16/bf16 is wrong: operands are upcast to fp32 there (UPCAST).
"""
from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

from zerofuse.kernels import interpreted
from zerofuse.kernels.common import next_power_of_2
from zerofuse.kernels.launch import launch_triton, other_device

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif a.dtype == tl.float32:
        # fp32 inputs get fp32 products, as torch's fp32 attention (tl.dot's default, tf32, was off
        # by ~2e-3 on an H100)
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _rows(base, first, stride, offs_d, BLOCK: tl.constexpr):
    """Pointers to the (BLOCK, BLOCK_D) tile of rows first .. first + BLOCK - 1, `stride` apart, of
    the matrix at base. [Note: 64-bit offsets]: the block's start is 64-bit (it may lie 2^31 or
    more elements in); offsets inside the tile stay 32-bit, as the launchers keep BLOCK * stride
    below 2^31."""
    return base + tl.cast(first, tl.int64) * stride + (tl.arange(0, BLOCK)[:, None] * stride + offs_d[None, :])


@triton.jit
def _heads(X, b, h, sb, sh):
    """X's (b, h) matrix: batch and head offsets in 64 bits (program ids and strides are int32)."""
    return X + b.to(tl.int64) * sb + h.to(tl.int64) * sh


@triton.jit
def _query_pid(REVERSE: tl.constexpr):
    """This program's query block: under a causal mask the last blocks (the most keys to visit) run
    first, so the longest programs do not start in the last wave."""
    if REVERSE:
        return tl.num_programs(0) - 1 - tl.program_id(0)
    return tl.program_id(0)


@triton.jit
def _query_block(Q, sqb, sqh, sqn, G, Nq, D, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, REVERSE: tl.constexpr = False):
    """This program's (batch, query head, kv head, rows, key offsets, dim offsets, dim mask, row
    mask) and its block of queries. Grid: (query blocks, query heads, batch)."""
    pid_m = _query_pid(REVERSE)
    h = tl.program_id(1)
    b = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    row_mask = (offs_m[:, None] < Nq) & d_mask[None, :]
    q = tl.load(_rows(_heads(Q, b, h, sqb, sqh), pid_m * BLOCK_M, sqn, offs_d, BLOCK_M), mask=row_mask, other=0.0)
    return b, h, h // G, offs_m, tl.arange(0, BLOCK_N), offs_d, d_mask, row_mask, q


@triton.jit
def _key_tile(base, start_n, stride, offs_n, offs_d, d_mask, Nk, MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
    """The (BLOCK_N, BLOCK_D) k or v tile of keys start_n ..: masked at the key tail only when MASKED."""
    if MASKED:
        mask = ((start_n + offs_n)[:, None] < Nk) & d_mask[None, :]
    else:
        mask = d_mask[None, :]
    return tl.load(_rows(base, start_n, stride, offs_d, BLOCK_N), mask=mask, other=0.0)


@triton.jit
def _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, skn, svn, start, end, offs_m, offs_n, offs_d, d_mask, Nk,
                qk_scale, doc_lo, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                UPCAST: tl.constexpr, DOCS: tl.constexpr = False):
    """The online softmax over the key blocks [start, end): masked (the key tail, the causal
    diagonal, and with DOCS each row's keys before doc_lo, its document's first token) only when
    MASKED."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k = _key_tile(k_base, start_n, skn, offs_n, offs_d, d_mask, Nk, MASKED, BLOCK_N)
        s = _dot(q, tl.trans(k), UPCAST) * qk_scale
        if MASKED:
            keep = cols[None, :] < Nk
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            if DOCS:
                keep = keep & (cols[None, :] >= doc_lo[:, None])
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = m_new
        if MASKED and DOCS:  # a row may have seen no key yet: 2^(-inf - -inf) would be NaN (m stays -inf)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _key_tile(v_base, start_n, svn, offs_n, offs_d, d_mask, Nk, MASKED, BLOCK_N)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


# [Note: documents] Packed sequences (several documents in one row, as pre-training packs them and
# transformers' DataCollatorWithFlattening does): with DOCS, causal attention where query i sees key
# j only if start(i) <= j <= i, start(i) being the first token of i's document. The bounds come as
# one int32 (2, B, N) tensor (zerofuse.ops.attention.document_bounds): row 0 each token's document
# start, row 1 the token one past its document's end; starts are non-decreasing along N. The
# forward and dq kernels run a query block's keys from its first row's start (rounded down to
# BLOCK_N: earlier blocks are skipped), masked up to its last row's start (rounded up), unmasked
# from there to the causal diagonal; the dk/dv kernel runs a key block's queries from the causal
# start to the end of its last key's document. Work per row is its document's length, not its
# position in the row, with no (N, N) mask read. A row that has seen no key yet in a masked block
# keeps its running max at -inf (a stand-in 0 would underflow rows whose scores are all far below 0).
@triton.jit
def _doc_starts(DOC, b, offs_m, Nq, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[Note: documents] For a block of query rows: each row's document start (its first visible
    key), the first key block any row sees (the first row's start, rounded down to BLOCK_N), and
    where the key blocks every row sees wholly begin (the last row's start, rounded up)."""
    first = tl.min(offs_m, axis=0)  # (a block's first row is always < Nq)
    last = tl.minimum(tl.max(offs_m, axis=0), Nq - 1)
    row_base = DOC + b.to(tl.int64) * Nq
    doc_lo = tl.load(row_base + offs_m, mask=offs_m < Nq, other=0)
    # (clamped at 0: bounds not made by document_bounds give wrong results, never reads before K/V)
    lo = (tl.maximum(tl.load(row_base + first), 0) // BLOCK_N) * BLOCK_N
    mid = ((tl.maximum(tl.load(row_base + last), 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    return doc_lo, lo, mid


@triton.jit
def _unmasked_end(pid_m, Nk, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where the key blocks that need no mask end: blocks wholly inside [0, Nk) and (causal) wholly
    at or before the block's first row. The rest, up to the diagonal or Nk, take the masked loop."""
    if CAUSAL:
        return (tl.minimum(pid_m * BLOCK_M + 1, Nk) // BLOCK_N) * BLOCK_N
    return (Nk // BLOCK_N) * BLOCK_N


@triton.jit
def _attn_fwd_kernel(Q, K, V, O, LSE, DOC, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
                     Hq, G, Nq, Nk, D, qk_scale,
                     CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     UPCAST: tl.constexpr, DOCS: tl.constexpr = False):
    pid_m = _query_pid(CAUSAL)
    b, h, hk, offs_m, offs_n, offs_d, d_mask, row_mask, q = _query_block(Q, sqb, sqh, sqn, G, Nq, D, BLOCK_M,
                                                                         BLOCK_N, BLOCK_D, CAUSAL)
    k_base = _heads(K, b, hk, skb, skh)
    v_base = _heads(V, b, hk, svb, svh)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    hi = Nk
    if CAUSAL:
        hi = tl.minimum(Nk, (pid_m + 1) * BLOCK_M)
    full = _unmasked_end(pid_m, Nk, CAUSAL, BLOCK_M, BLOCK_N)
    lo = 0
    doc_lo = offs_m
    if DOCS:  # masked from the first key block any row sees up to where every row sees whole blocks
        doc_lo, lo, mid = _doc_starts(DOC, b, offs_m, Nq, BLOCK_M, BLOCK_N)
        mid = tl.minimum(mid, hi)
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, skn, svn, lo, mid, offs_m, offs_n, offs_d,
                                    d_mask, Nk, qk_scale, doc_lo, True, CAUSAL, BLOCK_N, UPCAST, DOCS)
        lo = mid
        full = tl.maximum(full, mid)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, skn, svn, lo, full, offs_m, offs_n, offs_d,
                                d_mask, Nk, qk_scale, doc_lo, False, CAUSAL, BLOCK_N, UPCAST)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, skn, svn, full, hi, offs_m, offs_n, offs_d,
                                d_mask, Nk, qk_scale, doc_lo, True, CAUSAL, BLOCK_N, UPCAST, DOCS)
    out = acc / l_i[:, None]
    tl.store(_rows(_heads(O, b, h, sob, soh), pid_m * BLOCK_M, son, offs_d, BLOCK_M), out.to(O.dtype.element_ty),
             mask=row_mask)
    tl.store(LSE + (b.to(tl.int64) * Hq + h) * Nq + offs_m, (m_i + tl.log2(l_i)) * 0.6931471805599453,
             mask=offs_m < Nq)


# Interpreter: one fixed block shape (the interpreter runs no autotuning; tests monkeypatch it to
# check the other shapes the GPU autotuner may pick).
INTERPRETER_BLOCKS = (64, 64)
# GPU: (BLOCK_M, BLOCK_N, num_warps, num_stages), autotuned per (Nq, Nk, D, causal) on the first
# call of each shape; pruned by head_dim so a tile's q/k/v blocks fit in shared memory.
GPU_CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 4), (32, 64, 4, 3),
               (64, 128, 8, 2)]


def _block_d(d: int) -> int:
    return max(16, next_power_of_2(d))


# Taken when no GPU_CONFIGS tile fits (fp32 with head_dim 256 asked for 448 KiB of shared memory
# on an H100, which has 227 KiB).
SMALL_CONFIG = (32, 32, 4, 1)


def _prune(configs, named_args, **kwargs):
    bd = kwargs.get("BLOCK_D", named_args.get("BLOCK_D", 64))
    esize = named_args["Q"].element_size() if "Q" in named_args else 2
    limit = (128 * 128 if bd <= 128 else 64 * 256) * 2  # bytes of a (BLOCK, BLOCK_D) tile
    keep = [c for c in configs if max(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) * bd * esize <= limit]
    m, n, w, st = SMALL_CONFIG
    return keep or [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)]


def _tuned(kernel, key):
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st) for m, n, w, st in GPU_CONFIGS]
    return triton.autotune(configs=configs, key=key, prune_configs_by={"early_config_prune": _prune})(kernel)


_attn_fwd_tuned = _tuned(_attn_fwd_kernel, ["Nq", "Nk", "D", "CAUSAL", "DOCS"])


def length_class(n: int) -> int:
    """The sequence-length bucket a tuned tile config is kept for: the next power of 2, at least 64."""
    return max(64, next_power_of_2(n))


# [Note: tuned configs by length class] triton.autotune keys on the exact lengths: every new
# sequence length (an eval batch, a packed batch, inference) benchmarked all GPU_CONFIGS again
# (7 configs x ~100 runs), and its run() built three dicts per call (~8 us of host time per launch
# on the H200's host). The config it picks is kept here per (kernel, length classes, D, causal,
# dtype): a length of a class seen before launches the JIT kernel with that config directly. Any
# config is correct at any length (the tails are masked); only the speed may differ within a class.
_CHOSEN: dict = {}
_PINNED: list = [None]  # the launch options every GPU launch takes instead of tuning (pinned_config)


@contextlib.contextmanager
def pinned_config(cfg: tuple = SMALL_CONFIG):
    """Within the block every GPU launch takes the tile config ``cfg`` (BLOCK_M, BLOCK_N, warps,
    stages; the default fits every head_dim and dtype) instead of its autotuned one, and tunes
    nothing: for checks of the kernels' results, not their speed (the doctor's first attention call
    tuned every shape of its self-test: 44-78 s on an H200). Nothing is kept in _CHOSEN."""
    m, n, w, st = cfg
    saved = _PINNED[0]
    _PINNED[0] = triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st).all_kwargs()
    try:
        yield
    finally:
        _PINNED[0] = saved


def _launch(kernel, tuned, grid, *args, tune_key: tuple = (), **consts):
    """The interpreter: the fixed INTERPRETER_BLOCKS; a GPU: the config chosen for tune_key (the
    length classes, D, causal, dtype), autotuned on its first call ([Note: tuned configs by length class])."""
    if interpreted():
        bm, bn = INTERPRETER_BLOCKS
        launch_triton(kernel, grid({"BLOCK_M": bm, "BLOCK_N": bn}), *args, BLOCK_M=bm, BLOCK_N=bn, UPCAST=True,
                      num_warps=4, **consts)
        return
    if _PINNED[0] is not None:
        meta = _PINNED[0]
        launch_triton(kernel, grid(meta), *args, UPCAST=False, **meta, **consts)
        return
    key = (kernel, *tune_key)
    meta = _CHOSEN.get(key)
    if meta is None:
        i = other_device(args)  # (launch_triton's device guard: the query's device)
        with torch.cuda.device(i) if i is not None else contextlib.nullcontext():
            tuned[grid](*args, UPCAST=False, **consts)  # benchmarks the configs, launches the best
        _CHOSEN[key] = tuned.best_config.all_kwargs()  # (BLOCK_M, BLOCK_N, num_warps, num_stages, ...)
        return
    launch_triton(kernel, grid(meta), *args, UPCAST=False, **meta, **consts)


def check_like_query(q, k, v, fn: str) -> None:
    """Key and value on query's device and of its dtype (a kernel would read them as query's)."""
    for name, t in (("key", k), ("value", v)):
        if t.device != q.device:
            raise ValueError(f"{fn}: expected {name} on the device of query ({q.device}), got {t.device}")
        if t.dtype != q.dtype:
            raise TypeError(f"{fn}: expected {name} of the dtype of query ({q.dtype}), got {t.dtype}")


def _check(q, k, v, fn: str = "zerofuse::attention"):
    """The shapes, devices and dtypes the kernels (and the ops' CPU path) rely on; any B, H, N may
    be 0. A key or value on another device or of another dtype would be read as query's."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{fn}: expected 4-D (B, H, N, D) query, key and value, got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, hq, _, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"{fn}: expected key and value of shape (B={b}, Hkv, Nk, D={d}), got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    hkv = k.shape[1]
    if (hq % hkv) if hkv else hq:
        raise ValueError(f"{fn}: expected the key/value heads ({hkv}) to divide the query heads ({hq})")
    check_like_query(q, k, v, fn)
    if any(t.stride(-1) != 1 and t.shape[-1] > 1 for t in (q, k, v)):  # (one element a row: any stride)
        raise ValueError(f"{fn}: expected the last dimension of query, key and value to be contiguous, got "
                         f"strides {q.stride()}, {k.stride()}, {v.stride()}")


# [Note: 64-bit offsets] Tensors may hold 2^31 elements or more while Triton's program ids and int
# strides are int32, and int32 products wrap. The kernels compute the batch and head offsets and
# each block's first row offset in 64 bits (_heads, _rows), and offsets within a tile (at most
# 128 rows times the row stride, plus the head dim) in 32 bits, which the launchers guarantee by
# copying a tensor whose row stride is larger than this (only an exotic view has one).
_MAX_ROW_STRIDE = (2**31 - 1 - 256) // 128
# CUDA's limit on the grid's second and third dimensions (heads, batch)
_MAX_GRID_YZ = 65535


def _tileable(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous() if t.shape[-2] > 1 and t.stride(-2) > _MAX_ROW_STRIDE else t


def _check_grid(b: int, hq: int) -> None:
    if b > _MAX_GRID_YZ or hq > _MAX_GRID_YZ:
        raise ValueError(f"zerofuse attention: expected at most {_MAX_GRID_YZ} batches and heads (the kernels' grid), "
                         f"got B={b}, H={hq}")


def _writable(t: torch.Tensor | None, shape, like: torch.Tensor) -> torch.Tensor | None:
    """An output the caller gave (a strided view, e.g. of a packed qkv gradient) if the kernels can
    write it in place: its shape, like's dtype and device, unit stride along head_dim and a row
    stride within [Note: 64-bit offsets]; None otherwise (the launcher allocates and copies)."""
    if t is None:
        return None
    if tuple(t.shape) != tuple(shape) or t.dtype != like.dtype or t.device != like.device:
        raise ValueError(f"zerofuse attention: expected an output of shape {list(shape)}, {like.dtype} on "
                         f"{like.device}, got {list(t.shape)}, {t.dtype} on {t.device}")
    ok = t.stride(-1) == 1 and (t.shape[-2] <= 1 or t.stride(-2) <= _MAX_ROW_STRIDE)
    return t if ok else None


def check_docs(docs, q, k, causal: bool, fn: str) -> None:
    """[Note: documents] docs: int32 (2, B, N), per token its document's first token and the one past
    its last (document_bounds), for causal attention of queries and keys of one length N."""
    b, n = q.shape[0], q.shape[2]
    if not causal or k.shape[2] != n:
        raise ValueError(f"{fn}: documents are for causal attention of queries and keys of one length, got "
                         f"is_causal={causal}, {n} queries and {k.shape[2]} keys")
    if not isinstance(docs, torch.Tensor) or docs.dtype != torch.int32 or tuple(docs.shape) != (2, b, n) \
            or docs.device != q.device:
        got = f"{docs.dtype} {list(docs.shape)} on {docs.device}" if isinstance(docs, torch.Tensor) else type(docs)
        raise ValueError(f"{fn}: expected document bounds of shape [2, {b}, {n}], int32 on {q.device} "
                         f"(zerofuse.ops.attention.document_bounds), got {got}")


def default_scale(d: int) -> float:
    return 1.0 / math.sqrt(d)


# the launches (host side) live in kernels/attention_launch.py, which reads this module
from zerofuse.kernels.attention_launch import Launches, attention_bwd, attention_fwd  # noqa: E402,F401
