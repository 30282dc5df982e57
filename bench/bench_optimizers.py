"""Optimizer step time: zerofuse FusedAdamW vs torch.optim.AdamW (foreach, fused=True) and
DeepSpeedCPUAdam (CPU, when installed); zerofuse FusedLAMB vs an unfused PyTorch LAMB
(zerofuse.reference.lamb_step) and vs zerofuse's own AdamW time.

Parameters are split like a transformer's (a few large matrices, many vectors). GB/s counts 28
bytes per fp32 parameter for AdamW (read param, grad, exp_avg, exp_avg_sq; write param,
exp_avg, exp_avg_sq), 32 with grad-norm clipping (zerofuse_clip: one more read of the grads), and
44 for LAMB with clipping (norm pass: read grad; stage 1: read param, grad, m, v, write m, v;
stage 2: read param, m, v, write param), against the device's measured bandwidth
(roofline_ratio). From memory, a LAMB step therefore costs at least 44/32 = 1.375x a clipped AdamW
step (time_vs_zerofuse_adamw_clipped, the like-for-like ratio) and 44/28 = 1.57x an unclipped one
(time_vs_zerofuse_adamw). Below that only with cache reuse: the CPU kernel keeps a block's stage-1
updates in a scratch buffer and stage 2 reads them back from the last-level cache
(csrc/cpu/lamb.cpp); on GPUs the one-launch LAMB (provider zerofuse_one_launch) runs each tensor's
stage 2 right after its stage 1, reading from L2 what fits ([Note: one-launch LAMB] in
kernels/lamb.py), measured slower than the default two-launch form on an H200. A roofline_ratio above 1
for LAMB means reuse: the 44 bytes are counted as if all came from memory.

Every provider's params after its first (untimed) step are checked against the same step in float64
by the reference rule ([Note: checked results] in bench/conftest.py): torch.optim.AdamW
(foreach=False) for AdamW, its grads first clipped as zerofuse clips them for zerofuse_clip,
zerofuse.reference.lamb_step for LAMB; the peer the same in fp32. Every provider starts from the same
params and grads (seeded).
"""
import statistics

import pytest
import torch

from conftest import cached_reference, check_result, import_peer, timed  # bench/conftest.py
from timing import host_ms  # bench/timing.py
from zerofuse import reference
from zerofuse.optim import FusedAdamW, FusedLAMB

SIZES = {"1M": 1_000_000, "10M": 10_000_000, "100M": 100_000_000}


def _split(total: int) -> list[int]:
    """Blocks of 12 d^2 (4 attention + 8 MLP) + 9 d vectors, d chosen so ~8 blocks fill total."""
    d = max(8, int((total / 8 / 12) ** 0.5))
    sizes = []
    while sum(sizes) + 12 * d * d <= total:
        sizes += [3 * d * d, d * d, 4 * d * d, 4 * d * d] + [d] * 9
    return sizes or [total]


def _params(device, total):
    g = torch.Generator(device=device).manual_seed(0)  # (the same for every provider: one reference)
    params = [torch.nn.Parameter(torch.randn(n, device=device, generator=g) * 0.02) for n in _split(total)]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=g) * 1e-3
    return params


def _reference_step(params, kind: str, clip: bool) -> list:
    """params (with grads, in their dtype) after one reference step of LAMB or AdamW (clip: the
    grads first multiplied by max_norm / max(norm, max_norm), max_norm 1, as zerofuse clips)."""
    if kind == "lamb":
        _EagerLAMB(params).step()
        return [p.detach() for p in params]
    if clip:
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])))
        for p in params:
            p.grad.mul_(1.0 / max(norm, 1.0))
    torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=False).step()
    return [p.detach() for p in params]


# The step's update (params after it less before it) is what is checked, scaled up to sit above the
# fp32 atol: params of ~0.02 took any update of ~1e-5 (LAMB's x0.7 or x1.3, AdamW without its weight
# decay) within the rule's floor (a review, 2026-12-07). The subtractions are exact (Sterbenz).
UPDATE_SCALE = {"adamw": 2.0 ** 10, "lamb": 2.0 ** 15}


def _reference(device, n: int, kind: str, clip: bool = False, dtype=torch.float32):
    """(float64 reference, fp32 peer) of the update one step makes to the params of _params(device,
    n), rounded to dtype first, and those params before it (fp32)."""
    def copies(to):
        out = []
        for p in _params(device, n):
            q = torch.nn.Parameter(p.detach().to(dtype).to(to))
            q.grad = p.grad.to(dtype).to(to)
            out.append(q)
        return out

    before = [p.detach().to(dtype).float() for p in _params(device, n)]
    want = [a - b.double() for a, b in zip(_reference_step(copies(torch.float64), kind, clip), before)]
    peer = [a - b for a, b in zip(_reference_step(copies(torch.float32), kind, clip), before)]
    return want, peer, before


