"""FusedAdam / FusedAdamW and zerofuse::adam_ vs torch.optim and zerofuse.reference."""
import copy

import pytest
import torch

import zerofuse
from zerofuse import reference
from zerofuse.optim import FusedAdam, FusedAdamW

SHAPES = [(33, 65), (65,), (7, 65), (7,), (1,), (0, 3), (4097,)]


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _grads(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _run(opt_cls, params, steps=20, scheduler=False, **kw):
    params = [torch.nn.Parameter(p.clone()) for p in params]
    opt = opt_cls([{"params": params[:3]}, {"params": params[3:], "lr": kw.get("lr", 1e-3) * 3}], **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, 7, 0.5) if scheduler else None
    for step in range(steps):
        for p, g in zip(params, _grads(step, params[0].dtype)):
            p.grad = g.clone()
        opt.step()
        if sched:
            sched.step()
    return params, opt


@pytest.mark.parametrize(
    "ours,theirs,kw",
    [
        (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
        (FusedAdamW, torch.optim.AdamW, dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0, maximize=True)),
        (FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05)),
        (FusedAdam, torch.optim.Adam, dict(lr=1e-2)),
    ],
)
def test_twenty_steps_match_torch_optim(ours, theirs, kw):
    got, _ = _run(ours, _params(), scheduler=True, **kw)
    want, _ = _run(theirs, _params(), scheduler=True, foreach=False, **kw)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weights_follow_an_fp32_run(dtype):
    """bf16/fp16 params with fp32 masters: the masters follow torch's fp32 AdamW fed the same
    gradients, and each param is its master rounded once."""
    params = [torch.nn.Parameter(p) for p in _params(dtype)]
    ref = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = FusedAdamW(params, lr=1e-2, weight_decay=0.1, master_weights=True)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(20):
        for p, r, g in zip(params, ref, _grads(step, dtype)):
            p.grad, r.grad = g.clone(), g.float()
        opt.step()
        ref_opt.step()
    for p, r in zip(params, ref):
        master = opt.state[p]["master"]
        torch.testing.assert_close(master, r.detach(), rtol=1e-6, atol=1e-6)
        assert torch.equal(p.detach(), master.to(dtype))


def test_low_precision_params_without_masters_use_fp32_moments():
    p = torch.nn.Parameter(torch.randn(1000).bfloat16())
    expected, m, v = p.detach().float(), torch.zeros(1000), torch.zeros(1000)
    opt = FusedAdamW([p], lr=1e-2)
    for step in range(1, 4):
        g = torch.randn(1000).bfloat16()
        p.grad = g
        opt.step()
        reference.adam_step(expected, g.float(), m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=1e-2)
        expected = expected.bfloat16().float()  # the param is stored in bf16 between steps
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(p.detach().float(), expected, rtol=1.6e-2, atol=1e-2)


def test_mixed_dtypes_in_one_group_and_params_without_grad():
    a, b, c = (torch.nn.Parameter(torch.randn(50)), torch.nn.Parameter(torch.randn(30).bfloat16()),
               torch.nn.Parameter(torch.randn(10)))
    c_before = c.detach().clone()
    opt = FusedAdamW([a, b, c], lr=1e-2, master_weights=True)
    a.grad, b.grad = torch.randn(50), torch.randn(30).bfloat16()
    opt.step()
    assert torch.equal(c.detach(), c_before) and c not in opt.state
    assert "master" in opt.state[b] and "master" not in opt.state[a]
    assert opt.state[a]["step"].item() == opt.state[b]["step"].item() == 1


def test_ten_million_elements():
    p = torch.nn.Parameter(torch.randn(10_000_003))
    r = torch.nn.Parameter(p.detach().clone())
    g = torch.randn(10_000_003)
    p.grad, r.grad = g, g.clone()
    FusedAdamW([p], lr=1e-3).step()
    torch.optim.AdamW([r], lr=1e-3, foreach=False).step()
    torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)


def test_found_inf_skips_the_step_and_grad_scale_unscales():
    params, opt = _run(FusedAdamW, _params(), steps=3, lr=1e-2)
    before = [p.detach().clone() for p in params]
    states = {k: [opt.state[p][k].clone() for p in params] for k in ("step", "exp_avg", "exp_avg_sq")}
    for p in params:
        p.grad = torch.full_like(p, float("inf"))
    opt.step(found_inf=torch.tensor([1.0]))
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    for k, vals in states.items():
        assert all(torch.equal(opt.state[p][k], v) for p, v in zip(params, vals)), k
    # a scaled gradient with grad_scale gives the unscaled step
    twin, twin_opt = _run(FusedAdamW, _params(), steps=3, lr=1e-2)
    for p, t, g in zip(params, twin, _grads(99)):
        p.grad, t.grad = g * 1024.0, g.clone()
    opt.step(grad_scale=1024.0)
    twin_opt.step()
    for p, t in zip(params, twin):
        torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-7)


