"""ZeRO-Offload between backward and step(): what the caller does there (full_grads, full_params,
zero_grad, a checkpoint) against the host steps. With offload_overlap they have started: writes they
would miss are refused. Without it (offload_overlap=False, or clipping) nothing has started: the
caller's edits and discards hold as without offload, bit for bit."""
from __future__ import annotations

import pytest
import torch

import zerofuse
from zerofuse.models import GPT, GPTConfig

from test_zero_offload import CFG, LR, batches

pytestmark = pytest.mark.usefixtures("native_kernels")


@pytest.mark.parametrize("stage", [2, 3])
def test_writes_the_running_host_steps_would_miss_are_refused(stage, world_of_one):
    """offload_overlap: the host steps start during backward. A user's clipping inside full_grads
    was ignored (or raced the host thread), and an edit inside full_params made the step's update
    vanish (a review's reproduction, 2026-11-28): both refused; reading changes nothing and the
    step is the step of a run that did not look."""
    def trained(look):
        model = GPT(GPTConfig(**CFG), seed=0)
        zerofuse.zero.parallelize(model, stage=stage, bucket_mb=0.01, offload="optimizer")
        opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR)
        b = batches(1)[0]
        model(b[:, :-1], b[:, 1:])[1].backward()
        out = look(model) if look else None
        opt.step()
        with zerofuse.zero.full_params(model):
            return out, {n: p.detach().clone() for n, p in model.named_parameters()}

    def clip(model):
        with pytest.raises(RuntimeError, match="full_grads: the grads were changed while the offloaded"):
            with zerofuse.zero.full_grads(model):
                for p in model.parameters():
                    p.grad.mul_(0.5)

    def edit(model):
        with pytest.raises(RuntimeError, match="full_params: the params were written while the offloaded"):
            with zerofuse.zero.full_params(model), torch.no_grad():
                model.norm.weight.fill_(0.5)

    def read(model):
        with zerofuse.zero.full_grads(model):
            g = sum(float(p.grad.square().sum()) for p in model.parameters())
        with zerofuse.zero.full_params(model):
            return g + sum(float(p.square().sum()) for p in model.parameters())

    _, want = trained(None)
    for look in (read, clip):
        _, got = trained(look)
        assert all(torch.equal(got[n], want[n]) for n in want), look.__name__
    trained(edit)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_between_backward_and_step_is_refused(stage, tmp_path, world_of_one):
    """offload_overlap: the host steps of a backward move the masters and moments to the next step
    before step() advances the count. A save there wrote the new values under the old count (a
    resume applied the update twice), a load was overwritten by them and counted a step it never
    took (a review's reproduction, 2026-12-06): refused, nothing changed; after step() both run."""
    def build():
        model = GPT(GPTConfig(**CFG), seed=0)
        zerofuse.zero.parallelize(model, stage=stage, bucket_mb=0.01, offload="optimizer")
        return model, zerofuse.zero.Optimizer(model, "adamw", lr=LR)

    def params(model):
        with zerofuse.zero.full_params(model):
            return {n: p.detach().clone() for n, p in model.named_parameters()}

    b = batches(2)
    want_model, want_opt = build()
    for x in b:
        want_model(x[:, :-1], x[:, 1:])[1].backward()
        want_opt.step()
        want_opt.zero_grad()
    model, opt = build()
    path = str(tmp_path / "ck")
    zerofuse.checkpoint.save(path, model, opt)
    for x in b:
        model(x[:, :-1], x[:, 1:])[1].backward()
        for what in (lambda: zerofuse.checkpoint.save(str(tmp_path / "other"), model, opt),
                     lambda: zerofuse.checkpoint.load(path, model, opt), opt.state_dict):
            with pytest.raises(RuntimeError, match=r"offloaded host steps \(offload_overlap\) and step\(\) has not "
                                                   r"run: call step\(\) first"):
                what()
        opt.step()
        opt.zero_grad()
    got, want = params(model), params(want_model)
    assert all(torch.equal(got[n], want[n]) for n in want)
    zerofuse.checkpoint.save(str(tmp_path / "after"), model, opt)  # (between steps: as before)
    assert int(zerofuse.checkpoint.consolidate(str(tmp_path / "after"))["optimizer"]["state"][0]["step"]) == 2


