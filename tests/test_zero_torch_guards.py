"""torch's own gradient functions and optimizers on a ZeRO model's params (zerofuse/zero/torch_guards.py),
on real gloo ranks at stages 1-3: torch.nn.utils.clip_grad_norm_ clips (it is the Optimizer's), an
early-bound torch clip, clip_grad_value_ and a torch optimizer are refused by name (each did
nothing, silently: .grad is None outside full_grads; a review's reproductions, 2026-12-07)."""
from __future__ import annotations

import pytest
import torch

import zerofuse
from zerofuse.models import GPT, GPTConfig
from zerofuse.optim import FusedAdamW

from dist_utils import error_text, run_distributed

pytestmark = pytest.mark.usefixtures("native_kernels")

CFG = dict(vocab_size=65, seq_len=32, n_layer=2, n_head=4, n_kv_head=2, dim=48)
BATCH, SEQ = 6, 16


def _mine(rank, ws, seed=1):
    x = torch.randint(0, 65, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    per = BATCH // ws
    return x[rank * per:(rank + 1) * per]


def _trained(rank, ws, stage, clip):
    """One AdamW step of a ZeRO model clipped by ``clip(model, opt)``; (returned norm, params)."""
    model = GPT(GPTConfig(**CFG), seed=0)
    zerofuse.zero.parallelize(model, stage=stage, bucket_mb=0.02)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-2)
    x = _mine(rank, ws)
    model(x[:, :-1], x[:, 1:])[1].backward()
    norm = clip(model, opt)
    opt.step()
    with zerofuse.zero.full_params(model):
        return norm, {n: p.detach().clone() for n, p in model.named_parameters()}


def _clip_rank(rank, ws, stage):
    from torch.nn.utils import clip_grad

    out = {}
    torch_norm, ours = _trained(rank, ws, stage, lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05))
    opt_norm, want = _trained(rank, ws, stage, lambda m, o: o.clip_grad_norm_(0.05))
    out["norm"] = (torch_norm.shape, float(torch_norm), float(opt_norm))
    out["same_params"] = all(torch.equal(ours[n], want[n]) for n in want)
    unclipped = _trained(rank, ws, stage, lambda m, o: None)[1]
    out["clipped"] = any(not torch.equal(unclipped[n], want[n]) for n in want)

    model = GPT(GPTConfig(**CFG), seed=0)
    zerofuse.zero.parallelize(model, stage=stage, bucket_mb=0.02)
    x = _mine(rank, ws)
    model(x[:, :-1], x[:, 1:])[1].backward()
    params = list(model.parameters())
    out["no_optimizer"] = error_text(lambda: torch.nn.utils.clip_grad_norm_(params, 1.0))
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-2)
    out["subset"] = error_text(lambda: torch.nn.utils.clip_grad_norm_(params[1:], 1.0))
    early = clip_grad.clip_grad_norm_.__wrapped__  # torch's own, as `from torch.nn.utils import clip_grad_norm_`
    out["early"] = error_text(lambda: early(params, 1.0))  # bound before parallelize gives
    out["value"] = error_text(lambda: torch.nn.utils.clip_grad_value_(params, 0.1))
    out["public"] = error_text(lambda: torch.nn.utils.clip_grads_with_norm_(params, 1.0, torch.tensor(2.0)))
    head = torch.nn.Linear(2, 2)
    head(torch.ones(1, 2)).sum().backward()
    out["mixed"] = error_text(lambda: torch.nn.utils.clip_grad_norm_(params + list(head.parameters()), 1.0))
    with zerofuse.zero.full_grads(model):  # every .grad whole: torch's functions as torch's
        inside = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
        torch.nn.utils.clip_grad_value_(model.parameters(), 1e9)
    out["inside"] = (inside, float(opt.clip_grad_norm_(1e9)))
    out["torch_adamw"] = error_text(lambda: torch.optim.AdamW(model.parameters()).step())
    out["fused_adamw"] = error_text(lambda: FusedAdamW(model.parameters()).step())
    plain = torch.nn.Linear(2, 2)
    plain(torch.ones(1, 2)).sum().backward()
    torch.optim.AdamW(plain.parameters()).step()  # a plain model's optimizer steps as ever
    return out


