"""Mixture of Experts: the MoE layer (zerofuse.moe.MoE: moe_permute, grouped expert GEMMs,
moe_unpermute) against the per-expert loop most MoE code starts from (for each expert: the tokens
routed to it by a mask, its MLP, index_add of the weighted output) and DeepSpeed-MoE
(deepspeed.moe.layer.MoE), the same router weights, expert weights and tokens; the layer with its
experts split over ep gloo ranks (expert parallelism, all-to-all); and the permute + unpermute ops
alone against torch's index ops (GB/s against the copy roofline: each moved row read and written
once). Times forward + backward (grads of x and every parameter of sum(y^2)).

DeepSpeed (optional; skipped with the import error when it does not import; on CPU installed with
DS_BUILD_OPS=0, no compiled ops): its MoE with one SwiGLU expert module per local expert holding
zerofuse's w1[e] / w2[e] (the loop's ops: x @ w1, silu(gate) * up, @ w2, weights cast to the input
dtype) and its gate's wg = zerofuse's router weight. k=2, drop_tokens=False, use_rts=False,
top2_2nd_expert_sampling=False: the same softmax top-2 choice normalised over the two, no token
dropped (checked: its output equals zerofuse's). What differs: its gate always computes its GShard
aux loss (zerofuse's aux / z losses are off, coef 0) and the expert counts; dropless is done by
capacity = the largest expert's count (one host sync), every expert's rows are padded to it in an
[E, C, dim] buffer (extra_info padded_rows: E C / (T k)) and the experts run one by one on their C
rows (no grouped GEMM); with ep > 1 that capacity is an all-reduce(MAX) over the ep group and the
dispatch an all-to-all of the equal-size padded buffers, where zerofuse sends the counts
(all-to-all) then only the routed rows (all-to-all with per-rank splits). Its gate scores in fp32
like zerofuse's router; the experts run in the input dtype (fp32 on CPU, bf16 on a GPU) on all.
Its CPU comm backend JIT-compiles a shared-memory all-reduce op at init (used only for inference
all-reduces); the ranks skip that build.

Expert parallelism (bench_moe_layer_ep, a CPU suite, ep 2 and 4): ep real processes on gloo
(tests/dist_utils.run_distributed, file:// store, cores / ep intra-op threads per rank: 1 here), each holding
E/ep experts (zerofuse: ep_group=WORLD; DeepSpeed: ep_size=ep) and T/ep of the single-process
case's tokens (the global batch, weights and router are those of bench_moe_layer; checked: the
summed loss equals the single-process one). As bench_pipeline: the providers share one run and
take turns each round (the first rotating); an iteration is a barrier then forward + backward;
its time is the slowest rank's (extra_info also has rank 0's median); the stats are those times
after WARMUP rounds. The single-process case uses both cores (2 threads); on the 2-core VM ep 2
is one core per rank and ep 4 puts 4 ranks on 2 cores (oversubscribed: its times include waiting
for a core, not only compute and gloo).

Checked results ([Note: checked results] in bench/conftest.py): the loop's and zerofuse's grads (and
DeepSpeed's grad of x) from their warm-up call against the loop's math in float64 on the experts the
router chose (a choice, the same for every provider, not a rounding), the loop in the layer's dtype
the peer; permute + unpermute's output and grads against its math in float64 (out[t] = sum over
the slots of weight * x[t]), the same in the dtype the peer; the expert-parallel losses against
the single-process layer's.
"""
import math
import os
import statistics

import pytest
import torch
import torch.distributed as dist

from timing import timed  # bench/timing.py (the ranks import this suite by name)
from zerofuse.moe import MoE
from zerofuse.moe.router import SUM_EPS
from zerofuse.ops.moe import moe_permute, moe_unpermute

