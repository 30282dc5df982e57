"""Pipeline-parallel training steps on gloo CPU ranks, pp 2 and 4: zerofuse.pipeline.Pipeline vs
torch.distributed.pipelining on the same GPT (n_layer 8, dim 128, 4 heads, seq 64, vocab 65, fp32),
the same stages (zerofuse's split_gpt, balanced by parameters), batch, micro-batch count (m = 2p)
and schedule:

- gpipe: Pipeline("gpipe") vs ScheduleGPipe; 1f1b: Pipeline("1f1b") vs Schedule1F1B;
- interleaved: Pipeline("interleaved") with 2 stages per rank (stages rank + k p) vs
  ScheduleInterleaved1F1B on the same 2 stages per rank;
- zb: Pipeline("zb") (ZB-H1, one stage per rank) vs ScheduleInterleavedZeroBubble given one stage
  per rank (provider "torch": its ZB1P order with one local stage, the ZB-H1-like shape, as torch
  2.13 has no single-stage zero-bubble class) and given 2 stages per rank ("torch_v2", the
  interleaved layout it is written for). ScheduleZBVZeroBubble (V placement) is not run.

torch's stages wrap zerofuse's Stage modules (the same params, same C++ CPU kernels:
ZEROFUSE_TRITON_ON_CPU=0 in the ranks) in a module whose forward takes and returns tensors; its
last stage returns the final norm's output and the schedule's loss_fn applies the model's fused
linear + cross-entropy head (in the zerofuse stage the head runs inside the stage's forward), so
both sides run the same ops. Loss mean-reduced per micro-batch on both sides: zerofuse scales the
backward by 1/m, torch divides the grads by m after the last backward (scale_grads). Two changes
torch's zero-bubble schedules need (not the others): its W pass runs the head's backward node a
second time, which the fused loss refuses when its grads were made in forward, so there the head
recomputes its logits in backward (recompute=True, one 65 x 128 GEMM per micro-batch more); and
its I pass detach_()es the stage outputs in place, which views refuse, so the residual stream (a
view out of the fused add + norm) is cloned at the stage's end.

Timing, inside the ranks (tests/dist_utils.run_distributed, one rank per process, 1 intra-op
thread each). The providers of a case share one run and take turns: every round runs one step of
each (the first one rotating), so a change of the shared machine's load hits all of them. A step
is zero_grad (untimed), a barrier, then the training step alone: the forward and backward of all
m micro-batches, no optimizer step on either side. A step's time is the slowest rank's; the
recorded stats are those step times after WARMUP rounds (the first step agrees the boundary
shapes on both sides). speedup_vs_<peer> = peer's median / zerofuse's median (> 1: zerofuse
faster); paired_speedup_vs_<peer> the median over rounds of the per-round ratio.

Measured bubble: per step, the mean over ranks of 1 - compute / step time. Compute, zerofuse:
Pipeline.compute_seconds (its F/B/I/W actions); torch: the time inside the stage's
forward_one_chunk, backward_one_chunk and backward_weight_one_chunk and the schedule's
_compute_loss (the loss_fn, i.e. the head), the methods its schedules call for compute, wrapped
with a timer (outer call only: scale_grads inside backward_one_chunk counts once). Formula:
(p - 1) / (v m + p - 1); for zb also the zerofuse simulator's idle fraction with F = I = W = 1.
On the 2-core VM 4 ranks share 2 cores, so a rank's "compute" also holds time it waited for a
core; the pp 4 bubbles are not the schedule's alone.

Sanity: the first step's loss and grad norm of zerofuse and torch agree (same init, same batch).
"""
from __future__ import annotations

import math
import statistics
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from timing import timed  # bench/timing.py (the ranks import this suite by name)

PPS = [2, 4]
# schedule -> (torch schedule class, stages per rank) per torch provider
TORCH = {"gpipe": {"torch": ("ScheduleGPipe", 1)}, "1f1b": {"torch": ("Schedule1F1B", 1)},
         "interleaved": {"torch": ("ScheduleInterleaved1F1B", 2)},
         "zb": {"torch": ("ScheduleInterleavedZeroBubble", 1), "torch_v2": ("ScheduleInterleavedZeroBubble", 2)}}
ZEROFUSE_V = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb": 1}
CASES = [(pp, sched, prov) for pp in PPS for sched in TORCH for prov in [*TORCH[sched], "zerofuse"]]
WARMUP, STEPS = 2, 40
warnings.filterwarnings("ignore", message=".*is deprecated.*")


def _shape(smoke: bool) -> tuple[dict, int]:
    """GPT config and micro-batch size (sequences)."""
    if smoke:
        return dict(vocab_size=65, seq_len=16, n_layer=8, n_head=2, dim=32), 1
    return dict(vocab_size=65, seq_len=64, n_layer=8, n_head=4, dim=128), 4


def _batch(cfg, batch: int):
    g = torch.Generator().manual_seed(7)
    return (torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g),
            torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g))