@pytest.mark.parametrize("ws,stage", [(2, 1), (2, 2), (3, 3)])
def test_torch_clip_and_optimizers_on_a_zero_model(ws, stage):
    for r in run_distributed(_clip_rank, ws, stage, timeout=180):
        shape, torch_norm, opt_norm = r["norm"]
        assert shape == () and torch_norm == opt_norm > 0.05, r["norm"]
        assert r["same_params"] and r["clipped"]
        assert "build zerofuse.zero.Optimizer(model, ...) first" in r["no_optimizer"], r["no_optimizer"]
        assert "expected every trainable param of the ZeRO model" in r["subset"] and "got a subset without" in r["subset"]
        assert r["early"].startswith("RuntimeError: torch.nn.utils.clip_grad_norm_ (bound before "
                                     "zerofuse.zero.parallelize ran"), r["early"]
        assert "clip_grad_value_ was called on params of a model made data-parallel" in r["value"], r["value"]
        assert "(bound before zerofuse.zero.parallelize ran" in r["public"], r["public"]
        assert "expected only the params of the model made data-parallel" in r["mixed"] and "got 2 other" in r["mixed"]
        assert r["inside"][0] == pytest.approx(r["inside"][1], rel=1e-5)
        for name in ("torch_adamw", "fused_adamw"):
            assert "AdamW.step: its params belong to a model made data-parallel by zerofuse.zero.parallelize" in r[name]
            assert "Build zerofuse.zero.Optimizer(model, 'adamw'" in r[name], r[name]


def _habits_rank(rank, ws, stage=2):
    import copy
    import warnings

    from zerofuse.zero import torch_guards

    out = {}
    model = GPT(GPTConfig(**CFG), seed=0)
    zerofuse.zero.parallelize(model, stage=stage, bucket_mb=0.02)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-2)
    x = _mine(rank, ws)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(x[:, :-1], x[:, 1:])[1]).backward()
    out["scaler"] = error_text(lambda: scaler.step(opt))
    opt.zero_grad()
    try:
        copy.deepcopy(model)
        out["deepcopy"] = "no error"
    except TypeError as e:
        out["deepcopy"] = str(e)
    torch_guards._warned_stepped = False
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(3):
            model(x[:, :-1], x[:, 1:])[1].backward()
            opt.step()
            if step == 0:
                for p in model.parameters():  # the DDP habit: clears nothing here
                    p.grad = None
            else:
                opt.zero_grad()
    out["warnings"] = [str(w.message) for w in seen if "zerofuse" in str(w.message)]
    torch_guards._warned_stepped = False
    with warnings.catch_warnings(record=True) as seen:  # a GAN's D: G's backward adds to D's stepped grads,
        warnings.simplefilter("always")  # D's zero_grad clears them before its next step (no warning)
        for _ in range(2):
            model(x[:, :-1], x[:, 1:])[1].backward()
            opt.step()
            model(x[:, :-1], x[:, 1:])[1].backward()  # (the generator's backward through D)
            opt.zero_grad()
    out["gan_warnings"] = [str(w.message) for w in seen if "zerofuse" in str(w.message)]
    return out


