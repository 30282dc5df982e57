"""Precision of gradient reduction with bf16 params: grads accumulate and reduce in fp32 by default
(averages pre-divided); a bf16 wire (opt-in) is summed in fp32 after an all-to-all, rounding once.
Measured against an fp64 average of the ranks' own gradients and against torch DDP with bf16
params, at world size 4.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerofuse
from zerofuse.models import GPT, GPTConfig

from dist_utils import run_distributed

pytestmark = pytest.mark.usefixtures("native_kernels")

# The unfused loss (head, then F.cross_entropy). Which run's eval loss lands closer to the fp32 run's
# is within the noise of the bf16 forward/backward both runs share, and moves between CPUs: measured
# 2026-11-25, eval-loss error zerofuse 0.01305 vs DDP 0.01346 on an AVX2 AMD EPYC, 0.01436 vs 0.01367
# on an AVX-512 Intel Xeon (oneDNN's bf16 GEMMs differ); with the fused loss 0.01363 vs 0.01290 (AVX2).
# The param error, which the fp32 masters and fp32 reduction decide, is 0.0117-0.0119 vs 0.0394 on
# both: that is asserted; the losses are reported.
CFG = dict(vocab_size=65, seq_len=32, n_layer=2, n_head=4, dim=64, fused_loss=False)
WS, BATCH, SEQ, STEPS, LR = 4, 16, 16, 20, 3e-3


def _batches(steps):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 65, (BATCH, SEQ + 1), generator=g) for _ in range(steps)]


def _reduction_rank(rank, ws):
    """Per reduce dtype: max relative error of this rank's reduced grad shard against the fp64
    average of every rank's local bf16 grads; and the same error for a bf16 all-reduce of
    pre-divided grads (what DDP does with bf16 params)."""
    per = BATCH // ws
    x = _batches(1)[0][rank * per:(rank + 1) * per]
    plain = GPT(GPTConfig(**CFG), seed=0).to(torch.bfloat16)
    _, loss = plain(x[:, :-1], x[:, 1:])
    loss.backward()
    local = [p.grad.reshape(-1) for p in plain.parameters()]
    flat = torch.cat(local)
    every = [torch.empty_like(flat) for _ in range(ws)]
    dist.all_gather(every, flat)
    exact = torch.stack(every).double().mean(0)
    names = [n for n, _ in plain.named_parameters()]
    offsets = dict(zip(names, torch.tensor([0] + [g.numel() for g in local]).cumsum(0).tolist()))

    def rel(got: torch.Tensor) -> float:
        return float((got.double() - exact).abs().max() / exact.abs().max())

    out = {}
    ring = flat / ws
    dist.all_reduce(ring)
    out["ddp_bf16_ring"] = rel(ring)
    for key, reduce_dtype in (("default", None), ("bf16_wire", torch.bfloat16)):
        model = GPT(GPTConfig(**CFG), seed=0)
        zerofuse.zero.parallelize(model, stage=2, precision="bf16", reduce_dtype=reduce_dtype, bucket_mb=0.05)
        eng = model._zerofuse_zero
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        eng.finish_grad_sync()
        got, want = [], []
        for u in eng.units:
            g = u.grad_shard()
            for s in u.segments:
                o = offsets[u.names[s.param]] + s.param_offset
                got.append(g[s.shard_offset:s.shard_offset + s.length])
                want.append(exact[o:o + s.length])
        got, want_t = torch.cat(got), torch.cat(want)
        out[key] = float((got.double() - want_t).abs().max() / exact.abs().max())
        out[key + "_dtype"] = str(eng.reduce_dtype)
    return out


def test_bf16_grads_reduce_in_fp32_by_default_and_a_bf16_wire_rounds_once():
    for r in run_distributed(_reduction_rank, WS, timeout=180):
        assert r["default_dtype"] == "torch.float32" and r["bf16_wire_dtype"] == "torch.bfloat16"
        # fp32: ~1e-7 of the largest grad; a bf16 ring rounds every partial sum (~1e-3)
        assert r["default"] < 1e-5, r
        assert r["default"] * 100 < r["ddp_bf16_ring"], r
        # the bf16 wire rounds the inputs and the fp32 sum once each: within two bf16 half-ulps
        assert r["bf16_wire"] <= 2 * 2.0 ** -8, r


def _training_rank(rank, ws):
    per = BATCH // ws
    out = {}
    # torch DDP with bf16 params (its bf16 grads all-reduced in bf16), torch AdamW on them
    model = GPT(GPTConfig(**CFG), seed=0).to(torch.bfloat16)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    out["ddp"] = _run(rank, per, ddp, opt, lambda: {n: p.detach().float() for n, p in model.named_parameters()})
    model = GPT(GPTConfig(**CFG), seed=0)
    zerofuse.zero.parallelize(model, stage=2, precision="bf16")
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=0.0)

    def params():
        with zerofuse.zero.full_params(model):
            return {n: p.detach().float().clone() for n, p in model.named_parameters()}

    out["zerofuse"] = _run(rank, per, model, opt, params)
    return out


def _run(rank, per, model, opt, params):
    losses = []
    for b in _batches(STEPS):
        x = b[rank * per:(rank + 1) * per]
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().float().clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses, params()


def test_bf16_training_at_ws4_is_closer_to_fp32_than_ddp_with_bf16_params():
    model = GPT(GPTConfig(**CFG), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    ref_losses = []
    for b in _batches(STEPS):
        _, loss = model(b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    ref = {n: p.detach() for n, p in model.named_parameters()}
    ref_eval = _eval_losses(ref)
    r = run_distributed(_training_rank, WS, timeout=240)[0]
    err = {}
    for key, (losses, params) in r.items():
        err[key] = dict(train_loss=sum(abs(a - b) for a, b in zip(losses, ref_losses)) / len(losses),
                        param=max(float((params[n] - w).abs().max()) for n, w in ref.items()),
                        eval_loss=float((_eval_losses(params) - ref_eval).abs().mean()))
    # Params: the largest deviation from the fp32 run (asserted: the masters' and the fp32
    # reduction's doing). Losses (reported in the message, not asserted; see the note at the top):
    # the trained params evaluated in fp32 on held-out tokens, per-token losses against the fp32
    # run's, and the bf16 training losses, whose error is the forward's rounding both runs share
    # (mean 6.1e-4 vs DDP's 4.3-5.1e-4 on 2026-11-23).
    assert err["zerofuse"]["param"] <= err["ddp"]["param"], err


def _eval_losses(params: dict) -> torch.Tensor:
    """Per-token fp32 losses of an fp32 GPT holding these params on held-out batches."""
    model = GPT(GPTConfig(**CFG), seed=0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    g = torch.Generator().manual_seed(99)
    x = torch.randint(0, 65, (4 * BATCH, SEQ + 1), generator=g)
    with torch.no_grad():
        logits, _ = model(x[:, :-1])
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                             reduction="none")


class _Scaled(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))

    def forward(self, c):  # (the square's term: a grad that itself requires grad under create_graph)
        return (self.w * c).sum() + 0.0 * self.w.square().sum()


def _wire_rank(rank, ws, stage, reduce_dtype, coeffs, create_graph=False):
    m = zerofuse.zero.parallelize(_Scaled(coeffs.shape[1]), stage=stage, reduce_dtype=reduce_dtype)
    m(coeffs[rank]).backward(create_graph=create_graph)  # w's grad on this rank: coeffs[rank]
    with zerofuse.zero.full_grads(m):
        return m.w.grad.clone()


@pytest.mark.parametrize("stage", [0, 2])
def test_a_low_precision_wire_divides_each_grad_before_its_cast(stage):
    """The grads are pre-divided by the world size so that the wire's dtype holds the sum: an fp16
    grad of 70000 (ws 2, mean 35000) was cast first, inf, then divided (the params NaN after the
    step); a bf16 grad rounded on the cast and again on the division (ws 3). Now one rounding each:
    the fp16 mean is finite, the bf16 one equals round(fp32 sum of round(g / ws)) bit for bit (a
    review's reproductions, 2026-12-07)."""
    big = torch.tensor([[70000.0] * 4, [0.0] * 4])
    got = run_distributed(_wire_rank, 2, stage, torch.float16, big, timeout=120)
    for g in got:
        torch.testing.assert_close(g.float(), torch.full((4,), 35000.0), rtol=2 ** -10, atol=0)
    g = torch.Generator().manual_seed(3)
    small = torch.randn(3, 3000, generator=g).bfloat16().float()
    want = sum((c / 3).bfloat16().float() for c in small).bfloat16()
    for got in run_distributed(_wire_rank, 3, stage, torch.bfloat16, small, timeout=120):
        assert torch.equal(got.bfloat16(), want)
    # (create_graph: the out= multiply refused grads requiring grad; a review's reproduction)
    for got in run_distributed(_wire_rank, 3, stage, torch.bfloat16, small, True, timeout=120):
        assert torch.equal(got.detach().bfloat16(), want)