class _TorchModule(torch.nn.Module):
    """A zerofuse Stage as torch's PipelineStage wants it: forward(*tensors) -> tensor(s). The last
    stage stops at the final norm (the schedule's loss_fn runs the head)."""

    def __init__(self, stage, model, copy_views: bool):
        super().__init__()
        self.stage, self.model = stage, [model]  # the GPT kept out of the module tree
        self.blocks = [stage.get_submodule(n) for n in stage.parts if n.startswith("blocks.")]
        self.copy_views = copy_views

    def forward(self, *inputs):
        if not self.stage.is_last:
            out = self.stage(*inputs)
            if self.copy_views:  # the residual x out of the fused add + norm is a view
                out = tuple(t.clone() if t._base is not None else t for t in out)
            return out if len(out) > 1 else out[0]
        model = self.model[0]
        if self.stage.is_first:
            x, delta = model.embed(inputs[0]), None
        else:
            x, delta = inputs if len(inputs) == 2 else (inputs[0], None)
        for block in self.blocks:
            x, delta = model.run_block(block, x, delta)
        return model.norm(delta, x)[0] if delta is not None else model.norm(x)


class _Clock:
    """Seconds spent inside the wrapped methods (outer calls only)."""

    def __init__(self):
        self.seconds, self._depth = 0.0, 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - t0

        return timed


class _TorchRunner:
    def __init__(self, stages, model, schedule: str, provider: str, m: int):
        from torch.distributed import pipelining

        cls_name, v = TORCH[schedule][provider]
        self.clock = _Clock()
        self.pstages = []
        zero_bubble = "ZeroBubble" in cls_name
        for s in stages:
            ps = pipelining.PipelineStage(_TorchModule(s, model, zero_bubble), s.index, s.num_stages,
                                          torch.device("cpu"))
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(ps, name, self.clock.wrap(getattr(ps, name)))
            self.pstages.append(ps)
        head = model.head
        # torch's zero-bubble W pass runs the head's backward node a second time (after I), which
        # the fused loss's grads made in forward refuse: there it recomputes its logits in backward
        opts = {"recompute": True} if zero_bubble else {}

        def loss_fn(h, target):
            return head(h, target, **opts)  # the fused linear + cross-entropy of the zerofuse stage

        cls = getattr(pipelining, cls_name)
        self.sched = cls(self.pstages[0] if v == 1 and not cls_name.startswith("ScheduleInterleaved") else self.pstages,
                         n_microbatches=m, loss_fn=loss_fn)
        self.sched._compute_loss = self.clock.wrap(self.sched._compute_loss)
        self.first = any(s.is_first for s in stages)
        self.last = any(s.is_last for s in stages)

    def step(self, idx, tgt) -> tuple[float, float | None]:
        """(compute seconds, mean loss on the last stage's rank, else None)."""
        self.clock.seconds = 0.0
        losses = [] if self.last else None
        self.sched.step(*((idx,) if self.first else ()), target=tgt if self.last else None, losses=losses,
                        return_outputs=False)
        return self.clock.seconds, (torch.stack(losses).mean().item() if self.last else None)


class _ZerofuseRunner:
    def __init__(self, stages, schedule: str, m: int):
        from zerofuse.pipeline import Pipeline

        self.pipe = Pipeline(stages, schedule=schedule, microbatches=m)
        self.last = any(s.is_last for s in stages)

    def step(self, idx, tgt) -> tuple[float, float | None]:
        loss = self.pipe.step(idx, tgt)
        return self.pipe.compute_seconds, (loss.item() if self.last else None)


def _v(schedule: str, provider: str) -> int:
    return ZEROFUSE_V[schedule] if provider == "zerofuse" else TORCH[schedule][provider][1]


def _rank(rank: int, ws: int, schedule: str, providers: list[str], rounds: int, smoke: bool) -> dict:
    """Per provider, per round: (wall seconds, compute seconds, loss or None, this rank's squared
    grad norm). Every round runs one step of each provider, the first one rotating."""
    from zerofuse import kernels
    from zerofuse.models import GPT, GPTConfig
    from zerofuse.pipeline import split_gpt

    assert not kernels.TRITON_ON_CPU, "the ranks must run the C++ CPU kernels"
    model_kw, mbs = _shape(smoke)
    cfg = GPTConfig(**model_kw)
    m = 2 * ws
    runners = {}
    for prov in providers:
        v = _v(schedule, prov)
        with torch.device("meta"):
            model = GPT(cfg, seed=0)
        stages = split_gpt(model, ws * v, [rank + k * ws for k in range(v)], device="cpu")
        runners[prov] = (stages, _ZerofuseRunner(stages, schedule, m) if prov == "zerofuse"
                         else _TorchRunner(stages, model, schedule, prov, m))
    idx, tgt = _batch(cfg, m * mbs)
    out = {prov: [] for prov in providers}
    for i in range(rounds):
        for j in range(len(providers)):
            prov = providers[(i + j) % len(providers)]
            stages, runner = runners[prov]
            for s in stages:
                s.zero_grad(set_to_none=True)
            dist.barrier()
            got = []
            wall = timed(lambda: got.append(runner.step(idx, tgt)), idx.device)
            (compute, loss), = got
            gsq = sum(float(p.grad.double().pow(2).sum()) for s in stages for p in s.parameters()
                      if p.grad is not None)
            out[prov].append((wall, compute, loss, gsq))
    return out