@pytest.mark.parametrize("ws,stage", [(2, 2), (2, 3), (1, 1), (1, 2)])
def test_grad_scaler_deepcopy_and_grads_cleared_by_hand_are_named(ws, stage):
    """torch.amp.GradScaler: its bare "No inf checks were recorded" AssertionError after a backward of
    x65536 grads; copy.deepcopy(model): "cannot pickle 'ProcessGroup' object"; `p.grad = None` in
    place of zero_grad: the next step added both steps' grads, silently (now one warning: from the
    grad hooks, stage 3's pre-backward hook, over one rank where .grad is taken in)."""
    for r in run_distributed(_habits_rank, ws, stage, timeout=120):
        assert r["scaler"].startswith("RuntimeError: zerofuse.zero.Optimizer.step: torch.amp.GradScaler cannot "
                                      "unscale a ZeRO model's gradients"), r["scaler"]
        assert "parallelize(model, precision='fp16') and opt.scale_loss(loss).backward()" in r["scaler"]
        assert r["deepcopy"].startswith("zerofuse.zero: a model made data-parallel by zerofuse.zero.parallelize "
                                        "cannot be copied or pickled"), r["deepcopy"]
        assert len(r["warnings"]) == 1, r["warnings"]
        assert "this step takes gradients a backward added to the ones the last step already took" in r["warnings"][0]
        assert "`p.grad = None` clears nothing; call opt.zero_grad()" in r["warnings"][0]
        assert r["gan_warnings"] == [], r["gan_warnings"]


def _one_rank_accumulation(rank, ws, stage):
    """Two micro-batches, the first inside no_sync(): over one rank .grad then holds the second's
    only, the first's in the buckets already."""
    out = []
    for clip in ("torch", "optimizer"):
        model = GPT(GPTConfig(**CFG), seed=0)
        zerofuse.zero.parallelize(model, stage=stage, bucket_mb=0.02)
        opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-2)
        x = _mine(rank, ws)
        with model.no_sync():
            model(x[:3, :-1], x[:3, 1:])[1].backward()
        model(x[3:, :-1], x[3:, 1:])[1].backward()
        norm = (torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05) if clip == "torch"
                else opt.clip_grad_norm_(0.05))
        opt.step()
        with zerofuse.zero.full_params(model):
            out.append((float(norm), {n: p.detach().clone() for n, p in model.named_parameters()}))
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_torch_clip_over_one_rank_sees_every_micro_batch(stage):
    """Over one rank (no grad hooks) torch's clip saw .grad, the last micro-batch's only after a
    no_sync() window: it returned that norm and clipped those grads (a review, 2026-12-07). It is
    the Optimizer's clip now, over the grads of both."""
    (torch_norm, ours), (opt_norm, want) = run_distributed(_one_rank_accumulation, 1, stage, timeout=120)[0]
    assert torch_norm == opt_norm
    assert all(torch.equal(ours[n], want[n]) for n in want)


def _frozen_and_early_rank(rank, ws):
    from torch.nn.utils import clip_grad

    model = GPT(GPTConfig(**CFG), seed=0)
    model.wte.weight.requires_grad_(False)  # a frozen embedding (a LoRA base, ...)
    zerofuse.zero.parallelize(model, stage=2, bucket_mb=0.02)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-2)
    x = _mine(rank, ws)
    with model.no_sync():  # one micro-batch in the buckets (over one rank: taken from .grad)
        model(x[:3, :-1], x[:3, 1:])[1].backward()
    model(x[3:, :-1], x[3:, 1:])[1].backward()
    early = clip_grad.clip_grad_norm_.__wrapped__  # torch's own, bound before parallelize
    out = {"early": error_text(lambda: early(model.parameters(), 1.0))}
    out["norms"] = (float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)), float(opt.clip_grad_norm_(1e9)))
    return out


@pytest.mark.parametrize("ws", [1, 2])
def test_frozen_params_pass_and_an_early_bound_clip_after_no_sync_is_refused(ws):
    """model.parameters() with a frozen param (not in the ZeRO model's buckets) was refused as
    another model's; torch's clip bound before parallelize, over one rank after a no_sync() window,
    clipped the last micro-batch's .grad only (a review of the diff, 2026-12-07)."""
    for r in run_distributed(_frozen_and_early_rank, ws, timeout=120):
        assert r["norms"][0] == pytest.approx(r["norms"][1], rel=1e-6), r["norms"]
        assert "(bound before zerofuse.zero.parallelize ran" in r["early"], r["early"]
