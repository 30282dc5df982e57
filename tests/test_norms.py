"""Fused LayerNorm / RMSNorm: values and gradients vs the fp64 reference, faces, compile, errors.

Without a GPU the session runs the Triton kernels in the interpreter (conftest); ``path=cpp``
cases use the cpu_kernels fixture to test the C++ CPU kernels (csrc/cpu/norms.cpp) the same way.
"""
import inspect

import pytest
import torch

import zerofuse
import zerofuse.nn.functional as ZF
from common import DEVICES
from tolerances import assert_close
from zerofuse import reference


def _make(shape, normalized, dtype, device, affine=True, bias=True, residual=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda s: torch.randn(s, generator=g, dtype=torch.float64)  # noqa: E731
    t = {"x": mk(shape) * 2 + 0.5, "dy": mk(shape)}
    if residual:
        t["residual"] = mk(shape)
    if affine:
        t["weight"] = mk(normalized) * 0.5 + 1
        if bias:
            t["bias"] = mk(normalized)
    # round to the test dtype first, so reference and kernel see the same input values
    return {k: v.to(dtype).to(device) for k, v in t.items()}


def _run(norm, t, normalized, eps, grad_keys):
    """Our forward + backward; returns (y, h, grads) with grads keyed like t."""
    leaves = {k: t[k].clone().requires_grad_() for k in grad_keys}
    w, b, r = leaves.get("weight"), leaves.get("bias"), leaves.get("residual")
    if norm == "layer":
        out = ZF.add_layer_norm(leaves["x"], r, normalized, w, b, eps) if r is not None else (ZF.layer_norm(leaves["x"], normalized, w, b, eps), None)
    else:
        out = ZF.add_rms_norm(leaves["x"], r, normalized, w, eps) if r is not None else (ZF.rms_norm(leaves["x"], normalized, w, eps), None)
    y, h = out
    loss = (y.double() * t["dy"].double()).sum()
    if h is not None:  # the residual stream continues: its gradient must be accumulated too
        loss = loss + (h.double() * 0.25).sum()
    loss.backward()
    return y, h, {k: v.grad for k, v in leaves.items()}


def _reference(norm, t, normalized, eps, grad_keys):
    """fp64 reference of the same math. The fused sum h = x + residual is rounded to the input
    dtype, as unfused code would round it, then normalised in fp64; its gradient is both dx and
    dresidual."""
    h_in = t["x"] + t["residual"] if "residual" in t else t["x"]
    base = h_in.double().cpu().requires_grad_()
    params = {k: t[k].double().cpu().requires_grad_() for k in grad_keys if k in ("weight", "bias")}
    kw = dict(weight=params.get("weight"), eps=eps)
    if norm == "layer":
        kw["bias"] = params.get("bias")
    y, h = (reference.layer_norm if norm == "layer" else reference.rms_norm)(base, normalized, **kw)
    loss = (y * t["dy"].double().cpu()).sum()
    if "residual" in t:
        loss = loss + (h * 0.25).sum()
    loss.backward()
    grads = {k: p.grad for k, p in params.items()}
    grads.update({k: base.grad for k in ("x", "residual") if k in grad_keys})
    return y, h, grads


def _check(norm, shape, normalized, dtype, device, eps=1e-5, **kw):
    t = _make(shape, normalized, dtype, device, **kw)
    keys = [k for k in ("x", "residual", "weight", "bias") if k in t and not (norm == "rms" and k == "bias")]
    y, h, grads = _run(norm, t, normalized, eps, keys)
    y_ref, h_ref, grads_ref = _reference(norm, t, normalized, eps, keys)
    assert y.dtype == dtype and y.shape == t["x"].shape
    assert_close(y.cpu(), y_ref)
    if h is not None:
        assert torch.equal(h, t["x"] + t["residual"])  # the sum is rounded exactly as unfused code
    for k in keys:
        assert grads[k].dtype == t[k].dtype, k
        op = "norm_param_grad" if k in ("weight", "bias") else None
        assert_close(grads[k].cpu(), grads_ref[k], op=op, msg=lambda m: f"d{k}: {m}")


PATHS = ["triton", "cpp"]


@pytest.fixture(params=PATHS)
def path(request):
    if request.param == "cpp":
        request.getfixturevalue("cpu_kernels")
    return request.param


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


# ---- modules ----


def test_modules_have_torchs_signatures_and_state_dicts():
    assert inspect.signature(zerofuse.nn.LayerNorm.__init__) == inspect.signature(torch.nn.LayerNorm.__init__)
    assert inspect.signature(zerofuse.nn.RMSNorm.__init__) == inspect.signature(torch.nn.RMSNorm.__init__)
    assert inspect.signature(ZF.layer_norm).parameters.keys() == inspect.signature(torch.nn.functional.layer_norm).parameters.keys()
    assert inspect.signature(ZF.rms_norm).parameters.keys() == inspect.signature(torch.nn.functional.rms_norm).parameters.keys()
    for kw in [{}, {"bias": False}, {"elementwise_affine": False}]:
        ours, theirs = zerofuse.nn.LayerNorm(96, **kw), torch.nn.LayerNorm(96, **kw)
        assert ours.state_dict().keys() == theirs.state_dict().keys()
    theirs = torch.nn.LayerNorm((4, 6))
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.bias.normal_()
    ours = zerofuse.nn.LayerNorm((4, 6))
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 4, 6)
    assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    rms_t, rms_o = torch.nn.RMSNorm(32, eps=1e-6), zerofuse.nn.RMSNorm(32, eps=1e-6)
    rms_o.load_state_dict(rms_t.state_dict())
    x = torch.randn(5, 32)
    assert_close(rms_o(x), rms_t(x))