# (tokens, dim, hidden, experts, top_k)
SHAPES = {"cuda": [(16384, 2048, 1408, 64, 6), (8192, 1024, 2816, 8, 2)], "cpu": [(4096, 256, 512, 8, 2)],
          "smoke": [(64, 32, 48, 8, 2)]}
EPS = [2, 4]
EP_PROVIDERS = ["deepspeed", "zerofuse"]  # zerofuse last: its ratio to DeepSpeed
EP_CASES = [(ep, prov) for ep in EPS for prov in EP_PROVIDERS]
WARMUP, STEPS = 3, 30  # expert-parallel rounds


def pytest_generate_tests(metafunc):
    if "moe_shape" in metafunc.fixturenames:
        smoke = metafunc.config.getoption("--smoke") or os.environ.get("ZEROFUSE_BENCH_SMOKE") == "1"
        dev = metafunc.config.getoption("--bench-device") or ("cuda" if torch.cuda.is_available() else "cpu")
        shapes = SHAPES["smoke" if smoke else dev]
        metafunc.parametrize("moe_shape", shapes, ids=["x".join(map(str, s)) for s in shapes])


def _layer(shape, device):
    t, d, h, e, k = shape
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    m = MoE(d, h, e, k, activation="swiglu").to(device)
    with torch.no_grad():  # experts at 1 / sqrt(fan-in), outputs and grads of order 1: at MoE's init (0.02)
        m.w1.normal_(0, d ** -0.5)  # the grads were ~1e-6, under fp32's atol, and no wrong result failed its check
        m.w2.normal_(0, h ** -0.5)
    x = (torch.randn(t, d, device=device) * 0.5).to(dtype).requires_grad_()
    return m, x


