"""Bad input to zerofuse's faces (issue 22): the norm and attention functions and modules of
zerofuse.nn, and the fused optimizers of zerofuse.optim (construction, step, step's amp inputs),
with the documented results for odd but legal input (NaN, inf, empty, aliasing, strides) asserted
on values. Tables and runners: tests/bad_input.py."""
from __future__ import annotations

import math

import pytest
import torch

import zerofuse.nn as znn
from zerofuse.nn import functional as F
from zerofuse.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedLARS

from bad_input import TARGET, Behaviour, Case, params, print_census

r, z = torch.randn, torch.zeros
META, I64 = "meta", torch.int64
NAN, INF = math.nan, math.inf
torch_F = torch.nn.functional


def x3():
    return r(2, 3, 8)


def q4(*shape, **kw):
    return r(*(shape or (1, 2, 5, 8)), **kw)


SDPA = "zerofuse.nn.functional.scaled_dot_product_attention"
NN = [
    Case("layer_norm-trailing-dims", F.layer_norm, lambda: (x3(), (7,)), ValueError,
         r"layer_norm: expected input whose trailing dimensions equal normalized_shape=\[7\], got input of shape "
         r"\[2, 3, 8\]"),
    Case("layer_norm-shape-empty", F.layer_norm, lambda: (x3(), ()), ValueError, r"normalized_shape=\[\], got input"),
    Case("layer_norm-input-int", F.layer_norm, lambda: (torch.ones(2, 8, dtype=I64), (8,)), TypeError,
         r"layer_norm: expected input to be a floating-point tensor, got torch.int64"),
    Case("layer_norm-input-list", F.layer_norm, lambda: ([1.0, 2.0], (2,)), TypeError,
         r"expected input to be a floating-point tensor, got list"),
    Case("layer_norm-weight-shape", F.layer_norm, lambda: (x3(), (8,), r(7)), ValueError,
         r"expected weight of shape \[8\] \(normalized_shape\), got \[7\]"),
    Case("layer_norm-weight-int", F.layer_norm, lambda: (x3(), (8,), torch.ones(8, dtype=I64)), TypeError,
         r"expected weight to be a floating-point tensor, got torch.int64"),
    Case("layer_norm-weight-on-meta", F.layer_norm, lambda: (x3(), (8,), r(8, device=META)), ValueError,
         r"expected weight on the device of input \(cpu\), got meta"),
    Case("layer_norm-input-on-meta", F.layer_norm, lambda: (x3().to(META), (8,), r(8)), ValueError,
         r"expected weight on the device of input \(meta\), got cpu"),
    Case("layer_norm-bias-shape", F.layer_norm, lambda: (x3(), (8,), r(8), r(9)), ValueError,
         r"expected bias of shape \[8\] \(normalized_shape\), got \[9\]"),
    Case("layer_norm-eps-negative", F.layer_norm, lambda: (x3(), (8,)), ValueError,
         r"layer_norm: expected eps >= 0, got -1.0", dict(eps=-1.0)),
    Case("layer_norm-eps-nan", F.layer_norm, lambda: (x3(), (8,)), ValueError, r"expected eps >= 0, got nan",
         dict(eps=NAN)),
    # (torch's own errors before: "'>=' not supported", "'float' object is not iterable", "'list' object has
    # no attribute 'shape'"; a review's reproduction, 2026-12-07)
    Case("layer_norm-eps-str", F.layer_norm, lambda: (x3(), (8,)), TypeError,
         r"layer_norm: expected eps to be a float, got 'a'", dict(eps="a")),
    Case("layer_norm-shape-float", F.layer_norm, lambda: (x3(), 8.0), TypeError,
         r"layer_norm: expected normalized_shape to be an int or a sequence of ints, got 8.0"),
    Case("layer_norm-weight-list", F.layer_norm, lambda: (x3(), (8,), [1.0] * 8), TypeError,
         r"layer_norm: expected weight to be a tensor or None, got list"),
    Case("rms_norm-weight-list", F.rms_norm, lambda: (x3(), (8,), [1.0] * 8), TypeError,
         r"rms_norm: expected weight to be a tensor or None, got list"),
    Case("add_rms_norm-residual-list", F.add_rms_norm, lambda: (x3(), [0.0] * 8, (8,)), TypeError,
         r"add_rms_norm: expected residual to be a tensor, got list"),
    Case("linear_cross_entropy-ignore_index-float", F.linear_cross_entropy,  # (1.5 ignored class 1)
         lambda: (r(4, 8), r(10, 8), torch.tensor([1, 2, 3, 1])), TypeError,
         r"linear_cross_entropy: expected ignore_index to be an int, got 1.5", dict(ignore_index=1.5)),
    Case("linear_cross_entropy-label_smoothing-str", F.linear_cross_entropy,
         lambda: (r(4, 8), r(10, 8), torch.tensor([1, 2, 3, 1])), TypeError,
         r"linear_cross_entropy: expected label_smoothing to be a float, got '0.1'", dict(label_smoothing="0.1")),
    Case("rms_norm-weight-shape", F.rms_norm, lambda: (x3(), (8,), r(4)), ValueError,
         r"rms_norm: expected weight of shape \[8\] \(normalized_shape\), got \[4\]"),
    Case("rms_norm-eps-negative", F.rms_norm, lambda: (x3(), (8,)), ValueError,
         r"rms_norm: expected eps >= 0, got -0.5", dict(eps=-0.5)),
    Case("add_layer_norm-residual-shape", F.add_layer_norm, lambda: (x3(), r(2, 3, 7), (8,)), ValueError,
         r"add_layer_norm: expected residual of the input's shape \[2, 3, 8\], got \[2, 3, 7\]"),
    Case("add_layer_norm-residual-int", F.add_layer_norm, lambda: (x3(), torch.ones(2, 3, 8, dtype=I64), (8,)),
         ValueError, r"expected residual to be a floating-point tensor on cpu, got torch.int64 on cpu"),
    Case("add_layer_norm-residual-on-meta", F.add_layer_norm, lambda: (x3(), r(2, 3, 8, device=META), (8,)),
         ValueError, r"expected residual to be a floating-point tensor on cpu, got torch.float32 on meta"),
    Case("add_rms_norm-residual-shape", F.add_rms_norm, lambda: (x3(), r(3, 8), (8,)), ValueError,
         r"add_rms_norm: expected residual of the input's shape \[2, 3, 8\], got \[3, 8\]"),
    Case("LayerNorm-input-width", lambda x: znn.LayerNorm(8)(x), lambda: (r(2, 7),), ValueError,
         r"expected input whose trailing dimensions equal normalized_shape=\[8\], got input of shape \[2, 7\]"),
    Case("RMSNorm-residual-shape", lambda x, res: znn.RMSNorm(8)(x, res), lambda: (r(2, 8), r(2, 7)), ValueError,
         r"add_rms_norm: expected residual of the input's shape \[2, 8\], got \[2, 7\]"),
    Case("sdpa-key-on-meta", F.scaled_dot_product_attention, lambda: (q4(), q4(device=META), q4()), ValueError,
         r"expected key on the device of query \(cpu\), got meta"),
    Case("sdpa-value-on-meta", F.scaled_dot_product_attention, lambda: (q4(), q4(), q4(device=META)), ValueError,
         r"expected value on the device of query \(cpu\), got meta"),
    Case("sdpa-key-bf16", F.scaled_dot_product_attention, lambda: (q4(), q4(dtype=torch.bfloat16), q4()), TypeError,
         r"expected key of the dtype of query \(torch.float32\), got torch.bfloat16"),
    Case("sdpa-query-int", F.scaled_dot_product_attention, lambda: (torch.ones(1, 2, 5, 8, dtype=I64), q4(), q4()),
         TypeError, r"expected query to be a floating-point tensor, got torch.int64"),
    Case("sdpa-value-list", F.scaled_dot_product_attention, lambda: (q4(), q4(), [1.0]), TypeError,
         r"expected value to be a floating-point tensor, got list"),
    Case("sdpa-dropout-negative", F.scaled_dot_product_attention, lambda: (q4(), q4(), q4()), ValueError,
         r"expected dropout_p in \[0, 1\], got -0.5", dict(dropout_p=-0.5)),
    Case("sdpa-dropout-above-1", F.scaled_dot_product_attention, lambda: (q4(), q4(), q4()), ValueError,
         r"expected dropout_p in \[0, 1\], got 1.5", dict(dropout_p=1.5)),
    Case("sdpa-gqa-without-flag", F.scaled_dot_product_attention, lambda: (q4(1, 4, 5, 8), q4(), q4()), ValueError,
         r"query has 4 heads, key 2: pass enable_gqa=True"),
    Case("sdpa-gqa-heads-indivisible", F.scaled_dot_product_attention, lambda: (q4(1, 3, 5, 8), q4(), q4()),
         ValueError, r"key/value heads \(2\) .*query heads \(3\)", dict(enable_gqa=True)),
    Case("sdpa-key-head-dim", F.scaled_dot_product_attention, lambda: (q4(), q4(1, 2, 5, 4), q4(1, 2, 5, 4)),
         ValueError, r"expected key and value of shape .*D=8.*got \(1, 2, 5, 4\)"),
    Case("Attention-heads-indivisible", znn.Attention, lambda: (10, 3), ValueError,
         r"Attention: expected num_heads \(3\) to divide embed_dim \(10\)"),
    Case("Attention-kv-heads-indivisible", znn.Attention, lambda: (12, 4, 3), ValueError,
         r"Attention: expected num_kv_heads \(3\) to divide num_heads \(4\)"),
    Case("Attention-kv-heads-0", znn.Attention, lambda: (12, 4, 0), ValueError,
         r"Attention: expected num_kv_heads >= 1, got 0"),
    Case("Attention-heads-0", znn.Attention, lambda: (12, 0), ValueError, r"Attention: expected num_heads >= 1, got 0"),
    Case("Attention-input-width", lambda x: znn.Attention(12, 4)(x), lambda: (r(1, 5, 10),), ValueError,
         r"zerofuse.nn.Attention: expected x of shape \(batch, seq, embed_dim=12\), got \[1, 5, 10\]"),
    Case("Attention-input-2d", lambda x: znn.Attention(12, 4)(x), lambda: (r(5, 12),), ValueError,
         r"expected x of shape \(batch, seq, embed_dim=12\), got \[5, 12\]"),
]


