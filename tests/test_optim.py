"""Fused optimizers (FusedAdam, FusedAdamW, FusedLAMB, FusedLARS), their ops and the flat-buffer
functional API vs torch.optim and zerofuse.reference.

Most tests run three ways (the ``path`` fixture): the C++ CPU kernels, the Triton kernels in the
interpreter on CPU tensors, and the Triton kernels on CUDA (skipped without a GPU).
"""
import copy
import types

import pytest
import torch

import zerofuse
from zerofuse import kernels, reference
from zerofuse.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedLARS, functional

from dist_utils import run_distributed
from tolerances import assert_within_peer_rule

SHAPES = [(33, 65), (65,), (7, 65), (7,), (1,), (0, 3), (4097,)]


@pytest.fixture(params=["cpp", "triton", pytest.param("cuda", marks=pytest.mark.gpu)])
def path(request, monkeypatch):
    """The device the test runs on; for "cpp" / "triton", which kernels CPU tensors go through."""
    if request.param == "triton" and not kernels.interpreted():
        pytest.skip("Triton on CPU tensors needs the interpreter (ZEROFUSE_TRITON_ON_CPU=1 before import)")
    monkeypatch.setattr(kernels, "TRITON_ON_CPU", request.param == "triton")
    return torch.device("cuda" if request.param == "cuda" else "cpu")


def _params(dtype=torch.float32, seed=0, device="cpu", shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes]


def _grads(step, dtype=torch.float32, device="cpu", shapes=SHAPES):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes]


# [Note: Adam vs torch.optim] Params after several Adam steps are compared by tests/tolerances.py's
# peer rule, never by a fixed 1e-6 against torch.optim's fp32 result: the reference is the same
# torch.optim run in float64, the peer is its fp32 run (torch's unfused computation), and ours may be
# off the float64 params by twice the peer's error plus the fp32 atol (1e-5). Two fp32 runs round
# p - lr * m / (sqrt(v) + eps) differently at every step (FMA or separate mul/add, by ISA: 1.4e-6
# apart after 20 steps with our AVX-512 loop, where the relative difference is large only for params
# near zero), and torch's fp32 result is itself not stable: its first CPU sqrt over a tensor split
# between threads (> 2048 elements) returned one thread's half up to 3e-4 off, relative, in 5-20% of
# fresh processes (torch 2.13 with MKL, 2 threads, measured 2026-11-26); param 0 then lands 3e-6 from
# both the float64 run and ours, as in the CI failure (2.9e-6, 203 of 2145). A 0.1% lr error for
# ours alone still fails every test that uses the rule (1.2e-5 to 1.6e-4 against bounds of 1.0-1.3e-5).
def _run(opt_cls, params, steps=20, scheduler=False, **kw):
    params = [torch.nn.Parameter(p.clone()) for p in params]
    opt = opt_cls([{"params": params[:3]}, {"params": params[3:], "lr": kw.get("lr", 1e-3) * 3}], **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, 7, 0.5) if scheduler else None
    for step in range(steps):
        for p, g in zip(params, _grads(step, params[0].dtype, params[0].device)):
            p.grad = g.clone()
        opt.step()
        if sched:
            sched.step()
    return params, opt


# ---------------------------------------------------------------------------------- Adam / AdamW


@pytest.mark.parametrize(
    "ours,theirs,kw",
    [
        (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
        (FusedAdamW, torch.optim.AdamW, dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0, maximize=True)),
        (FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05)),
        (FusedAdam, torch.optim.Adam, dict(lr=1e-2)),
    ],
)
def test_twenty_steps_match_torch_optim(path, ours, theirs, kw):
    got, _ = _run(ours, _params(device=path), scheduler=True, **kw)
    peer, _ = _run(theirs, _params(device=path), scheduler=True, foreach=False, **kw)
    want, _ = _run(theirs, _params(torch.float64, device=path), scheduler=True, foreach=False, **kw)
    # the peer rule, not a fixed 1e-6 against the fp32 run ([Note: Adam vs torch.optim]; CI failed at 2.9e-6)
    for i, (a, b, r) in enumerate(zip(got, peer, want)):
        assert_within_peer_rule(a.detach(), r.detach(), b.detach(), msg=f"param {i}")


