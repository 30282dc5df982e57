"""Tensor-parallel GPT training steps on gloo: zerofuse's TP (with and without sequence
parallelism) vs torch's DTensor tensor parallelism (``parallelize_module`` with
ColwiseParallel / RowwiseParallel), on the same model, batch, precision (fp32) and optimizer
(AdamW), in one run. Layouts: tp=2 (2 ranks) and dp=2 × tp=2 (4 ranks; zerofuse ZeRO-2 over the
DP group, torch FSDP2 without resharding after forward, i.e. ZeRO-2-like, over the DP mesh dim).

The DTensor model is the same GPT with the fused QKV projection split into q, k and v Linears
(ColwiseParallel cuts a weight into contiguous row blocks, which would split a fused projection
across q/k/v), heads made local after parallelize_module (torch's TP tutorial recipe), the
embedding RowwiseParallel and the head ColwiseParallel gathering the logits (vocab 65: a negligible
gather) and F.cross_entropy on them; the zerofuse model computes its loss with the fused
vocabulary-parallel head + cross-entropy (its default). Both use zerofuse's attention kernel and norms.

The pytest process is rank 0 and times whole steps with pytest-benchmark; helper processes are the
other ranks and run the same steps in lockstep (a barrier before each, outside the timing).
Activation memory: bytes autograd saves for backward (params excluded) in the norms and in the
whole model, zerofuse with and without SP (tests/common.py SavedActivations). The DTensor model's
AdamW is torch's foreach one (the default picked the per-parameter loop for DTensor params, where
bench_zero's peers step fused), in two param groups, the DTensor params and the plain ones (the
norms', not in the plan): in one group the foreach kernels refuse the mix.

Checked ([Note: checked results] in bench/conftest.py): every rank runs one untimed step before the
timed ones; rank 0's losses of that step and of the first timed one (after one update) against
torch's computation of the same two steps (conftest.gpt_losses: the plain GPT on the data-parallel
ranks' batches, grads averaged, torch's AdamW) in float64 by the reference rule, fp32 the peer.
"""
from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from conftest import cached_reference, check_result, gpt_losses  # bench/conftest.py

CASES = [("tp2", "dtensor"), ("tp2", "zerofuse"), ("tp2", "zerofuse_sp"),
         ("dp2xtp2", "dtensor_fsdp2"), ("dp2xtp2", "zerofuse_z2"), ("dp2xtp2", "zerofuse_z2_sp")]
LAYOUTS = {"tp2": (1, 2), "dp2xtp2": (2, 2)}
warnings.filterwarnings("ignore", message=".*is deprecated.*")


def _shape(smoke: bool) -> dict:
    if smoke:
        return dict(model=dict(vocab_size=65, seq_len=32, n_layer=2, n_head=2, dim=64), batch=2)
    return dict(model=dict(vocab_size=65, seq_len=128, n_layer=6, n_head=6, dim=384), batch=4)


class _SplitQKV(torch.nn.Module):
    """zerofuse.nn.Attention with q, k, v as separate Linears (what ColwiseParallel can shard)."""

    def __init__(self, att):
        super().__init__()
        d, hq, hkv = att.head_dim, att.num_heads, att.num_kv_heads
        w = att.qkv.weight.detach()
        self.q, self.k, self.v = (torch.nn.Linear(w.shape[1], n * d, bias=False) for n in (hq, hkv, hkv))
        with torch.no_grad():
            self.q.weight.copy_(w[:hq * d])
            self.k.weight.copy_(w[hq * d:(hq + hkv) * d])
            self.v.weight.copy_(w[(hq + hkv) * d:])
        self.proj, self.sdpa, self.causal = att.proj, att.sdpa, att.causal
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, d

    def forward(self, x):
        b, n, _ = x.shape
        d = self.head_dim
        q = self.q(x).view(b, n, -1, d).transpose(1, 2)  # local heads after parallelize_module
        k = self.k(x).view(b, n, -1, d).transpose(1, 2)
        v = self.v(x).view(b, n, -1, d).transpose(1, 2)
        out = self.sdpa(q, k, v, is_causal=self.causal, enable_gqa=q.shape[1] != k.shape[1])
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


def _dtensor_model(model, dp: int, tpn: int, fsdp: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dp, tpn), mesh_dim_names=("dp", "tp"))
    plan = {"wte": RowwiseParallel(input_layouts=Replicate()), "head": ColwiseParallel(output_layouts=Replicate())}
    for i, blk in enumerate(model.blocks):
        blk.attn = _SplitQKV(blk.attn)
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "mlp.proj"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for blk in model.blocks:
            fully_shard(blk, mesh=mesh["dp"], reshard_after_forward=False)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
    return mesh


