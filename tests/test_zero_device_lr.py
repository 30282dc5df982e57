"""zerofuse.zero.Optimizer.sync_lr: the lr kept in a device tensor that the step's kernels read (what a
CUDA graph of the step needs to follow a schedule). Steps equal the float-lr ones bit for bit under
a schedule; after sync_lr a step writes no constant from the host (no fill_: the only writes a
captured graph would freeze), and the kernels take the lr from the device tensor."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

HYPER = {"adamw": dict(lr=3e-2, weight_decay=0.1), "lamb": dict(lr=3e-2, weight_decay=0.01),
         "lars": dict(lr=0.5, weight_decay=1e-4)}


class _CountFills(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.fills = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("fill_", "fill"):
            self.fills += 1
        return func(*args, **(kwargs or {}))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3))


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 9, generator=g), torch.randn(6, 3, generator=g)) for _ in range(n)]


def _train(kind, device_lr, steps=6, stage=2):
    from zerofuse import zero

    model = zero.parallelize(_model(), stage=stage)
    opt = zero.Optimizer(model, kind, max_grad_norm=1.0, **HYPER[kind])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for x, y in _batches(steps):
        torch.nn.functional.mse_loss(model(x), y).backward()
        if device_lr:
            opt.sync_lr()
        opt.step()
        opt.zero_grad()
        sched.step()
    with zero.full_params(model):
        return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["adamw", "lamb", "lars"])
def test_device_lr_steps_equal_float_lr_steps(kind, kernel_path, world_of_one):
    ref = _train(kind, device_lr=False)
    got = _train(kind, device_lr=True)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    if kind == "adamw":  # and the schedule matters: a constant lr trains elsewhere
        assert not all(torch.equal(a, b) for a, b in zip(ref, _train(kind, device_lr=False, steps=1)))


@pytest.mark.parametrize("kind", ["adamw", "lamb", "lars"])
def test_after_sync_lr_a_step_writes_no_constant_and_reads_the_device_lr(kind, world_of_one):
    from zerofuse import zero

    model = zero.parallelize(_model(), stage=2)
    opt = zero.Optimizer(model, kind, max_grad_norm=1.0, **HYPER[kind])
    (x, y), = _batches(1)
    before = None
    for step in range(3):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.param_groups[0]["lr"] *= 0.5  # a schedule: a new lr every step
        opt.sync_lr()
        if step == 2:  # the step itself, as a graph would capture it: every launch, no host-written value
            opt.param_groups[0]["lr"] = 123.0  # not synced: the kernels must not see it
            before = [p.detach().clone() for p in model.parameters()]
            with _CountFills() as counter:
                opt.step()
            assert counter.fills == 0
            moved = max((p.detach() - b).abs().max().item() for p, b in zip(model.parameters(), before))
            assert 0 < moved < 1.0, moved  # an lr of 123 would move the params by far more
        else:
            opt.step()
        opt.zero_grad()