def test_kept_step_plans_follow_every_change_a_user_makes_between_steps(path):
    """The optimizers keep their lists and launch tables between steps ([Note: step plans] in
    optim/_base.py). Each change below must reach the next step, compared with torch.optim.AdamW
    making the same changes: grads rewritten in place (the kept tables are used as they are),
    a param moved by `p.data = ...`, a param without grad, a state tensor replaced, a new lr, a
    state_dict round trip, a new param group, a param's state dict replaced by a torch-style one,
    master weights switched on. Params by the peer rule ([Note: Adam vs torch.optim]): a float64
    torch.optim.AdamW makes the same changes."""
    shapes = [(37, 5), (4096,), (4099,), (1,)]
    ours = [torch.nn.Parameter(p) for p in _params(device=path, shapes=shapes)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    theirs64 = [torch.nn.Parameter(p.detach().double()) for p in ours]
    opt = FusedAdamW(ours, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, foreach=False)
    ref64 = torch.optim.AdamW(theirs64, lr=1e-2, weight_decay=0.1, foreach=False)
    extra = [torch.nn.Parameter(torch.randn(300, device=path))]
    extra += [torch.nn.Parameter(extra[0].detach().clone()), torch.nn.Parameter(extra[0].detach().double())]

    def change(step, params, o):  # one change per step; even steps also bring new grad tensors
        if step == 3:
            o.state[params[0]]["exp_avg"] = o.state[params[0]]["exp_avg"].clone()
        if step == 5:
            params[1].data = params[1].data.clone()
        if step == 7:
            o.param_groups[0]["lr"] = 3e-3
        if step == 9:
            params[2].grad = None
        if step == 10 and o is opt:
            o.load_state_dict(copy.deepcopy(o.state_dict()))
        if step == 11:
            o.add_param_group({"params": [extra[0] if o is opt else extra[1] if o is ref else extra[2]]})
        if step == 12:  # a param's state dict replaced, in torch.optim's layout (a float64 cpu step)
            old_state = o.state[params[3]]
            o.state[params[3]] = {k: torch.tensor(float(v), dtype=torch.float64) if k == "step" else v.clone()
                                  for k, v in old_state.items()}
            if o is opt:
                for t in old_state.values():
                    t.fill_(float("nan"))
        if step == 13 and o is opt:
            o.param_groups[0]["master_weights"] = True  # fp32 params: no master is made, nothing changes

    for step in range(14):
        grads = _grads(step, device=path, shapes=shapes)
        for group_params, o in ((ours, opt), (theirs, ref), (theirs64, ref64)):
            params = group_params + [q for g in o.param_groups[1:] for q in g["params"]]
            old = [(p.grad, p.data) for p in params]
            for p, g in zip(params, grads + [torch.full((300,), 0.01 * step, device=path)]):
                if step % 2 and p.grad is not None:
                    p.grad.copy_(g)  # same addresses as last step
                else:
                    p.grad = g.to(p.dtype, copy=True)
            change(step, params, o)
            # what a stale table would point at: kept alive (not reused) and poisoned
            for (grad, data), p in zip(old, params):
                for t, now in ((grad, p.grad), (data, p.data)):
                    if t is not None and (now is None or t.data_ptr() != now.data_ptr()):
                        t.fill_(float("nan"))
            o.poisoned = old
        opt.step()
        ref.step()
        ref64.step()
        for i, (a, b, r) in enumerate(zip(ours + extra[:1], theirs + extra[1:2], theirs64 + extra[2:])):
            assert_within_peer_rule(a.detach(), r.detach(), b.detach(), msg=f"step {step}, param {i}")
            # the moments are never divided: with or without FMA they stay within an ulp or two of torch's
            for key in ("exp_avg", "exp_avg_sq") if ref.state[b] else ():
                torch.testing.assert_close(opt.state[a][key], ref.state[b][key], rtol=1e-6, atol=1e-6,
                                           msg=lambda m: f"step {step}, {key}: {m}")
    assert opt.state[ours[0]]["step"].item() == 14 and opt.state[ours[2]]["step"].item() == 13


@pytest.mark.parametrize("opt_cls", [FusedAdamW, FusedLAMB, FusedLARS])
def test_steps_with_unchanged_tensors_build_no_launch_tables(path, opt_cls, monkeypatch):
    """After the first step, a step whose params and grads have the same addresses builds no
    kernel table (the host work that cost ~1 ms per step on an H100), and one with a grad at a
    new address rebuilds its tables once. Also: the params' version counters move at each step
    (the dispatcher would bump them; the direct launch does it itself)."""
    if path.type == "cpu" and not kernels.TRITON_ON_CPU:
        pytest.skip("the C++ CPU kernels take no tables")
    from zerofuse.kernels import optim as K

    built = []
    real = K._Table.__init__
    monkeypatch.setattr(K._Table, "__init__", lambda self, *a, **k: (built.append(1), real(self, *a, **k))[1])
    params = [torch.nn.Parameter(p) for p in _params(device=path)]
    opt = opt_cls(params, lr=1e-2, **({"max_grad_norm": 1.0} if opt_cls is FusedAdamW else {}))
    for p, g in zip(params, _grads(0, device=path)):
        p.grad = g
    opt.step()
    first = len(built)
    assert first > 0
    versions = [p._version for p in params]
    for step in range(1, 4):
        for p, g in zip(params, _grads(step, device=path)):
            p.grad.copy_(g)
        opt.step()
    assert len(built) == first
    assert all(p._version > v for p, v in zip(params, versions))
    params[1].grad = params[1].grad.clone()
    opt.step()
    assert 0 < len(built) - first <= first


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weights_follow_an_fp32_run(path, dtype):
    """bf16/fp16 params with fp32 masters: the masters follow torch's fp32 AdamW fed the same
    gradients (by the peer rule: [Note: Adam vs torch.optim]), and each param is its master rounded once."""
    params = [torch.nn.Parameter(p) for p in _params(dtype, device=path)]
    ref = [torch.nn.Parameter(p.detach().float()) for p in params]
    ref64 = [torch.nn.Parameter(p.detach().double()) for p in params]
    opt = FusedAdamW(params, lr=1e-2, weight_decay=0.1, master_weights=True)
    ref_opts = [torch.optim.AdamW(r, lr=1e-2, weight_decay=0.1, foreach=False) for r in (ref, ref64)]
    for step in range(20):
        for p, r, r64, g in zip(params, ref, ref64, _grads(step, dtype, path)):
            p.grad, r.grad, r64.grad = g.clone(), g.float(), g.double()
        opt.step()
        for o in ref_opts:
            o.step()
    for i, (p, r, r64) in enumerate(zip(params, ref, ref64)):
        master = opt.state[p]["master"]
        assert_within_peer_rule(master, r64.detach(), r.detach(), msg=f"master {i}")
        assert torch.equal(p.detach(), master.to(dtype))


def test_low_precision_params_without_masters_use_fp32_moments(path):
    p = torch.nn.Parameter(torch.randn(1000, device=path).bfloat16())
    expected, m, v = p.detach().float(), torch.zeros(1000, device=path), torch.zeros(1000, device=path)
    opt = FusedAdamW([p], lr=1e-2)
    for step in range(1, 4):
        g = torch.randn(1000, device=path).bfloat16()
        p.grad = g
        opt.step()
        reference.adam_step(expected, g.float(), m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=1e-2)
        expected = expected.bfloat16().float()  # the param is stored in bf16 between steps
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(p.detach().float(), expected, rtol=1.6e-2, atol=1e-2)


def test_mixed_dtypes_in_one_group_and_params_without_grad(path):
    a, b, c, d = (torch.nn.Parameter(torch.randn(50, device=path)),
                  torch.nn.Parameter(torch.randn(30, device=path).bfloat16()),
                  torch.nn.Parameter(torch.randn(10, device=path)),
                  torch.nn.Parameter(torch.randn(20, device=path).half()))
    c_before = c.detach().clone()
    # clone: a.float() is a itself, and both optimizers would step the one tensor
    ref = [torch.nn.Parameter(t.detach().float().clone()) for t in (a, b, d)]
    ref64 = [torch.nn.Parameter(t.detach().double()) for t in (a, b, d)]  # the peer rule's reference
    opt = FusedAdamW([a, b, c, d], lr=1e-2, master_weights=True)
    ref_opts = [torch.optim.AdamW(r, lr=1e-2, foreach=False) for r in (ref, ref64)]
    for step in range(3):
        grads = [torch.randn(50, device=path), torch.randn(30, device=path).bfloat16(), torch.randn(20, device=path)]
        a.grad, b.grad, d.grad = grads[0], grads[1], grads[2].half()
        for r, r64, g in zip(ref, ref64, (grads[0], grads[1], grads[2].half())):
            r.grad, r64.grad = g.float(), g.double()
        opt.step()
        for o in ref_opts:
            o.step()
    assert torch.equal(c.detach(), c_before) and c not in opt.state
    assert "master" in opt.state[b] and "master" in opt.state[d] and "master" not in opt.state[a]
    assert opt.state[a]["step"].item() == opt.state[b]["step"].item() == 3
    for name, t, r, r64 in zip("abd", (a, b, d), ref, ref64):  # [Note: Adam vs torch.optim]
        assert_within_peer_rule(opt.state[t].get("master", t).detach(), r64.detach(), r.detach(), msg=name)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_ten_million_elements(device, cpu_kernels):
    p = torch.nn.Parameter(torch.randn(10_000_003, device=device))
    r = torch.nn.Parameter(p.detach().clone())
    g = torch.randn(10_000_003, device=device)
    p.grad, r.grad = g, g.clone()
    FusedAdamW([p], lr=1e-3).step()
    torch.optim.AdamW([r], lr=1e-3, foreach=False).step()
    torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_lamb_with_tensors_larger_than_a_cache_block(device, cpu_kernels):
    """The CPU lamb_ keeps updates in a scratch block for tensors up to 2M elements and recomputes
    them for larger ones: a mix of both vs the reference."""
    shapes = [(3_000_001,), (1000, 1001), (5,), (2_100_000,)]
    params = [torch.nn.Parameter(p) for p in _params(device=device, shapes=shapes)]
    ref = [p.detach().clone() for p in params]
    states = [[torch.zeros_like(p) for p in ref] for _ in range(2)]
    opt = FusedLAMB(params, lr=1e-2, max_grad_norm=None)
    for step in range(2):
        grads = _grads(step, device=device, shapes=shapes)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        reference.lamb_step(ref, grads, *states, step=step + 1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6,
                            weight_decay=0.01)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt_cls", [FusedLAMB, FusedLARS])
def test_max_grad_norm_zero_means_no_clipping(path, opt_cls):
    """LAMB and LARS document max_grad_norm=0 as no clipping and their constructors take it; every
    step() then refused it (the shared threshold check wanted > 0)."""
    got, _ = _run(opt_cls, _params(device=path), steps=3, lr=1e-2, max_grad_norm=0)
    want, _ = _run(opt_cls, _params(device=path), steps=3, lr=1e-2, max_grad_norm=None)
    for p, q in zip(got, want):
        assert torch.equal(p, q)


@pytest.mark.parametrize("opt_cls", [FusedAdamW, FusedLAMB, FusedLARS])
def test_found_inf_skips_the_step_and_grad_scale_unscales(path, opt_cls):
    params, opt = _run(opt_cls, _params(device=path), steps=3, lr=1e-2)
    before = [p.detach().clone() for p in params]
    keys = ("step", "exp_avg", "exp_avg_sq") if opt_cls is not FusedLARS else ("momentum_buffer",)
    states = {k: [opt.state[p][k].clone() for p in params] for k in keys}
    for p in params:
        p.grad = torch.full_like(p, float("inf"))
    opt.step(found_inf=torch.tensor([1.0], device=path))
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    for k, vals in states.items():
        assert all(torch.equal(opt.state[p][k], v) for p, v in zip(params, vals)), k
    # a scaled gradient with grad_scale gives the unscaled step
    twin, twin_opt = _run(opt_cls, _params(device=path), steps=3, lr=1e-2)
    for p, t, g in zip(params, twin, _grads(99, device=path)):
        p.grad, t.grad = g * 1024.0, g.clone()
    opt.step(grad_scale=torch.tensor(1024.0, device=path), found_inf=torch.zeros(1, device=path))
    twin_opt.step()
    for p, t in zip(params, twin):
        torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-7)