def _step(cls, params, grads, kw=None, **step_kw):
    for p, g in zip(params, grads):
        p.grad = g
    cls(params, **(kw or {})).step(**step_kw)


def P(*shape, **kw):
    return torch.nn.Parameter(r(*shape, **kw))


def _optimizer_rows(cls) -> list[Case]:
    n = cls.__name__
    rows = [
        Case(f"{n}-param-twice", lambda p: cls([p, P(2), p]), lambda: (P(3),), ValueError,
             rf"{n}: expected each param once in a param group, got params\[2\] of param_groups\[0\] the same tensor "
             r"as params\[0\]"),
        Case(f"{n}-param-in-two-groups", lambda p: cls([{"params": [p]}, {"params": [p]}]), lambda: (P(3),),
             ValueError, r"some parameters appear in more than one parameter group"),
        Case(f"{n}-no-params", cls, lambda: ([],), ValueError, r"optimizer got an empty parameter list"),
        Case(f"{n}-param-strided", _step, lambda: (cls, [torch.nn.Parameter(r(4, 3).t())], [r(3, 4)]), RuntimeError,
             rf"{n}: expected param_groups\[0\]\['params'\]\[0\] to be contiguous .*got shape \[3, 4\] with strides "
             r"\[1, 3\]"),
        Case(f"{n}-param-float64", _step, lambda: (cls, [P(3), P(3, dtype=torch.float64)], [r(3), r(3).double()]),
             RuntimeError, rf"{n}: expected param_groups\[0\]\['params'\]\[1\] in float32, bfloat16 or float16, got "
                           r"torch.float64"),
        Case(f"{n}-params-two-devices", _step, lambda: (cls, [P(3), P(3, device=META)], [r(3), r(3, device=META)]),
             RuntimeError, rf"{n}: expected every param with a grad on one device, got \['cpu', 'meta'\]"),
        Case(f"{n}-sparse-grad", _step, lambda: (cls, [P(4, 3)], [r(4, 3).to_sparse()]), RuntimeError,
             rf"{n}: sparse gradients are not supported"),
        Case(f"{n}-grad_scale-0", _step, lambda: (cls, [P(3)], [r(3)]), ValueError,
             rf"{n}.step: expected grad_scale to be finite and > 0, got 0.0", dict(grad_scale=0.0)),
        Case(f"{n}-grad_scale-inf", _step, lambda: (cls, [P(3)], [r(3)]), ValueError,
             r"expected grad_scale to be finite and > 0, got inf", dict(grad_scale=INF)),
        Case(f"{n}-grad_scale-tensor-negative", _step, lambda: (cls, [P(3)], [r(3)]), ValueError,
             r"expected grad_scale to be finite and > 0, got -2.0", lambda: dict(grad_scale=torch.tensor(-2.0))),
        Case(f"{n}-found_inf-shape", _step, lambda: (cls, [P(3)], [r(3)]), ValueError,
             rf"{n}.step: expected found_inf to hold one number, got a tensor of shape \[2\]",
             lambda: dict(found_inf=z(2))),
        Case(f"{n}-found_inf-str", _step, lambda: (cls, [P(3)], [r(3)]), TypeError,
             r"expected found_inf to be a number or a 1-element tensor, got str", dict(found_inf="yes")),
        Case(f"{n}-lr-negative", cls, lambda: ([P(3)],), ValueError,
             r"(Invalid learning rate|expected lr finite and >= 0, got)[: ]*-1.0", dict(lr=-1.0)),
        Case(f"{n}-lr-nan", cls, lambda: ([P(3)],), ValueError,
             r"(Invalid learning rate|expected lr finite and >= 0, got)[: ]*nan", dict(lr=NAN)),
        Case(f"{n}-weight_decay-negative", cls, lambda: ([P(3)],), ValueError,
             r"(Invalid weight_decay value|expected weight_decay finite and >= 0, got)[: ]*-1.0", dict(weight_decay=-1.0)),
        Case(f"{n}-max_grad_norm-negative", cls, lambda: ([P(3)],), ValueError,
             rf"{n}: expected max_grad_norm >= 0 or None( \(0: no clipping\))?, got -1.0", dict(max_grad_norm=-1.0)),
        Case(f"{n}-max_grad_norm-nan", cls, lambda: ([P(3)],), ValueError,
             rf"{n}: expected max_grad_norm >= 0 or None( \(0: no clipping\))?, got nan", dict(max_grad_norm=NAN)),
    ]
    if cls is not FusedLARS:
        rows += [
            Case(f"{n}-betas-one", cls, lambda: ([P(3)],), ValueError,
                 rf"{n}: expected betas to be a pair \(beta1, beta2\) in \[0, 1\), got \(0.9,\)", dict(betas=(0.9,))),
            Case(f"{n}-betas-above-1", cls, lambda: ([P(3)],), ValueError,
                 rf"{n}: expected betas to be a pair .*got \(1.5, 0.9\)", dict(betas=(1.5, 0.9))),
            Case(f"{n}-eps-negative", cls, lambda: ([P(3)],), ValueError,
                 r"(Invalid epsilon value|expected eps finite and >= 0, got)[: ]*-1.0", dict(eps=-1.0)),
        ]
    return rows