def _loop(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """The per-expert loop: a mask per expert, its tokens' MLP, index_add of the weighted output."""
    r = m.router(x)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(m.router.num_experts):
        tok, slot = (r.experts == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        hid = x[tok] @ m.w1[e].to(x.dtype)
        hid = torch.nn.functional.silu(hid[:, :m.hidden]) * hid[:, m.hidden:]
        y = hid @ m.w2[e].to(x.dtype)
        out.index_add_(0, tok, y.float() * r.weights[tok, slot].unsqueeze(1))
    return out.to(x.dtype)


def _reference(m: MoE, x: torch.Tensor):
    """(float64 reference, the loop's in x's dtype) of the grads of sum(y^2) with respect to x, w1, w2
    and the router's weight: the loop's math in float64, on the experts the router chooses for x."""
    from conftest import float64

    with torch.no_grad():
        experts = m.router(x.detach()).experts
    x64, w1, w2, wr = float64(x, m.w1, m.w2, m.router.weight, grad=True)
    weights = torch.softmax(x64 @ wr.T, -1).gather(1, experts)
    weights = weights / (weights.sum(-1, keepdim=True) + SUM_EPS)
    out = torch.zeros_like(x64)
    for e in range(m.router.num_experts):
        tok, slot = (experts == e).nonzero(as_tuple=True)
        hid = x64[tok] @ w1[e]
        hid = torch.nn.functional.silu(hid[:, :m.hidden]) * hid[:, m.hidden:]
        out = out.index_add(0, tok, (hid @ w2[e]) * weights[tok, slot].unsqueeze(1))
    want = torch.autograd.grad(out.pow(2).sum(), [x64, w1, w2, wr])
    xp = x.detach().requires_grad_()
    return want, torch.autograd.grad(_loop(m, xp).float().pow(2).sum(), [xp, m.w1, m.w2, m.router.weight])


def _deepspeed_error() -> str | None:
    """Why DeepSpeed-MoE cannot run here (its import error), or None."""
    import importlib

    try:
        importlib.import_module("deepspeed.moe.layer")
    except Exception as exc:  # ImportError, or its accelerator set-up failing at import
        return f"deepspeed not importable: {type(exc).__name__}: {exc}"
    return None


class _SwiGLUExpert(torch.nn.Module):
    """One expert as DeepSpeed's MoE takes it (a module it deep-copies per local expert): the
    loop's MLP, w1 [dim, 2 hidden] (gate then up), w2 [hidden, dim], cast to the input dtype."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        self.w1, self.w2 = torch.nn.Parameter(w1.detach().clone()), torch.nn.Parameter(w2.detach().clone())

    def forward(self, x):
        h, n = x @ self.w1.to(x.dtype), self.w2.shape[0]
        return (torch.nn.functional.silu(h[..., :n]) * h[..., n:]) @ self.w2.to(x.dtype)


def _ds_layer(m: MoE, ep: int = 1):
    """DeepSpeed's MoE holding m's router and (local) expert weights, dropless (module docstring)."""
    from deepspeed.moe.layer import MoE as DSMoE

    ds = DSMoE(m.w1.shape[1], _SwiGLUExpert(m.w1[0], m.w2[0]), num_experts=m.router.num_experts, ep_size=ep,
               k=m.router.top_k, min_capacity=0, drop_tokens=False, use_rts=False,
               top2_2nd_expert_sampling=False).to(m.w1.device)
    with torch.no_grad():
        ds.deepspeed_moe.gate.wg.weight.copy_(m.router.weight)
        for i, ex in enumerate(ds.deepspeed_moe.experts.deepspeed_experts):
            ex.w1.copy_(m.w1[i])
            ex.w2.copy_(m.w2[i])
    return ds


@pytest.mark.parametrize("provider", ["loop", "deepspeed", "zerofuse"])  # zerofuse last: its ratios to the peers
def bench_moe_layer(measure, benchmark, device, provider, moe_shape):
    m, x = _layer(moe_shape, device)
    t, d, h, e, k = moe_shape
    if provider == "deepspeed":
        if (why := _deepspeed_error()) is not None:
            pytest.skip(why)
        ds = _ds_layer(m)
        fn, params = (lambda inp: ds(inp)[0]), [x, *ds.parameters()]
        with torch.no_grad():
            y, ref = fn(x).float(), m(x).float()
        if x.dtype == torch.float32:  # same routing, nothing dropped
            torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-6)
        counts = ds.deepspeed_moe.exp_counts
        benchmark.extra_info.update(max_abs_diff_vs_zerofuse=float((y - ref).abs().max()),
                                    padded_rows=round(e * int(counts.max()) / (t * k), 4))
    else:
        fn = m if provider == "zerofuse" else (lambda inp: _loop(m, inp))
        params = [x, m.w1, m.w2, m.router.weight]

    def run():
        return torch.autograd.grad(fn(x).float().pow(2).sum(), params)

    got = run()  # its result checked below
    flops = 3 * 2 * t * k * (d * 2 * h + h * d)  # forward + backward of the experts' GEMMs
    measure(run, case=f"moe_layer/fwd+bwd/{x.dtype}/{t}x{d}x{h}/E{e}k{k}", provider=provider, flops=flops)
    from conftest import cached_reference, check_result

    want, peer = cached_reference(("moe_layer", moe_shape, device), lambda: _reference(m, x))
    if provider == "deepspeed":  # (its own parameters: the grad of x only)
        got, want, peer = got[:1], want[:1], peer[:1]
    check_result(got, want, peer, what=f"{provider} MoE grads of x, w1, w2, router weight")


def _ep_rank(rank: int, ws: int, shape: tuple, providers: list[str], rounds: int) -> dict:
    """Per provider, per round: (wall seconds, this rank's loss). Every round runs one forward +
    backward of each provider, the first one rotating."""
    from zerofuse import kernels

    assert not kernels.TRITON_ON_CPU, "the ranks must run the C++ CPU kernels"
    full, x_all = _layer(shape, torch.device("cpu"))  # the single-process case's weights and tokens
    t, d, h, e, k = shape
    lo, hi = rank * e // ws, (rank + 1) * e // ws
    m = MoE(d, h, e, k, activation="swiglu", ep_group=dist.group.WORLD)
    with torch.no_grad():
        m.router.weight.copy_(full.router.weight)
        m.w1.copy_(full.w1[lo:hi])
        m.w2.copy_(full.w2[lo:hi])
    x = x_all.detach().chunk(ws)[rank].clone().requires_grad_()
    fns = {"zerofuse": (m, [x, *m.parameters()])}
    if "deepspeed" in providers:
        import importlib

        import deepspeed.comm

        # its JIT-compiled shm all-reduce (inference only); deepspeed.comm.torch names torch there
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        deepspeed.comm.init_distributed(dist_backend="gloo", verbose=False)  # on torch's group
        ds = _ds_layer(m, ws)
        ds.set_deepspeed_parallelism()  # its ep group: all ws ranks
        fns["deepspeed"] = ((lambda inp: ds(inp)[0]), [x, *ds.parameters()])
    out = {prov: [] for prov in providers}
    for i in range(rounds):
        for j in range(len(providers)):
            prov = providers[(i + j) % len(providers)]
            fn, params = fns[prov]
            dist.barrier()
            losses = []
            seconds = timed(lambda: losses.append(_forward_backward(fn, x, params)), x.device)
            out[prov].append((seconds, losses[0].item()))
    return out


def _forward_backward(fn, x, params) -> torch.Tensor:
    """The timed unit of an iteration: forward, a scalar of it, the grads of the inputs and params."""
    loss = fn(x).float().pow(2).sum()
    torch.autograd.grad(loss, params)
    return loss


def _report_times(benchmark, times: list[float]) -> None:
    """pytest-benchmark's stats for times measured in the ranks: a pedantic run of a no-op makes
    the stats object, whose samples then become the ranks' times (as bench_pipeline)."""
    benchmark.pedantic(lambda: None, rounds=1)
    if benchmark.stats is not None:
        benchmark.stats.stats.data[:] = list(times)


_RUNS: dict[tuple, dict] = {}


def _run_ep(ep: int, shape: tuple, providers: list[str], rounds: int) -> dict:
    """Per provider: per-round times (slowest rank's, rank 0's) and the summed first loss (one
    distributed run for all of a case's providers, made by its first test)."""
    key = (ep, shape, tuple(providers), rounds)
    if key not in _RUNS:
        from dist_utils import run_distributed

        out = run_distributed(_ep_rank, ep, shape, providers, rounds, timeout=600)
        _RUNS[key] = {prov: dict(times=[max(r[prov][i][0] for r in out) for i in range(rounds)],
                                 rank0=[t for t, _ in out[0][prov]], loss=sum(r[prov][0][1] for r in out))
                      for prov in providers}
    return _RUNS[key]


@pytest.mark.parametrize("ep,provider", EP_CASES, ids=[f"ep{a}-{b}" for a, b in EP_CASES])
def bench_moe_layer_ep(benchmark, registry, device, smoke, ep, provider, moe_shape, monkeypatch):
    if device.type != "cpu":
        pytest.skip("a CPU (gloo) suite")
    ds_error = _deepspeed_error()
    if provider == "deepspeed" and ds_error is not None:
        pytest.skip(ds_error)
    monkeypatch.setenv("ZEROFUSE_TRITON_ON_CPU", "0")  # the ranks take this environment
    monkeypatch.delenv("ZEROFUSE_CHECK_COLLECTIVES", raising=False)
    t, d, h, e, k = moe_shape
    warm, steps = (1, 1) if smoke or benchmark.disabled else (WARMUP, STEPS)
    providers = EP_PROVIDERS if ds_error is None else ["zerofuse"]
    res = _run_ep(ep, moe_shape, providers, warm + steps)
    mine = res[provider]
    timed = mine["times"][warm:]
    _report_times(benchmark, timed)
    full, x_all = _layer(moe_shape, torch.device("cpu"))
    with torch.no_grad():
        ref_loss = full(x_all).float().pow(2).sum().item()
    assert math.isclose(mine["loss"], ref_loss, rel_tol=1e-4), (provider, mine["loss"], ref_loss)
    case1 = f"moe_layer/fwd+bwd/{x_all.dtype}/{t}x{d}x{h}/E{e}k{k}"
    from dist_utils import ranks_threads

    info = benchmark.extra_info
    info.update(case=f"moe_layer_ep/fwd+bwd/{x_all.dtype}/{t}x{d}x{h}/E{e}k{k}/ep{ep}", provider=provider, ep=ep,
                tokens_per_rank=t // ep, threads_per_rank=ranks_threads(ep), device="cpu (gloo)",
                torch=torch.__version__,
                iter_ms_median=round(statistics.median(timed) * 1e3, 3),
                rank0_ms_median=round(statistics.median(mine["rank0"][warm:]) * 1e3, 3), first_loss=mine["loss"])
    if (case1, provider) in registry.medians:  # the single-process run of this session (2 threads)
        info["ep1_ms_median"] = round(registry.medians[(case1, provider)] * 1e3, 3)
    if provider != "zerofuse" or len(providers) == 1 or benchmark.stats is None:
        return
    peer_timed = res["deepspeed"]["times"][warm:]
    info["speedup_vs_deepspeed"] = round(statistics.median(peer_timed) / statistics.median(timed), 3)
    info["paired_speedup_vs_deepspeed"] = round(statistics.median(a / b for a, b in zip(peer_timed, timed)), 3)


@pytest.mark.parametrize("provider", ["torch", "zerofuse"])
def bench_moe_permute_unpermute(measure, device, smoke, provider, moe_shape, monkeypatch):
    """permute + unpermute forward and backward; provider torch: the op's torch index path."""
    from zerofuse import kernels

    if provider == "torch":
        from zerofuse.ops import moe as ops_moe

        monkeypatch.setattr(ops_moe, "_use_triton", lambda *_: False)
    elif device.type != "cuda" and not (smoke and kernels.interpreted()):
        pytest.skip("the Triton kernels run on a GPU (or the interpreter at the smoke size: correctness, not speed)")
    t, d, _, e, k = moe_shape
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(t, d, generator=g).to(device, dtype).requires_grad_()
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)
    w = torch.rand(t, k, generator=g).to(device).requires_grad_()

    def run():
        rows, pos, src, _ = moe_permute(x, experts, e)
        z = moe_unpermute(rows, pos, src, w)
        return z, *torch.autograd.grad(z.sum(), (x, w))

    got = run()  # its result checked below
    row = d * x.element_size()
    # the rows each op must move at least: permute reads and writes t*k; unpermute reads t*k, writes t;
    # their backwards: the rows' grad (dz gathered, t*k read and written) and dw (the t*k rows read),
    # then dx (t*k read, t written): 7 t k + 2 t rows (4 t k before: not what the ops move)
    moved = (7 * t * k + 2 * t) * row
    measure(run, case=f"moe_permute_unpermute/fwd+bwd/{dtype}/{t}x{d}/E{e}k{k}", provider=provider,
            bytes_moved=moved)
    from conftest import cached_reference, check_result, float64

    def combined(x, w):  # what permute then unpermute compute: out[t] = sum over slots s of w[t, s] * x[t]
        z = (w.unsqueeze(-1) * x.unsqueeze(1)).sum(1)
        return z.detach(), *torch.autograd.grad(z.sum(), (x, w))

    want, peer = cached_reference(("moe_permute", moe_shape, device),
                                  lambda: (combined(*float64(x, w, grad=True)),
                                           combined(x.detach().requires_grad_(), w.detach().requires_grad_())))
    check_result(got, want, peer, what=f"{provider} permute + unpermute out, grads of x, weights")