def test_grad_scaler_drives_the_step(path):
    """torch.amp.GradScaler hands its scale and inf flag to the fused step: an inf gradient skips
    the step and halves the scale; otherwise the update equals the unscaled one."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).to(path)
    twin = copy.deepcopy(model)
    opt, twin_opt = FusedAdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(twin.parameters(), lr=1e-2,
                                                                                foreach=False)
    scaler = torch.amp.GradScaler(path.type, init_scale=256.0)
    x = torch.randn(4, 16, device=path)
    for step in range(3):
        opt.zero_grad()
        twin_opt.zero_grad()
        scaler.scale(model(x).square().sum()).backward()
        twin(x).square().sum().backward()
        if step == 1:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        if step != 1:
            twin_opt.step()
    assert scaler.get_scale() == 256.0 * 0.5
    assert opt.state[model.weight]["step"].item() == 2
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_max_grad_norm_clips_like_clip_grad_norm(path, max_norm):
    params = [torch.nn.Parameter(p) for p in _params(device=path)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = FusedAdamW(params, lr=1e-2, max_grad_norm=max_norm)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    for step in range(5):
        for p, r, g in zip(params, ref, _grads(step, device=path)):
            p.grad, r.grad = g.clone(), g.clone()
        norm = float(reference.global_norm([r.grad for r in ref]))
        if norm > max_norm:
            for r in ref:
                r.grad.mul_(max_norm / norm)
        opt.step()
        ref_opt.step()
        assert abs(opt.last_grad_norm.item() - norm) <= 1e-5 * norm
    for a, b in zip(params, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_inputs_match_float64_with_scale_flag_and_mixed_dtypes(path, max_norm):
    """zerofuse.ops.l2norm.clip_inputs (an optimizer's clipping inputs: one pass and one small
    kernel with kept tables on the Triton path, torch ops otherwise) against float64: grads of two
    dtypes (two launches into one buffer of block sums), a loss scale, a given skip flag, and an
    inf grad that must set the flag."""
    from zerofuse.ops._optim import Prepared
    from zerofuse.ops.l2norm import clip_inputs

    grads = _grads(0, device=path) + [torch.randn(5000, device=path).bfloat16(), torch.randn(3, device=path).half()]
    scale = torch.tensor(8.0, device=path)
    want_norm = float(reference.global_norm(grads)) / 8.0
    want_mult = (1 / 8.0) * max_norm / max(want_norm, max_norm)
    for prepared in (None, Prepared(), "again"):
        kept = prepared if prepared != "again" else kept
        mult, found, norm = clip_inputs(grads, max_norm, scale, None, prepared=kept)
        assert mult.shape == found.shape == norm.shape == (1,)
        assert abs(norm.item() - want_norm) <= 1e-6 * want_norm and found.item() == 0.0
        assert abs(mult.item() - want_mult) <= 1e-6 * want_mult
        _, found, _ = clip_inputs(grads, max_norm, None, torch.ones(1, device=path), prepared=kept)
        assert found.item() == 1.0
    grads[3][0] = float("inf")
    for kept_tables in (None, Prepared()):
        mult, found, norm = clip_inputs(grads, max_norm, scale, torch.zeros(1, device=path), prepared=kept_tables)
        assert found.item() == 1.0 and not torch.isfinite(norm).item()
    with pytest.raises(ValueError, match="expected max_norm > 0, got 0"):
        clip_inputs(grads, 0)


@pytest.mark.parametrize("opt_cls", [FusedAdamW, FusedLAMB])
def test_an_inf_grad_under_clipping_skips_the_step_and_its_count(path, opt_cls):
    """No found_inf given: the clipping norm turns non-finite, the kernels skip, and the step
    counters stay (their increment comes from the clipping kernel on the Triton path)."""
    params, opt = _run(opt_cls, _params(device=path), steps=2, lr=1e-2, max_grad_norm=1.0)
    before = [p.detach().clone() for p in params]
    for i, (p, g) in enumerate(zip(params, _grads(5, device=path))):
        p.grad = g
        if i == 3:
            p.grad[0] = float("nan")
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(opt.state[p]["step"].item() == 2 for p in params)
    assert not torch.isfinite(opt.last_grad_norm).item()
    for p, g in zip(params, _grads(6, device=path)):
        p.grad = g
    opt.step()
    assert all(opt.state[p]["step"].item() == 3 for p in params)
    assert any(not torch.equal(p, b) for p, b in zip(params, before))


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
    # all four ran the same 10 AdamW steps: each within the peer rule of torch's float64 run, torch's
    # fp32 run the peer ([Note: Adam vs torch.optim]); a step count or moment lost in a swap is off by ~lr
    want, _ = _run(torch.optim.AdamW, _params(torch.float64), steps=10, lr=1e-2, weight_decay=0.1, foreach=False)
    for i, (a, b, c, d, r) in enumerate(zip(ours, theirs, t2, o2, want)):
        for name, x in (("ours", a), ("torch from ours", c), ("ours from torch", d)):
            assert_within_peer_rule(x.detach(), r.detach(), b.detach(), msg=f"{name}, param {i}")


# ---------------------------------------------------------------------------------- LAMB / LARS


@pytest.mark.parametrize(
    "kw",
    [
        dict(mode="nvlamb", lr=1e-2, weight_decay=0.01, max_grad_norm=1.0),
        dict(mode="paper", lr=1e-2, weight_decay=0.01, max_grad_norm=None, min_trust=0.05, max_trust=2.0),
        dict(mode="nvlamb", lr=3e-3, weight_decay=0.0, max_grad_norm=50.0, bias_correction=False),
    ],
)
def test_lamb_twenty_steps_match_the_reference(path, kw):
    params, opt = _run(FusedLAMB, _params(device=path), **kw)
    ref = _params(device=path)
    states = [[torch.zeros_like(p) for p in ref] for _ in range(2)]
    ref_kw = dict(kw, beta1=0.9, beta2=0.999, eps=1e-6)
    lr = ref_kw.pop("lr")
    for step in range(20):
        grads = _grads(step, device=path)
        # two param groups (the second at 3x lr): one global clipping factor for both
        if kw["max_grad_norm"]:
            norm = float(reference.global_norm(grads))
            if norm > kw["max_grad_norm"]:
                grads = [g / (norm / kw["max_grad_norm"]) for g in grads]
        one = dict(ref_kw, max_grad_norm=None)
        reference.lamb_step(ref[:3], grads[:3], states[0][:3], states[1][:3], step=step + 1, lr=lr, **one)
        reference.lamb_step(ref[3:], grads[3:], states[0][3:], states[1][3:], step=step + 1, lr=3 * lr, **one)
    for a, b in zip(params, ref):
        torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["nvlamb", "paper"])
def test_one_launch_lamb_equals_the_two_launch_path_bit_for_bit(path, mode, monkeypatch):
    """[Note: one-launch LAMB]: the same sums in the same order, so the same bits as stage 1 then
    stage 2, over empty, 1-element, one-block and many-block tensors, two dtype groups (one launch
    each: bf16 params with masters, fp32 params), grads scaled, and a skipped step."""
    if path.type == "cpu" and not kernels.TRITON_ON_CPU:
        pytest.skip("the C++ CPU kernels keep stage 1's results in cache instead (csrc/cpu/lamb.cpp)")
    from zerofuse.kernels import optim as K

    shapes = [(0,), (1,), (4097,), (33, 65), (3 * 4096 + 5,), (4096,)]
    if path.type == "cuda":  # over 128 blocks: the block sums' per-thread grouping (the launches' warps) shows
        shapes.append((300 * 2048 + 7,))
    runs = []
    for one_launch in (True, False):
        monkeypatch.setattr(K, "LAMB_ONE_LAUNCH", one_launch)
        params = [torch.nn.Parameter(p.to(torch.bfloat16 if i % 2 else torch.float32))
                  for i, p in enumerate(_params(device=path, shapes=shapes))]
        opt = FusedLAMB(params, lr=1e-2, weight_decay=0.01, mode=mode, master_weights=True,
                        **({"min_trust": 0.05, "max_trust": 2.0} if mode == "paper" else {}))
        for step in range(3):
            for p, g in zip(params, _grads(step, device=path, shapes=shapes)):
                p.grad = (g * 64.0).to(p.dtype)
            found = torch.tensor([1.0 if step == 1 else 0.0], device=path)
            opt.step(grad_scale=torch.tensor(64.0, device=path), found_inf=found)
        runs.append((params, opt))
    (ours, opt), (theirs, ref) = runs
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step") + (("master",) if a.dtype == torch.bfloat16 else ()):
            assert torch.equal(opt.state[a][key], ref.state[b][key]), key
    assert opt.state[ours[2]]["step"].item() == 2


def test_one_launch_lamb_schedule_runs_each_tensor_stage_1_then_stage_2_backwards():
    from zerofuse.kernels import optim as K

    # tensors of 2, 0, 1 and 3 blocks: codes 2 * block + stage
    table = types.SimpleNamespace(numels=(5000, 0, 7, 9000), block_starts=[0, 2, 2, 3, 6])
    sched = K._schedule(table, torch.device("cpu")).tolist()
    assert sched == [0, 2, 3, 1, 4, 5, 6, 8, 10, 11, 9, 7]


def test_one_launch_lamb_schedule_outlives_the_layout_cache(monkeypatch):
    """A captured step (--cuda-graphs) reads the schedule of its first launch at every replay: an
    optimizer's launch keeps using that same tensor after more than _LAYOUTS_KEPT other layouts
    (e.g. ZeRO buckets) pushed it out of the shared cache, which freed it for reuse."""
    from zerofuse.kernels import lamb as KL
    from zerofuse.kernels import multi_tensor as MT
    from zerofuse.kernels import optim as K

    monkeypatch.setattr(K, "LAMB_ONE_LAUNCH", True)
    monkeypatch.setattr(KL, "_SCHEDULES", KL.OrderedDict())
    seen = []
    real = KL.launch_triton

    def spy(kernel, grid, *args, **consts):
        if kernel is KL._lamb_fused_kernel:
            seen.append(args[2])
        return real(kernel, grid, *args, **consts)

    monkeypatch.setattr(KL, "launch_triton", spy)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 4099)]
    opt = FusedLAMB(params, lr=1e-3)
    for p in params:
        p.grad = torch.zeros_like(p)  # kept, as a job's grads are: the launch's tables are kept
    for step in range(2):
        for p in params:
            p.grad.normal_()
        opt.step()
        for n in range(MT._LAYOUTS_KEPT + 1):  # other layouts evict this optimizer's
            MT._kept(KL._SCHEDULES, ("another layout", n), lambda: torch.zeros(1, dtype=torch.int32))
    assert len(seen) == 2 and seen[0] is seen[1]


def test_lamb_launch_form_is_chosen_by_the_environment(monkeypatch):
    """ZEROFUSE_LAMB_ONE_LAUNCH: unset or 0 = two launches (faster on an H200: 2026-11-26), 1 = one
    launch; anything else is refused with the variable's name and value."""
    from zerofuse.kernels import optim as K

    monkeypatch.delenv("ZEROFUSE_LAMB_ONE_LAUNCH", raising=False)
    assert K._lamb_one_launch_from_env() is False
    monkeypatch.setenv("ZEROFUSE_LAMB_ONE_LAUNCH", "1")
    assert K._lamb_one_launch_from_env() is True
    monkeypatch.setenv("ZEROFUSE_LAMB_ONE_LAUNCH", "0")
    assert K._lamb_one_launch_from_env() is False
    monkeypatch.setenv("ZEROFUSE_LAMB_ONE_LAUNCH", "yes")
    with pytest.raises(ValueError, match=r"ZEROFUSE_LAMB_ONE_LAUNCH must be .*got 'yes'"):
        K._lamb_one_launch_from_env()