def _load_short_state():
    p = P(4)
    opt = FusedAdamW([p])
    ref = torch.optim.AdamW([torch.nn.Parameter(r(3))])
    ref.param_groups[0]["params"][0].grad = r(3)
    ref.step()
    opt.load_state_dict(ref.state_dict())
    _step(lambda ps: opt, [p], [r(4)])


OPTIM = [row for cls in (FusedAdamW, FusedAdam, FusedLAMB, FusedLARS) for row in _optimizer_rows(cls)] + [
    Case("FusedAdamW-amsgrad", FusedAdamW, lambda: ([P(3)],), ValueError,
         r"FusedAdamW: amsgrad=True is not supported \(use torch.optim.AdamW\)", dict(amsgrad=True)),
    Case("FusedAdamW-fused-False", FusedAdamW, lambda: ([P(3)],), ValueError, r"fused=False asks for an unfused step",
         dict(fused=False)),
    Case("FusedAdam-differentiable", FusedAdam, lambda: ([P(3)],), ValueError,
         r"FusedAdam: differentiable=True is not supported", dict(differentiable=True)),
    Case("FusedLAMB-mode", FusedLAMB, lambda: ([P(3)],), ValueError,
         r"FusedLAMB: expected mode 'paper' or 'nvlamb', got 'lars'", dict(mode="lars")),
    Case("FusedLAMB-trust-range", FusedLAMB, lambda: ([P(3)],), ValueError,
         r"expected 0 <= min_trust <= max_trust, got 2.0, 1.0", dict(min_trust=2.0, max_trust=1.0)),
    Case("FusedLAMB-lr-inf", FusedLAMB, lambda: ([P(3)],), ValueError, r"FusedLAMB: expected lr finite and >= 0, got inf",
         dict(lr=float("inf"))),
    Case("FusedLARS-trust_coefficient-inf", FusedLARS, lambda: ([P(3)],), ValueError,
         r"FusedLARS: expected trust_coefficient finite and >= 0, got inf", dict(trust_coefficient=float("inf"))),
    Case("FusedLARS-momentum-negative", FusedLARS, lambda: ([P(3)],), ValueError,
         r"FusedLARS: expected momentum finite and >= 0, got -0.1", dict(momentum=-0.1)),
    Case("FusedLARS-trust_coefficient-negative", FusedLARS, lambda: ([P(3)],), ValueError,
         r"FusedLARS: expected trust_coefficient finite and >= 0, got -1", dict(trust_coefficient=-1)),
    Case("FusedAdamW-loaded-state-of-another-shape", _load_short_state, tuple, ValueError,
         r"expected exp_avgs\[0\] to have 4 elements like params\[0\], got 3"),
]


