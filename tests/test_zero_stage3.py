"""ZeRO on real gloo ranks, the rest of test_zero.py's: tied params and ranks without params, stage
3's freeing and gathering, overlap off, the launch record, bad input, diverging ranks, a CUDA world
of one."""
from __future__ import annotations

import os

import pytest
import torch

import zerofuse
from zerofuse.optim import FusedAdamW

from dist_utils import run_distributed
from tolerances import tol
from zero_common import (GLOBAL_BATCH, LR, STAGES, WD, _train, _zero_adamw, assert_close_params, batches,
                         full_state, make_model, reference_pair)

pytestmark = pytest.mark.usefixtures("native_kernels")


class TiedBlocks(torch.nn.Module):
    """Two blocks sharing one weight: a param shared across stage-3 units."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.blocks[1].weight = self.blocks[0].weight

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def _tiny_models_rank(rank, ws, steps):
    out = {}
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(ws * 2, 8, generator=g) for _ in range(steps)]
    for stage in STAGES:
        for name, make in (("tied", TiedBlocks), ("one_linear", lambda: torch.nn.Linear(3, 2))):
            torch.manual_seed(0)
            model = make()
            zerofuse.zero.parallelize(model, stage=stage)
            opt = zerofuse.zero.Optimizer(model, "adamw", lr=0.01)
            for x in xs:
                x = x[rank * 2:(rank + 1) * 2, : 3 if name == "one_linear" else 8]
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            out[(stage, name)] = full_state(model)
    return out


def test_tied_params_and_ranks_without_params():
    """A weight shared by two stage-3 units lives in the root unit; a model smaller than the
    ranks leaves some ranks only padding: both train like a single process."""
    steps, ws = 3, 4
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(ws * 2, 8, generator=g) for _ in range(steps)]
    want = {}
    for name, make in (("tied", TiedBlocks), ("one_linear", lambda: torch.nn.Linear(3, 2))):
        torch.manual_seed(0)
        model = make()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        for x in xs:
            (model(x[:, : 3 if name == "one_linear" else 8]).square().mean()).backward()
            opt.step()
            opt.zero_grad()
        want[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    results = run_distributed(_tiny_models_rank, ws, steps, timeout=240)
    for (stage, name), params in results[0].items():
        for n, p in want[name].items():
            torch.testing.assert_close(params[n], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"stage {stage} {name} {n}: {m}")


def _stage3_rank(rank, ws):
    model, eng, opt, per = _zero_adamw(ws, stage=3, prefetch=2)
    out = {"units": [u.name for u in eng.units]}
    # blocks run under activation checkpointing: their forward (and its hooks) re-run inside backward
    model.activation_checkpointing = True
    for b in batches(3):
        mine = b[rank * per:(rank + 1) * per]
        _, loss = model(mine[:, :-1], mine[:, 1:])
        loss.backward()
        out.setdefault("gathered_after_backward", []).append([u.state for u in eng.units])
        opt.step()
        opt.zero_grad()
    mem = zerofuse.zero.memory_report(model, opt)
    out["param_bytes"] = mem["params"]
    out["shard_bytes"] = sum(u.shard.numel() * u.shard.element_size() for u in eng.units)
    with torch.no_grad():
        model(batches(1)[0][:2, :-1])
    out["after_eval"] = [u.state for u in eng.units]
    out["params"] = full_state(model)
    return out


def test_stage3_frees_params_and_supports_activation_checkpointing():
    results = run_distributed(_stage3_rank, 2, timeout=240)
    r = results[0]
    assert r["units"] == ["blocks.0", "blocks.1", "blocks.2", "<root>"]
    assert all(s == "free" for states in r["gathered_after_backward"] for s in states)
    assert r["after_eval"] == ["free"] * 4
    assert r["param_bytes"] == r["shard_bytes"]  # between steps a rank holds only its shards
    _, _, ref_params, alt_params = reference_pair(3, 2, clip=False)
    assert_close_params(r["params"], ref_params, alt_params)


def _free_while_gathering_rank(rank, ws):
    model, eng, _, _ = _zero_adamw(ws, stage=3)
    u = eng.units[0]
    u.start_param_sync(eng.comm)
    u.free()  # as the engine may, e.g. at the end of a backward, with a prefetch still running
    after_free = (u.state, u.gather_work is None, u.full.untyped_storage().nbytes())
    u.finish_param_sync(eng.comm)
    ref = dict(make_model().named_parameters())
    want = torch.cat([ref[n].detach().reshape(-1) for n in u.names])
    return after_free, torch.equal(u.full[:u.numel], want)


def test_stage3_free_waits_for_a_running_gather():
    """free() of a unit whose all-gather is in flight finishes the gather before dropping the
    storage (the collective would otherwise write into memory handed back to the allocator)."""
    for after_free, gathered_ok in run_distributed(_free_while_gathering_rank, 2, timeout=120):
        assert after_free == ("free", True, 0)
        assert gathered_ok


def _no_reshard_rank(rank, ws):
    model = make_model()
    zerofuse.zero.parallelize(model, stage=3, reshard_after_forward=False)
    eng = model._zerofuse_zero
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD)
    per = GLOBAL_BATCH // ws
    states = []
    for b in batches(2):
        mine = b[rank * per:(rank + 1) * per]
        _, loss = model(mine[:, :-1], mine[:, 1:])
        states.append([u.state for u in eng.units])  # after forward: everything still gathered
        loss.backward()
        states.append([u.state for u in eng.units])  # after backward: freed
        opt.step()
        opt.zero_grad()
    return states, full_state(model)


def test_stage3_without_resharding_after_forward():
    states, params = run_distributed(_no_reshard_rank, 2, timeout=240)[0]
    assert states[0] == ["gathered"] * 4 and states[1] == ["free"] * 4
    _, _, ref_params, alt_params = reference_pair(2, 2, clip=False)
    assert_close_params(params, ref_params, alt_params)


def _overlap_off_rank(rank, ws):
    model = make_model()
    zerofuse.zero.parallelize(model, stage=2, bucket_mb=0.25, overlap=False)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD)
    _train(rank, ws, model, opt, 2, clip=False)
    return list(model._zerofuse_zero.events), full_state(model)


def test_overlap_off_launches_at_the_end_and_matches():
    events, params = run_distributed(_overlap_off_rank, 2, timeout=240)[0]
    assert events and all(when == "end" for _, _, when in events)
    _, _, ref_params, alt_params = reference_pair(2, 2, clip=False)
    assert_close_params(params, ref_params, alt_params)


def _events_rank(rank, ws):
    model = make_model()
    zerofuse.zero.parallelize(model, stage=2, bucket_mb=0.25)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD)
    sizes = []
    for _ in range(3):
        _train(rank, ws, model, opt, 1, clip=False)
        sizes.append(len(model._zerofuse_zero.events))
    return sizes, len(model._zerofuse_zero.units)


def test_the_launch_record_is_the_last_backwards():
    """engine.events kept every step's launches: one entry per unit and step, host memory growing
    without bound (a review's reproduction, 2026-12-07: 18 -> 1818 entries over 100 steps)."""
    for sizes, units in run_distributed(_events_rank, 2, timeout=240):
        assert sizes == [units] * 3, (sizes, units)


def _errors_rank(rank, ws):
    msgs = {}

    def catch(key, fn):
        try:
            fn()
        except (ValueError, TypeError) as e:
            msgs[key] = str(e)

    catch("stage", lambda: zerofuse.zero.parallelize(make_model(), stage=4))
    catch("precision", lambda: zerofuse.zero.parallelize(make_model(), stage=1, precision="fp8"))
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    catch("no_params", lambda: zerofuse.zero.parallelize(frozen, stage=2))
    catch("plain", lambda: zerofuse.zero.Optimizer(make_model(), "adamw"))
    model = zerofuse.zero.parallelize(make_model(), stage=2)
    catch("twice", lambda: zerofuse.zero.parallelize(model, stage=2))
    catch("kind", lambda: zerofuse.zero.Optimizer(model, "sgd"))
    catch("hyper", lambda: zerofuse.zero.Optimizer(model, "adamw", momentum=0.9))
    opt = zerofuse.zero.Optimizer(model, "adamw")
    other = zerofuse.zero.parallelize(make_model(), stage=3)
    other_opt = zerofuse.zero.Optimizer(other, "adamw")
    catch("layout", lambda: other_opt.load_state_dict(opt.state_dict()))
    catch("groups", lambda: zerofuse.zero.Optimizer(model, "adamw", param_groups=[{"params": [torch.zeros(2)]}]))
    return msgs


def test_bad_input_errors():
    msgs = run_distributed(_errors_rank, 2, timeout=240)[0]
    assert "expected stage 0, 1, 2 or 3, got 4" in msgs["stage"]
    assert "precision" in msgs["precision"] and "'fp8'" in msgs["precision"]
    assert "no trainable parameters" in msgs["no_params"]
    assert "zerofuse.zero.parallelize" in msgs["plain"]
    assert "already parallelized" in msgs["twice"]
    assert "'sgd'" in msgs["kind"]
    assert "momentum" in msgs["hyper"]
    assert "stage=2" in msgs["layout"] and "stage=3" in msgs["layout"]
    assert "not a trainable parameter" in msgs["groups"]


def test_checker_catches_diverging_ranks_in_zero():
    """A rank skipping a step (different collective sequences) fails fast with the checker on."""
    os.environ["ZEROFUSE_CHECK_COLLECTIVES"] = "1"
    try:
        with pytest.raises(AssertionError, match="differs across ranks|did not reach"):
            run_distributed(_diverging_rank, 2, timeout=120)
    finally:
        del os.environ["ZEROFUSE_CHECK_COLLECTIVES"]


def _diverging_rank(rank, ws):
    model = make_model()
    zerofuse.zero.parallelize(model, stage=3)
    opt = zerofuse.zero.Optimizer(model, "adamw", max_grad_norm=1.0 if rank == 0 else None)
    b = batches(1)[0][:2]
    _, loss = model(b[:, :-1], b[:, 1:])
    loss.backward()
    opt.step()  # rank 0 all-reduces a grad norm first, rank 1 goes straight to the next forward's gather
    model(b[:, :-1], b[:, 1:])


def _cuda_rank(rank, ws, precision, steps):
    out = {}
    for stage in STAGES:
        model = make_model().cuda()
        zerofuse.zero.parallelize(model, stage=stage, precision=precision, bucket_mb=0.25)
        opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD)
        losses = []
        for b in batches(steps):
            b = b.cuda()
            _, loss = model(b[:, :-1], b[:, 1:])
            opt.scale_loss(loss).backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[stage] = dict(losses=losses, params={k: v.cpu() for k, v in full_state(model).items()})
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_world_of_one_matches_single_process(precision):
    """On one GPU: CUDA tensors go through zerofuse's NCCL transport (world of one) and the Triton
    optimizer kernels; every stage matches plain single-GPU training."""
    steps = 5
    model = make_model(precision).cuda()
    opt = (torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD) if precision == "fp32"
           else FusedAdamW(model.parameters(), lr=LR, weight_decay=WD, master_weights=True))
    ref = []
    for b in batches(steps):
        b = b.cuda()
        _, loss = model(b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    results = run_distributed(_cuda_rank, 1, precision, steps, timeout=300)[0]
    t = dict(rtol=1e-5, atol=1e-5) if precision == "fp32" else tol(torch.bfloat16)
    for stage in STAGES:
        torch.testing.assert_close(torch.tensor(results[stage]["losses"]), torch.tensor(ref), **t)
        for name, p in model.named_parameters():
            torch.testing.assert_close(results[stage]["params"][name], p.detach().float().cpu(), **t)