def _check_step(got, device, n, kind, what, clip=False, dtype=torch.float32):
    want, peer, before = cached_reference(("optim", kind, clip, dtype, n, device),
                                          lambda: _reference(device, n, kind, clip, dtype))
    check_result([g.float() - b for g, b in zip(got, before)], want, peer, what=f"{what}: one step's update",
                 scale=UPDATE_SCALE[kind])


def _snapshot(params) -> list:
    return [p.detach().clone() for p in params]


def _optimizer(provider, params):
    if provider in ("zerofuse", "zerofuse_flat_grid"):  # (the grid is set by bench_adamw_step)
        return FusedAdamW(params, lr=1e-3, weight_decay=0.01)
    if provider == "zerofuse_clip":  # the same step with global grad-norm clipping, as LAMB has
        return FusedAdamW(params, lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)
    if provider == "torch_foreach":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)
    if provider == "torch_fused":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    if provider == "deepspeed_cpu_adam":
        ds = import_peer("deepspeed.ops.adam")
        return ds.DeepSpeedCPUAdam(params, lr=1e-3, weight_decay=0.01, adamw_mode=True)
    raise ValueError(provider)


@pytest.mark.parametrize("provider", ["torch_foreach", "torch_fused", "deepspeed_cpu_adam", "zerofuse", "zerofuse_clip",
                                      "zerofuse_flat_grid"])
@pytest.mark.parametrize("size", list(SIZES))
def bench_adamw_step(measure, device, smoke, size, provider, monkeypatch):
    """zerofuse: the shipped launch (the persistent grid, [Note: persistent grid] in
    kernels/multi_tensor.py); zerofuse_flat_grid: one program per block (ZEROFUSE_OPTIM_GRID=flat),
    the form measured on the H100/H200 before; on CPU both are the C++ kernel."""
    if provider == "deepspeed_cpu_adam" and device.type != "cpu":
        pytest.skip("DeepSpeedCPUAdam is a CPU optimizer")
    from zerofuse.kernels import multi_tensor
    if provider == "zerofuse_flat_grid":
        if device.type == "cpu":
            pytest.skip("the C++ CPU kernel has no grid")
        monkeypatch.setattr(multi_tensor, "GRID", "flat")
    if size == "100M" and device.type == "cpu" and provider == "torch_foreach" and not smoke:
        pytest.skip("torch's foreach AdamW at 100M parameters: seconds per step on a 2-core CPU")
    total = 20_000 if smoke else SIZES[size]
    params = _params(device, total)
    opt = _optimizer(provider, params)
    opt.step()  # states allocated outside the timing
    got = _snapshot(params)
    n = sum(p.numel() for p in params)
    measure(opt.step, case=f"adamw/{size}", provider=provider, bytes_moved=(32 if provider == "zerofuse_clip" else 28) * n)
    _check_step(got, device, total, "adamw", provider, clip=provider == "zerofuse_clip")


@pytest.mark.parametrize("grid", ["persistent", "flat"])
@pytest.mark.parametrize("warps", [4, 8, 16])
@pytest.mark.parametrize("block", [1024, 2048, 4096])
@pytest.mark.parametrize("size", ["10M", "100M"])
def bench_adamw_block_sweep(measure, device, smoke, size, block, warps, grid, monkeypatch):
    """The Triton AdamW step (bf16 params with fp32 masters, as zerofuse.zero trains) at each
    BLOCK x num_warps x grid, to choose multi_tensor.BLOCK, _NUM_WARPS and GRID on a GPU
    (roofline_ratio at 28 bytes per param: read the bf16 grad and fp32 master, m, v; write those three
    and the bf16 param). GPU only."""
    if device.type != "cuda":
        pytest.skip("a sweep of the Triton kernels' launch configuration: GPU only")
    from zerofuse.kernels import multi_tensor
    monkeypatch.setattr(multi_tensor, "BLOCK", block)
    monkeypatch.setattr(multi_tensor, "_NUM_WARPS", warps)
    monkeypatch.setattr(multi_tensor, "GRID", grid)
    total = 20_000 if smoke else SIZES[size]
    params = []
    for p in _params(device, total):
        params.append(torch.nn.Parameter(p.detach().to(torch.bfloat16)))
        params[-1].grad = p.grad.to(torch.bfloat16)
    opt = FusedAdamW(params, lr=1e-3, weight_decay=0.01, master_weights=True)
    opt.step()
    got = _snapshot(opt.state[p]["master"] for p in params)  # (the fp32 masters: what the step computes)
    n = sum(p.numel() for p in params)
    measure(opt.step, case=f"adamw_bf16_masters/{size}", provider=f"block{block}_warps{warps}_{grid}", bytes_moved=28 * n)
    _check_step(got, device, total, "adamw", f"block{block}_warps{warps}_{grid}", dtype=torch.bfloat16)


