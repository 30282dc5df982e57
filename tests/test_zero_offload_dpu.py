"""ZeRO-Offload's delayed parameter update (Optimizer(delayed_update=True), [Note: delayed parameter
update] in zero/offload.py) on real gloo ranks: the host step of step t is applied at step t+1, so
each gradient is taken one update late. Stages 1/2/3 at world sizes 2 and 4 against one process
that applies the same schedule to torch.optim.AdamW (losses at every step and params by the
parity rule), with a warm-up of undelayed steps and with clipping; a checkpoint taken mid-run
resumes to the same bits; misuse is refused."""
from __future__ import annotations

import copy
import re

import pytest
import torch

import zerofuse
from zerofuse.models import GPT, GPTConfig

from dist_utils import run_distributed
from test_zero_offload import CFG, GLOBAL_BATCH, LR, MAX_NORM, STEPS, WD, batches
from tolerances import assert_close_training, tol

pytestmark = pytest.mark.usefixtures("native_kernels")


def reference(micro: int, warmup: int, clip: bool, delayed: bool = True):
    """One process: torch AdamW steps the masters; the model's params are the masters as of the
    last step (undelayed) or of the step before it (delayed, once past the warm-up)."""
    model = GPT(GPTConfig(**CFG), seed=0)
    master = copy.deepcopy(model)
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for t, b in enumerate(batches(STEPS)):
        total = 0.0
        for part in b.chunk(micro):
            loss = model(part[:, :-1], part[:, 1:])[1] / micro
            loss.backward()
            total += loss.item()
        losses.append(total)
        for p, q in zip(model.parameters(), master.parameters()):
            q.grad, p.grad = p.grad, None
        if clip:
            torch.nn.utils.clip_grad_norm_(master.parameters(), MAX_NORM)
        late = delayed and t >= warmup
        with torch.no_grad():
            if late:  # the last step's update reaches the params now, this one's at the next step
                for p, q in zip(model.parameters(), master.parameters()):
                    p.copy_(q)
            opt.step()
            opt.zero_grad()
            if not late:
                for p, q in zip(model.parameters(), master.parameters()):
                    p.copy_(q)
    with torch.no_grad():  # apply_pending at the end
        for p, q in zip(model.parameters(), master.parameters()):
            p.copy_(q)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(rank, ws, model, opt, steps, first=0):
    per = GLOBAL_BATCH // ws
    losses = []
    for b in batches(first + steps)[first:]:
        mine = b[rank * per:(rank + 1) * per]
        loss = model(mine[:, :-1], mine[:, 1:])[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _build(stage, mode, warmup, clip, seed=0):
    model = GPT(GPTConfig(**CFG), seed=seed)
    zerofuse.zero.parallelize(model, stage=stage, bucket_mb=0.01, offload=mode)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD, max_grad_norm=MAX_NORM if clip else None,
                                  delayed_update=True, delayed_update_warmup=warmup)
    return model, opt


def _dpu_rank(rank, ws, stage, mode, warmup, clip):
    import torch.distributed as dist

    model, opt = _build(stage, mode, warmup, clip)
    losses = _train(rank, ws, model, opt, STEPS)
    pending = bool(opt.host.pending)
    opt.apply_pending()
    loss = torch.stack(losses)
    dist.all_reduce(loss)
    with zerofuse.zero.full_params(model):
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return (loss / ws).tolist(), params, pending, list(opt.host.last_log)


@pytest.mark.parametrize("ws,stage,mode,warmup,clip", [
    (2, 1, "optimizer", 0, False), (2, 2, "optimizer", 2, True), (4, 2, "optimizer", 0, False),
    (2, 3, "optimizer", 0, True), (4, 3, "optimizer+params", 2, False),
])
def test_delayed_update_equals_one_process_with_the_same_delay(ws, stage, mode, warmup, clip):
    ref_losses, ref = reference(1, warmup, clip)
    alt_losses, alt = reference(ws, warmup, clip)
    undelayed_losses, _ = reference(1, warmup, clip, delayed=False)
    losses, params, pending, log = run_distributed(_dpu_rank, ws, stage, mode, warmup, clip, timeout=300)[0]
    assert pending and log and all(when == "step" for _, when in log)  # started at step(), left running
    bound = tol(torch.float32, "training_params")
    for t, (got, want, other) in enumerate(zip(losses, ref_losses, alt_losses)):
        assert abs(got - want) <= bound["atol"] + bound["rtol"] * abs(want) + 2 * abs(other - want), (t, got, want)
    # the delay is real: the first delayed step's loss is the previous params' (the undelayed run moved on)
    first = warmup + 1
    assert abs(losses[first] - undelayed_losses[first]) > 100 * abs(ref_losses[first] - alt_losses[first]) + 1e-6
    for name, want in ref.items():
        assert_close_training(params[name], want, alt[name], msg=name)


