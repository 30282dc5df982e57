"""FusedLAMB and FusedLARS against zerofuse.reference, and the fused L2 norms (see test_optim.py)."""
import types

import pytest
import torch

import zerofuse
from zerofuse import kernels, reference
from zerofuse.optim import FusedLAMB, FusedLARS, functional

from optim_common import _grads, _params, _run, path  # noqa: F401  (path: the fixture)


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
