"""Data-parallel training steps on gloo, 2 ranks: zerofuse ZeRO-0/1/2/3 vs torch DDP, FSDP2
(fully_shard, reshard_after_forward True and False) and DeepSpeed ZeRO-1/2/3 (when installed), on
the same GPT (~10.7M params, zerofuse's attention and norms in every provider), batch, precision
(fp32) and optimizer (AdamW; torch's fused CPU AdamW for the peers).

The pytest process is rank 0 and times whole steps (forward, backward, optimizer step, with the
communication each provider does) with pytest-benchmark; a fresh helper process per provider is
rank 1 and runs the same steps in lockstep (a barrier before each, outside the timing). Memory:
the helper's peak RSS growth (sampled every ms) from just before the model is built to the end
(model states, activations, communication buffers, allocator slack: what a rank really needs),
and for zerofuse the model-state bytes of zero.memory_report. Each rank gets cores // 2 intra-op threads (as torchrun would).

Peak memory per rank, at the peak (what ZeRO's promises are about), not after it: after the timed
steps both ranks build a fresh model and run MEM_STEPS more steps with phase marks (forward,
backward, optimizer step), untimed (the instruments slow a step). Recorded, max over the steps
after the first (which makes the buffers kept between steps): peak_backward_MB (the most bytes
allocated at once during backward) and peak_step_MB (over forward + backward + optimizer step),
absolute since counting starts before the model exists: params, grads, optimizer states,
activations and the comm buffers torch allocates, not memory gloo or DeepSpeed's C++ ops allocate
themselves. They come from zerofuse.zero.peak_memory, a counting wrapper around torch's CPU
allocator that sees every thread (torch.profiler's allocator events, used before, are per thread
and missed frees done on gloo's workers: 4-50 MiB per rank counted as live after its free).
Gradient buckets: zerofuse stages 0-2 bucket_mb 25 (default) and 4 (*_b4), max_inflight 2; DDP
bucket_cap_mb 25 (default; its first bucket 1 MiB); DeepSpeed reduce/allgather buckets of 25 MiB
(set here: the 5e8-element default is a 1.9 GB fp32 buffer; overlap_comm its default, on at stage 3
only); FSDP2 and zerofuse stage 3 reduce one unit per transformer block plus a root unit.

Checked ([Note: checked results] in bench/conftest.py): every rank runs one untimed step before the
timed ones; rank 0's losses of that step and of the first timed one (after one update) against
torch's computation of the same two steps (conftest.gpt_losses: the plain GPT, both ranks' batches,
grads averaged, torch's AdamW) in float64 by the reference rule, the same in fp32 the peer.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import resource
import tempfile
import threading
import warnings

import pytest
import torch
import torch.distributed as dist
from conftest import cached_reference, check_result, gpt_losses, import_peer  # bench/conftest.py

WS = 2
PROVIDERS = ["ddp", "fsdp2_reshard", "fsdp2_no_reshard", "deepspeed_z1", "deepspeed_z2", "deepspeed_z3",
             "zerofuse_z0", "zerofuse_z1", "zerofuse_z2", "zerofuse_z2_b4", "zerofuse_z3", "zerofuse_z3_no_reshard"]
DS_BUCKET_ELEMS = 25 * 2**20 // 4  # 25 MiB of fp32, DDP's and zerofuse's default bucket
MiB = 2**20
warnings.filterwarnings("ignore", message=".*is deprecated.*")


def _shape(smoke: bool) -> dict:
    if smoke:
        return dict(model=dict(vocab_size=65, seq_len=32, n_layer=2, n_head=2, dim=64), batch=2)
    return dict(model=dict(vocab_size=65, seq_len=128, n_layer=6, n_head=6, dim=384), batch=4)


def _adamw(params):
    try:
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


class _Workload:
    """The model and optimizer of one provider, built the same way on every rank; step() is one
    training step on this rank's batch."""

    def __init__(self, provider: str, rank: int, smoke: bool):
        import zerofuse
        from zerofuse.models import GPT, GPTConfig

        shape = _shape(smoke)
        model = GPT(GPTConfig(**shape["model"]), seed=0)
        g = torch.Generator().manual_seed(rank)
        self.x = torch.randint(0, 65, (shape["batch"], shape["model"]["seq_len"] + 1), generator=g)
        self.psi = model.num_params()
        self.provider, self.losses = provider, []
        if provider == "ddp":
            self.model = torch.nn.parallel.DistributedDataParallel(model)
            self.opt = _adamw(self.model.parameters())
        elif provider.startswith("fsdp2"):
            from torch.distributed.fsdp import fully_shard

            reshard = provider == "fsdp2_reshard"
            for blk in model.blocks:
                fully_shard(blk, reshard_after_forward=reshard)
            fully_shard(model, reshard_after_forward=reshard)
            self.model = model
            self.opt = _adamw(model.parameters())
        elif provider.startswith("deepspeed"):
            import logging

            import deepspeed

            deepspeed.utils.logger.setLevel(logging.WARNING)
            cfg = {"train_micro_batch_size_per_gpu": shape["batch"], "gradient_accumulation_steps": 1,
                   "zero_optimization": {"stage": int(provider[-1]), "reduce_bucket_size": DS_BUCKET_ELEMS,
                                         "allgather_bucket_size": DS_BUCKET_ELEMS},
                   "zero_allow_untested_optimizer": True,
                   "steps_per_print": 1 << 30}
            self.model, self.opt, _, _ = deepspeed.initialize(model=model, optimizer=_adamw(model.parameters()),
                                                              config=cfg)
        else:
            stage = int(provider.split("_z")[1][0])
            kw = {"bucket_mb": _bucket_mb(provider)} if stage < 3 else {}  # stage 3: one unit per block
            zerofuse.zero.parallelize(model, stage=stage, reshard_after_forward=not provider.endswith("no_reshard"),
                                      **kw)
            self.model = model
            self.opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-3, weight_decay=0.01)

    def step(self, mark=lambda label: None) -> None:
        mark("forward")
        _, loss = self.model(self.x[:, :-1], self.x[:, 1:])
        self.losses.append(loss.detach())
        mark("backward")
        if self.provider.startswith("deepspeed"):
            self.model.backward(loss)
            mark("step")
            self.model.step()
            return
        loss.backward()
        mark("step")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def model_state_bytes(self) -> int | None:
        """zerofuse's own count of this rank's params, grads and optimizer states (asked once, after
        the steps: it walks every unit, and ran inside each timed step before)."""
        if not self.provider.startswith("zerofuse"):
            return None
        import zerofuse

        return zerofuse.zero.memory_report(self.model, self.opt)["total"]


