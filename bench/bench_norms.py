"""LayerNorm / RMSNorm forward, backward and forward+backward: zerofuse vs torch eager,
torch.compile and Liger-Kernel (when installed).

GB/s counts the minimum bytes: each input read once, each output written once (forward: x, weight,
bias in; y, mean/rstd out; backward: x, dy, weight, mean/rstd in; dx, dweight, dbias out), against
the device's measured bandwidth (roofline_ratio, bench/conftest.py). The zerofuse provider runs last so its
extra_info holds its speedup over each peer measured in the same run. Every provider's result (y, or
the grads of x, weight, bias) from its warm-up call is checked against zerofuse.reference in float64
by the reference rule, torch eager's in the same dtype the peer ([Note: checked results] in
bench/conftest.py). Liger's modules get the same weight, bias and eps (LigerLayerNorm's defaults:
eps 1e-6, no bias).
"""
import os

import pytest
import torch

import zerofuse.nn.functional as ZF
from conftest import cached_reference, check_result, float64, import_peer  # bench/conftest.py
from zerofuse import reference as R

GPU_SHAPES = [(4096, 1024), (4096, 4096), (16384, 4096), (4096, 8192), (16384, 8192), (4096, 16384)]
# CPU: outputs of at most 16 MB. Larger ones (32-64 MB) are mmapped fresh by glibc on each call and
# their page faults, which vary 4x with the run order, swamp the kernels' differences (measured).
CPU_SHAPES = [(4096, 1024), (1024, 4096)]
SMOKE_SHAPES = [(64, 256)]


def _liger(norm, w, b):
    """Liger's module with the same weight, bias and eps as the other providers."""
    mod = import_peer("liger_kernel.transformers")
    n = w.shape[0]
    m = mod.LigerLayerNorm(n, eps=1e-5, bias=True) if norm == "layer" else mod.LigerRMSNorm(n, eps=1e-6)
    m = m.to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        for mine, theirs in zip(m.parameters(), [t for t in (w, b) if t is not None]):
            mine.copy_(theirs)
    return m


def _inputs(norm, m, n, dtype, device):
    """x (requiring grad), dy, weight, bias (None for rms): the same for every provider."""
    g = torch.Generator(device=device).manual_seed(0)  # (drawn on the device: on the host, 31e9 numbers over
    # the GPU shapes took ~6 minutes of a lease's call; a review, 2026-12-07)
    x, dy = (torch.randn(m, n, generator=g, device=device).to(dtype) for _ in range(2))
    w, b = (torch.nn.Parameter(torch.randn(n, generator=g, device=device).to(dtype)) for _ in range(2))
    return x.requires_grad_(), dy, w, (b if norm == "layer" else None)


def _reference(norm, grads, x, dy, w, b):
    """(float64 reference, torch eager in x's dtype) of y (grads=False) or of the grads of x, w, b."""
    params = [t for t in (w, b) if t is not None]
    ref = (lambda x, w, b: R.layer_norm(x, (x.shape[-1],), w, b)[0]) if norm == "layer" else \
        (lambda x, w: R.rms_norm(x, (x.shape[-1],), w, 1e-6)[0])
    peer, _ = _forward_fn(norm, "torch", w, b)
    if not grads:
        with torch.no_grad():
            return ref(*float64(x, *params)), peer(x)
    ours, xp = float64(x, *params, grad=True), x.detach().requires_grad_()
    return torch.autograd.grad(ref(*ours), ours, dy.double()), torch.autograd.grad(peer(xp), [xp, *params], dy)


def _forward_fn(norm, provider, w, b):
    n = w.shape[0]
    if provider == "liger":
        m = _liger(norm, w, b)
        return m, list(m.parameters())
    if provider == "zerofuse":
        fn = (lambda x: ZF.layer_norm(x, (n,), w, b)) if norm == "layer" else (lambda x: ZF.rms_norm(x, (n,), w, 1e-6))
    else:
        F = torch.nn.functional
        fn = (lambda x: F.layer_norm(x, (n,), w, b)) if norm == "layer" else (lambda x: F.rms_norm(x, (n,), w, 1e-6))
        if provider == "torch_compile":
            fn = torch.compile(fn, dynamic=False)  # (automatic dynamic, shared by every test's lambda, made
            # each shape after the first a symbolic-shape kernel: not what a user compiling one model gets)
    return fn, [p for p in (w, b) if p is not None]