def _between(stage, offload, between, reduce_dtype):
    """Two steps with offload_overlap=False whose first runs ``between(model, opt, batch)`` after its
    backward; the params after them (as fp32). bf16 params; grads reduced in reduce_dtype (fp32: the
    host step reads a CPU grad shard in place; bf16: from a copy, as a GPU's always)."""
    model = GPT(GPTConfig(**CFG), seed=0)
    zerofuse.zero.parallelize(model, stage=stage, bucket_mb=0.01, offload=offload, precision="bf16",
                              reduce_dtype=reduce_dtype)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=0.1, offload_overlap=False)
    for i, x in enumerate(batches(2)):
        model(x[:, :-1], x[:, 1:])[1].backward()
        if i == 0:
            between(model, opt, batches(3, seed=5)[i])
        opt.step()
        opt.zero_grad()
    with zerofuse.zero.full_params(model):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _clip_half(model, opt, x):
    with zerofuse.zero.full_grads(model):
        for p in model.parameters():
            p.grad.mul_(0.5)


def _discard(model, opt, x):
    opt.zero_grad()


def _discard_and_redo(model, opt, x):  # a bad batch's backward dropped, another one's taken
    opt.zero_grad()
    model(x[:, :-1], x[:, 1:])[1].backward()


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("between", [_clip_half, _discard, _discard_and_redo])
def test_edits_and_discards_before_the_host_steps_start_hold(stage, between, world_of_one):
    """offload_overlap=False: the host copies of the grads are taken as each unit's reduction ends,
    the steps at step(). A grad halved in full_grads was stepped unhalved (bf16 grads: the copy of
    before the edit), zero_grad() did not discard the backward (its grads were stepped; the next
    backward refused as a second one before step()) (a review's reproduction, 2026-12-07): now the
    params are those of the same run without offload, bit for bit."""
    for reduce_dtype in (torch.float32, torch.bfloat16):
        want = _between(stage, None, between, reduce_dtype)
        got = _between(stage, "optimizer", between, reduce_dtype)
        assert all(torch.equal(got[n], want[n]) for n in want), (reduce_dtype, between.__name__)


def test_each_host_step_waits_for_its_grads_copy_when_step_comes_first(world_of_one, monkeypatch):
    """On a GPU each unit's grads reach pinned memory by a copy whose event its host step waits
    for. step() reset the events (apply_pending's _finish) while host steps were still queued on
    the busy offload thread: those started, found no event and stepped a buffer the copy had not
    reached, silently (a review, 2026-12-07). CPU simulation: _to_host records a fake event as the
    CUDA branch does, the first host step holds the thread until step() has begun."""
    import threading

    from zerofuse.zero import offload as O

    class Copy:
        def __init__(self, i):
            self.i = i

        def synchronize(self):
            waited.append(self.i)

    waited, in_step = [], threading.Event()
    to_host, step_units, apply_pending = O.HostSteps._to_host, O.HostSteps._step_units, O.HostSteps.apply_pending

    def fake_to_host(self, u):
        to_host(self, u)
        self.events[u.index] = Copy(u.index)

    def slow_step_units(self, units, *a):
        if units[0].index == self.units[0].index:
            in_step.wait(30)  # (host Adam slower than the device's backward)
        return step_units(self, units, *a)

    def marked_apply_pending(self):
        out = apply_pending(self)
        in_step.set()
        return out

    monkeypatch.setattr(O.HostSteps, "_to_host", fake_to_host)
    monkeypatch.setattr(O.HostSteps, "_step_units", slow_step_units)
    monkeypatch.setattr(O.HostSteps, "apply_pending", marked_apply_pending)
    model = GPT(GPTConfig(**CFG), seed=0)
    zerofuse.zero.parallelize(model, stage=2, bucket_mb=0.01, offload="optimizer")
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR)
    assert opt.host.overlapped and len(opt.host.units) > 2
    b = batches(1)[0]
    model(b[:, :-1], b[:, 1:])[1].backward()
    opt.step()
    assert sorted(waited) == sorted(u.index for u in opt.host.units)