# ---------------------------------------------------------------------------- documented behaviour


def _ln_strided_input_matches_torch():
    x = r(3, 2, 8).transpose(0, 1)
    torch.testing.assert_close(F.layer_norm(x, (8,)), torch_F.layer_norm(x, (8,)))


def _norms_of_empty_rows_and_rows_of_nothing():
    for shape in ((0, 8), (3, 0)):
        x = r(*shape)
        assert F.layer_norm(x, shape[1:]).shape == torch_F.layer_norm(x, shape[1:]).shape == x.shape
        assert F.rms_norm(x, shape[1:]).shape == x.shape


def _nan_stays_in_its_row():
    x = r(3, 8)
    x[1, 2] = NAN
    for ours, theirs in ((F.layer_norm, torch_F.layer_norm), (F.rms_norm, torch_F.rms_norm)):
        y = ours(x, (8,))
        assert y[1].isnan().all() and y[[0, 2]].isfinite().all()
        torch.testing.assert_close(y[[0, 2]], theirs(x, (8,))[[0, 2]])


def _residual_aliasing_input():
    x = r(2, 8)
    y, h = F.add_layer_norm(x, x, (8,))
    torch.testing.assert_close(h, 2 * x)
    torch.testing.assert_close(y, torch_F.layer_norm(2 * x, (8,)))


