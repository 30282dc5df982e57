"""Writes to params reaching the fp32 masters the optimizers step (each test failed before its fix):
inside full_params at every ZeRO stage, between steps of a bf16 param, partial writes, after a step
plan was rebuilt or the optimizer loaded, after deepcopy / pickle and round trips through torch;
sparse grads, refused group options and load_state_dict's old states (tests/test_optim_contract.py:
the rest of the torch.optim contract)."""
from __future__ import annotations

import copy

import pytest
import torch

import zerofuse
from zerofuse.optim import FusedAdam, FusedAdamW, FusedLAMB

from optim_common import small_model, train_steps

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _stage3_run(precision, edit, stage=3):
    model = zerofuse.zero.parallelize(small_model(), stage=stage, precision=precision)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-2)
    for step in range(3):
        edit(model, step, opt)
        train_steps(model, opt, 1, start=step)
    with zerofuse.zero.full_params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage3_writes_inside_full_params_reach_the_shards(precision, world_of_one):
    """full_params at stage 3 was read-only: an in-place init or a load_state_dict inside it was
    silently dropped at exit (and load_state_dict refused). Now each rank's part is written back and
    the fp32 masters of bf16 params refreshed: the same run as stage 0 loading the same weights. A
    block that only reads changes nothing, bit for bit (the masters are not rounded to bf16)."""
    def halve(model, step, _opt):
        if step == 1:
            with zerofuse.zero.full_params(model), torch.no_grad():
                model[0].weight.mul_(0.5)
                model.load_state_dict({**model.state_dict(), "2.bias": torch.ones(4)})

    def halve_at_stage0(model, step, _opt):
        if step == 1:
            state = model.state_dict()
            model.load_state_dict({**state, "0.weight": state["0.weight"] * 0.5, "2.bias": torch.ones(4)})

    def read(model, step, _opt):
        with zerofuse.zero.full_params(model):
            assert all(torch.isfinite(p).all() for p in model.parameters())

    got, want = _stage3_run(precision, halve), _stage3_run(precision, halve_at_stage0, stage=0)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    plain_run, read_run = _stage3_run(precision, lambda *_: None), _stage3_run(precision, read)
    assert all(torch.equal(read_run[n], plain_run[n]) for n in plain_run)
    assert not all(torch.equal(got[n], plain_run[n]) for n in plain_run)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_writes_inside_full_params_at_stages_0_to_2_reach_the_fp32_masters(stage, world_of_one):
    """bf16 params keep fp32 masters in the Optimizer: an in-place edit of a param (an init, weight
    surgery) was overwritten by its old master at the next step. Inside full_params, as at stage 3,
    the masters of the elements written are refreshed on exit, the others keep their fp32 bits (a
    whole bucket's masters were replaced by their bf16 rounding before 2026-12-06): the run of stage 0
    editing the param and its master by hand; a block that only reads changes nothing, bit for bit."""
    def halve(model, step, _opt):
        if step == 1:
            with zerofuse.zero.full_params(model), torch.no_grad():
                model[0].weight.mul_(0.5)

    def halve_by_hand(model, step, opt):
        if step == 1:
            with torch.no_grad():
                w = model[0].weight
                w.mul_(0.5)  # (a power of two: no element of w is left as it was but its zeros)
                opt.state[w]["master"].copy_(w.reshape(-1))

    def read(model, step, _opt):
        with zerofuse.zero.full_params(model):
            assert all(torch.isfinite(p).all() for p in model.parameters())

    got, want = _stage3_run("bf16", halve, stage=stage), _stage3_run("bf16", halve_by_hand, stage=0)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    plain_run, read_run = _stage3_run("bf16", lambda *_: None, stage=stage), _stage3_run("bf16", read, stage=stage)
    assert all(torch.equal(read_run[n], plain_run[n]) for n in plain_run)
    assert not all(torch.equal(got[n], plain_run[n]) for n in plain_run)


# ---------------------------------------------------------------- what a review reproduced (2026-11-28)