def _bucket_mb(provider: str) -> float | None:
    """The gradient bucket size in MiB as configured above; None where reductions go per unit."""
    if provider.startswith("fsdp2") or provider.startswith("zerofuse_z3"):
        return None
    return 4.0 if provider.endswith("_b4") else 25.0


MEM_STEPS = 3


def _memory_pass(provider: str, rank: int, smoke: bool) -> dict:
    """Absolute (at, peak) bytes per phase, the max over the steps after the first, on a model built
    inside zerofuse.zero.peak_memory (its CPU allocator counter is installed only for this pass)."""
    import gc

    import zerofuse

    with zerofuse.zero.peak_memory() as mem:  # counts every thread's allocations (csrc/memory_counter.cpp)
        work = _Workload(provider, rank, smoke)
        for i in range(MEM_STEPS):
            dist.barrier()
            work.step(lambda label, i=i: mem.mark(f"{label}{i}"))
        mem.mark("end")
    del work
    gc.collect()
    steps = [{k: mem.phases[f"{k}{i}"] for k in ("forward", "backward", "step")} for i in range(1, MEM_STEPS)]
    return {"at_step_start": max(s["forward"][0] for s in steps),
            "at_backward_start": max(s["backward"][0] for s in steps),
            "peak_backward": max(s["backward"][1] for s in steps),
            "peak_step": max(hi for s in steps for _, hi in s.values())}


def _threads() -> int:
    return max(1, (os.cpu_count() or 1) // WS)


def _env(rank: int) -> None:
    # DeepSpeed reads the launcher's variables; CPU tensors use the C++ kernels here
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(WS), DS_ACCELERATOR="cpu")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class _PeakRSS:
    """Highest resident set size seen by a thread sampling /proc/self/statm every millisecond
    (getrusage's high-water mark would include the imports' peak)."""

    def __init__(self):
        self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss_bytes())


