"""The standalone optimizers' param groups and loaded states (a review's reproductions, 2026-12-07;
each test failed before its fix): LAMB/LARS options refused only inside the kernel call, after the
groups before had stepped (or never: min_trust > max_trust, beta2 1.5); torch.optim.SGD's nesterov,
maximize, dampening loaded into FusedLARS and ignored; an SGD momentum_buffer of None."""
from __future__ import annotations

import copy

import pytest
import torch

from zerofuse.optim import FusedLAMB, FusedLARS

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _params(n=2):
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5, generator=g)) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn(5, generator=g)
    return ps


@pytest.mark.parametrize("bad,message", [
    ({"mode": "nvLAMB"}, r"expected mode 'paper' or 'nvlamb', got 'nvLAMB'"),
    ({"min_trust": 2.0, "max_trust": 1.0}, r"expected 0 <= min_trust <= max_trust, got 2.0, 1.0"),
    ({"betas": (0.9, 1.5)}, r"betas"),
    ({"eps": -1.0}, r"expected eps finite and >= 0, got -1.0"),
])
def test_a_bad_lamb_group_steps_no_group(bad, message):
    a, b = _params()
    opt = FusedLAMB([{"params": [a]}])
    opt.add_param_group({"params": [b], **bad})  # (torch's add_param_group checks nothing of these)
    before = a.detach().clone()
    with pytest.raises(ValueError, match=message):
        opt.step()
    assert torch.equal(a.detach(), before) and not opt.state[a]


@pytest.mark.parametrize("option", [{"nesterov": True}, {"maximize": True}, {"dampening": 0.1}])
def test_sgd_options_loaded_into_lars_are_refused(option):
    p = _params(1)[0]
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9, **({"dampening": 0} if "nesterov" in option else {}) | option)
    sgd.step()
    q = torch.nn.Parameter(p.detach().clone())
    q.grad = p.grad.clone()
    lars = FusedLARS([q])
    lars.load_state_dict(copy.deepcopy(sgd.state_dict()))
    (key, value), = option.items()
    with pytest.raises(ValueError, match=rf"FusedLARS: {key}={value}.*torch.optim.SGD"):
        lars.step()


def test_a_none_momentum_buffer_starts_anew_as_torch_sgds():
    p = _params(1)[0]
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    sgd.step()
    sd = copy.deepcopy(sgd.state_dict())
    sd["state"][0]["momentum_buffer"] = None
    ref = torch.nn.Parameter(p.detach().clone())
    ref.grad = p.grad.clone()
    q = torch.nn.Parameter(p.detach().clone())
    q.grad = p.grad.clone()
    fresh, loaded = FusedLARS([ref]), FusedLARS([q])
    loaded.load_state_dict(sd)
    fresh.step()
    loaded.step()
    assert torch.equal(q.detach(), ref.detach())  # as a fresh buffer (lr 0.1 from the loaded group as fresh's)


@pytest.mark.parametrize("option", [{"maximize": True}, {"amsgrad": True}, {"grad_averaging": False}])
def test_options_lamb_has_none_of_are_refused_in_a_group(option):
    """maximize=True in a FusedLAMB group descended, silently (a review's reproduction, 2026-12-07)."""
    p = _params(1)[0]
    opt = FusedLAMB([{"params": [p], **option}])
    (key, value), = option.items()
    with pytest.raises(ValueError, match=rf"FusedLAMB: {key}={value} in a param group"):
        opt.step()


@pytest.mark.parametrize("cpu_path", ["native", "triton"])
def test_lars_decays_no_param_whose_grad_is_zero(cpu_path, monkeypatch):
    """LARC adds the weight decay only with the trust ratio: a param whose grads were all zero decayed
    at the full lr (0.87 after 5 steps of lr 1, wd 1e-2, momentum 0.9) where LARC leaves it and 1e-12
    grads moved it to 0.987 (a review's reproduction, 2026-12-07)."""
    from zerofuse import kernels, reference

    monkeypatch.setattr(kernels, "TRITON_ON_CPU", cpu_path == "triton")
    p = torch.nn.Parameter(torch.ones(6))
    opt = FusedLARS([p], lr=1.0, momentum=0.9, weight_decay=1e-2, trust_coefficient=1e-3)
    ref, buf = torch.ones(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
    for _ in range(5):
        p.grad = torch.zeros(6)
        opt.step()
        reference.lars_step([ref], [torch.zeros(6, dtype=torch.float64)], [buf], lr=1.0, momentum=0.9,
                            weight_decay=1e-2, trust_coefficient=1e-3)
    assert torch.equal(p.detach(), torch.ones(6)) and torch.equal(ref, torch.ones(6, dtype=torch.float64))
