"""ZeRO-3 where a review (2026-12-07) reproduced a silent NaN or an unclear crash, each test failing
before its fix: a submodule shared by several wrapped blocks (ALBERT's layers; its params went into
the last block's unit and the earlier blocks read them freed); a re-entrant checkpoint inside a
module called twice per forward (its unit freed after the first recompute's backward, the second
read it freed); a nested parallelize (two engines over the same params); a double backward
(refused by name: the second-order graph reads params freed after the first)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dist_utils import error_text, run_distributed

pytestmark = pytest.mark.usefixtures("native_kernels")


class _SharedBlock(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.own, self.shared = nn.Linear(8, 8), shared

    def forward(self, h):
        return h + torch.tanh(self.shared(self.own(h)))


class _Shared(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        shared = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([_SharedBlock(shared) for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class _InnerCheckpoint(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def _f(self, h):
        return h + torch.tanh(self.lin(h))

    def forward(self, h):
        return checkpoint(self._f, h, use_reentrant=True)


class _Reused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([_InnerCheckpoint(), _InnerCheckpoint()])

    def forward(self, x):
        x = self.blocks[1](self.blocks[0](self.inp(x)))
        return self.blocks[1](x)  # the same block again


def _train(rank, ws, make, stage):
    from zerofuse import zero

    m = make()
    zero.parallelize(m, stage=stage)
    opt = zero.Optimizer(m, "adamw", lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x = torch.randn(4 * ws, 8, generator=g)[rank * 4:(rank + 1) * 4]
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with zero.full_params(m):
        return losses, {n: p.detach().clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("make", [_Shared, _Reused], ids=["shared submodule", "re-entrant checkpoint reused"])
def test_stage3_trains_as_stage2(make):
    from tolerances import assert_close

    ref = run_distributed(_train, 2, make, 2, timeout=120)
    for (losses, params), (want_losses, want) in zip(run_distributed(_train, 2, make, 3, timeout=120), ref):
        assert all(torch.isfinite(torch.tensor(losses)))  # (a rank's own batches' losses)
        assert_close(torch.tensor(losses), torch.tensor(want_losses), msg="losses")
        for n, p in params.items():
            assert_close(p, want[n], msg=n)


def _refusals(rank, ws):
    from zerofuse import zero

    out = {}
    inner = _Shared()
    zero.parallelize(inner.blocks[0], stage=3)
    out["inner first"] = error_text(lambda: zero.parallelize(inner, stage=3))
    outer = _Shared()
    zero.parallelize(outer, stage=3)
    out["outer first"] = error_text(lambda: zero.parallelize(outer.blocks[0], stage=3))
    x = torch.randn(4, 8, requires_grad=True)
    y = outer(x).square().sum()
    out["double"] = error_text(lambda: torch.autograd.grad(y, x, create_graph=True))
    y = outer(x).square().sum()  # a plain step after the refusal
    y.backward()
    out["after"] = bool(all(torch.isfinite(p.grad).all() for p in outer.parameters() if p.grad is not None))
    return out


def test_nested_parallelize_and_a_double_backward_are_refused():
    for out in run_distributed(_refusals, 2, timeout=120):
        assert out["inner first"] == ("ValueError: zerofuse.zero.parallelize: its submodule 'blocks.0' is already "
                                      "parallelized by another zerofuse.zero.parallelize call; expected one call over "
                                      "the whole model (wrap= names the modules that shard on their own)"), out
        assert out["outer first"].startswith("ValueError: zerofuse.zero.parallelize: its parameters are already "
                                             "parallelized"), out
        assert out["double"].startswith("RuntimeError: zerofuse.zero: a backward with create_graph=True"), out
        assert out["after"], out
