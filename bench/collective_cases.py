"""bench_collectives' workloads' inputs and the check of their results (a module of its own, which
the suite and its ranks import by name): the sizes of the cases, integer-valued inputs made from
each rank's seed, ZeRO-2's bucketing, the MLP of the overlap cases, and _check, rank 0's comparison
of a workload's result with torch's computation on every rank's inputs ([Note: checked results]
in bench/conftest.py)."""
from __future__ import annotations

import math

import torch


def _sizes(case: str, smoke: bool) -> list[int]:
    """fp32 element counts: 256 tensors of 4 KB ("small") or log-uniform 4 KB - 4 MB ("mixed")."""
    n = 16 if smoke else 256
    if case == "small":
        return [1024] * n
    g = torch.Generator().manual_seed(0)
    lo, hi = math.log(1024), math.log((1 << 12) if smoke else (1 << 20))
    return [int(math.exp(lo + (hi - lo) * torch.rand((), generator=g).item())) for _ in range(n)]


def _pad(n: int, ws: int) -> int:
    return -(-n // ws) * ws


def _ints(n: int, g: torch.Generator) -> torch.Tensor:
    """Integer-valued fp32 in [-8, 8]: sums over the ranks are exact in any order (check_equal)."""
    return torch.randint(-8, 9, (n,), generator=g).float()


def _coalesced_inputs(case: str, rank: int, smoke: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [_ints(n, g) for n in _sizes(case, smoke)]


def _bucket_grads(rank: int, smoke: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [_ints(n, g) for n in _model_sizes(smoke)]


def _bucketed(grads: list, mb: float) -> list[list]:
    """ZeRO-2's buckets: grads in reverse order, about mb MiB each."""
    buckets, cur = [], []
    for t in reversed(grads):
        cur.append(t)
        if 4 * sum(x.numel() for x in cur) >= mb * (1 << 20):
            buckets.append(cur)
            cur = []
    return buckets + ([cur] if cur else [])


def _bucket_mb(provider: str, smoke: bool) -> float:
    return float(provider.removeprefix("bucket_").removesuffix("MB")) / (64 if smoke else 1)


def _mlp(rank: int, smoke: bool):
    """bench_backward_overlap's model (the same on every rank) and this rank's batch."""
    torch.manual_seed(0)
    width = 64 if smoke else 1024
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(12)])
    x = torch.randn(32 if smoke else 256, width, generator=torch.Generator().manual_seed(rank))
    return model, x


def _shard0(tensors: list, ws: int) -> torch.Tensor:
    """Rank 0's shard of a reduce-scatter of the concatenation of tensors (padded to ws shards)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return flat[: _pad(flat.numel(), ws) // ws]


def _check(spec: tuple, got: list, ws: int, smoke: bool) -> None:
    """Rank 0's result of one workload (_Workload.first) against torch's computation on every
    rank's inputs: sums of integer-valued floats exactly, the ZeRO-2 backward's grads by the rule."""
    from conftest import check_equal, check_result

    suite, case, provider = spec[:3]
    what = f"{provider} {suite}/{case} ws{ws}"
    if suite == "overlap":
        ranks = [0] if provider == "no_comm" else range(ws)  # (ZeRO-2 averages the ranks' grads)
        means = []
        for dtype in (torch.float64, torch.float32):
            total = None
            for r in ranks:
                model, x = _mlp(r, smoke)
                model.to(dtype)(x.to(dtype)).square().mean().backward()
                grads = [p.grad for p in model.parameters()]
                total = grads if total is None else [a + b for a, b in zip(total, grads)]
            means.append([t / len(ranks) for t in total])
        check_result(got, *means, what=f"{what}: grads")
        return
    inputs = _coalesced_inputs if suite != "buckets" else (lambda case, r, smoke: _bucket_grads(r, smoke))
    sums = [sum(ts) for ts in zip(*[inputs(case, r, smoke) for r in range(ws)])]
    if suite == "all_reduce":
        want = sums
    elif suite == "reduce_scatter":
        want = [_shard0([t], ws) for t in sums] if provider in ("per_tensor", "torch_coalescing_manager") \
            else [_shard0(sums, ws)]
    elif provider == "single":
        want = [_shard0(sums[::-1], ws)]
    else:
        want = [_shard0(b, ws) for b in _bucketed(sums, _bucket_mb(provider, smoke))]
    check_equal(got, want, what=f"{what}: reduced tensors")


def _model_sizes(smoke: bool) -> list[int]:
    """~300 MB of fp32 grads (75.6 M) shaped like 6 transformer blocks (d = 1024) (smoke: ~1.2 MB)."""
    d = 64 if smoke else 1024
    sizes = []
    for _ in range(6):
        sizes += [3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d, d, d]
    return sizes