def _bytes(norm, mode, m, n, dtype):
    e = torch.empty((), dtype=dtype).element_size()
    params = 2 if norm == "layer" else 1
    stats = 2 if norm == "layer" else 1
    fwd = 2 * m * n * e + params * n * e + stats * m * 4
    bwd = 3 * m * n * e + n * e + stats * m * 4 + params * n * e
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def _shapes(device, smoke):
    return SMOKE_SHAPES if smoke else (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)


def pytest_generate_tests(metafunc):
    if "shape" in metafunc.fixturenames:
        smoke = metafunc.config.getoption("--smoke") or os.environ.get("ZEROFUSE_BENCH_SMOKE") == "1"
        dev = metafunc.config.getoption("--bench-device") or ("cuda" if torch.cuda.is_available() else "cpu")
        shapes = _shapes(torch.device(dev), smoke)
        metafunc.parametrize("shape", shapes, ids=[f"{m}x{n}" for m, n in shapes])


@pytest.mark.parametrize("provider", ["torch", "torch_compile", "liger", "zerofuse"])
@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def bench_norm(measure, device, smoke, norm, dtype, mode, provider, shape):
    if device.type == "cpu" and provider == "liger":
        pytest.skip("Liger-Kernel's norm kernels need a GPU")
    m, n = shape
    x, dy, w, b = _inputs(norm, m, n, dtype, device)
    fn, params = _forward_fn(norm, provider, w, b)
    leaves = [x, *params]
    setup = None
    if mode == "fwd":
        def run():
            with torch.no_grad():
                return fn(x)
    elif mode == "bwd":
        def graph():  # a fresh graph each round, built outside the timing
            return (fn(x),)

        setup = graph

        def run(y):
            return torch.autograd.grad(y, leaves, dy)
    else:
        def run():
            return torch.autograd.grad(fn(x), leaves, dy)
    got = run(*(setup() if setup else ()))  # compile / autotune outside the timing; its result checked
    measure(run, case=f"{norm}/{mode}/{dtype}/{m}x{n}", provider=provider, bytes_moved=_bytes(norm, mode, m, n, dtype),
            setup=setup)
    grads = mode != "fwd"
    want, peer = cached_reference(("norm", norm, grads, dtype, shape, device),
                                  lambda: _reference(norm, grads, x, dy, w, b))
    check_result(got, want, peer, what=f"{provider} {norm}_norm {mode} {'grads' if grads else 'y'}")


# The backward's weight/bias reduction, at GPT-2 shapes, to set colsum.ONE_LAUNCH_FLOATS from a
# measurement (GPU only: the CPU path has no such choice): "one_launch" (4 programs per SM, every
# partial summed by the launch's last program), "two_launch" (a quarter of the programs, a second
# launch sums), "default" (the shipped threshold: 1 MiB of partials in one launch); torch's
# backward in the same run for scale.
REDUCTION_SHAPES = [(16384, 768), (16384, 1024), (4096, 1600), (8192, 2048)]


@pytest.mark.parametrize("provider", ["torch", "two_launch", "one_launch", "default"])
@pytest.mark.parametrize("rshape", REDUCTION_SHAPES, ids=[f"{m}x{n}" for m, n in REDUCTION_SHAPES])
def bench_norm_bwd_reduction(measure, device, monkeypatch, provider, rshape):
    if device.type != "cuda":
        pytest.skip("the one-launch reduction is a choice of the Triton path: GPU only")
    from zerofuse.kernels import colsum
    m, n = rshape
    if provider == "two_launch":
        monkeypatch.setattr(colsum, "ONE_LAUNCH_FLOATS", 0)
    elif provider == "one_launch":
        monkeypatch.setattr(colsum, "ONE_LAUNCH_FLOATS", 1 << 24)
    x, dy, w, b = _inputs("layer", m, n, torch.bfloat16, device)
    fn, params = _forward_fn("layer", "torch" if provider == "torch" else "zerofuse", w, b)

    def setup():
        return (fn(x),)

    def run(y):
        return torch.autograd.grad(y, [x, *params], dy)

    got = run(*setup())
    measure(run, case=f"layer/bwd/reduction/{m}x{n}", provider=provider,
            bytes_moved=_bytes("layer", "bwd", m, n, torch.bfloat16), setup=setup)
    want, peer = cached_reference(("norm", "layer", True, torch.bfloat16, rshape, device),
                           lambda: _reference("layer", True, x, dy, w, b))
    check_result(got, want, peer, what=f"{provider} layer_norm bwd grads")
