"""Address arithmetic past 2^31 elements in the Triton kernels ([Note: 64-bit offsets] in
kernels/attention.py): program ids and int strides are int32 in Triton, and int32 products wrap.

Without a GPU, the interpreter (numpy) wraps int32 the same way, so a view whose elements lie 2^31
or more elements past its first one shows the bug on a few KiB of data: the views live in one
buffer of 2^32 + 2^20 fp16 elements (8 GiB of address space, of which only the pages written are
ever backed by memory), placed so that a wrapped offset still lands inside the buffer and reads
wrong values instead of faulting. Each kernel's result on the views must equal, bit for bit, its
result on contiguous copies (the same arithmetic on the same values). (On a GPU the same tests
run, the buffer then being 8 GiB of device memory.)

On a GPU, tensors of 2^31 + 7 elements (norms) and just over 2^31 (attention) are run whole, and
rows past 2^31 are compared with the same kernel on those rows alone.
"""
import pytest
import torch

from common import HAS_CUDA
from tolerances import assert_close
from zerofuse import kernels
from zerofuse.kernels import attention as KA
from zerofuse.kernels import norms as KN

DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_kernels = pytest.mark.skipif(not (HAS_CUDA or kernels.interpreted()),
                                   reason="the Triton kernels need a GPU or the interpreter")
BUFFER = 2**32 + 2**20


@pytest.fixture(scope="module")
def buffer():
    try:
        return torch.empty(BUFFER, dtype=torch.float16, device=DEVICE)
    except (RuntimeError, MemoryError) as e:  # address space refused (e.g. strict overcommit)
        pytest.skip(f"cannot reserve {BUFFER * 2 / 2**30:.0f} GiB: {e}")


def _view(buffer, offset, shape, strides, seed):
    t = buffer.as_strided(shape, strides, offset)
    g = torch.Generator().manual_seed(seed)
    t.copy_(torch.randn(shape, generator=g).to(torch.float16))  # writes (backs) only these elements
    return t


def _attention_both_ways(q, k, v, dout, causal):
    """Forward and backward of the kernels on (q, k, v, dout) as given and on contiguous copies."""
    scale = q.shape[-1] ** -0.5
    results = []
    for args in ((q, k, v, dout), tuple(t.contiguous() for t in (q, k, v, dout))):
        out, lse = KA.attention_fwd(*args[:3], causal, scale)
        results.append((out, lse, *KA.attention_bwd(args[3], *args[:3], out, lse, causal, scale)))
    return results


def _assert_same(got, want):
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, name
        assert torch.equal(a, b), f"{name}: max |difference| {(a.float() - b.float()).abs().max().item():.3g}"


@needs_kernels
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_with_a_batch_stride_past_int32(buffer, causal):
    """Batch stride 1.5 * 2^30: batch 2 starts 3 * 2^30 elements in. Grouped-query (2 query heads,
    1 kv head); q, k, v and dout interleaved in one batch slab."""
    b, hq, hkv, nq, nk, d = 3, 2, 1, 33, 40, 16
    sb = 3 * 2**29 - 2**12
    base = 2**30 + 2**16  # a wrapped batch offset (-(2^30 + 2^13)) stays inside the buffer
    q = _view(buffer, base, (b, hq, nq, d), (sb, nq * d, d, 1), 0)
    k = _view(buffer, base + 2**13, (b, hkv, nk, d), (sb, nk * d, d, 1), 1)
    v = _view(buffer, base + 2**14, (b, hkv, nk, d), (sb, nk * d, d, 1), 2)
    dout = _view(buffer, base + 3 * 2**13, (b, hq, nq, d), (sb, nq * d, d, 1), 3)
    assert 2 * sb >= 2**31 and base + 2 * sb + 3 * 2**13 + hq * nq * d <= BUFFER
    got, want = _attention_both_ways(q, k, v, dout, causal)
    _assert_same(got, want)


