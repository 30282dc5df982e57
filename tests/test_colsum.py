"""kernels/colsum.py: column sums of per-program partials formed by the last program of the same
launch (the norms' backward in one launch) equal the two-launch sums bit for bit, leave the arrival
counter at zero, and the one-launch path launches nothing else. Interpreter (CPU) tests; the GPU
run of the same kernels is covered by test_norms' CUDA cases."""
import os

import pytest
import torch
import triton
import triton.language as tl

from zerofuse import kernels
from zerofuse.kernels import colsum
from zerofuse.kernels import norms as KN
from zerofuse.kernels.common import _cast

interp = pytest.mark.skipif(not kernels.triton_on_cpu(), reason="interpreter tests (ZEROFUSE_TRITON_ON_CPU=1)")


def _case(rows, n, dtype, is_rms, has_w=True, has_b=True, has_dh=False, seed=0, dr=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g).to(dtype)
    w = torch.randn(n, generator=g).to(dtype) if has_w else None
    b = torch.randn(n, generator=g).to(dtype) if (has_b and not is_rms) else None
    _, _, mean, rstd = KN.norm_fwd(x, w, b, None, 1e-5, is_rms)
    dy = torch.randn(rows, n, generator=g).to(dtype)
    dh = torch.randn(rows, n, generator=g).to(dtype) if has_dh else None
    return dy, dh, x, w, b, mean, rstd, is_rms, (dtype if dr else None)


def _two_launch(monkeypatch, args):
    with monkeypatch.context() as m:
        m.setattr(colsum, "ONE_LAUNCH_FLOATS", 0)
        return KN.norm_bwd(*args)


@interp
@pytest.mark.parametrize("rows,n", [(1, 7), (5, 33), (97, 123), (300, 768)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_rms,has_b,has_dh,dr", [(False, True, False, False), (False, False, True, True),
                                                    (True, False, False, False), (True, False, True, True)])
def test_one_launch_equals_two_launches_bitwise(monkeypatch, rows, n, dtype, is_rms, has_b, has_dh, dr):
    args = _case(rows, n, dtype, is_rms, has_b=has_b, has_dh=has_dh, dr=dr)
    counter = colsum.arrival_counter(torch.device("cpu"))
    calls = []
    real = colsum.sum_partials
    monkeypatch.setattr(colsum, "sum_partials", lambda *a: calls.append(a) or real(*a))
    one = KN.norm_bwd(*args)
    assert calls == [], "the one-launch backward launched a second kernel"
    assert int(counter) == 0, "the last program must put the arrival counter back to zero"
    two = _two_launch(monkeypatch, args)
    assert len(calls) == 3  # the two-launch path really ran (dw, db and dr, each None-aware)
    assert (one[3] is not None) == dr
    if dr:  # the sum over rows of dx, formed in fp32 before dx was rounded to its dtype: within the
        # rounding of each dx element (half an ulp of the dtype) and of the sum itself
        ulp = torch.finfo(dtype).eps
        dx = two[0].double()
        err = (one[3].double() - dx.sum(0)).abs()
        assert (err <= dx.abs().sum(0) * ulp + one[3].double().abs() * ulp + 1e-6).all(), err.max()
    for name, a, b in zip(("dx", "dw", "db", "dr"), one, two):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), name


@interp
def test_counter_not_at_zero_breaks_the_sum(monkeypatch):
    """The last-arrival test is what forms dw: with a stale count no program draws the last ticket
    and dw is never written (so the reset after each launch matters; the test can fail)."""
    args = _case(40, 16, torch.float32, False)
    good = KN.norm_bwd(*args)
    counter = colsum.arrival_counter(torch.device("cpu"))
    counter.fill_(1)
    real_empty = torch.empty
    try:  # outputs start as NaN, so one never written shows
        monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
        bad = KN.norm_bwd(*args)
    finally:
        counter.zero_()
    assert torch.equal(good[0], bad[0])
    assert torch.isnan(bad[1]).all() and not torch.isnan(good[1]).any()