def test_lamb_modes_differ_where_the_paper_clamps():
    """A tensor with |p| above max_trust: "paper" clamps phi(|p|), "nvlamb" does not."""
    p = torch.randn(1000) * 10  # |p| ~ 316
    out = {}
    for mode in ("paper", "nvlamb"):
        q = torch.nn.Parameter(p.clone())
        q.grad = torch.randn(1000)
        FusedLAMB([q], lr=1e-2, mode=mode, max_trust=10.0, max_grad_norm=None).step()
        out[mode] = (q.detach() - p).norm().item()
    # the step length is lr * trust * |u| = lr * phi(|p|): 1e-2 * 10 vs 1e-2 * 316
    assert out["paper"] == pytest.approx(1e-2 * 10.0, rel=1e-4)
    assert out["nvlamb"] == pytest.approx(1e-2 * p.norm().item(), rel=1e-4)


def test_lamb_master_weights_follow_an_fp32_run(path):
    params = [torch.nn.Parameter(p) for p in _params(torch.bfloat16, device=path)]
    ref = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = FusedLAMB(params, lr=1e-2, master_weights=True)
    ref_opt = FusedLAMB(ref, lr=1e-2)
    for step in range(10):
        for p, r, g in zip(params, ref, _grads(step, torch.bfloat16, path)):
            p.grad, r.grad = g.clone(), g.float()
        opt.step()
        ref_opt.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(opt.state[p]["master"], r.detach(), rtol=1e-6, atol=1e-6)
        assert torch.equal(p.detach(), opt.state[p]["master"].bfloat16())