@needs_kernels
def test_attention_with_row_blocks_starting_past_int32(buffer):
    """193 rows, row stride ceil(2^31 / 192) (below KA._MAX_ROW_STRIDE: no copy): the interpreter's
    row block at 192 (its blocks are 64 rows) starts just past 2^31, in q, k, v and dout."""
    n, d, stride = 193, 16, -(-(2**31) // 192)
    base = 2**31 + 2**12  # a wrapped row offset (about -2^31) stays inside the buffer
    q, k, v, dout = (_view(buffer, base + 32 * i, (1, 1, n, d), (n * stride, n * stride, stride, 1), i)
                     for i in range(4))
    assert stride <= KA._MAX_ROW_STRIDE and 192 * stride >= 2**31
    assert base + 192 * stride + 3 * 32 + d <= BUFFER
    got, want = _attention_both_ways(q, k, v, dout, True)
    _assert_same(got, want)


@needs_kernels
def test_attention_copies_a_query_whose_row_stride_is_too_large_for_int32_tiles(buffer):
    """Row stride 2^26 (above KA._MAX_ROW_STRIDE), 33 rows: row 32 lies 2^31 elements into the
    first tile (the launchers copy such a tensor rather than widen every offset in the tile)."""
    n, d, stride = 33, 16, 2**26
    base = 2**31 + 2**12  # row 32's wrapped offset, -2^31, stays inside the buffer
    q = _view(buffer, base, (1, 2, n, d), (2 * n * stride, 8 * d, stride, 1), 0)
    k, v, dout = (torch.randn(s, generator=torch.Generator().manual_seed(i)).to(DEVICE, torch.float16)
                  for i, s in enumerate([(1, 2, 50, d), (1, 2, 50, d), (1, 2, n, d)], start=1))
    assert (n - 1) * stride >= 2**31 and base + (n - 1) * stride + 8 * d + d <= BUFFER
    got, want = _attention_both_ways(q, k, v, dout, False)
    _assert_same(got, want)


def test_attention_refuses_a_grid_beyond_cuda_limits():
    q = torch.empty(2**16, 1, 1, 16)
    with pytest.raises(ValueError, match=r"expected at most 65535 batches and heads \(the kernels' grid\), got B=65536, H=1"):
        KA.attention_fwd(q, q, q, False, 1.0)


# ---------------------------------------------------------------------------------- whole tensors


def _attention_rows_past_int32(shape, device):
    """Forward and backward on q, k, v, dout of `shape` (contiguous); the first and the last batch
    (whose offsets pass 2^31 when the tensors do) equal the kernels' result on that batch alone."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(shape, generator=g, device=device, dtype=torch.float16) for _ in range(4))
    scale = shape[-1] ** -0.5
    out, lse = KA.attention_fwd(q, k, v, True, scale)
    grads = KA.attention_bwd(dout, q, k, v, out, lse, True, scale)
    big = (out, lse, *grads)
    del grads
    for b in (0, shape[0] - 1):
        part = [t[b:b + 1] for t in (q, k, v, dout)]
        out_b, lse_b = KA.attention_fwd(*part[:3], True, scale)
        _assert_same([t[b:b + 1] for t in big], (out_b, lse_b, *KA.attention_bwd(part[3], *part[:3], out_b, lse_b,
                                                                                   True, scale)))


def _norm_rows_past_int32(m, n, device, is_rms):
    """Forward and backward of the norm kernels on (m, n) fp16 rows; the first and last rows equal
    the kernels' result on those rows alone, weight/bias gradients (sums over every row) match
    an fp64 sum within the table's norm_param_grad tolerance."""
    g = torch.Generator(device=device).manual_seed(0)
    x, dy = (torch.randn(m, n, generator=g, device=device, dtype=torch.float16) for _ in range(2))
    w, b = (torch.randn(n, generator=g, device=device, dtype=torch.float16) for _ in range(2))
    b = None if is_rms else b
    y, _, mean, rstd = KN.norm_fwd(x, w, b, None, 1e-5, is_rms)
    dx, dw, db, _ = KN.norm_bwd(dy, None, x, w, b, mean, rstd, is_rms)
    for rows in (slice(0, 3), slice(m - 3, m)):
        y_r, _, mean_r, rstd_r = KN.norm_fwd(x[rows], w, b, None, 1e-5, is_rms)
        assert torch.equal(y[rows], y_r) and torch.equal(rstd[rows], rstd_r)
        assert torch.equal(dx[rows], KN.norm_bwd(dy[rows], None, x[rows], w, b, mean_r, rstd_r, is_rms)[0])
    dw64, db64 = torch.zeros(n, dtype=torch.float64, device=device), torch.zeros(n, dtype=torch.float64, device=device)
    for r in range(0, m, 1 << 16):  # fp64 sums, a slab of rows at a time
        xs, dys = x[r:r + (1 << 16)].double(), dy[r:r + (1 << 16)].double()
        mu = 0.0 if is_rms else xs.mean(-1, keepdim=True)
        xhat = (xs - mu) * torch.rsqrt((xs - mu).square().mean(-1, keepdim=True) + 1e-5)
        dw64 += (dys * xhat).sum(0)
        db64 += dys.sum(0)
    assert_close(dw, dw64, op="norm_param_grad")
    if b is not None:
        assert_close(db, db64, op="norm_param_grad")


@needs_kernels
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_norm_check_on_a_small_tensor(norm):
    """The GPU tests' checks below, on a small tensor (so a broken check shows without a GPU)."""
    _norm_rows_past_int32(37, 123, DEVICE, norm == "rms")


@needs_kernels
def test_attention_check_on_a_small_tensor():
    _attention_rows_past_int32((3, 2, 70, 16), DEVICE)


@pytest.mark.gpu
@pytest.mark.xdist_group("over_30_gb")  # one at a time (run_gpu.sh: --dist loadgroup): ~32 GB each
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_gpu_norms_of_2_pow_31_plus_7_elements(norm):
    m, n = 364289, 5895  # m * n = 2^31 + 7
    assert m * n == 2**31 + 7
    _norm_rows_past_int32(m, n, "cuda", norm == "rms")


@pytest.mark.gpu
@pytest.mark.xdist_group("over_30_gb")  # ~34 GB
def test_gpu_attention_past_2_pow_31_elements():
    shape = (2047, 16, 1025, 64)  # 2^31 + 1047552 elements per tensor; 4 GiB each in fp16
    assert shape[0] * shape[1] * shape[2] * shape[3] >= 2**31 + 7
    _attention_rows_past_int32(shape, "cuda")