def _helper(init_file: str, provider: str, steps: int, smoke: bool) -> None:
    _env(1)
    torch.set_num_threads(_threads())
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=1, world_size=WS,
                            timeout=datetime.timedelta(seconds=600))
    try:
        import importlib

        if provider.startswith("deepspeed"):
            importlib.import_module("deepspeed")  # (imports before the baseline)
        importlib.import_module("zerofuse")
        base = _rss_bytes()
        sampler = _PeakRSS()
        work = _Workload(provider, 1, smoke)
        for _ in range(steps + 1):  # (+ rank 0's untimed first step)
            dist.barrier()
            work.step()
        rss, state_bytes = sampler.stop() - base, work.model_state_bytes()
        del work
        box = [(rss, state_bytes, _memory_pass(provider, 1, smoke))]
        dist.broadcast_object_list(box, src=1)
    finally:
        dist.destroy_process_group()


_MEDIANS: dict[str, float] = {}


@pytest.mark.parametrize("provider", PROVIDERS)
def bench_zero_step(benchmark, provider, smoke, device):
    if device.type != "cpu":
        pytest.skip("a CPU (gloo, 2 ranks) suite; ZeRO on one GPU is not benchmarked yet")
    if provider.startswith("deepspeed"):
        import_peer("deepspeed")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    rounds, warmup = (1, 0) if benchmark.disabled or smoke else (8, 2)
    tmp = tempfile.TemporaryDirectory(prefix="zerofuse-bench-")
    init = os.path.join(tmp.name, "init")
    helper = mp.get_context("spawn").Process(target=_helper, args=(init, provider, rounds + warmup, smoke),
                                             daemon=True)
    helper.start()
    threads = torch.get_num_threads()
    saved_env = dict(os.environ)
    _env(0)
    torch.set_num_threads(_threads())
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=WS,
                            timeout=datetime.timedelta(seconds=600))
    try:
        work = _Workload(provider, 0, smoke)
        dist.barrier()
        work.step()  # untimed, its loss and the next step's checked below
        benchmark.pedantic(work.step, setup=dist.barrier, rounds=rounds, warmup_rounds=warmup)
        psi, tokens, got = work.psi, work.x[:, :-1].numel(), torch.stack(work.losses[:2])
        del work  # the memory pass builds its own model (the timed one would only add RSS)
        mem = {0: _memory_pass(provider, 0, smoke)}
        box = [None]
        dist.broadcast_object_list(box, src=1)
        rss, state_bytes, mem[1] = box[0]
    finally:
        if provider.startswith("deepspeed"):
            import deepspeed.comm
            from deepspeed.utils import groups

            # DeepSpeed caches its backend and groups of the process group destroyed below
            deepspeed.comm.comm.cdb = None
            groups._WORLD_GROUP = groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = groups._DATA_PARALLEL_GROUP = None
        dist.destroy_process_group()
        helper.join(timeout=60)
        if helper.is_alive():
            helper.kill()
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(saved_env)
        tmp.cleanup()
    info = benchmark.extra_info
    info.update(case=f"gpt{psi / 1e6:.1f}M/ws{WS}/fp32", provider=provider, world_size=WS, params=psi,
                device="cpu (gloo)", torch=torch.__version__, peak_rss_growth_MB_rank1=round(rss / MiB, 1),
                bucket_mb=_bucket_mb(provider), full_grad_MB=round(psi * 4 / MiB, 2))
    if provider.startswith("zerofuse"):
        info["max_inflight"] = 2  # parallelize's default
    for rank, m in mem.items():
        for key, val in m.items():
            info[f"{key}_MB_rank{rank}"] = round(val / MiB, 2)
    if state_bytes is not None:
        info["model_state_MB_rank1"] = round(state_bytes / MiB, 2)
    shape = _shape(smoke)
    batches = [torch.randint(0, 65, (shape["batch"], shape["model"]["seq_len"] + 1),
                             generator=torch.Generator().manual_seed(r)) for r in range(WS)]  # (as _Workload's)
    want, peer = cached_reference(("zero_step_losses", smoke), lambda: gpt_losses(shape["model"], batches))
    check_result(got, want, peer, what=f"{provider}: losses of the first two steps")
    if benchmark.stats is None:
        return
    median = benchmark.stats.stats.median
    _MEDIANS[provider] = median
    info["tokens_per_s"] = round(WS * tokens / median, 1)
    if provider.startswith("zerofuse"):
        for peer in PROVIDERS:
            if not peer.startswith("zerofuse") and peer in _MEDIANS:
                info[f"speedup_vs_{peer}"] = round(_MEDIANS[peer] / median, 3)