def test_lars_twenty_steps_match_the_reference(path):
    kw = dict(lr=0.5, momentum=0.9, weight_decay=1e-4, trust_coefficient=1e-3, eps=1e-8)
    params, _ = _run(FusedLARS, _params(device=path), **kw)
    ref = _params(device=path)
    bufs = [torch.zeros_like(p) for p in ref]
    for step in range(20):
        grads = _grads(step, device=path)
        reference.lars_step(ref[:3], grads[:3], bufs[:3], **kw)
        reference.lars_step(ref[3:], grads[3:], bufs[3:], **dict(kw, lr=3 * kw["lr"]))
    for a, b in zip(params, ref):
        torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6)


def test_lars_with_given_norms_matches_lars_computing_them(path):
    """lars_(norms=...) (ZeRO passes norms summed over the ranks) against the op computing them,
    and with the optimizers' kept tables; other norms give another step."""
    from zerofuse.ops._optim import Prepared

    params, grads = _params(device=path), _grads(0, device=path)
    kw = dict(lr=0.5, momentum=0.9, weight_decay=1e-4, trust_coefficient=1e-3)
    pn, gn = torch.stack([p.norm() for p in params]), torch.stack([g.norm() for g in grads])
    runs = {}
    for name, extra in (("computed", {}), ("given", dict(norms=torch.cat([pn, gn]))),
                        ("kept tables", dict(norms=torch.cat([pn, gn]), prepared=Prepared())),
                        ("grad norms doubled", dict(norms=torch.cat([pn, 2 * gn])))):
        ps, bufs = [p.clone() for p in params], [torch.zeros_like(p) for p in params]
        zerofuse.ops.lars_(ps, grads, bufs, **extra, **kw)
        runs[name] = ps
    for name in ("given", "kept tables"):
        for a, b in zip(runs[name], runs["computed"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert all(not torch.allclose(a, b) for a, b in zip(runs["grad norms doubled"], runs["computed"]) if a.numel())


def test_lars_moves_zero_initialised_tensors():
    """|p| = 0 (a zero-initialised bias): local lr 1, as NVIDIA's LARC, not a frozen tensor."""
    p = torch.nn.Parameter(torch.zeros(10))
    p.grad = torch.ones(10)
    FusedLARS([p], lr=0.1, momentum=0.0).step()
    torch.testing.assert_close(p.detach(), torch.full((10,), -0.1))


# ---------------------------------------------------------------------------------- norms


def test_l2norm_matches_float64_and_flags_non_finite(path):
    ts = _params(device=path) + [torch.randn(300, device=path).bfloat16(), torch.randn(77, device=path).half()]
    total, each = zerofuse.ops.l2norm(ts, per_tensor=True)
    torch.testing.assert_close(total.double().cpu(), reference.global_norm(ts), rtol=1e-6, atol=0)
    torch.testing.assert_close(each.double().cpu(), torch.stack([reference.global_norm([t]) for t in ts]),
                               rtol=1e-6, atol=1e-30)
    assert zerofuse.ops.l2norm(ts)[1].numel() == 0
    for bad in (float("inf"), float("nan")):
        ts[3][2] = bad
        norm, found = functional.grad_norm(ts, grad_scale=4.0)
        assert not torch.isfinite(norm).item() and found.item() == 1.0
    ts[3][2] = 0.0
    norm, found = functional.grad_norm(ts, grad_scale=4.0)
    assert found.item() == 0.0
    torch.testing.assert_close(norm.double().cpu(), reference.global_norm(ts).reshape(1) / 4, rtol=1e-6, atol=0)
    assert zerofuse.ops.l2norm([])[0].item() == 0.0


# ---------------------------------------------------------------------------------- flat buffers


def test_kernel_tables_promise_16_byte_alignment_only_when_every_address_has_it():
    """The Triton kernels read tensor addresses from a table and vectorise only when the table
    says all are 16-byte aligned: a view at an odd element offset (a ZeRO segment) must turn it off."""
    from zerofuse.kernels import optim as K

    base = torch.zeros(2048)
    cpu = torch.device("cpu")
    assert base.data_ptr() % 16 == 0
    assert K._Table([[base[:512], base[512:1024]], None], cpu).aligned
    assert not K._Table([[base[:512], base[1:513]]], cpu).aligned
    assert not K._Table([[base[:512]], [base[3:515]]], cpu).aligned


# fp32 arrays each kernel loads and stores per element on its unmasked (full-block) path
# (arrays read, arrays written) by a full block; the one-launch LAMB has both stages' code paths
_FP32_ARRAYS = {"adam": (4, 3), "lamb_stage1": (4, 2), "lamb_stage2": (3, 1), "lamb_fused": (7, 3), "lars": (3, 2), "sum_squares": (1, 0),
                "sum_squares_scaled": (1, 0)}


def test_full_blocks_compile_to_16_byte_accesses_for_an_h100():
    """Compiled for sm_90 on this CPU machine (tools/kernel_asm.py): with aligned tables every
    fp32 array of a full block moves in 16-byte vectors (BLOCK / threads / 4 per array and
    thread); without the alignment promise, none may. A mask against the runtime numel on every
    block made all of them 4-byte accesses (the kernels before this test reached 0.47 of the H100's
    copy bandwidth)."""
    from zerofuse.kernels import optim as K

    from common import kernel_asm

    rows = kernel_asm()
    per_array = K.BLOCK // (32 * K._NUM_WARPS) // 4
    seen = set()
    assert {"segment_sum", "clip"} <= {r["kernel"] for r in rows if r["aligned"] is None}  # they compile
    for row in rows:
        loads, stores = row["loads"].get("v4.b32", 0), row["stores"].get("v4.b32", 0)
        if row["aligned"] is None:
            continue
        if not row["aligned"]:
            assert loads == stores == 0, row
        elif row["kernel"] in _FP32_ARRAYS:
            n_in, n_out = _FP32_ARRAYS[row["kernel"]]
            assert (loads, stores) == (n_in * per_array, n_out * per_array), row
            seen.add(row["kernel"])
    assert seen == set(_FP32_ARRAYS)
    bf16 = next(r for r in rows if r["kernel"] == "adam_bf16_master" and r["aligned"])
    # grad (bf16: half the vectors), master, m, v in; master, m, v, bf16 param out
    assert bf16["loads"]["v4.b32"] == 3 * per_array + per_array // 2, bf16
    assert bf16["stores"]["v4.b32"] == 3 * per_array + per_array // 2, bf16


def test_adamw_flat_equals_the_optimizer_on_separate_tensors(path):
    params = _params(device=path)
    flat = torch.cat([p.reshape(-1) for p in params])
    m, v, step = torch.zeros_like(flat), torch.zeros_like(flat), torch.zeros((), device=path)
    twin = [torch.nn.Parameter(p.clone()) for p in params]
    opt = FusedAdamW(twin, lr=1e-2, weight_decay=0.1)
    for s in range(5):
        grads = _grads(s, device=path)
        functional.adamw_flat(flat, torch.cat([g.reshape(-1) for g in grads]), m, v, step, lr=1e-2, weight_decay=0.1)
        for t, g in zip(twin, grads):
            t.grad = g
        opt.step()
    torch.testing.assert_close(flat, torch.cat([t.detach().reshape(-1) for t in twin]), rtol=1e-6, atol=1e-6)


def _segments(shapes):
    out, off = [], 0
    for s in shapes:
        n = torch.Size(s).numel()
        out.append((off, n))
        off += n
    return out


def test_lamb_flat_equals_the_optimizer_on_separate_tensors(path):
    params = _params(device=path)
    flat = torch.cat([p.reshape(-1) for p in params])
    m, v, step = torch.zeros_like(flat), torch.zeros_like(flat), torch.zeros((), device=path)
    twin = [torch.nn.Parameter(p.clone()) for p in params]
    opt = FusedLAMB(twin, lr=1e-2, max_grad_norm=None)
    calls = []
    for s in range(5):
        grads = _grads(s, device=path)
        functional.lamb_flat(flat, torch.cat([g.reshape(-1) for g in grads]), m, v, step, _segments(SHAPES),
                             lr=1e-2, norm_reduce=calls.append)
        for t, g in zip(twin, grads):
            t.grad = g
        opt.step()
    assert len(calls) == 5 and calls[0].shape == (len(SHAPES), 2)
    torch.testing.assert_close(flat, torch.cat([t.detach().reshape(-1) for t in twin]), rtol=1e-5, atol=1e-6)


def _lamb_shard_rank(rank, world_size):
    """Each rank holds 1/world_size of the flat buffer (padded); segments are the pieces of the
    params that fall in its shard; norm sums are all-reduced between the stages."""
    import torch.distributed as dist

    params, total = _params(), sum(torch.Size(s).numel() for s in SHAPES)
    shard = -(-total // world_size)
    flat = torch.zeros(shard * world_size)
    flat[:total] = torch.cat([p.reshape(-1) for p in params])
    lo, hi = rank * shard, (rank + 1) * shard
    segments = []  # (offset in shard, length) of each param's piece, also when empty
    for off, n in _segments(SHAPES):
        b, e = max(off, lo), min(off + n, hi)
        segments.append((b - lo, max(0, e - b)) if e > b else (0, 0))
    mine = flat[lo:hi].clone()
    m, v, step = torch.zeros_like(mine), torch.zeros_like(mine), torch.zeros(())
    for s in range(3):
        g = torch.zeros(shard * world_size)
        g[:total] = torch.cat([x.reshape(-1) for x in _grads(s)])
        functional.lamb_flat(mine, g[lo:hi].clone(), m, v, step, segments, lr=1e-2, mode="nvlamb",
                             norm_reduce=dist.all_reduce)
    out = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(out, mine)
    return torch.cat(out)[:total]


@pytest.mark.parametrize("world_size", [2, 3])
def test_lamb_on_shards_with_all_reduced_norms_equals_unsharded(world_size, cpu_kernels):
    got = run_distributed(_lamb_shard_rank, world_size, timeout=120)
    ref = _params()
    states = [[torch.zeros_like(p) for p in ref] for _ in range(2)]
    for s in range(3):
        reference.lamb_step(ref, _grads(s), *states, step=s + 1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6,
                            weight_decay=0.01, mode="nvlamb")
    want = torch.cat([p.reshape(-1) for p in ref])
    for r in range(world_size):
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------- errors, op checks


@pytest.mark.parametrize(
    "make,exc,msg",
    [
        (lambda p: FusedAdamW([p], amsgrad=True), ValueError, r"FusedAdamW: amsgrad=True is not supported \(use torch.optim.AdamW\)"),
        (lambda p: FusedAdam([p], differentiable=True), ValueError, r"FusedAdam: differentiable=True is not supported"),
        (lambda p: FusedAdamW([p], max_grad_norm=-1.0), ValueError, r"FusedAdamW: expected max_grad_norm >= 0 or None \(0: no clipping\), got -1.0"),
        (lambda p: FusedLAMB([p], mode="lars"), ValueError, r"FusedLAMB: expected mode 'paper' or 'nvlamb', got 'lars'"),
        (lambda p: FusedLAMB([p], min_trust=2.0, max_trust=1.0), ValueError, r"expected 0 <= min_trust <= max_trust"),
        (lambda p: FusedLARS([p], momentum=-0.1), ValueError, r"FusedLARS: expected momentum finite and >= 0, got -0.1"),
    ],
)
def test_bad_options_raise(make, exc, msg):
    with pytest.raises(exc, match=msg):
        make(torch.nn.Parameter(torch.randn(3)))


@pytest.mark.parametrize("opt_cls", [FusedAdamW, FusedLAMB, FusedLARS])
def test_sparse_and_complex_gradients_raise(opt_cls):
    name = opt_cls.__name__
    p = torch.nn.Parameter(torch.randn(4, 3))
    p.grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match=f"{name}: sparse gradients are not supported"):
        opt_cls([p]).step()
    q = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    q.grad = torch.randn(3, dtype=torch.complex64)
    with pytest.raises(RuntimeError, match=f"{name}: complex parameters are not supported"):
        opt_cls([q]).step()


def test_op_errors_name_the_argument(path):
    from zerofuse.ops._optim import Prepared

    prepared = Prepared()
    p, g = [torch.randn(5, device=path)], [torch.randn(5, device=path)]
    z = lambda *s, **k: torch.zeros(*s, device=path, **k)  # noqa: E731
    steps = [torch.ones((), device=path)]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    with pytest.raises(ValueError, match=r"zerofuse::adam_: expected exp_avgs to have one tensor per param \(1\), got 0"):
        zerofuse.ops.adam_(p, g, [], [z(5)], steps, **kw)
    with pytest.raises(RuntimeError, match=r"zerofuse::adam_: expected exp_avgs\[0\] in float32, got .*[bB][fF]loat16"):
        zerofuse.ops.adam_(p, g, [z(5, dtype=torch.bfloat16)], [z(5)], steps, **kw)
    with pytest.raises(ValueError, match=r"expected grads\[0\] to have 5 elements like params\[0\], got 4"):
        zerofuse.ops.adam_(p, [torch.randn(4, device=path)], [z(5)], [z(5)], steps, **kw)
    with pytest.raises(RuntimeError, match=r"expected params\[0\] to be contiguous"):
        zerofuse.ops.adam_([torch.randn(5, 2, device=path).t()], [z(2, 5)], [z(10)], [z(10)], steps, **kw)
    with pytest.raises(ValueError, match=r"expected steps to have one tensor per param \(1\), got 0"):
        zerofuse.ops.adam_(p, g, [z(5)], [z(5)], [], **kw)
    with pytest.raises(RuntimeError, match=r"lamb_stage1_: expected norms to be a contiguous float32 (cpu )?tensor of shape \[1, 2\]"):
        zerofuse.ops.lamb_stage1_(p, g, [z(5)], [z(5)], steps, z(2), beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0)
    with pytest.raises(ValueError, match=r"zerofuse::lamb_: expected mode 'paper' or 'nvlamb', got 'x'"):
        zerofuse.ops.lamb_(p, g, [z(5)], [z(5)], steps, lr=1, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0, mode="x")
    with pytest.raises(ValueError, match=r"lamb_stage2_: expected mode 'paper' or 'nvlamb', got 'x'"):
        zerofuse.ops.lamb_stage2_(p, [z(5)], [z(5)], steps, z(1, 2), lr=1, beta1=0.9, beta2=0.99, eps=1e-6,
                                  weight_decay=0, mode="x")
    lars = dict(lr=0.1, momentum=0.9, weight_decay=0.0, trust_coefficient=1e-3)
    with pytest.raises(RuntimeError, match=r"lars_: expected norms to be a contiguous float32 (cpu )?tensor of shape \[2\]"):
        zerofuse.ops.lars_(p, g, [z(5)], norms=z(3), **lars)
    # kept launch tables (an optimizer's Prepared) still check the norms, which may change at every call
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"lamb_stage2_: expected norms to be a contiguous float32 (cpu )?tensor "
                                               r"of shape \[1, 2\]"):
            zerofuse.ops.lamb_stage2_(p, [z(5)], [z(5)], steps, z(2), lr=1, beta1=0.9, beta2=0.99, eps=1e-6,
                                      weight_decay=0, prepared=prepared)
        with pytest.raises(RuntimeError, match=r"lars_: expected norms (on the params' device|to be a contiguous float32 "
                                               r"cpu tensor).*meta"):
            zerofuse.ops.lars_(p, g, [z(5)], norms=torch.zeros(2, device="meta"), prepared=prepared, **lars)
    with pytest.raises(ValueError, match=r"segments\[1\] = \(3, 9\) runs outside the flat buffer of 5 elements"):
        functional.lamb_flat(z(5), z(5), z(5), z(5), steps[0], [(0, 3), (3, 9)], lr=1e-3)


def _op_args():
    ps = [torch.randn(7, 3), torch.randn(5)]
    gs = [torch.randn(7, 3), torch.randn(5).bfloat16()]
    st = [torch.zeros(7, 3), torch.zeros(5)]
    st2 = [torch.zeros(7, 3), torch.zeros(5)]
    steps = [torch.tensor(1.0), torch.tensor(2.0)]  # advanced to 2 and 3 by the step
    return ps, gs, st, st2, steps


def test_opcheck(cpu_kernels):
    ps, gs, st, st2, steps = _op_args()
    masters = [p.clone() for p in ps]
    mult, found = torch.tensor([0.5]), torch.tensor([0.0])
    torch.library.opcheck(torch.ops.zerofuse.adam_.default,
                          (ps, gs, st, st2, masters, steps, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, False, mult, found))
    norms = torch.zeros(2, 2)
    torch.library.opcheck(torch.ops.zerofuse.lamb_stage1_.default,
                          (ps, gs, st, st2, [], steps, 0.9, 0.999, 1e-6, 0.01, True, mult, found, norms))
    torch.library.opcheck(torch.ops.zerofuse.lamb_.default,
                          (ps, gs, st, st2, [], steps, 1e-3, 0.9, 0.999, 1e-6, 0.01, True, 0, 0.0, 10.0, mult, None))
    torch.library.opcheck(torch.ops.zerofuse.lamb_stage2_.default,
                          (ps, st, st2, [], steps, norms.abs() + 1, 1e-3, 0.9, 0.999, 1e-6, 0.01, True, 1, 0.0, 10.0,
                           None))
    torch.library.opcheck(torch.ops.zerofuse.lars_.default,
                          (ps, gs, st, [], torch.ones(4), 0.1, 0.9, 1e-4, 1e-3, 1e-8, None, None))
    torch.library.opcheck(torch.ops.zerofuse.l2norm.default, (gs, True))


def test_torch_compile_fullgraph(cpu_kernels):
    ps, gs, st, st2, steps = _op_args()
    ref = [t.clone() for t in ps]
    ref_st = [[t.clone() for t in st], [t.clone() for t in st2]]

    def step(ps, gs, st, st2, steps):
        norm, _ = torch.ops.zerofuse.l2norm(gs, False)
        torch.ops.zerofuse.adam_(ps, gs, st, st2, [], steps, 1e-2, 0.9, 0.999, 1e-8, 0.01, True, False, None, None)
        return norm

    norm = torch.compile(step, fullgraph=True, backend="aot_eager")(ps, gs, st, st2, steps)
    torch.testing.assert_close(norm.double(), reference.global_norm(gs).float().double(), rtol=1e-6, atol=0)
    for i, s in enumerate((2, 3)):
        reference.adam_step(ref[i], gs[i].float(), ref_st[0][i], ref_st[1][i], step=s, lr=1e-2, beta1=0.9,
                            beta2=0.999, eps=1e-8, weight_decay=0.01)
        torch.testing.assert_close(ps[i], ref[i], rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_cuda_step_with_amp_inputs_never_syncs():
    """The whole CUDA step (unscale, clipping norm, inf flag, update, step counters) runs without
    a host sync: torch's sync debug mode turns any sync into an error."""
    params = [torch.nn.Parameter(p) for p in _params(device="cuda")]
    opt = FusedAdamW(params, lr=1e-2, max_grad_norm=1.0)
    for p, g in zip(params, _grads(0, device="cuda")):
        p.grad = g
    scale, found = torch.tensor(2.0, device="cuda"), torch.zeros(1, device="cuda")
    opt.step(grad_scale=scale, found_inf=found)  # warm-up: kernel compilation may sync
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step(grad_scale=scale, found_inf=found)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt.state[params[0]]["step"].item() == 2


def test_launch_constants_are_written_in_place_when_the_lr_changes():
    """A schedule changes the lr every step: the constants tensor the kernels read is one
    persistent tensor per kind of launch, updated in place (a fill on the stream), never a new
    upload through a new pinned allocation."""
    from zerofuse.kernels import optim as KO

    ps = [torch.zeros(10), torch.zeros(3)]
    launch = KO.Launch(ps, [torch.zeros_like(p) for p in ps], [None, None, None, None])
    first = launch.consts((1e-3, 0.9, 0.95, 1e-8, 0.1))
    again = launch.consts((5e-4, 0.9, 0.95, 1e-8, 0.1))
    assert again is first and again.tolist() == [5e-4, 0.9, 0.95, 1e-8, 0.1]
    lamb = launch.consts((0.9, 0.95, 1e-8, 0.1))  # another kind of launch keeps its own tensor
    assert lamb is not first and lamb.tolist() == [0.9, 0.95, 1e-8, 0.1]
    assert launch.consts((1e-4, 0.9, 0.95, 1e-8, 0.1)) is first and first[0].item() == 1e-4


def test_a_grad_of_another_dtype_at_the_same_address_is_read_as_its_dtype(path):
    """The kept launch table fixed the grads' dtype: a bf16 grad at the fp32 grad's old address was
    read as fp32 bits (the update, and a clipping norm, wrong; a review's reproduction, 2026-12-06)."""
    results = []
    for same in (False, True):
        p = torch.nn.Parameter(torch.ones(8, device=path))
        p.grad_dtype = None  # (torch takes a grad of another dtype only so)
        opt = FusedAdamW([p], lr=0.1, weight_decay=0.0, max_grad_norm=100.0)
        buf = torch.ones(8, device=path)
        p.grad = buf
        opt.step()
        g16 = buf.view(torch.bfloat16)[:8] if same else torch.empty(8, dtype=torch.bfloat16, device=path)
        g16.fill_(-1.0)
        p.grad = g16
        opt.step()
        results.append((p.detach().clone(), float(opt.last_grad_norm)))
    assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1] == pytest.approx(8 ** 0.5)


def test_l2_decay_of_zero_leaves_non_finite_params_as_torch(path):
    """FusedAdam's L2 term at weight_decay 0: the Triton kernel added 0 * p, NaN for an inf param (its
    moments NaN too), where torch and the C++ kernel add nothing (a review's reproduction, 2026-12-06)."""
    def run(cls):
        p = torch.nn.Parameter(torch.tensor([1.0, float("inf"), float("-inf")], device=path))
        opt = cls([p], lr=0.1)
        p.grad = torch.ones_like(p)
        opt.step()
        return p.detach().cpu(), opt.state[p]["exp_avg"].cpu()

    for got, want in zip(run(FusedAdam), run(torch.optim.Adam)):
        torch.testing.assert_close(got, want)


def test_an_apex_state_dict_loads_with_its_step_count():
    """Apex keeps one step count per param group and none per param: torch's Adam raised KeyError
    'step', FusedLAMB too; each param takes its group's count now (a review's reproduction,
    2026-12-06), and Apex options without an equivalent are refused."""
    ps = [torch.nn.Parameter(torch.randn(7)), torch.nn.Parameter(torch.randn(3))]
    moments = {i: {"exp_avg": torch.full((n,), 0.1), "exp_avg_sq": torch.full((n,), 0.01)}
               for i, n in enumerate((7, 3))}
    group = {"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
             "step": 1000, "params": [0, 1]}
    for cls, extra in ((FusedAdamW, {}), (FusedLAMB, {"grad_averaging": True, "max_grad_norm": 1.0})):
        opt = cls(ps)
        opt.load_state_dict({"state": copy.deepcopy(moments), "param_groups": [group | extra]})
        assert all(float(opt.state[p]["step"]) == 1000 for p in ps) and "step" not in opt.param_groups[0]
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
        assert all(float(opt.state[p]["step"]) == 1001 for p in ps)
    for cls, bad, match in ((FusedAdamW, {"bias_correction": False}, "bias_correction=False"),
                            (FusedLAMB, {"grad_averaging": False}, "grad_averaging=False")):
        with pytest.raises(ValueError, match=rf"param_groups\[0\] of an Apex state dict has {match}"):
            cls(ps).load_state_dict({"state": copy.deepcopy(moments), "param_groups": [group | bad]})