@pytest.mark.parametrize("peer", ["torch_fused", "deepspeed_cpu_adam"])
@pytest.mark.parametrize("size", list(SIZES))
def bench_adamw_interleaved(benchmark, device, smoke, size, peer):
    """zerofuse and one peer stepped alternately, each on its own copy of the params, so that the
    slow and fast phases of a noisy machine hit both alike (back-to-back runs of bench_adamw_step
    on the 2-core VM moved single ratios by +-20%). The timed unit is the pair of steps;
    extra_info speedup_vs_<peer> is the median over rounds of (peer step time / zerofuse step time)."""
    if peer == "deepspeed_cpu_adam" and device.type != "cpu":
        pytest.skip("DeepSpeedCPUAdam is a CPU optimizer")
    n = 20_000 if smoke else SIZES[size]
    params = {"zerofuse": _params(device, n), peer: _params(device, n)}
    opts = {name: _optimizer(name, ps) for name, ps in params.items()}
    for name, opt in opts.items():  # a first step each, untimed (states allocated), checked
        opt.step()
        _check_step(_snapshot(params[name]), device, n, "adamw", name)
    # the stream held while the host queues a step (device_ms): twice its host time, at most 50 ms (a
    # 1M-param FusedAdamW step queues for ~1.2 ms on an H100, past timed()'s default hold of 1 ms)
    hold = {name: min(50.0, max(1.0, 2 * host_ms(opt.step, device))) for name, opt in opts.items()}
    times = {name: [] for name in opts}

    order = list(opts)

    def pair():  # each round in the other order, so neither runs first (after the other's writes) always
        order.reverse()
        for name in order:  # (as bench_adamw_step's: L2 flushed)
            times[name].append(timed(opts[name].step, device, cold=True, hold_ms=hold[name]))

    rounds = 1 if smoke else (10 if size == "100M" else 30)
    benchmark.pedantic(pair, rounds=rounds, warmup_rounds=0 if smoke else 2)
    warm = 0 if smoke else 2
    ratios = [p / z for p, z in zip(times[peer][warm:], times["zerofuse"][warm:])]
    benchmark.extra_info.update(case=f"adamw_interleaved/{size}", provider=f"zerofuse+{peer}", device=str(device),
                                timing="rounds")
    if benchmark.stats is not None:
        benchmark.extra_info[f"speedup_vs_{peer}"] = round(statistics.median(ratios), 3)
        benchmark.extra_info["zerofuse_median_ms"] = round(statistics.median(times["zerofuse"][warm:]) * 1e3, 3)
        benchmark.extra_info[f"{peer}_median_ms"] = round(statistics.median(times[peer][warm:]) * 1e3, 3)


class _EagerLAMB:
    """LAMB as plain PyTorch ops (zerofuse.reference.lamb_step), the unfused baseline."""

    def __init__(self, params):
        self.params = params
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.t = 0

    @torch.no_grad()
    def step(self):
        self.t += 1
        reference.lamb_step([p.data for p in self.params], [p.grad for p in self.params], self.m, self.v,
                            step=self.t, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01,
                            max_grad_norm=1.0)


@pytest.mark.parametrize("provider", ["torch_eager", "zerofuse_one_launch", "zerofuse"])
@pytest.mark.parametrize("size", list(SIZES))
def bench_lamb_step(measure, registry, device, smoke, size, provider, benchmark, monkeypatch):
    """zerofuse: stage 1 over every tensor, then stage 2 (two launches per dtype group, the default;
    what ZeRO runs, with an all-reduce between); zerofuse_one_launch: ZEROFUSE_LAMB_ONE_LAUNCH's form
    ([Note: one-launch LAMB] in kernels/lamb.py: stage 2 of a tensor right after its stage 1,
    reading from L2). On CPU both are the C++ kernel."""
    if size == "100M" and device.type == "cpu" and provider == "torch_eager" and not smoke:
        pytest.skip("eager LAMB at 100M parameters: seconds per step on a 2-core CPU")
    from zerofuse.kernels import optim as K
    if provider == "zerofuse_one_launch":
        if device.type == "cpu":
            pytest.skip("the C++ CPU kernel has one form")
        monkeypatch.setattr(K, "LAMB_ONE_LAUNCH", True)
    else:
        monkeypatch.setattr(K, "LAMB_ONE_LAUNCH", False)
    total = 20_000 if smoke else SIZES[size]
    params = _params(device, total)
    opt = (_EagerLAMB(params) if provider == "torch_eager"
           else FusedLAMB(params, lr=1e-3, weight_decay=0.01, max_grad_norm=1.0))
    opt.step()
    got = _snapshot(params)
    n = sum(p.numel() for p in params)
    seconds = measure(opt.step, case=f"lamb/{size}", provider=provider, bytes_moved=44 * n)
    _check_step(got, device, total, "lamb", provider)
    if not provider.startswith("zerofuse") or seconds is None:
        return
    for peer, key in (("zerofuse", "time_vs_zerofuse_adamw"), ("zerofuse_clip", "time_vs_zerofuse_adamw_clipped")):
        adamw = registry.medians.get((f"adamw/{size}", peer))
        if adamw:
            benchmark.extra_info[key] = round(seconds / adamw, 3)
