"""Fused LayerNorm / RMSNorm: values and gradients vs the fp64 reference (tests/test_norms_surfaces.py:
the modules, errors, torch.library, GPU and C++ kernel faces).

Without a GPU the session runs the Triton kernels in the interpreter (conftest); ``path=cpp``
cases use the cpu_kernels fixture to test the C++ CPU kernels (csrc/cpu/norms.cpp) the same way.
"""
import pytest
import torch

import zerofuse.nn.functional as ZF
from tolerances import assert_close
from zerofuse import reference
from norms_common import _check, _make, _run, path  # noqa: F401 - (path: a fixture)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("hidden", [1, 123, 4095, 5120])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_forward_and_gradients_match_fp64_reference(norm, dtype, hidden, residual, path):
    rows = 97 if hidden < 4096 else 9
    shape = (2, rows, hidden) if hidden < 4096 else (rows, hidden)
    _check(norm, shape, (hidden,), dtype, "cpu", residual=residual)


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("affine,bias", [(True, False), (False, False)], ids=["no_bias", "no_affine"])
def test_optional_weight_and_bias(norm, affine, bias, path):
    _check(norm, (3, 33, 80), (80,), torch.float32, "cpu", affine=affine, bias=bias, residual=True)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_float64_is_computed_in_float64(norm, residual, path):
    _check(norm, (3, 21, 77), (77,), torch.float64, "cpu", residual=residual)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_a_float64_residual_is_added_and_normalised_in_float64(norm, path):
    """fp32 x + a float64 residual: h and y are float64 (torch's type promotion), so the sum and the
    norm are taken in float64 on every path (the Triton kernels added in fp32 into float64 outputs:
    the residual's detail below fp32's epsilon was lost)."""
    x = torch.randn(3, 5, 40)
    r = 1.0 + 1e-9 * torch.randn(3, 5, 40, dtype=torch.float64)
    want_h = x.double() + r
    if norm == "layer":
        y, h = ZF.add_layer_norm(x, r, (40,))
        want_y = torch.nn.functional.layer_norm(want_h, (40,))
    else:
        y, h = ZF.add_rms_norm(x, r, (40,), eps=1e-6)
        want_y = torch.nn.functional.rms_norm(want_h, (40,), eps=1e-6)
    assert h.dtype == y.dtype == torch.float64
    assert torch.equal(h, want_h)
    assert_close(y, want_y)


