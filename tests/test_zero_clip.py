"""zerofuse.zero.Optimizer's clipping where the norm needs no collective (one rank, or stage 0): the
fused clip_inputs path (one sum-of-squares pass and one single-program kernel, torch's
clip_grad_norm_ coefficient min(max_norm / (norm + 1e-6), 1)) gives the general path's norm, skip
flag and training within fp32 rounding, and runs none of its ~15 small ops."""
from __future__ import annotations

import pytest
import torch

from tolerances import assert_close
from zerofuse import kernels
from zerofuse.train.launches import CountLaunches

pytestmark = pytest.mark.skipif(not kernels.triton_on_cpu(), reason="the kernels' path (interpreter)")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3))


def _train(monkeypatch, fused: bool, stage: int, max_norm: float, steps=5, count=False):
    from zerofuse import zero
    from zerofuse.zero.grad_norm import GradNorms

    with monkeypatch.context() as m:
        if not fused:
            m.setattr(GradNorms, "_fused_clip", lambda self, max_norm: None)
        model = zero.parallelize(_model(), stage=stage)
        opt = zero.Optimizer(model, "adamw", lr=3e-2, weight_decay=0.1, max_grad_norm=max_norm)
        g = torch.Generator().manual_seed(1)
        norms, names = [], {}
        for i in range(steps):
            x, y = torch.randn(6, 9, generator=g) * 4, torch.randn(6, 3, generator=g)
            torch.nn.functional.mse_loss(model(x), y).backward()
            with CountLaunches() as c:
                opt.step()
            names = c.names
            norms.append(opt.last_grad_norm.clone())
            opt.zero_grad()
        with zero.full_params(model):
            return [p.detach().clone() for p in model.parameters()], torch.cat(norms), names


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("max_norm", [0.05, 1e3])  # clipping every step / never
def test_fused_clip_equals_the_general_path(monkeypatch, world_of_one, stage, max_norm):
    params, norms, names = _train(monkeypatch, True, stage, max_norm)
    ref_params, ref_norms, ref_names = _train(monkeypatch, False, stage, max_norm)
    assert_close(norms, ref_norms, atol=0, rtol=1e-6)
    for a, b in zip(params, ref_params):
        assert_close(a, b, atol=1e-6, rtol=1e-5)
    if max_norm < 1:  # the clip changed the update: the test would see a wrong coefficient
        assert (ref_norms > max_norm).all()
    general = {"clamp", "isfinite", "reciprocal", "bitwise_not", "pow", "sqrt"}
    assert general & set(ref_names), ref_names  # what the general path runs ...
    assert not general & set(names), names  # ... and the fused one does not
    assert sum(names.values()) <= sum(ref_names.values()) - 10, (names, ref_names)


def test_fused_clip_skips_a_step_with_an_inf_grad(monkeypatch, world_of_one):
    from zerofuse import zero

    model = zero.parallelize(_model(), stage=2)
    opt = zero.Optimizer(model, "adamw", lr=3e-2, max_grad_norm=1.0)
    with zero.full_params(model):
        before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(6, 9)
    x[0, 0] = float("inf")
    model(x).sum().backward()
    opt.step()
    assert not torch.isfinite(opt.last_grad_norm).all()
    assert float(opt.last_step_skipped) == 1.0
    with zero.full_params(model):
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


@pytest.mark.parametrize("found", [1.0, 2.0, -1.0, 0.0])
def test_both_clip_paths_skip_on_any_nonzero_found_inf(found):
    """found_inf != 0 skips the step, on the fused kernel and on the torch fallback alike (the
    fallback took max(found_inf, bad): a found_inf of -1 did not skip, 2 gave a flag of 2)."""
    from zerofuse.ops._optim import Prepared
    from zerofuse.ops.l2norm import clip_inputs

    grads = [torch.randn(7), torch.randn(3, 5)]
    flag = torch.tensor([found])
    _, fused, _ = clip_inputs(grads, 1.0, found_inf=flag, prepared=Prepared())
    _, general, _ = clip_inputs(grads, 1.0, found_inf=flag)
    want = float(found != 0)
    assert fused.item() == want and general.item() == want, (fused, general)