def _resume_rank(rank, ws, path, warmup):
    from zerofuse import checkpoint

    model, opt = _build(2, "optimizer", warmup, True)
    _train(rank, ws, model, opt, 3)
    checkpoint.save(path, model, opt)  # applies the pending update first
    after_save = bool(opt.host.pending)
    l1 = _train(rank, ws, model, opt, 3, first=3)
    model2, opt2 = _build(2, "optimizer", warmup, True, seed=1)
    checkpoint.load(path, model2, opt2)
    l2 = _train(rank, ws, model2, opt2, 3, first=3)
    opt.apply_pending()
    opt2.apply_pending()
    with zerofuse.zero.full_params(model), zerofuse.zero.full_params(model2):
        same = all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    return after_save, [x.item() for x in l1], [x.item() for x in l2], same


@pytest.mark.parametrize("warmup", [0, 2])
def test_a_checkpoint_mid_run_resumes_to_the_same_bits(tmp_path, warmup):
    """Saved at step 3; with a warm-up of 2 the resumed run's steps are delayed as the
    uninterrupted run's (the warm-up counts the checkpoint's steps, not this run's)."""
    for after_save, l1, l2, same in run_distributed(_resume_rank, 2, str(tmp_path / "ckpt"), warmup, timeout=240):
        assert not after_save and l1 == l2 and same


def _late_lr_rank(rank, ws):
    import threading

    held, held_opt = _build(2, "optimizer", 0, False)
    model, opt = _build(2, "optimizer", 0, False)
    gate = threading.Event()
    held_opt.host.pool.submit(gate.wait)  # the offload thread busy until the lr below is written
    _train(rank, ws, held, held_opt, 1)  # step() returns with its host step queued
    for g in held_opt.param_groups:
        g["lr"] = 1.0  # what a scheduler writes for the next step, while this step's host step waits
    gate.set()
    held_opt.apply_pending()
    _train(rank, ws, model, opt, 1)
    opt.apply_pending()
    with zerofuse.zero.full_params(held), zerofuse.zero.full_params(model):
        return [n for (n, p), q in zip(held.named_parameters(), model.parameters()) if not torch.equal(p, q)]


def test_the_delayed_host_step_uses_the_lr_of_its_own_step():
    """The host step of a delayed update runs after step() returned and the scheduler moved on:
    it takes the lr its step had (it read the group's live lr: a run's bits depended on the
    offload thread's timing)."""
    for differ in run_distributed(_late_lr_rank, 2, timeout=120):
        assert differ == []


def _misuse_rank(rank, ws):
    errors = []
    for offload, kw in ((None, dict(delayed_update=True)), ("optimizer", dict(delayed_update=1)),
                        ("optimizer", dict(delayed_update=True, delayed_update_warmup=-1))):
        model = GPT(GPTConfig(**CFG), seed=0)
        zerofuse.zero.parallelize(model, stage=2, offload=offload)
        try:
            zerofuse.zero.Optimizer(model, "adamw", **kw)
        except (TypeError, ValueError) as e:
            errors.append(str(e))
    model = GPT(GPTConfig(**CFG), seed=0)
    zerofuse.zero.parallelize(model, stage=2, offload="optimizer", offload_ratio=0.5)
    try:
        zerofuse.zero.Optimizer(model, "adamw", delayed_update=True)
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_misuse_is_refused():
    errors = run_distributed(_misuse_rank, 2, timeout=120)[0]
    wants = [r"delayed_update=True delays the host step of an offloaded optimizer.*got offload=None",
             r"expected delayed_update to be a bool, got 1",
             r"expected delayed_update_warmup to be an int >= 0, got -1",
             r"delayed_update=True with offload_ratio=0.5 would delay only the host's part"]
    assert len(errors) == len(wants), errors
    for got, want in zip(errors, wants):
        assert re.search(want, got), (got, want)


@pytest.mark.timeout(300)
def test_the_job_offloads_with_a_measured_ratio_and_a_delayed_update(tmp_path):
    """zerofuse-train --offload optimizer: with --offload-ratio auto the same losses as without
    offload (the same kernel on a CPU); with --offload-delayed-update 1 the first two steps' losses
    too (step 1 undelayed), the third differs (taken at the params of step 1), and the run ends
    with its update applied (a finite final validation loss)."""
    from train_common import _ok, metrics, run

    flags = ["--nproc", 2, "--zero-stage", 2, "--steps", 4, "--eval-every", 0, "--sample-tokens", 0]
    _ok(run(*flags, "--out", tmp_path / "base"))
    _ok(run(*flags, "--offload", "optimizer", "--offload-ratio", "auto", "--out", tmp_path / "auto"))
    _ok(run(*flags, "--offload", "optimizer", "--offload-delayed-update", 1, "--out", tmp_path / "dpu"))
    base, auto, dpu = ([m["loss"] for m in metrics(tmp_path / d)] for d in ("base", "auto", "dpu"))
    assert auto == base and len(base) == 4
    assert dpu[:2] == base[:2] and dpu[2] != base[2]
    import json
    summary = json.loads((tmp_path / "dpu" / "summary.json").read_text())
    assert summary["offload"] == "optimizer" and summary["final_val_loss"] < summary["initial_val_loss"]


