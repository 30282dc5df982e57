"""The Llama family's hot spots: the output layer + cross-entropy, fused (zerofuse.nn.functional.
linear_cross_entropy) vs torch eager (head, then F.cross_entropy on fp32 logits), torch.compile of
the same, and Liger-Kernel's LigerFusedLinearCrossEntropyLoss (when installed; its Triton kernels
need a GPU outside the interpreter).

bench_linear_cross_entropy times forward + backward (TFLOP/s counts the model's 3 GEMMs,
6·T·D·V; the fused op recomputes nothing with its gradients made in the forward);
bench_linear_cross_entropy_memory records, untimed, the peak bytes allocated above the start during
forward + backward (zerofuse.zero.peak_memory: an allocator counter on the cpu, max_memory_allocated on a GPU) and, for zerofuse, the
ratio to torch eager's peak measured in the same run. The memory shape is the one of the issue
(4096 tokens, dim 1024, vocab 128256 = Llama-3's) on both devices.
"""
import os

import pytest
import torch
import torch.nn.functional as F

from zerofuse.nn.functional import linear_cross_entropy
from zerofuse.zero import peak_memory

GPU_SHAPES = [(4096, 1024, 128256), (8192, 2048, 128256), (8192, 768, 50304)]  # (tokens, dim, vocab)
CPU_SHAPES = [(1024, 256, 32768)]
SMOKE_SHAPES = [(64, 32, 1000)]
MEMORY_SHAPE = (4096, 1024, 128256)
PROVIDERS = ["torch", "torch_compile", "liger", "zerofuse"]  # zerofuse last: its ratios to the others


def _unfused(h, w, t):
    return F.cross_entropy((h @ w.T).float(), t)


_compiled = {}


def _loss_fn(provider, device):
    if provider == "zerofuse":
        return linear_cross_entropy
    if provider == "torch":
        return _unfused
    if provider == "torch_compile":
        return _compiled.setdefault("fn", torch.compile(_unfused))
    if device.type != "cuda":
        pytest.skip("Liger-Kernel's fused linear cross-entropy launches Triton kernels: GPU only")
    mod = pytest.importorskip("liger_kernel.transformers")
    loss = mod.LigerFusedLinearCrossEntropyLoss()
    return lambda h, w, t: loss(w, h, t)


def _inputs(shape, dtype, device):
    t, d, v = shape
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(t, d, generator=g) * 0.5).to(device, dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g) * d ** -0.5).to(device, dtype).requires_grad_()
    return h, w, torch.randint(0, v, (t,), generator=g).to(device)


def _dtype(device):
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def pytest_generate_tests(metafunc):
    if "shape" in metafunc.fixturenames:
        smoke = metafunc.config.getoption("--smoke") or os.environ.get("ZEROFUSE_BENCH_SMOKE") == "1"
        dev = metafunc.config.getoption("--bench-device") or ("cuda" if torch.cuda.is_available() else "cpu")
        shapes = SMOKE_SHAPES if smoke else (GPU_SHAPES if dev == "cuda" else CPU_SHAPES)
        metafunc.parametrize("shape", shapes, ids=["x".join(map(str, s)) for s in shapes])


@pytest.mark.parametrize("provider", PROVIDERS)
def bench_linear_cross_entropy(measure, device, provider, shape):
    fn = _loss_fn(provider, device)
    h, w, target = _inputs(shape, _dtype(device), device)

    def run():
        return torch.autograd.grad(fn(h, w, target), (h, w))

    run()  # compile outside the timing
    t, d, v = shape
    measure(run, case=f"linear_cross_entropy/fwd+bwd/{_dtype(device)}/{t}x{d}x{v}", provider=provider,
            flops=6.0 * t * d * v)


def peak_bytes(fn, device) -> int:
    """Peak bytes allocated above the level at the start, during fn() (zerofuse.zero.peak_memory:
    CUDA's max_memory_allocated; on the cpu a counting wrapper around torch's allocator)."""
    with peak_memory(device) as mem:
        fn()
    return mem.peak


_peaks: dict = {}


@pytest.mark.parametrize("provider", ["torch", "liger", "zerofuse"])
def bench_linear_cross_entropy_memory(benchmark, device, smoke, provider):
    shape = SMOKE_SHAPES[0] if smoke else MEMORY_SHAPE
    fn = _loss_fn(provider, device)
    h, w, target = _inputs(shape, _dtype(device), device)
    peak = peak_bytes(lambda: torch.autograd.grad(fn(h, w, target), (h, w)), device)
    benchmark.pedantic(lambda: None, rounds=1)  # untimed: the figure is the peak, in extra_info
    _peaks[(shape, provider)] = peak
    t, d, v = shape
    info = dict(case=f"linear_cross_entropy/peak/{_dtype(device)}/{t}x{d}x{v}", provider=provider,
                device=str(device), peak_MiB=round(peak / 2**20, 1),
                logits_MiB=round(t * v * 4 / 2**20, 1), weight_grad_MiB=round(v * d * w.element_size() / 2**20, 1))
    if provider == "zerofuse" and (shape, "torch") in _peaks:
        info["ratio_vs_torch"] = round(peak / _peaks[(shape, "torch")], 3)
        if not smoke:
            assert peak <= 0.25 * _peaks[(shape, "torch")], info
    benchmark.extra_info.update(info)