def _formula(p: int, m: int, v: int) -> float:
    return (p - 1) / (v * m + p - 1)


def _zb_sim(p: int, m: int) -> float:
    from zerofuse.pipeline import build_schedule, simulate

    sim = simulate(build_schedule("zb", p, m), p, costs={"F": 1.0, "I": 1.0, "W": 1.0})
    return statistics.mean(sim.idle_fraction)


def _report_times(benchmark, times: list[float]) -> None:
    """pytest-benchmark's stats for step times measured in the ranks: a pedantic run of a no-op
    makes the stats object, whose samples then become the ranks' step times."""
    benchmark.pedantic(lambda: None, rounds=1)
    if benchmark.stats is not None:
        benchmark.stats.stats.data[:] = list(times)


_RUNS: dict[tuple[int, str, bool], dict] = {}


def _run(pp: int, schedule: str, rounds: int, smoke: bool) -> dict:
    """Per provider of the case: step times, measured bubbles, first loss and grad norm (one
    distributed run for all of a case's providers, made by its first test)."""
    key = (pp, schedule, smoke)
    if key not in _RUNS:
        providers = [*TORCH[schedule], "zerofuse"]
        out = run_distributed(_rank, pp, schedule, providers, rounds, smoke, timeout=600)
        res = {}
        for prov in providers:
            per_rank = [r[prov] for r in out]
            times = [max(r[i][0] for r in per_rank) for i in range(rounds)]
            bubbles = [statistics.mean(1 - r[i][1] / t for r in per_rank) for i, t in enumerate(times)]
            loss = next(r[0][2] for r in per_rank if r[0][2] is not None)
            res[prov] = dict(times=times, bubbles=bubbles, loss=loss, gnorm=math.sqrt(sum(r[0][3] for r in per_rank)))
        _RUNS[key] = res
    return _RUNS[key]


@pytest.mark.parametrize("pp,schedule,provider", CASES, ids=[f"pp{a}-{b}-{c}" for a, b, c in CASES])
def bench_pipeline_step(benchmark, pp, schedule, provider, smoke, device, monkeypatch):
    if device.type != "cpu":
        pytest.skip("a CPU (gloo) suite")
    monkeypatch.setenv("ZEROFUSE_TRITON_ON_CPU", "0")  # the ranks take this environment
    monkeypatch.delenv("ZEROFUSE_CHECK_COLLECTIVES", raising=False)
    warm, steps = (1, 1) if smoke or benchmark.disabled else (WARMUP, STEPS)
    res = _run(pp, schedule, warm + steps, smoke)
    mine = res[provider]
    timed = mine["times"][warm:]
    _report_times(benchmark, timed)
    model_kw, mbs = _shape(smoke)
    m, v = 2 * pp, _v(schedule, provider)
    info = benchmark.extra_info
    info.update(case=f"gpt/pp{pp}/{schedule}", provider=provider, pp=pp, schedule=schedule, v=v, microbatches=m,
                microbatch_size=mbs, model=model_kw, device="cpu (gloo)", torch=torch.__version__,
                step_ms_median=round(statistics.median(timed) * 1e3, 3),
                bubble_measured=round(statistics.median(mine["bubbles"][warm:]), 4),
                bubble_formula=round(_formula(pp, m, v), 4), first_loss=mine["loss"], first_grad_norm=mine["gnorm"])
    if provider != "zerofuse":
        info["torch_schedule"] = TORCH[schedule][provider][0]
    if schedule == "zb" and v == 1:
        info["bubble_sim_zb_F=I=W"] = round(_zb_sim(pp, m), 4)
    if provider != "zerofuse":
        return
    for peer in TORCH[schedule]:
        ref = res[peer]  # same init and batch: the same loss and grads
        assert math.isclose(mine["loss"], ref["loss"], rel_tol=1e-5), (peer, mine["loss"], ref["loss"])
        assert math.isclose(mine["gnorm"], ref["gnorm"], rel_tol=1e-4), (peer, mine["gnorm"], ref["gnorm"])
        if benchmark.stats is not None:
            peer_timed = ref["times"][warm:]
            info[f"speedup_vs_{peer}"] = round(statistics.median(peer_timed) / statistics.median(timed), 3)
            info[f"paired_speedup_vs_{peer}"] = round(statistics.median(
                a / b for a, b in zip(peer_timed, timed)), 3)