def test_state_dict_moves_both_ways_with_torch():
    ours, ours_opt = _run(FusedAdamW, _params(), steps=5, lr=1e-2, weight_decay=0.1)
    theirs, theirs_opt = _run(torch.optim.AdamW, _params(), steps=5, lr=1e-2, weight_decay=0.1, foreach=False)
    # swap: torch continues from our state, we continue from torch's
    t2 = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    o2 = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    t2_opt = torch.optim.AdamW([{"params": t2[:3]}, {"params": t2[3:]}], foreach=False)
    # state_dict() returns references (torch's convention): copy, or the two live optimizers
    # would update the same moment tensors
    t2_opt.load_state_dict(copy.deepcopy(ours_opt.state_dict()))
    o2_opt = FusedAdamW([{"params": o2[:3]}, {"params": o2[3:]}])
    o2_opt.load_state_dict(copy.deepcopy(theirs_opt.state_dict()))
    assert o2_opt.state_dict()["state"][0].keys() == theirs_opt.state_dict()["state"][0].keys()
    for step in range(5, 10):
        for params in (ours, theirs, t2, o2):
            for p, g in zip(params, _grads(step)):
                p.grad = g.clone()
        for o in (ours_opt, theirs_opt, t2_opt, o2_opt):
            o.step()
    for a, b, c, d in zip(ours, theirs, t2, o2):
        torch.testing.assert_close(c, a, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(d, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "make,exc,msg",
    [
        (lambda p: FusedAdamW([p], amsgrad=True), ValueError, r"FusedAdamW: amsgrad=True is not supported \(use torch.optim.AdamW\)"),
        (lambda p: FusedAdam([p], differentiable=True), ValueError, r"FusedAdam: differentiable=True is not supported"),
    ],
)
def test_unsupported_options_raise(make, exc, msg):
    with pytest.raises(exc, match=msg):
        make(torch.nn.Parameter(torch.randn(3)))


def test_sparse_and_complex_gradients_raise():
    p = torch.nn.Parameter(torch.randn(4, 3))
    p.grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="FusedAdamW: sparse gradients are not supported"):
        FusedAdamW([p]).step()
    q = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    q.grad = torch.randn(3, dtype=torch.complex64)
    with pytest.raises(RuntimeError, match="FusedAdamW: complex parameters are not supported"):
        FusedAdamW([q]).step()


def test_op_errors_name_the_argument():
    p, g = [torch.randn(5)], [torch.randn(5)]
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    with pytest.raises(ValueError, match=r"expected params, grads, exp_avgs and exp_avg_sqs of the same length, got 1, 1, 0, 1"):
        zerofuse.ops.adam_(p, g, [], [torch.zeros(5)], **kw)
    with pytest.raises(RuntimeError, match=r"expected exp_avgs\[0\] in float32, got BFloat16"):
        zerofuse.ops.adam_(p, g, [torch.zeros(5, dtype=torch.bfloat16)], [torch.zeros(5)], **kw)
    with pytest.raises(ValueError, match=r"expected grads\[0\] to have 5 elements like params\[0\], got 4"):
        zerofuse.ops.adam_(p, [torch.randn(4)], [torch.zeros(5)], [torch.zeros(5)], **kw)
    with pytest.raises(ValueError, match=r"expected step >= 1"):
        zerofuse.ops.adam_(p, g, [torch.zeros(5)], [torch.zeros(5)], **(kw | {"step": 0}))


def test_opcheck():
    ps = [torch.randn(7, 3), torch.randn(5).bfloat16()]
    gs = [torch.randn(7, 3), torch.randn(5).bfloat16()]
    ms = [torch.zeros(7, 3), torch.zeros(5)]
    vs = [torch.zeros(7, 3), torch.zeros(5)]
    masters = [ps[0].clone(), ps[1].float()]
    args = (ps, gs, ms, vs, masters, 1e-3, 0.9, 0.999, 1e-8, 0.01, 0.1, 0.001, True, False, 1.0, None)
    torch.library.opcheck(torch.ops.zerofuse.adam_.default, args)