class _Workload:
    def __init__(self, layout: str, provider: str, rank: int, smoke: bool):
        import zerofuse
        from zerofuse.models import GPT, GPTConfig

        dp, tpn = LAYOUTS[layout]
        shape = _shape(smoke)
        cfg = GPTConfig(**shape["model"])
        self.provider = provider
        if provider.startswith("dtensor"):
            # the DTensor plan parallelizes the head as a Linear that yields logits: the unfused loss
            model = GPT(dataclasses.replace(cfg, fused_loss=False), seed=0)
            self.psi = model.num_params()
            mesh = _dtensor_model(model, dp, tpn, provider.endswith("fsdp2"))
            dp_rank = mesh.get_local_rank("dp")
            # foreach, a group each for the DTensor params and the plain ones (the norms', not in the TP
            # plan): in one group the foreach kernels refuse the mix
            from torch.distributed.tensor import DTensor

            groups = [[p for p in model.parameters() if isinstance(p, DTensor) == d] for d in (True, False)]
            self.opt = torch.optim.AdamW([{"params": g} for g in groups if g], lr=1e-3, weight_decay=0.01,
                                         foreach=True)
        else:
            mesh = zerofuse.parallel.init_mesh(dp=dp, tp=tpn)
            model = GPT(cfg, seed=0, tp_group=mesh.tp_group, sequence_parallel=provider.endswith("_sp"))
            self.psi = model.num_params()  # unsharded
            zerofuse.zero.parallelize(model, stage=2 if dp > 1 else 0, group=mesh.dp_group)
            self.opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-3, weight_decay=0.01)
            dp_rank = mesh.dp_rank
        self.model, self.losses = model, []
        g = torch.Generator().manual_seed(dp_rank)
        self.x = torch.randint(0, 65, (shape["batch"], shape["model"]["seq_len"] + 1), generator=g)
        self.tokens = dp * self.x[:, :-1].numel()

    def step(self) -> None:
        _, loss = self.model(self.x[:, :-1], self.x[:, 1:])
        self.losses.append(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def saved_activations(self) -> tuple[int, int]:
        """(norms', whole model's) bytes saved for backward by one forward (params excluded)."""
        from common import SavedActivations

        norms = [m for n, m in self.model.named_modules() if n.rsplit(".", 1)[-1] in ("norm1", "norm2", "norm")]
        probes = SavedActivations(norms), SavedActivations([self.model])
        _, loss = self.model(self.x[:, :-1], self.x[:, 1:])
        for p in probes:
            p.remove()
        loss.backward()
        self.opt.zero_grad(set_to_none=True)
        return probes[0].bytes, probes[1].bytes


def _init(init_file: str, rank: int, ws: int) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ws))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=600))


def _helper(init_file: str, rank: int, ws: int, layout: str, provider: str, steps: int, smoke: bool) -> None:
    _init(init_file, rank, ws)
    try:
        work = _Workload(layout, provider, rank, smoke)
        for _ in range(steps + 1):  # (+ rank 0's untimed first step)
            dist.barrier()
            work.step()
        if provider.startswith("zerofuse"):
            work.saved_activations()
    finally:
        dist.destroy_process_group()


_MEDIANS: dict[tuple[str, str], float] = {}


@pytest.mark.parametrize("layout,provider", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def bench_tp_step(benchmark, layout, provider, smoke, device):
    if device.type != "cpu":
        pytest.skip("a CPU (gloo) suite: one GPU cannot hold a multi-rank TP group")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dp, tpn = LAYOUTS[layout]
    ws = dp * tpn
    rounds, warmup = (1, 0) if benchmark.disabled or smoke else (6, 1)
    tmp = tempfile.TemporaryDirectory(prefix="zerofuse-bench-")
    init = os.path.join(tmp.name, "init")
    ctx = mp.get_context("spawn")
    helpers = [ctx.Process(target=_helper, args=(init, r, ws, layout, provider, rounds + warmup, smoke), daemon=True)
               for r in range(1, ws)]
    for h in helpers:
        h.start()
    threads = torch.get_num_threads()
    _init(init, 0, ws)
    try:
        work = _Workload(layout, provider, 0, smoke)
        dist.barrier()
        work.step()  # untimed, its loss and the next step's checked below
        benchmark.pedantic(work.step, setup=dist.barrier, rounds=rounds, warmup_rounds=warmup)
        acts = work.saved_activations() if provider.startswith("zerofuse") else None
    finally:
        dist.destroy_process_group()
        for h in helpers:
            h.join(timeout=60)
            if h.is_alive():
                h.kill()
        torch.set_num_threads(threads)
        tmp.cleanup()
    info = benchmark.extra_info
    info.update(case=f"gpt{work.psi / 1e6:.1f}M/{layout}/fp32", provider=provider, layout=layout, world_size=ws,
                params=work.psi, device="cpu (gloo)", torch=torch.__version__)
    if acts is not None:
        info["norm_activations_MB_rank0"] = round(acts[0] / 2**20, 3)
        info["all_activations_MB_rank0"] = round(acts[1] / 2**20, 3)
        base = _ACTS.get((layout, provider.removesuffix("_sp")))
        if provider.endswith("_sp") and base is not None:
            info["norm_activation_ratio_sp_vs_no_sp"] = round(acts[0] / base[0], 3)
            info["all_activation_ratio_sp_vs_no_sp"] = round(acts[1] / base[1], 3)
            assert acts[0] * tpn <= base[0], (acts, base)  # the norms keep 1/tp of their activations
        _ACTS[(layout, provider)] = acts
    shape = _shape(smoke)
    batches = [torch.randint(0, 65, (shape["batch"], shape["model"]["seq_len"] + 1),
                             generator=torch.Generator().manual_seed(r)) for r in range(dp)]  # (as _Workload's)
    want, peer = cached_reference(("tp_step_losses", dp, smoke), lambda: gpt_losses(shape["model"], batches))
    check_result(torch.stack(work.losses[:2]), want, peer, what=f"{layout} {provider}: losses of the first two steps")
    if benchmark.stats is None:
        return
    median = benchmark.stats.stats.median
    _MEDIANS[(layout, provider)] = median
    info["tokens_per_s"] = round(work.tokens / median, 1)
    peer = (layout, "dtensor" if layout == "tp2" else "dtensor_fsdp2")
    if provider.startswith("zerofuse") and peer in _MEDIANS:
        info[f"speedup_vs_{peer[1]}"] = round(_MEDIANS[peer] / median, 3)


_ACTS: dict[tuple[str, str], tuple[int, int]] = {}
