"""clip_grad_norm_ between the backwards of one step (gradient accumulation) is torch's: it scales
the grads accumulated so far, the later backwards add theirs unscaled. The Optimizer kept the
coefficient for step(), which scaled the later grads too (a review's reproduction, 2026-12-07):
it is folded into the reduced shards as the next backward begins (hooks; a world of one's taken
grads; .grad views clip at once)."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed

pytestmark = pytest.mark.usefixtures("native_kernels")
MAX_NORM = 0.01


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))


def _batches(rank):
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(4, 6, generator=g) for _ in range(2)]


def _torch(ws):
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1.0, eps=10.0, weight_decay=0.0)
    xs = [_batches(r) for r in range(ws)]
    for r in range(ws):
        (ref(xs[r][0]).pow(2).sum() / ws).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    for r in range(ws):
        (ref(xs[r][1]).pow(2).sum() / ws).backward()
    opt.step()
    return float(norm), ref.state_dict()


def _zero_rank(rank, ws, stage, views=False):
    from zerofuse import zero

    kw = dict(gradient_as_bucket_view=True) if views else {}
    m = zero.parallelize(_model(), stage=stage, **kw)
    opt = zero.Optimizer(m, "adamw", lr=1.0, eps=10.0, weight_decay=0.0)
    xs = _batches(rank)
    m(xs[0]).pow(2).sum().backward()
    norm = opt.clip_grad_norm_(MAX_NORM)
    m(xs[1]).pow(2).sum().backward()
    opt.step()
    with zero.full_params(m):
        return float(norm), {k: v.clone() for k, v in m.state_dict().items()}


def _check(got, want):
    (n, params), (n_ref, ref) = got, want
    assert n == pytest.approx(n_ref, rel=1e-5)
    for k, v in params.items():
        torch.testing.assert_close(v, ref[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_clip_between_backwards_scales_only_the_grads_before_it(stage):
    for got in run_distributed(_zero_rank, 2, stage, timeout=180):
        _check(got, _torch(2))


def _optimizer_gone_rank(rank, ws):
    from zerofuse import zero

    m = zero.parallelize(_model(), stage=2)
    opt = zero.Optimizer(m, "adamw")
    xs = _batches(rank)
    m(xs[0]).pow(2).sum().backward()
    opt.clip_grad_norm_(MAX_NORM)
    del opt  # (the next backward's fold found no optimizer: an AttributeError)
    m(xs[1]).pow(2).sum().backward()
    return m._zerofuse_zero.clip_pending


def test_a_backward_after_the_optimizer_is_gone_needs_no_fold():
    assert run_distributed(_optimizer_gone_rank, 2, timeout=120) == [False, False]


@pytest.mark.parametrize("stage,views", [(0, False), (2, False), (1, True)])
def test_the_same_in_a_world_of_one(world_of_one, stage, views):
    _check(_zero_rank(0, 1, stage, views), _torch(1))