def _sdpa_strided_head_dim_matches_torch():
    q, k, v = (r(1, 2, 8, 5).transpose(2, 3) for _ in range(3))  # head_dim is the strided dim
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v), torch_F.scaled_dot_product_attention(q, k, v),
                               rtol=1e-5, atol=1e-5)


def _sdpa_nan_key_spreads_as_torch():
    q, k = q4(), q4()
    k[0, 0, 2, 3] = NAN
    got = F.scaled_dot_product_attention(q, k, k)
    assert torch.equal(got.isnan(), torch_F.scaled_dot_product_attention(q, k, k).isnan())
    assert got[0, 0].isnan().all() and got[0, 1].isfinite().all()  # head 0 attends to the NaN key


def _sdpa_3d_runs_torch_after_a_warning():
    q = r(2, 5, 8)
    with pytest.warns(UserWarning, match="expected 4-D"):
        got = F.scaled_dot_product_attention(q, q, q)
    torch.testing.assert_close(got, torch_F.scaled_dot_product_attention(q, q, q))


def _inf_grad_under_clipping_skips(cls):
    def check():
        p = P(4)
        before = p.detach().clone()
        p.grad = torch.tensor([1.0, INF, 0.0, 1.0])
        opt = cls([p], max_grad_norm=1.0)
        opt.step()
        assert torch.equal(p.detach(), before)
        assert opt.state[p].get("step", torch.zeros(())).item() == 0  # nor is the step counted
        assert not math.isfinite(opt.last_grad_norm.item())

    return check