def test_module_residual_forward_returns_norm_and_sum():
    m = zerofuse.nn.RMSNorm(16)
    x, r = torch.randn(4, 16), torch.randn(4, 16)
    y, h = m(x, r)
    assert torch.equal(h, x + r)
    assert_close(y, torch.nn.functional.rms_norm(x + r, (16,), m.weight))


class _PreNormBlock(torch.nn.Module):
    """Hugging Face-style pre-norm decoder block (LLaMA: RMSNorm; GPT-2: LayerNorm)."""

    def __init__(self, d, norm):
        super().__init__()
        self.input_layernorm = norm(d)
        self.attn = torch.nn.Linear(d, d)
        self.post_attention_layernorm = norm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Model(torch.nn.Module):
    def __init__(self, norm, d=48, layers=2):
        super().__init__()
        self.layers = torch.nn.ModuleList(_PreNormBlock(d, norm) for _ in range(layers))
        self.norm = norm(d)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


@pytest.mark.parametrize("norm", [torch.nn.LayerNorm, torch.nn.RMSNorm])
def test_replace_norms_keeps_outputs_gradients_and_parameters(norm, path):
    torch.manual_seed(0)
    model = _Model(norm)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_()
    x = torch.randn(3, 17, 48)
    y0 = model(x)
    y0.square().mean().backward()
    grads0 = {n: p.grad.clone() for n, p in model.named_parameters()}
    params0 = {n: p for n, p in model.named_parameters()}
    model.zero_grad()

    assert zerofuse.nn.replace_norms(model) is model
    kinds = {type(m) for m in model.modules()}
    assert norm not in kinds and (zerofuse.nn.LayerNorm in kinds or zerofuse.nn.RMSNorm in kinds)
    assert {n: p for n, p in model.named_parameters()} == params0  # same Parameter objects
    y1 = model(x)
    y1.square().mean().backward()
    assert_close(y1, y0, atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        assert_close(p.grad, grads0[n], atol=1e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")


def test_replace_norms_on_a_bare_norm_returns_it_replaced():
    ln = torch.nn.LayerNorm(8, bias=False)
    new = zerofuse.nn.replace_norms(ln)
    assert type(new) is zerofuse.nn.LayerNorm and new is ln and new.bias is None


def test_replace_norms_keeps_hooks_and_attributes():
    """The norm is the same module afterwards (a new one lost its forward hooks, state_dict hooks
    and attributes: accelerate-style wrappers and user hooks stopped running silently)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RMSNorm(8))
    seen = []
    model[1].register_forward_pre_hook(lambda m, a: seen.append("pre"))
    model[1].register_forward_hook(lambda m, a, out: seen.append("post"))
    model[1].tag = "kept"
    zerofuse.nn.replace_norms(model)
    model(torch.randn(2, 8))
    assert type(model[1]) is zerofuse.nn.RMSNorm and model[1].tag == "kept" and seen == ["pre", "post"]


# ---- errors ----


@pytest.mark.parametrize(
    "call,exc,msg",
    [
        (lambda: ZF.layer_norm(torch.randn(2, 8), (8,), torch.ones(7)), ValueError, r"layer_norm: expected weight of shape \[8\] \(normalized_shape\), got \[7\]"),
        (lambda: ZF.layer_norm(torch.randn(2, 8), (4,)), ValueError, r"expected input whose trailing dimensions equal normalized_shape=\[4\], got input of shape \[2, 8\]"),
        (lambda: ZF.rms_norm(torch.ones(2, 8, dtype=torch.int64), (8,)), TypeError, r"rms_norm: expected input to be a floating-point tensor, got torch.int64"),
        (lambda: ZF.layer_norm(torch.randn(2, 8), (8,), None, torch.ones(8, dtype=torch.int32)), TypeError, r"expected bias to be a floating-point tensor, got torch.int32"),
        (lambda: ZF.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), (8,)), ValueError, r"add_rms_norm: expected residual of the input's shape \[2, 8\], got \[3, 8\]"),
        (lambda: ZF.layer_norm(torch.randn(2, 8), (8,), torch.ones(8, device="meta")), ValueError, r"expected weight on the device of input \(cpu\), got meta"),
    ],
)
def test_bad_input_errors_name_the_argument(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


# ---- torch.library ----


def _op_samples(dtype=torch.float32):
    x, r = torch.randn(3, 7, 40, dtype=dtype), torch.randn(3, 7, 40, dtype=dtype)
    w, b = torch.randn(40, dtype=dtype), torch.randn(40, dtype=dtype)
    return x, r, w, b


def test_opcheck_forward_and_backward_ops():
    x, r, w, b = _op_samples()
    for args in [(x, w, b, r, 1e-5), (x, None, None, None, 1e-5), (x.requires_grad_(), w.requires_grad_(), b, r, 1e-5)]:
        torch.library.opcheck(torch.ops.zerofuse.layer_norm.default, args)
    for args in [(x, w, r, 1e-6), (x.detach(), None, None, 1e-6)]:
        torch.library.opcheck(torch.ops.zerofuse.rms_norm.default, args)
    y, h, mean, rstd = torch.ops.zerofuse.layer_norm(x.detach(), w.detach(), b, r, 1e-5)
    dy = torch.randn_like(y)
    torch.library.opcheck(torch.ops.zerofuse.layer_norm_backward.default, (dy, torch.randn_like(h), h, w.detach(), b, mean, rstd))
    y, h, rstd = torch.ops.zerofuse.rms_norm(x.detach(), w.detach(), r, 1e-6)
    torch.library.opcheck(torch.ops.zerofuse.rms_norm_backward.default, (dy, None, h, w.detach(), rstd))


def test_fakes_match_torchs_fallback_path(cpu_kernels):
    """The path through torch's native kernels (float64; a residual of a wider dtype on the CPU):
    h kept a transposed input's strides and a float64 residual made float64 stats while the fakes
    promise contiguous h and stats in h's stat dtype (under compile: "incorrect fake")."""
    xt, rt = (torch.randn(8, 5, dtype=torch.float64).t() for _ in range(2))
    x32, r64 = torch.randn(5, 8), torch.randn(5, 8, dtype=torch.float64)
    for x, r in ((xt, rt), (x32, r64)):
        torch.library.opcheck(torch.ops.zerofuse.layer_norm.default, (x, None, None, r, 1e-5))
        torch.library.opcheck(torch.ops.zerofuse.rms_norm.default, (x, None, r, 1e-6))
        y, h, mean, rstd = torch.ops.zerofuse.layer_norm(x, None, None, r, 1e-5)
        assert h.is_contiguous() and mean.dtype == rstd.dtype == torch.float64  # (h's: float64 here)
    x, r = x32.clone().requires_grad_(), r64.clone().requires_grad_()
    y, h = ZF.add_layer_norm(x, r, (8,))
    y.backward(torch.arange(40.0).view(5, 8))
    ref = [t.detach().double().requires_grad_() for t in (x32, r64)]
    torch.nn.functional.layer_norm(ref[0] + ref[1], (8,)).backward(torch.arange(40.0, dtype=torch.float64).view(5, 8))
    # float64 h: float64 stats, so the float64 grads are float64-exact (the stats rounded to fp32 put
    # 1e-7 errors into them: a review's reproduction, 2026-12-06)
    for got, want in zip((x.grad, r.grad), (ref[0].grad, ref[1].grad)):
        assert_close(got, want)


def test_the_ops_stats_are_not_differentiable():
    """mean and rstd carry no gradient (the backward ignores one): they are marked so, as attention's
    lse is, instead of taking a loss's gradient through them as zero without a word."""
    x = torch.randn(4, 8, requires_grad=True)
    y, h, mean, rstd = torch.ops.zerofuse.layer_norm(x, None, None, None, 1e-5)
    assert y.requires_grad and not mean.requires_grad and not rstd.requires_grad
    y, h, rstd = torch.ops.zerofuse.rms_norm(x, None, None, 1e-5)
    assert y.requires_grad and not rstd.requires_grad


def _block(x, r, w, b):
    y, h = ZF.add_layer_norm(x, r, (x.shape[-1],), w, b)
    z, _ = ZF.add_rms_norm(torch.nn.functional.gelu(y), h, (x.shape[-1],), w)
    return z


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_forward_and_backward(device):
    x, r, w, b = (t.to(device) for t in _op_samples())
    leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
    eager_leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
    out = torch.compile(_block, fullgraph=True)(*leaves)
    ref = _block(*eager_leaves)
    assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    for a, e in zip(leaves, eager_leaves):
        assert_close(a.grad, e.grad, atol=1e-4, rtol=1e-4)


# ---- GPU (skipped without CUDA) ----


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [123, 4096, 5120, 8192, 65536])
def test_cuda_matches_reference(norm, dtype, hidden):
    _check(norm, (1024 if hidden <= 8192 else 64, hidden), (hidden,), dtype, "cuda", residual=True)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [torch.nn.LayerNorm, torch.nn.RMSNorm])
