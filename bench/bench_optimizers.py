"""Optimizer step time: zerofuse FusedAdamW vs torch.optim.AdamW (foreach, fused=True) and
DeepSpeedCPUAdam (CPU, when installed).

Parameters are split like a transformer's (a few large matrices, many vectors). GB/s counts 28
bytes per fp32 parameter for AdamW (read param, grad, exp_avg, exp_avg_sq; write param,
exp_avg, exp_avg_sq), against the device's measured copy bandwidth (roofline_ratio).
"""
import pytest
import torch

from zerofuse.optim import FusedAdamW

SIZES = {"1M": 1_000_000, "10M": 10_000_000, "100M": 100_000_000}


def _split(total: int) -> list[int]:
    """Blocks of 12 d^2 (4 attention + 8 MLP) + 9 d vectors, d chosen so ~8 blocks fill total."""
    d = max(8, int((total / 8 / 12) ** 0.5))
    sizes = []
    while sum(sizes) + 12 * d * d <= total:
        sizes += [3 * d * d, d * d, 4 * d * d, 4 * d * d] + [d] * 9
    return sizes or [total]


def _optimizer(provider, params):
    if provider == "zerofuse":
        return FusedAdamW(params, lr=1e-3, weight_decay=0.01)
    if provider == "torch_foreach":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)
    if provider == "torch_fused":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    if provider == "deepspeed_cpu_adam":
        ds = pytest.importorskip("deepspeed.ops.adam")
        return ds.DeepSpeedCPUAdam(params, lr=1e-3, weight_decay=0.01, adamw_mode=True)
    raise ValueError(provider)


@pytest.mark.parametrize("provider", ["torch_foreach", "torch_fused", "deepspeed_cpu_adam", "zerofuse"])
@pytest.mark.parametrize("size", list(SIZES))
def bench_adamw_step(measure, device, smoke, size, provider):
    if provider == "deepspeed_cpu_adam" and device.type != "cpu":
        pytest.skip("DeepSpeedCPUAdam is a CPU optimizer")
    if size == "100M" and device.type == "cpu" and not smoke:
        pytest.skip("100M parameters: ~2 GB of state and minutes of rounds on a 2-core CPU")
    total = 20_000 if smoke else SIZES[size]
    params = [torch.nn.Parameter(torch.randn(n, device=device) * 0.02) for n in _split(total)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = _optimizer(provider, params)
    opt.step()  # states allocated outside the timing
    n = sum(p.numel() for p in params)
    measure(opt.step, case=f"adamw/{size}", provider=provider, bytes_moved=28 * n)