def _clip_peek_load_rank(rank, ws, stage):
    import threading

    out = {}
    # the caller's clip_grad_norm_ reaches the delayed update as max_grad_norm does (it was dropped)
    runs = []
    for caller in (False, True):
        model, opt = _build(stage, "optimizer", 0, clip=not caller)
        per = GLOBAL_BATCH // ws
        for b in batches(3):
            mine = b[rank * per:(rank + 1) * per]
            model(mine[:, :-1], mine[:, 1:])[1].backward()
            if caller:
                opt.clip_grad_norm_(MAX_NORM)
            opt.step()
            opt.zero_grad()
        opt.apply_pending()
        with zerofuse.zero.full_params(model):
            runs.append([p.detach().clone() for p in model.parameters()])
    out["clip"] = all(torch.equal(a, b) for a, b in zip(*runs))
    # a read-only full_params between steps leaves the pending update alone (it undid it: no training)
    runs = []
    for peek in (False, True):
        model, opt = _build(stage, "optimizer", 0, False)
        for t in range(3):
            _train(rank, ws, model, opt, 1, first=t)
            if peek:
                with zerofuse.zero.full_params(model):
                    sum(p.norm() for p in model.parameters())
        opt.apply_pending()
        with zerofuse.zero.full_params(model):
            runs.append([p.detach().clone() for p in model.parameters()])
    out["peek"] = all(torch.equal(a, b) for a, b in zip(*runs))
    # a write inside it with an update pending is refused (the update would land on it)
    _train(rank, ws, model, opt, 1)  # (a step: its update pending again)
    try:
        with zerofuse.zero.full_params(model), torch.no_grad():
            next(model.parameters()).add_(1.0)
        out["write"] = "accepted"
    except RuntimeError as e:
        out["write"] = str(e)
    # the grads of the next backward may be changed while the update is pending (its host step read others)
    per = GLOBAL_BATCH // ws
    b = batches(1, seed=3)[0][rank * per:(rank + 1) * per]
    model(b[:, :-1], b[:, 1:])[1].backward()
    try:
        with zerofuse.zero.full_grads(model):
            for p in model.parameters():
                p.grad.mul_(0.5)
        out["grads"] = "ok"
    except RuntimeError as e:
        out["grads"] = str(e)
    opt.step()
    opt.zero_grad()
    if stage != 3:  # a model load waits for the pending update first (its result depended on the thread's timing)
        model, opt = _build(stage, "optimizer", 0, False)
        other = GPT(GPTConfig(**CFG), seed=5).state_dict()
        gate = threading.Event()
        opt.host.pool.submit(gate.wait)  # a slow host step, done 0.3 s later
        threading.Timer(0.3, gate.set).start()
        _train(rank, ws, model, opt, 1)
        model.load_state_dict(other)
        opt.apply_pending()
        with zerofuse.zero.full_params(model):
            out["load"] = all(torch.equal(p, other[n]) for n, p in model.named_parameters())
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clipping_reads_and_loads_between_delayed_steps(stage):
    """Three reviews' reproductions (2026-12-06): the caller's clip_grad_norm_ was ignored by the delayed
    update, a read-only full_params between steps reset the masters to the params (the model never
    trained), a model.load_state_dict raced the pending host step."""
    for out in run_distributed(_clip_peek_load_rank, 2, stage, timeout=240):
        assert out["clip"] and out["peek"], out
        assert "a delayed update was pending" in out["write"], out
        assert out.get("load", True) and out["grads"] == "ok", out


@pytest.mark.timeout(300)
def test_the_evaluation_cadence_does_not_change_the_training(tmp_path):
    """--offload-delayed-update with --eval-every: an evaluation that applied the pending update made
    the next step's grad undelayed, so the losses depended on --eval-every (a review's reproduction,
    2026-12-06); a mid-run evaluation scores the params one update behind, the end applies it."""
    from train_common import _ok, metrics, run

    flags = ["--nproc", 2, "--zero-stage", 2, "--steps", 4, "--sample-tokens", 0, "--ckpt-every", 0,
             "--offload", "optimizer", "--offload-delayed-update", 1]
    _ok(run(*flags, "--eval-every", 0, "--out", tmp_path / "none"))
    _ok(run(*flags, "--eval-every", 2, "--out", tmp_path / "every2"))
    none, every2 = ([m["loss"] for m in metrics(tmp_path / d)] for d in ("none", "every2"))
    assert none == every2 and len(none) == 4