def test_cuda_autocast_runs_the_norms_in_fp32_as_torch_does(norm):
    """Under torch.autocast("cuda") torch's layer_norm / rms_norm compute and return fp32 for bf16
    inputs (its fp32 list); the faces returned bf16."""
    torch.manual_seed(0)
    ref = norm(96).cuda()
    ours = {torch.nn.LayerNorm: zerofuse.nn.LayerNorm, torch.nn.RMSNorm: zerofuse.nn.RMSNorm}[norm](96).cuda()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(7, 96, device="cuda", dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want, got = ref(x), ours(x)
    assert got.dtype == want.dtype == torch.float32
    assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---- the C++ CPU kernels directly ----


def test_cpu_kernel_gradients_do_not_depend_on_thread_count(cpu_kernels):
    t = _make((3, 50, 257), (257,), torch.float32, "cpu", residual=True)
    keys = ["x", "residual", "weight", "bias"]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run("layer", t, (257,), 1e-5, keys)[2]
        torch.set_num_threads(max(2, threads))
        many = _run("layer", t, (257,), 1e-5, keys)[2]
    finally:
        torch.set_num_threads(threads)
    for k in keys:
        assert torch.equal(one[k], many[k]), k


def test_opcheck_cpu_kernel_ops():
    x, r, w, b = _op_samples(torch.bfloat16)
    x, r = x.reshape(-1, 40), r.reshape(-1, 40)
    torch.library.opcheck(torch.ops.zerofuse.norm_fwd_cpu.default, (x, w, b, r, 1e-5, False))
    torch.library.opcheck(torch.ops.zerofuse.norm_fwd_cpu.default, (x, None, None, None, 1e-5, True))
    y, h, mean, rstd = torch.ops.zerofuse.norm_fwd_cpu(x, w, b, r, 1e-5, False)
    torch.library.opcheck(torch.ops.zerofuse.norm_bwd_cpu.default, (torch.randn_like(y), torch.randn_like(h), h, w, b, mean, rstd, False))


def test_cpu_kernel_rejects_bad_input():
    with pytest.raises(RuntimeError, match=r"zerofuse::norm_cpu: expected x in float32, float16 or bfloat16, got Double"):
        torch.ops.zerofuse.norm_fwd_cpu(torch.randn(2, 4, dtype=torch.float64), None, None, None, 1e-5, False)
    with pytest.raises(RuntimeError, match=r"expected residual to be a contiguous \(2, 4\) tensor, got shape \[2, 5\]"):
        torch.ops.zerofuse.norm_fwd_cpu(torch.randn(2, 4), None, None, torch.randn(2, 5), 1e-5, False)
    for rms in (False, True):  # a hidden size of 0: LayerNorm read x[0] of an empty row (a segfault)
        with pytest.raises(RuntimeError, match=r"with a hidden size >= 1, got shape \[3, 0\]"):
            torch.ops.zerofuse.norm_fwd_cpu(torch.randn(3, 0), None, None, None, 1e-5, rms)
    with pytest.raises(RuntimeError, match=r"zerofuse::layer_norm: expected x .* with a hidden size >= 1"):
        torch.ops.zerofuse.layer_norm(torch.randn(3, 0), None, None, None, 1e-5)


def test_cpu_kernel_rms_of_squares_summing_past_the_float_range(cpu_kernels):
    """17 values of 5e18: each square (2.5e37) and their mean are floats, their sum (4.25e38) is not.
    The C++ kernel divided the (double) sum by N only after rounding it to float: inf, rstd 0, y 0
    (torch's own rms_norm gives 0 too; the Triton kernels sum in fp32 as torch does)."""
    x = torch.full((2, 17), 5e18)
    x[1] *= -1
    w = torch.linspace(0.5, 1.5, 17)
    assert_close(ZF.rms_norm(x, (17,), w), reference.rms_norm(x.double(), (17,), w.double())[0].float())


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_custom_op_autograd_matches_the_eager_path(norm, path):
    """Eager faces use ops.norms.EagerNorm; compiled graphs use the custom ops' registered autograd."""
    from zerofuse.ops import norms as ops

    t = _make((3, 29, 70), (70,), torch.float32, "cpu", residual=True)
    keys = ["x", "residual", "weight"] + (["bias"] if norm == "layer" else [])
    eager = _run(norm, t, (70,), 1e-5, keys)
    leaves = {k: t[k].clone().requires_grad_() for k in keys}
    if norm == "layer":
        y, h, _, _ = ops.layer_norm(leaves["x"], leaves["weight"], leaves["bias"], leaves["residual"], 1e-5)
    else:
        y, h, _ = ops.rms_norm(leaves["x"], leaves["weight"], leaves["residual"], 1e-5)
    ((y.double() * t["dy"].double()).sum() + (h.double() * 0.25).sum()).backward()
    assert torch.equal(y, eager[0]) and torch.equal(h, eager[1])
    for k in keys:
        assert torch.equal(leaves[k].grad, eager[2][k]), k


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_eager_path_without_autograd_gives_the_ops_values(norm, path):
    """With nothing requiring grad the faces run the kernels without autograd's bookkeeping (and with
    grad, through zerofuse.ops.eager_apply: test_custom_op_autograd_matches_the_eager_path): the
    custom ops' values, no graph."""
    import zerofuse.nn.functional as ZF
    from zerofuse.ops import norms as ops

    t = _make((3, 29, 70), (70,), torch.float32, "cpu", residual=True)
    with torch.no_grad():
        if norm == "layer":
            y, h = ZF.add_layer_norm(t["x"], t["residual"], (70,), t["weight"], t["bias"])
            want = ops.layer_norm(t["x"], t["weight"], t["bias"], t["residual"], 1e-5)
        else:
            y, h = ZF.add_rms_norm(t["x"], t["residual"], (70,), t["weight"], 1e-5)
            want = ops.rms_norm(t["x"], t["weight"], t["residual"], 1e-5)
    assert torch.equal(y, want[0]) and torch.equal(h, want[1]) and y.grad_fn is None
    x = t["x"].clone().requires_grad_()  # one input requiring grad is enough for the autograd path
    y = ZF.layer_norm(x, (70,), t["weight"], t["bias"]) if norm == "layer" else ZF.rms_norm(x, (70,), t["weight"])
    assert y.grad_fn is not None