def _nan_grad_without_clipping_as_torch():
    p = P(4)
    q = torch.nn.Parameter(p.detach().clone())
    p.grad = torch.tensor([1.0, NAN, 0.0, 1.0])
    q.grad = p.grad.clone()
    FusedAdamW([p]).step()
    torch.optim.AdamW([q]).step()
    assert torch.equal(p.detach().isnan(), q.detach().isnan())  # the NaN element only, as torch
    torch.testing.assert_close(p.detach()[[0, 2, 3]], q.detach()[[0, 2, 3]])


def _found_inf_skips():
    p = P(3)
    before = p.detach().clone()
    p.grad = r(3)
    opt = FusedAdamW([p])
    opt.step(found_inf=torch.ones(1))
    assert torch.equal(p.detach(), before) and opt.state[p]["step"].item() == 0


BEHAVIOUR = [
    Behaviour("layer_norm-strided-input", _ln_strided_input_matches_torch),
    Behaviour("norms-empty", _norms_of_empty_rows_and_rows_of_nothing),
    Behaviour("norms-nan-row", _nan_stays_in_its_row),
    Behaviour("add_layer_norm-residual-is-input", _residual_aliasing_input),
    Behaviour("sdpa-strided-head-dim", _sdpa_strided_head_dim_matches_torch),
    Behaviour("sdpa-nan-key", _sdpa_nan_key_spreads_as_torch),
    Behaviour("sdpa-3d", _sdpa_3d_runs_torch_after_a_warning),
    *(Behaviour(f"{cls.__name__}-inf-grad-clipped-skips", _inf_grad_under_clipping_skips(cls))
      for cls in (FusedAdamW, FusedLAMB, FusedLARS)),
    Behaviour("FusedAdamW-nan-grad-unclipped", _nan_grad_without_clipping_as_torch),
    Behaviour("FusedAdamW-found_inf-skips", _found_inf_skips),
]

TABLES = {"nn faces": NN, "optimizers": OPTIM, "documented behaviour": BEHAVIOUR}


@pytest.mark.parametrize("case", params(NN + OPTIM))
def test_bad_input(case):
    case.check()


@pytest.mark.parametrize("row", params(BEHAVIOUR))
def test_behaviour(row):
    row.check()


def test_case_count(capsys):
    assert print_census(__name__, capsys) >= TARGET