def _bf16_step(opt, p):
    p.grad = torch.ones_like(p)
    opt.step()


@pytest.mark.parametrize("how", ["copy_", "data"])
def test_a_write_to_a_bf16_param_between_steps_reaches_its_master(how):
    """master_weights=True: a write to the param (p.copy_: a load, an EMA swap; p.data = ...) was
    undone by the next step, which wrote round(old master - update) over it."""
    p = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
    q = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
    ours, theirs = FusedAdamW([p], lr=1e-3, weight_decay=0.0, master_weights=True), torch.optim.AdamW([q], lr=1e-3)
    for opt, t in ((ours, p), (theirs, q)):
        _bf16_step(opt, t)
        with torch.no_grad():
            if how == "copy_":
                t.copy_(torch.full((8,), 5.0))
            else:
                t.data = torch.full((8,), 5.0, dtype=torch.bfloat16)
        _bf16_step(opt, t)
    assert torch.equal(p, q) and float(p[0]) == 5.0


def test_a_partial_write_keeps_the_other_elements_masters_and_data_writes_are_told():
    """A write to some elements refreshes only their masters (the others kept their fp32 bits:
    the whole master was set to the bf16 param before, a 1-ulp jump for every unwritten element);
    an in-place op on p.data moves no version counter: params_written() hands it to the masters
    (the next step undid it, silently: a review's reproduction, 2026-12-07)."""
    runs = {}
    for case in ("none", "partial", "data"):
        p = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
        opt = FusedAdamW([p], lr=1e-3, weight_decay=0.0, master_weights=True)
        _bf16_step(opt, p)
        if case == "partial":
            with torch.no_grad():
                p[:2] = 5.0
        elif case == "data":
            p.data[:2].fill_(5.0)
            opt.params_written()
        _bf16_step(opt, p)
        runs[case] = (p.detach().float().clone(), opt.state[p]["master"].clone())
    for case in ("partial", "data"):
        got, master = runs[case]
        assert (got[:2] - 5.0).abs().max() < 0.05, (case, got)  # (the step moves it by at most lr)
        assert torch.equal(master[2:], runs["none"][1][2:]), (case, master, runs["none"][1])


@pytest.mark.parametrize("cls", [FusedAdam, FusedAdamW, FusedLAMB, zerofuse.optim.FusedLARS])
@pytest.mark.parametrize("case", ["other_param_without_grad", "frozen_while_written"])
def test_a_write_reaches_its_master_when_the_step_plan_was_rebuilt(cls, case, kernel_path):
    """The versions telling a written param lived in the step plan, rebuilt whenever the set of
    params with a grad changed (another param's grad None, the written one frozen meanwhile): the
    write was undone by the next step, silently (found by a review, 2026-12-06)."""
    p, q = (torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16)) for _ in range(2))
    opt = cls([p, q], lr=1e-3, weight_decay=0.0, master_weights=True)
    p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    opt.step()
    with torch.no_grad():
        p.copy_(torch.full((8,), 5.0))
    p.grad = torch.zeros_like(p)  # (a zero grad: the step moves p by at most lr)
    q.grad = None if case == "other_param_without_grad" else q.grad
    if case == "frozen_while_written":
        p.grad = None
        opt.step()
        p.grad = torch.zeros_like(p)
    opt.step()
    assert (p.float() - 5.0).abs().max() < 0.05, p


def test_a_write_after_loading_the_optimizer_reaches_its_master(kernel_path):
    """A fresh optimizer given a state_dict (its masters), then weights written into the params (not
    the checkpoint's), then a step: the write was undone (no versions to compare yet)."""
    p = torch.nn.Parameter(torch.full((8,), 0.5, dtype=torch.bfloat16))
    first = FusedAdamW([p], lr=1e-3, weight_decay=0.0, master_weights=True)
    _bf16_step(first, p)
    q = torch.nn.Parameter(p.detach().clone())
    opt = FusedAdamW([q], lr=1e-3, weight_decay=0.0, master_weights=True)
    opt.load_state_dict(first.state_dict())
    with torch.no_grad():
        q.fill_(-1.0)
    q.grad = torch.zeros_like(q)
    opt.step()
    assert (q.float() + 1.0).abs().max() < 0.01, q


