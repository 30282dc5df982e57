"""zerofuse.moe on one process: moe_permute / moe_unpermute against the float64 reference (odd token
counts, top-k 1/2/4, empty experts, dropped choices, fp32/bf16, both paths, forward and backward),
op checks; the router against its reference and its balancing terms; the MoE layer against a loop
over the experts."""
import math
import re

import numpy as np

import pytest
import torch

from tolerances import assert_close
from zerofuse import reference
from zerofuse.moe import MoE, Router, grouped_mm
from zerofuse.ops.moe import moe_permute, moe_unpermute


def _routing(t, k, e, drop, seed=0):
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.empty(0, k).long()
    experts[experts == e - 1] = 0 if e > 2 else experts[experts == e - 1]  # expert e - 1 gets nothing
    if drop:
        experts[torch.rand(t, k, generator=g) < 0.2] = -1
    return experts


@pytest.mark.parametrize("t,k,e", [(37, 2, 5), (97, 1, 8), (13, 4, 6), (1, 2, 3), (0, 2, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("drop", [False, True])
def test_permute_unpermute_match_the_reference(t, k, e, dtype, drop, kernel_path):
    d = 123
    g = torch.Generator().manual_seed(1)
    experts = _routing(t, k, e, drop)
    x64 = torch.randn(t, d, generator=g, dtype=torch.float64)
    w64 = torch.rand(t, k, generator=g, dtype=torch.float64)
    dz = torch.randn(t, d, generator=g, dtype=torch.float64)
    x = x64.to(dtype).requires_grad_()
    w = w64.float().requires_grad_()
    rows, pos, src, counts = moe_permute(x, experts, e)
    ref_rows, ref_counts = reference.moe_permute(x64.to(dtype).double(), experts, e)
    assert rows.dtype == dtype and torch.equal(rows.double(), ref_rows)  # a copy: exact
    assert torch.equal(counts, ref_counts) and counts.sum() == (experts >= 0).sum()
    y64 = torch.randn(t * k, d, generator=g, dtype=torch.float64)
    y = y64.to(dtype).requires_grad_()
    z = moe_unpermute(y, pos, src, w)
    assert z.dtype == torch.float32  # the router's fp32 weights: combined in fp32
    if not (experts >= 0).any():  # no tokens, or every choice dropped: zeros, and zero grads
        assert z.shape == (t, d) and rows.shape == (t * k, d) and pos.shape == (t, k) and not z.any()
        (z.sum() + rows.float().sum()).backward()
        assert not x.grad.any() and not w.grad.any() and not y.grad.any()
        return
    yr, wr = y64.to(dtype).double().requires_grad_(), w64.float().double().requires_grad_()
    zr = reference.moe_unpermute(yr, experts, wr, e)
    assert_close(z, zr.float())
    (z.double() * dz).sum().backward()
    (zr * dz).sum().backward()
    assert_close(y.grad, yr.grad.to(dtype))
    assert_close(w.grad, wr.grad.float(), atol=1e-4, rtol=1e-4)
    (rows.double() * y64).sum().backward()  # permute's backward: each token's rows summed
    xr = x64.to(dtype).double().requires_grad_()
    (reference.moe_permute(xr, experts, e)[0] * y64).sum().backward()
    assert_close(x.grad, xr.grad.to(dtype))


@pytest.mark.parametrize("drop", [False, True])
def test_eager_paths_are_the_ops(drop, kernel_path):
    """ops.moe.permute / unpermute (what the MoE layer calls: eager autograd without custom_op's
    dispatch) give the ops' outputs and gradients bit for bit; the routing outputs carry no grad."""
    from zerofuse.ops.moe import permute, unpermute

    g = torch.Generator().manual_seed(4)
    experts = _routing(37, 2, 5, drop)
    x0, w0, y0 = torch.randn(37, 24, generator=g), torch.rand(37, 2, generator=g), torch.randn(74, 24, generator=g)
    dz, drows = torch.randn(37, 24, generator=g), torch.randn(74, 24, generator=g)
    results = []
    for p_fn, u_fn in ((permute, unpermute), (moe_permute, moe_unpermute)):
        x, w, y = (t.clone().requires_grad_() for t in (x0, w0, y0))
        rows, pos, src, counts = p_fn(x, experts, 5)
        assert not (pos.requires_grad or src.requires_grad or counts.requires_grad)
        z = u_fn(y, pos, src, w)
        ((z * dz).sum() + (rows * drows).sum()).backward()
        results.append((rows, pos, src, counts, z, x.grad, w.grad, y.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    from zerofuse.train.launches import CountLaunches

    x = x0.clone().requires_grad_()
    rows = permute(x, experts, 5)[0]
    with CountLaunches() as c:  # no zero-filled gradients made for the integer outputs
        rows.sum().backward()
    assert not {"zeros", "zeros_like", "fill_", "zero_"} & set(c.names), c.names


def test_all_tokens_to_one_expert_and_int32_ids(kernel_path):
    x = torch.randn(9, 16)
    experts = torch.full((9, 2), 3, dtype=torch.int32)
    experts[:, 1] = 1
    rows, pos, src, counts = moe_permute(x, experts, 4)
    assert counts.tolist() == [0, 9, 0, 9]
    assert torch.equal(rows[:9], x) and torch.equal(rows[9:], x)
    z = moe_unpermute(rows, pos, src, torch.full((9, 2), 0.5))
    assert_close(z, x)


def test_bad_input_is_refused():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match=r"expected experts to be an int32/int64 tensor \[tokens=4, top_k\]"):
        moe_permute(x, torch.zeros(3, 2, dtype=torch.long), 4)
    with pytest.raises(RuntimeError, match="expected num_experts >= 1, got 0"):
        moe_permute(x, torch.zeros(4, 2, dtype=torch.long), 0)
    rows, pos, src, _ = moe_permute(x, torch.zeros(4, 2, dtype=torch.long), 2)
    with pytest.raises(RuntimeError, match="expected weights to be a floating-point tensor of pos's shape"):
        moe_unpermute(rows, pos, src, torch.ones(4, 3))
    with pytest.raises(RuntimeError, match="expected y and src with tokens \\* top_k = 8 rows"):
        moe_unpermute(rows[:5], pos, src, torch.ones(4, 2))


def test_opcheck_and_compile():
    x = torch.randn(11, 24, requires_grad=True)
    experts = _routing(11, 2, 4, True)
    w = torch.rand(11, 2, requires_grad=True)
    rows, pos, src, counts = moe_permute(x, experts, 4)
    y = torch.randn(22, 24)
    ops = torch.ops.zerofuse
    torch.library.opcheck(ops.moe_permute.default, (x, experts, 4))
    torch.library.opcheck(ops.moe_unpermute.default, (y.requires_grad_(), pos, src, w))
    torch.library.opcheck(ops.moe_permute_backward.default, (torch.randn(22, 24), pos))
    torch.library.opcheck(ops.moe_unpermute_backward.default, (torch.randn(11, 24), y.detach(), src, w.detach()))

    def f(x, w):
        rows, pos, src, _ = moe_permute(x, experts, 4)
        return moe_unpermute(rows * 2, pos, src, w)

    want = torch.autograd.grad(f(x, w).sum(), (x, w))
    got = torch.autograd.grad(torch.compile(f, fullgraph=True)(x, w).sum(), (x, w))
    for a, b in zip(got, want):
        assert_close(a, b)


def test_a_compiled_fp32_moe_model_matches_eager():
    """torch.compile of a whole fp32 MoE GPT failed to trace on CPU: torch._grouped_mm's fake kernel
    takes bf16 only (its eager CPU kernel fp32 too); the experts' loop runs under compile instead."""
    from zerofuse.models import GPT, config

    model = GPT(config("moe-tiny", n_layer=2, dim=64, n_head=2, seq_len=32), seed=0)
    x = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    want = model(x[:, :-1], x[:, 1:])[1]
    want_g = torch.autograd.grad(want, list(model.parameters()), allow_unused=True)
    got = torch.compile(model, backend="aot_eager")(x[:, :-1], x[:, 1:])[1]
    got_g = torch.autograd.grad(got, list(model.parameters()), allow_unused=True)
    assert_close(got, want)
    for a, b in zip(got_g, want_g):
        assert (a is None) == (b is None)
        if a is not None:
            assert_close(a, b)


@pytest.mark.parametrize("score,normalize,k", [("softmax", True, 2), ("softmax", False, 1), ("sigmoid", True, 4)])
def test_router_matches_the_reference_and_its_losses(score, normalize, k):
    torch.manual_seed(0)
    r = Router(32, 8, k, score=score, normalize=normalize, aux_loss_coef=0.01, z_loss_coef=1e-3)
    x = torch.randn(57, 32)
    out = r(x)
    logits = x.double() @ r.weight.double().t()
    w, e = reference.moe_route(logits, k, score, normalize)
    assert torch.equal(out.experts, e)
    assert_close(out.weights, w.float())
    probs = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
    probs = probs / probs.sum(-1, keepdim=True)
    frac = torch.bincount(e.reshape(-1), minlength=8).double() / e.numel()
    assert math.isclose(out.aux_loss.item(), 0.01 * 8 * float((frac * probs.mean(0)).sum()), rel_tol=1e-5)
    assert math.isclose(out.z_loss.item(), 1e-3 * float(torch.logsumexp(logits, -1).pow(2).mean()), rel_tol=1e-5)
    assert torch.equal(r.last_load, torch.bincount(e.reshape(-1), minlength=8))
    (out.weights.sum() + out.aux_loss + out.z_loss).backward()
    assert r.weight.grad is not None and torch.isfinite(r.weight.grad).all()


def test_router_capacity_drops_the_latest_choices():
    r = Router(4, 4, 1, capacity_factor=1.0)
    with torch.no_grad():
        r.weight.zero_()
        r.weight[2, 0] = 10.0  # every token prefers expert 2
    x = torch.zeros(8, 4)
    x[:, 0] = 1.0
    out = r(x)
    # capacity ceil(1.0 * 8 * 1 / 4) = 2: the first two tokens keep expert 2, the rest are dropped
    assert out.experts.reshape(-1).tolist() == [2, 2] + [-1] * 6
    assert int(r.last_dropped) == 6


def test_aux_free_bias_balances_a_skewed_router():
    """A router whose weights favour experts 0 and 1 for every token (a constant feature): the bias
    updates bring the max / mean load from > 3 to <= 1.2 (measured 3.58 -> 1.07 after 150 steps)."""
    torch.manual_seed(0)
    r = Router(16, 8, 2, bias_update_rate=0.003)
    with torch.no_grad():
        r.weight.normal_(0, 0.3)
        r.weight[0, 0], r.weight[1, 0] = 3.0, 2.0
    x = torch.randn(1024, 16)
    x[:, 0] = 1.0

    def imbalance():
        r.eval()  # no load kept for the bias
        with torch.no_grad():
            r(x)
        r.train()
        return float(r.last_load.max() / r.last_load.float().mean())

    before = imbalance()
    for _ in range(300):
        r(x)
        r.update_bias()
    after = imbalance()
    assert before > 3.0 and after <= 1.2, (before, after)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_the_aux_loss_counts_the_routers_own_choices_not_the_biased_ones(score):
    """With the balancing bias on, the aux loss's f_e came from the bias-steered top-k: a bias sending
    every token to expert 3 made the loss push the router away from it (gradient cosine -0.36 to
    Megatron's; a review's reproduction, 2026-12-06). f_e counts the top-k of the scores alone
    (Megatron-Core, DeepSeek-V3 eq. 18); the bias still decides the routing."""
    torch.manual_seed(0)
    e, t, k = 4, 32, 2
    r = Router(8, e, k, score=score, aux_loss_coef=1.0, bias_update_rate=1e-3)
    with torch.no_grad():
        r.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))
    x = torch.randn(t, 8)
    out = r(x)
    assert (out.experts == 3).any(dim=-1).all()  # the bias routes
    w = r.weight.detach().clone().requires_grad_()
    logits = x @ w.t()
    s = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
    p = s if score == "softmax" else s / s.sum(-1, keepdim=True)
    own = torch.bincount(s.detach().topk(k).indices.reshape(-1), minlength=e).float()
    want = e * (p.sum(0) * own).sum() / (t * t * k)
    torch.testing.assert_close(out.aux_loss, want)
    torch.testing.assert_close(torch.autograd.grad(out.aux_loss, r.weight)[0], torch.autograd.grad(want, w)[0])


@pytest.mark.parametrize("kwargs", [dict(num_experts=1, top_k=1), dict(num_experts=4, top_k=5),
                                    dict(num_experts=4, top_k=2, capacity_factor=-1.0),
                                    dict(num_experts=4, top_k=2, score="relu"),
                                    dict(num_experts=4, top_k=2, aux_loss_scope="batch")])
def test_router_bad_options_are_refused(kwargs):
    if kwargs == dict(num_experts=1, top_k=1):
        Router(8, **kwargs)  # one expert is allowed
        return
    with pytest.raises(ValueError, match="zerofuse.moe.Router: expected"):
        Router(8, **kwargs)


@pytest.mark.parametrize("kwargs, err, want", [
    (dict(dim=-1), ValueError, "expected dim >= 1, got -1"), (dict(dim=0), ValueError, "expected dim >= 1, got 0"),
    (dict(normalize="no"), TypeError, "expected normalize to be a bool, got 'no'"),
    (dict(aux_loss_coef=True), TypeError, "expected aux_loss_coef to be a number, got True"),
    (dict(capacity_factor=True), TypeError, "expected capacity_factor to be a number, got True"),
    (dict(z_loss_coef=torch.tensor(0.1)), TypeError, "expected z_loss_coef to be a number, got tensor"),
    (dict(aux_loss_coef=float("nan")), ValueError, "expected aux_loss_coef >= 0, got nan")])
def test_router_arguments_are_checked_by_name(kwargs, err, want):
    """A review's reproductions (2026-12-07): dim -1 failed inside torch, dim 0, normalize="no" and
    True as a coefficient were taken; a numpy or tensor coefficient was called "< 0"."""
    with pytest.raises(err, match=re.escape(want)):
        Router(**({"dim": 8, "num_experts": 4, "top_k": 2} | kwargs))
    if "aux_loss_coef" in kwargs and kwargs["aux_loss_coef"] is True:  # numpy's floats are numbers
        assert Router(8, 4, 2, aux_loss_coef=np.float32(0.5)).aux_loss_coef == 0.5


@pytest.mark.parametrize("aux", [0.0, 1e-2])
def test_sigmoid_scores_underflowing_give_finite_weights(aux):
    """fp32 sigmoid scores of very negative logits are 0: the normalized top-k weights were 0/0, NaN
    (a review's reproduction, 2026-12-07); the sum gets Megatron's 1e-20, as the reference."""
    r = Router(2, 4, 2, score="sigmoid", aux_loss_coef=aux)
    with torch.no_grad():
        r.weight.fill_(-100.0)
    out = r(torch.full((3, 2), 1.0, requires_grad=True))
    assert torch.isfinite(out.weights).all() and torch.isfinite(out.aux_loss)
    want, _ = reference.moe_route(torch.full((3, 4), -800.0), 2, "sigmoid")
    assert torch.isfinite(want).all()


def _loop_moe(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE layer as a loop over tokens and their experts (the reference)."""
    flat = x.reshape(-1, x.shape[-1])
    r = m.router(flat)
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for s in range(r.experts.shape[1]):
            e = int(r.experts[t, s])
            if e < 0:
                continue
            h = flat[t] @ m.w1[e]
            if m.activation == "gelu":
                h = torch.nn.functional.gelu(h, approximate="tanh")
            else:
                h = torch.nn.functional.silu(h[:m.hidden]) * h[m.hidden:]
            out[t] = out[t] + r.weights[t, s] * (h @ m.w2[e])
    return out.reshape(x.shape)


@pytest.mark.parametrize("activation,dim,capacity", [("gelu", 16, 0.0), ("swiglu", 16, 1.0), ("swiglu", 13, 0.0)])
def test_moe_layer_matches_a_loop_over_experts(activation, dim, capacity):
    """dim 16: torch._grouped_mm; dim 13: rows not 16-byte aligned, the loop over experts."""
    torch.manual_seed(0)
    m = MoE(dim, 24, 6, 2, activation=activation, capacity_factor=capacity).double().float()
    x = torch.randn(2, 19, dim)
    ours_x, ref_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = m(ours_x)
    grads = torch.autograd.grad(y.pow(2).sum(), [ours_x, m.w1, m.w2, m.router.weight])
    y_ref = _loop_moe(m, ref_x)
    grads_ref = torch.autograd.grad(y_ref.pow(2).sum(), [ref_x, m.w1, m.w2, m.router.weight])
    assert_close(y, y_ref, atol=1e-5, rtol=1e-4)
    for a, b in zip(grads, grads_ref):
        assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_grouped_mm_with_empty_groups_and_both_paths():
    x = torch.randn(10, 16)
    w = torch.randn(4, 16, 8)
    counts = torch.tensor([3, 0, 5, 0])
    want = torch.cat([x[:3] @ w[0], x[3:8] @ w[2], torch.zeros(2, 8)])
    assert_close(grouped_mm(x, w, counts), want, atol=1e-5, rtol=1e-5)
    assert_close(grouped_mm(x[:, :13].contiguous(), w[:, :13].contiguous(), counts),
                 torch.cat([x[:3, :13] @ w[0, :13], x[3:8, :13] @ w[2, :13], torch.zeros(2, 8)]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_gradients_of_rows_outside_the_groups_are_zero(dtype):
    """torch._grouped_mm's backward leaves the input gradient of rows past sum(counts) undefined:
    x.grad there was whatever memory held (1e36 or NaN in bf16)."""
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 0])
    for _ in range(5):
        x = torch.randn(10, 16, generator=g).to(dtype).requires_grad_()
        w = torch.randn(4, 16, 8, generator=g).to(dtype).requires_grad_()
        dy = torch.randn(10, 8, generator=g).to(dtype)
        grouped_mm(x, w, counts).backward(dy)
        xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
        torch.cat([xr[:3] @ wr[0], xr[3:8] @ wr[2], xr[8:] @ wr[0] * 0]).backward(dy.float())
        assert torch.equal(x.grad[8:], torch.zeros_like(x.grad[8:]))
        assert_close(x.grad, xr.grad)
        assert_close(w.grad, wr.grad)


def test_index_tensors_at_any_strides(kernel_path):
    """pos and src in another layout give the same bits (the Triton kernels read them as contiguous:
    a column-major pos combined the wrong rows)."""
    experts = _routing(13, 3, 5, True)
    x, w, dout = torch.randn(13, 37), torch.rand(13, 3), torch.randn(13, 37)
    rows, pos, src, _ = moe_permute(x, experts, 5)
    pos_t = pos.t().contiguous().t()
    src_s = torch.stack([src, src], 1)[:, 0]
    assert not pos_t.is_contiguous() and not src_s.is_contiguous()
    ops = torch.ops.zerofuse
    assert torch.equal(moe_unpermute(rows, pos_t, src_s, w), moe_unpermute(rows, pos, src, w))
    assert torch.equal(ops.moe_permute_backward(rows, pos_t), ops.moe_permute_backward(rows, pos))
    for a, b in zip(ops.moe_unpermute_backward(dout, rows, src_s, w), ops.moe_unpermute_backward(dout, rows, src, w)):
        assert torch.equal(a, b)


def test_unpermute_refuses_bad_indices(kernel_path):
    """pos/src not int64 or out of range are refused naming the argument (the Triton path read
    another row's memory for a pos past y)."""
    rows, pos, src, _ = moe_permute(torch.randn(4, 8), _routing(4, 2, 3, False), 3)
    w = torch.rand(4, 2)
    with pytest.raises(IndexError, match=r"expected pos in \[0, 8\) or -1, got 8"):
        moe_unpermute(rows, torch.where(pos == 0, 8, pos), src, w)
    with pytest.raises(IndexError, match=r"expected src in \[0, 8\) or -1, got -2"):
        moe_unpermute(rows, pos, torch.where(src == 0, -2, src), w)
    with pytest.raises(RuntimeError, match="expected pos to be int64 .moe_permute's., got torch.float32"):
        moe_unpermute(rows, pos.float(), src, w)
    with pytest.raises(RuntimeError, match="expected src to be int64 .moe_permute's., got torch.int32"):
        moe_unpermute(rows, pos, src.int(), w)


def test_float64_weights_take_the_float64_path(kernel_path):
    """fp32 rows with fp64 weights: z, dy and dweights in fp64 as the fake says (the Triton path
    returned fp32 dweights, rounding the weights to fp32), equal to the reference in fp64."""
    experts = _routing(11, 2, 4, True)
    x = torch.randn(11, 24, dtype=torch.float64)
    w = torch.rand(11, 2, dtype=torch.float64, requires_grad=True)
    rows, pos, src, _ = moe_permute(x.float(), experts, 4)
    y = rows.detach().requires_grad_()
    z = moe_unpermute(y, pos, src, w)
    assert z.dtype == torch.float64
    torch.testing.assert_close(z, reference.moe_unpermute(rows.double(), experts, w.detach(), 4), rtol=1e-12, atol=1e-12)
    dout = torch.randn(11, 24, dtype=torch.float64)
    torch.library.opcheck(torch.ops.zerofuse.moe_unpermute_backward.default, (dout, y.detach(), src, w.detach()))
    torch.library.opcheck(torch.ops.zerofuse.moe_unpermute.default, (y, pos, src, w))