@pytest.mark.parametrize("pdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_low_precision_params_with_a_float64_residual(norm, pdtype, path):
    """bf16 x and params + a float64 residual: h float64, and y and the grads as the float64
    reference with the params cast up (aten's CPU layer_norm refused the bf16/fp32 params next to a
    float64 h, forward and backward: a review's reproduction, 2026-12-07; rms_norm took them)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 9, generator=g).to(torch.bfloat16)
    r = torch.randn(4, 9, generator=g, dtype=torch.float64)
    w, b = (torch.randn(9, generator=g).to(pdtype) for _ in range(2))
    ours = [t.clone().requires_grad_() for t in (x, r, w, b)]
    refs = [t.detach().double().requires_grad_() for t in (x, r, w, b)]
    if norm == "layer":
        y, h = ZF.add_layer_norm(ours[0], ours[1], (9,), ours[2], ours[3])
        want_y, want_h = reference.layer_norm(refs[0], (9,), refs[2], refs[3], 1e-5, residual=refs[1])
    else:
        y, h = ZF.add_rms_norm(ours[0], ours[1], (9,), ours[2], eps=1e-6)
        want_y, want_h = reference.rms_norm(refs[0], (9,), refs[2], 1e-6, residual=refs[1])
    assert h.dtype == y.dtype == torch.float64
    assert torch.equal(h, want_h)
    torch.testing.assert_close(y, want_y, rtol=1e-12, atol=1e-12)
    dy = torch.randn(4, 9, generator=g, dtype=torch.float64)
    (y * dy).sum().backward()
    (want_y * dy).sum().backward()
    for a, e in zip(ours, refs):
        if a.grad is None:  # (rms: no bias)
            assert e.grad is None
            continue
        assert a.grad.dtype == a.dtype
        assert_close(a.grad, e.grad.to(a.dtype))


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_backward_ops_read_strided_stats_by_row(norm, path):
    """mean / rstd passed as strided views (a column of a wider tensor) give the gradients of the
    same values contiguous (the Triton kernels read them flat: dx off by O(1000))."""
    x, w, b = torch.randn(6, 24), torch.randn(24), torch.randn(24)
    dy = torch.randn(6, 24)
    if norm == "layer":
        _, _, mean, rstd = torch.ops.zerofuse.layer_norm(x, w, b, None, 1e-5)
        wide = torch.stack([mean, rstd, torch.zeros_like(mean)], 1)  # (6, 3): columns of stride 3
        want = torch.ops.zerofuse.layer_norm_backward(dy, None, x, w, b, mean, rstd)
        got = torch.ops.zerofuse.layer_norm_backward(dy, None, x, w, b, wide[:, 0], wide[:, 1])
    else:
        _, _, rstd = torch.ops.zerofuse.rms_norm(x, w, None, 1e-6)
        wide = torch.stack([rstd, torch.zeros_like(rstd)], 1)
        want = torch.ops.zerofuse.rms_norm_backward(dy, None, x, w, rstd)
        got = torch.ops.zerofuse.rms_norm_backward(dy, None, x, w, wide[:, 0])
    for g, w_ in zip(got, want):
        assert torch.equal(g, w_)


def test_layer_norm_of_rows_with_a_large_mean_and_tiny_spread(path):
    """|mean| / std = 1e5: a plain one-pass sum of squares cancels to garbage (errors of O(1) or
    NaN) in fp32. What remains is inherent to fp32: the mean's rounding (ulp(1000) = 6e-5) over a
    std of 0.01 moves y by up to ~6e-3."""
    x = (1000.0 + 0.01 * torch.randn(6, 513, dtype=torch.float64)).float()
    y = ZF.layer_norm(x, (513,))
    assert_close(y, reference.layer_norm(x.double(), (513,))[0], atol=1e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_rows_holding_inf_or_nan_give_torchs_non_finite_values(norm, dtype, path):
    """The C++ LayerNorm of a row holding inf gave -inf and NaN where torch gives NaN throughout:
    the variance (inf - inf: NaN) was clamped to 0, so the row was scaled by 1/sqrt(eps)."""
    x = torch.randn(4, 40, dtype=dtype)
    x[0, 3], x[1, 0], x[2, 7] = float("inf"), float("-inf"), float("nan")
    fn, ref = (ZF.layer_norm, torch.nn.functional.layer_norm) if norm == "layer" else \
        (ZF.rms_norm, torch.nn.functional.rms_norm)
    y, want = fn(x, (40,)), ref(x, (40,))
    assert torch.equal(y.isnan(), want.isnan()) and torch.equal(y.isinf(), want.isinf())
    torch.testing.assert_close(y[want.isfinite()], want[want.isfinite()])


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_widest_rows(norm):
    _check(norm, (3, 65536), (65536,), torch.bfloat16, "cpu")


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_rows_wider_than_the_kernel_fall_back_correctly(norm):
    _check(norm, (2, 65537), (65537,), torch.float32, "cpu")


@pytest.mark.parametrize("hidden", [16384, 65536])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_wide_fp32_rows_on_the_cpp_path(norm, hidden, cpu_kernels):
    """Row statistics and the backward's row sums add `hidden` terms: in fp32 lanes they drifted
    past the fp32 tolerance at 65537 on AVX2 (csrc/cpu/norms.cpp sums in double since)."""
    _check(norm, (2, hidden), (hidden,), torch.float32, "cpu", residual=True)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_outputs_changed_in_place_backpropagate_as_torchs(norm, dtype, path):
    """y.mul_(2) on a norm's output: the CPU path returned views made inside its autograd Function,
    and autograd refused the in-place change (torch's norms allow it); 2026-12-06. (h is saved for
    the backward, by torch's norm as by the fused one: an in-place change of it is refused by both.)"""
    g = torch.Generator().manual_seed(0)
    x0, r0 = torch.randn(3, 5, 8, generator=g, dtype=dtype), torch.randn(3, 5, 8, generator=g, dtype=dtype)
    w0 = torch.randn(8, generator=g, dtype=dtype)
    ours = ZF.add_layer_norm if norm == "layer" else ZF.add_rms_norm
    theirs = torch.nn.functional.layer_norm if norm == "layer" else torch.nn.functional.rms_norm
    grads = []
    for fused in (True, False):  # (torch's in fp64: the reference of the tolerance rule)
        x, r, w = (t.clone() if fused else t.double() for t in (x0, r0, w0))
        for t in (x, r, w):
            t.requires_grad_()
        if fused:
            y, h = ours(x, r, (8,), w)
        else:
            h = x + r
            y = theirs(h, (8,), w)
        y.mul_(2)
        (y * 3 + h).float().sum().backward()
        grads.append([t.grad for t in (x, r, w)])
    for a, b, name in zip(*grads, ("x", "residual", "weight")):
        assert_close(a, b, op="norm_param_grad" if name == "weight" else None, msg=lambda m: f"d{name}: {m}")



@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_multi_dim_normalized_shape_and_eps(norm, path):
    _check(norm, (4, 5, 6, 7), (6, 7), torch.float32, "cpu", eps=0.3, residual=True)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_non_contiguous_input(norm, path):
    x = torch.randn(40, 3, 64).transpose(0, 1)  # (3, 40, 64), non-contiguous
    w = torch.randn(64)
    xr = x.detach().double().requires_grad_()
    x = x.requires_grad_()
    if norm == "layer":
        y, y_ref = ZF.layer_norm(x, (64,), w), reference.layer_norm(xr, (64,), w.double())[0]
    else:
        y, y_ref = ZF.rms_norm(x, (64,), w, 1e-6), reference.rms_norm(xr, (64,), w.double(), 1e-6)[0]
    assert_close(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g.double())
    assert_close(x.grad, xr.grad)


def test_rms_norm_default_eps_is_torchs():
    x = torch.full((2, 8), 1e-4)
    torch.testing.assert_close(ZF.rms_norm(x, (8,)), torch.nn.functional.rms_norm(x, (8,)))


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_gradients_are_deterministic(norm):
    t = _make((4, 61, 300), (300,), torch.bfloat16, "cpu", residual=True)
    keys = ["x", "residual", "weight"] + (["bias"] if norm == "layer" else [])
    first = _run(norm, t, (300,), 1e-5, keys)[2]
    second = _run(norm, t, (300,), 1e-5, keys)[2]
    for k in keys:
        assert torch.equal(first[k], second[k]), k