def test_fused_adam_steps_after_deepcopy_and_pickle():
    """FusedAdam set its decoupled flag on the instance only: a deepcopied or unpickled optimizer
    (torch's __getstate__ keeps defaults, state and groups) raised AttributeError at its step."""
    import pickle

    p = torch.nn.Parameter(torch.ones(4))
    opt = FusedAdam([p], lr=0.1, weight_decay=0.1)
    p.grad = torch.ones(4)
    for other in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        q = other.param_groups[0]["params"][0]
        q.grad = torch.ones(4)
        other.step()
        assert 0.85 < float(q[0]) < 0.95, q  # moved by ~lr, not stepped twice, not refused


def test_a_sparse_grad_after_the_first_step_is_refused_clearly(kernel_path):
    """The sparse check ran when a step plan was built: a sparse grad at a later step with a kept plan
    failed in torch's contiguous() ('unsupported memory format option')."""
    p = torch.nn.Parameter(torch.ones(4, 3))
    opt = FusedAdamW([p], lr=0.1)
    p.grad = torch.ones(4, 3)
    opt.step()
    p.grad = torch.ones(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="zerofuse.optim.FusedAdamW: sparse gradients are not supported"):
        opt.step()


def test_masters_after_a_round_trip_through_torch_and_after_model_bfloat16():
    """A FusedAdamW state loaded into torch.optim.AdamW and back: torch cast the master to bf16 and
    the next step refused it (and it was stale); a model converted to bf16 after a step kept a plan
    without masters (master_weights=True ignored)."""
    p = torch.nn.Parameter(torch.linspace(-1, 1, 8).bfloat16())
    opt = FusedAdamW([p], lr=1e-3, master_weights=True)
    _bf16_step(opt, p)
    via = torch.optim.AdamW([p], lr=1e-3)
    via.load_state_dict(opt.state_dict())
    _bf16_step(via, p)
    back = FusedAdamW([p], lr=1e-3, master_weights=True)
    back.load_state_dict(via.state_dict())
    assert "master" not in back.state[p]  # made again from the param: torch stepped it, not the master
    _bf16_step(back, p)
    assert back.state[p]["master"].dtype == torch.float32
    w = torch.nn.Parameter(torch.ones(8))
    opt = FusedAdamW([w], lr=1e-4, master_weights=True, weight_decay=0.0)
    _bf16_step(opt, w)
    w.data = w.data.bfloat16()  # what model.bfloat16() does: the same Parameter
    _bf16_step(opt, w)
    assert opt.state[w]["master"].dtype == torch.float32


def test_a_refused_group_option_steps_no_group_and_a_number_found_inf_without_grads():
    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    opt = FusedAdam([a], lr=0.1)
    opt.add_param_group({"params": [b], "amsgrad": True})
    a.grad, b.grad = torch.ones(4), torch.ones(4)
    with pytest.raises(ValueError, match="amsgrad=True in a param group is not supported"):
        opt.step()
    assert torch.equal(a, torch.zeros(4)) and not opt.state[a]  # (group 0 was stepped before the refusal)
    c = torch.nn.Parameter(torch.zeros(4))
    for found in (0.0, 1):  # no param has a grad: nothing to skip ('float' has no attribute 'ne' before)
        FusedAdamW([c]).step(found_inf=found)


def test_load_state_dict_lets_go_of_the_old_states():
    """torch.optim frees the old moments at load_state_dict; the kept step plans held them until the
    next step (a rollback into a live optimizer held both sets)."""
    import gc
    import weakref

    p = torch.nn.Parameter(torch.zeros(4))
    opt = FusedAdamW([p])
    p.grad = torch.ones(4)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    old = weakref.ref(opt.state[p]["exp_avg"])
    opt.load_state_dict(saved)
    gc.collect()
    assert old() is None