@interp
def test_without_a_counter_the_sums_take_the_second_launch(monkeypatch):
    """While a stream captures a CUDA graph and has no arrival counter yet, arrival_counter gives
    None (a counter made there would be zeroed only by a replay) and the norms' and bias-GELU's
    backwards sum their partials in a second launch: the same bits as in one launch."""
    from zerofuse.kernels import bias_gelu as KB

    class _Stream:
        cuda_stream = 12345  # a stream no counter was made for

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert colsum.arrival_counter(torch.device("cuda", 0), _Stream()) is None
    args = _case(97, 123, torch.bfloat16, False, has_dh=True, dr=True)
    one = KN.norm_bwd(*args)
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(37, 130, generator=g), torch.randn(37, 130, generator=g)
    b = torch.randn(130, generator=g)
    gelu_one = KB.bias_gelu_bwd(dy, x, b)
    calls = []
    real = colsum.sum_partials
    monkeypatch.setattr(colsum, "sum_partials", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(colsum, "arrival_counter", lambda device, stream=None: None)
    two = KN.norm_bwd(*args)
    gelu_two = KB.bias_gelu_bwd(dy, x, b)
    assert len(calls) == 4  # dw, db, dr and the bias-GELU's db, each in a second launch
    for a, c in zip((*one, *gelu_one), (*two, *gelu_two)):
        assert torch.equal(a, c)


@interp
@pytest.mark.parametrize("is_rms", [False, True])
def test_a_backward_over_no_rows(is_rms):
    """No rows (an empty batch): an empty dx and zero parameter gradients, no launch (the program
    count was 0, and the partition by it a ZeroDivisionError)."""
    x = torch.randn(0, 8, dtype=torch.bfloat16)
    w = torch.randn(8, dtype=torch.bfloat16)
    b = None if is_rms else torch.randn(8, dtype=torch.bfloat16)
    stats = torch.empty(0)
    dx, dw, db, dr = KN.norm_bwd(torch.empty_like(x), None, x, w, b, None if is_rms else stats, stats, is_rms,
                                 torch.float32)
    assert dx.shape == (0, 8) and torch.equal(dw, torch.zeros(8, dtype=torch.bfloat16))
    assert (db is None) == is_rms and (db is None or torch.equal(db, torch.zeros(8, dtype=torch.bfloat16)))
    assert torch.equal(dr, torch.zeros(8))
    xg = x.clone().requires_grad_()  # through the face's autograd too
    import zerofuse.nn.functional as ZF

    y = ZF.rms_norm(xg, (8,), w) if is_rms else ZF.layer_norm(xg, (8,), w.requires_grad_(), b)
    y.sum().backward()
    assert xg.grad.shape == (0, 8)


def test_part_counts_and_limits():
    assert colsum.one_launch(4, colsum.ONE_LAUNCH_FLOATS // 4)
    assert not colsum.one_launch(4, colsum.ONE_LAUNCH_FLOATS // 4 + 1)
    # a 768-wide norm on a 132-SM GPU: at most 4 x 132 programs, cut to what one program can sum
    assert colsum.max_parts(768, 528) == colsum.ONE_LAUNCH_FLOATS // 768
    assert colsum.one_launch(colsum.max_parts(768, 528), 768)
    # wide rows keep a quarter of the cap for the two-launch sum
    assert colsum.max_parts(16384, 528) == 132 and not colsum.one_launch(132, 16384)


def test_one_launch_backward_compiles_for_an_h100_without_spills():
    """tools/kernel_asm.py --norms compiles the norms' backward for sm_90 on this CPU machine: the
    one-launch kernels draw their ticket by one acq_rel atomic at GPU scope and read the partials
    through L2 (.cg); the two-launch kernel has no atomic; none spills registers. Its row loop takes
    the barriers of the row reductions alone (LayerNorm's two, RMSNorm's one, about 3 barriers
    each): the weight/bias/input-bias column sums are accumulated per (row, column) lane and
    reduced once after the loop (they took three more cross-warp reductions a pass: 15 barriers at
    width 768 before)."""
    from common import kernel_asm

    rows = kernel_asm("--norms")
    assert len(rows) == 6
    for r in rows:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["registers"] <= 128, r  # two 8-warp programs an SM
        assert r["loops"][0]["barriers"] <= (3 if r["rms"] else 6), r
        if r["one_launch"]:
            assert r["atomics"] == {"atom.global.gpu.acq_rel.add.u32": 1}, r
            assert r["l2_loads"].get("v4.b32", 0) > 0, r
        else:
            assert r["atomics"] == {} and r["l2_loads"] == {}, r


@pytest.mark.gpu
@pytest.mark.parametrize("rows,n", [(16384, 768), (4096, 1024), (1000, 4096), (64, 65536)])
def test_cuda_one_launch_and_two_launch_sums_agree_and_repeat(monkeypatch, rows, n):
    """On a GPU: the one-launch backward (its last program's sums) against the two-launch one, and
    against itself run again (deterministic: the fixed order holds whoever arrives last); the
    counter is back at zero after each; dr (the input bias's gradient) equals dx's row sums."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n, generator=g).to("cuda", torch.bfloat16)
    w, b = (torch.randn(n, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    _, _, mean, rstd = KN.norm_fwd(x, w, b, None, 1e-5, False)
    dy = torch.randn(rows, n, generator=g).to("cuda", torch.bfloat16)
    args = (dy, None, x, w, b, mean, rstd, False, torch.float32)
    one, again = KN.norm_bwd(*args), KN.norm_bwd(*args)
    assert int(colsum.arrival_counter(x.device)) == 0
    two = _two_launch(monkeypatch, args)
    for a, c in zip(one, again):
        assert torch.equal(a, c)
    assert torch.equal(one[0], two[0])
    for a, c in zip(one[1:], two[1:]):
        torch.testing.assert_close(a.float(), c.float(), atol=1e-2 * rows ** 0.5, rtol=1e-2)
    torch.testing.assert_close(one[3], one[0].float().sum(0), atol=5e-2 * rows ** 0.5, rtol=1e-2)


def test_the_one_launch_threshold_is_set_by_the_environment():
    """ZEROFUSE_ONE_LAUNCH_FLOATS=0 sends every sum to the second launch (the way back, on a GPU,
    should the one-launch form misbehave there): read at import."""
    import subprocess
    import sys

    code = ("from zerofuse.kernels import colsum; "
            "print(colsum.ONE_LAUNCH_FLOATS, colsum.one_launch(1, 1), colsum.max_parts(768, 528))")
    env = dict(os.environ, ZEROFUSE_ONE_LAUNCH_FLOATS="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["0", "False", "132"]


@triton.jit
def _cast_kernel(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, _cast(tl.load(X + offs, mask=offs < N), Y.dtype.element_ty, True), mask=offs < N)


@interp
def test_the_interpreters_bf16_rounding_keeps_every_nan_a_nan():
    """kernels.common._cast's round-to-nearest-even on the bits (the interpreter truncates) carried
    a NaN whose payload sits in the low 16 bits into inf (0x7F800001) or, through the sign, into
    -0.0 (0x7FFFFFFF); finite values still round as torch's cast (a review, 2026-12-07)."""
    bits = torch.tensor([0x7F800001, 0x7FFFFFFF, 0x7FC00000, 0xFFC00001, 0x3F808000, 0x3F818000, 0x7F7FFFFF],
                        dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, y, x.numel(), BLOCK=8)
    assert y[:4].isnan().all(), y
    torch.testing.assert_close(y[4:], x[4:].to(torch.bfloat16), rtol=0, atol=0)
