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

bench_swiglu and bench_rotary_embedding time forward + backward of SwiGLU (vs F.silu(gate) * up,
its torch.compile and Liger's LigerSiLUMulFunction on a GPU) and of RoPE on q and k (vs the
reference's torch ops and their torch.compile); bench_bias_gelu GPT-2's bias + GELU after the fc
matmul (vs F.gelu(x + b) and its torch.compile; backward includes the bias gradient's sum). GB/s
counts each input and output once.

Every timed provider's grads from its warm-up call are checked against zerofuse.reference in float64
by the reference rule, torch eager's in the same dtype the peer ([Note: checked results] in
bench/conftest.py); the linear cross-entropy's float64 reference a chunk of tokens at a time, its
grads compared as the sum's (times the tokens: the mean's are far under bf16's atol).
"""
import os

import pytest
import torch
import torch.nn.functional as F

from zerofuse.nn.functional import linear_cross_entropy
from conftest import cached_reference, check_result, float64, import_peer  # bench/conftest.py
from zerofuse import reference as R
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
        return _compiled.setdefault("fn", torch.compile(_unfused, dynamic=False))
    if device.type != "cuda":
        pytest.skip("Liger-Kernel's fused linear cross-entropy launches Triton kernels: GPU only")
    mod = import_peer("liger_kernel.transformers")
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
    for name, table in (("glu_shape", GLU_SHAPES), ("rope_shape", ROPE_SHAPES), ("gelu_shape", GELU_SHAPES),
                        ("bias_grad_shape", BIAS_GRAD_SHAPES)):
        if name in metafunc.fixturenames:
            smoke = metafunc.config.getoption("--smoke") or os.environ.get("ZEROFUSE_BENCH_SMOKE") == "1"
            dev = metafunc.config.getoption("--bench-device") or ("cuda" if torch.cuda.is_available() else "cpu")
            shapes = table["smoke" if smoke else dev]
            metafunc.parametrize(name, shapes, ids=["x".join(map(str, s)) for s in shapes])


def _grads_reference(ref, peer, inputs, dy=None):
    """(float64 reference, peer in the inputs' dtype) of the grads of the inputs (requiring grad) of
    ref(*inputs) and peer(*inputs), with output gradient dy (None: a scalar's)."""
    leaves = [t for t in inputs if t.requires_grad]
    ours = [float64(t, grad=True) if t.requires_grad else t for t in inputs]
    theirs = [t.detach().requires_grad_() if t.requires_grad else t for t in inputs]
    return (torch.autograd.grad(ref(*ours), [t for t in ours if t.requires_grad], None if dy is None else dy.double()),
            torch.autograd.grad(peer(*theirs), [t for t in theirs if t.requires_grad], dy)[:len(leaves)])


def _lce_reference(h, w, target):
    """The grads of h and w: float64 (zerofuse.reference, logits of at most 2^26 elements at a time:
    the sum of the chunks' losses / tokens) and torch eager's in h's dtype."""
    h64, w64 = float64(h, w, grad=True)
    t, chunk = h.shape[0], max(1, (1 << 26) // w.shape[0])
    for a in range(0, t, chunk):
        (R.linear_cross_entropy(h64[a:a + chunk], w64, target[a:a + chunk], reduction="sum") / t).backward()
    hp, wp = h.detach().requires_grad_(), w.detach().requires_grad_()
    return (h64.grad, w64.grad), torch.autograd.grad(_unfused(hp, wp, target), (hp, wp))


@pytest.mark.parametrize("provider", PROVIDERS)
def bench_linear_cross_entropy(measure, device, provider, shape):
    fn = _loss_fn(provider, device)
    h, w, target = _inputs(shape, _dtype(device), device)

    def run():
        return torch.autograd.grad(fn(h, w, target), (h, w))

    got = run()  # compile outside the timing; its result checked below
    t, d, v = shape
    measure(run, case=f"linear_cross_entropy/fwd+bwd/{_dtype(device)}/{t}x{d}x{v}", provider=provider,
            flops=6.0 * t * d * v)
    want, peer = cached_reference(("linear_cross_entropy", shape, device), lambda: _lce_reference(h, w, target))
    check_result(got, want, peer, what=f"{provider} linear_cross_entropy grads of hidden, weight", scale=t)


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
                device=str(device), timing="untimed", peak_MiB=round(peak / 2**20, 1),
                logits_MiB=round(t * v * 4 / 2**20, 1), weight_grad_MiB=round(v * d * w.element_size() / 2**20, 1))
    if provider == "zerofuse" and (shape, "torch") in _peaks:
        info["ratio_vs_torch"] = round(peak / _peaks[(shape, "torch")], 3)
        if not smoke:
            assert peak <= 0.25 * _peaks[(shape, "torch")], info
    benchmark.extra_info.update(info)


# ---------------------------------------------------------------------------- SwiGLU and RoPE

GLU_SHAPES = {"cuda": [(8192, 14336), (16384, 8192)], "cpu": [(2048, 2816)], "smoke": [(64, 96)]}
ROPE_SHAPES = {"cuda": [(4, 32, 8, 4096, 128)], "cpu": [(2, 16, 4, 512, 128)], "smoke": [(1, 4, 2, 16, 32)]}
GELU_SHAPES = {"cuda": [(16384, 3072), (8192, 5120)], "cpu": [(2048, 3072)], "smoke": [(64, 96)]}  # gpt2-124m/774m


def _torch_glu(gate, up):
    return F.silu(gate) * up


@pytest.mark.parametrize("provider", ["torch", "torch_compile", "liger", "zerofuse"])
def bench_swiglu(measure, device, provider, glu_shape):
    from zerofuse.nn.functional import swiglu
    if provider == "liger":
        if device.type != "cuda":
            pytest.skip("Liger-Kernel's SwiGLU launches Triton kernels: GPU only")
        fn = import_peer("liger_kernel.ops.swiglu").LigerSiLUMulFunction.apply
    else:
        fn = {"torch": _torch_glu, "torch_compile": torch.compile(_torch_glu, dynamic=False),
              "zerofuse": swiglu}[provider]
    rows, hidden = glu_shape
    g = torch.Generator().manual_seed(0)
    gate, up, dy = (torch.randn(rows, hidden, generator=g).to(device, _dtype(device)) for _ in range(3))
    gate.requires_grad_(), up.requires_grad_()

    def run():
        return torch.autograd.grad(fn(gate, up), (gate, up), dy)

    got = run()
    # forward reads gate, up and writes y; backward reads dy, gate, up and writes dgate, dup
    measure(run, case=f"swiglu/fwd+bwd/{_dtype(device)}/{rows}x{hidden}", provider=provider,
            bytes_moved=8 * rows * hidden * gate.element_size())
    want, peer = cached_reference(("swiglu", glu_shape, device),
                                  lambda: _grads_reference(R.swiglu, _torch_glu, (gate, up), dy))
    check_result(got, want, peer, what=f"{provider} swiglu grads of gate, up")


def _torch_rope(q, k, cos, sin):
    from zerofuse import reference
    return reference.rotary_embedding(q, cos, sin), reference.rotary_embedding(k, cos, sin)


@pytest.mark.parametrize("provider", ["torch", "torch_compile", "zerofuse"])
def bench_rotary_embedding(measure, device, provider, rope_shape):
    from zerofuse.nn import rope_tables
    from zerofuse.nn.functional import rotary_embedding
    fn = {"torch": _torch_rope, "torch_compile": torch.compile(_torch_rope, dynamic=False),
          "zerofuse": rotary_embedding}[provider]
    b, hq, hkv, n, d = rope_shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, n, hq, d, generator=g).to(device, _dtype(device)).transpose(1, 2).requires_grad_()
    k = torch.randn(b, n, hkv, d, generator=g).to(device, _dtype(device)).transpose(1, 2).requires_grad_()
    cos, sin = rope_tables(n, d, device=device)

    with torch.no_grad():  # the output gradients made once, outside the timing
        douts = tuple(torch.ones_like(o) for o in fn(q, k, cos, sin))

    def run():
        return torch.autograd.grad(fn(q, k, cos, sin), (q, k), douts)

    got = run()
    # forward reads q, k and writes their rotations; backward reads and writes as much
    qk = (q.numel() + k.numel()) * q.element_size()
    measure(run, case=f"rotary/fwd+bwd/{_dtype(device)}/{b}x{hq}x{hkv}x{n}x{d}", provider=provider, bytes_moved=4 * qk)

    def ref(q, k, cos, sin):  # (the sum of both outputs' products with their output gradients)
        outs = _torch_rope(q, k, cos.to(q.dtype), sin.to(q.dtype))
        return sum((o * g.to(o.dtype)).sum() for o, g in zip(outs, douts))

    want, peer = cached_reference(("rotary", rope_shape, device), lambda: _grads_reference(ref, ref, (q, k, cos, sin)))
    check_result(got, want, peer, what=f"{provider} rotary_embedding grads of q, k")


def _torch_bias_gelu(x, b):
    return F.gelu(x + b, approximate="tanh")


@pytest.mark.parametrize("provider", ["torch", "torch_compile", "zerofuse"])
def bench_bias_gelu(measure, device, provider, gelu_shape):
    from zerofuse.nn.functional import bias_gelu
    fn = {"torch": _torch_bias_gelu, "torch_compile": torch.compile(_torch_bias_gelu, dynamic=False),
          "zerofuse": bias_gelu}[provider]
    rows, hidden = gelu_shape
    g = torch.Generator().manual_seed(0)
    x, dy = (torch.randn(rows, hidden, generator=g).to(device, _dtype(device)) for _ in range(2))
    b = torch.randn(hidden, generator=g).to(device, _dtype(device))
    x.requires_grad_(), b.requires_grad_()

    def run():
        return torch.autograd.grad(fn(x, b), (x, b), dy)

    got = run()
    # forward reads x and writes y; backward reads dy and x and writes dx (the bias terms are small)
    measure(run, case=f"bias_gelu/fwd+bwd/{_dtype(device)}/{rows}x{hidden}", provider=provider,
            bytes_moved=5 * rows * hidden * x.element_size())
    want, peer = cached_reference(("bias_gelu", gelu_shape, device),
                           lambda: _grads_reference(R.bias_gelu, _torch_bias_gelu, (x, b), dy))
    check_result(got, want, peer, what=f"{provider} bias_gelu grads of x, bias")


# A linear layer's bias gradient (the column sums of its output gradient): GPT-2 124M's qkv
# (2304 wide) and MLP-out (768) at 16 x 1024 tokens, where torch's reduce_kernel took 1.74 ms of a
# step on the H200 (bench/results/h200-2026-11-26). To choose, on a GPU, whether the bias sums of
# those layers should move to kernels/bias_gelu.py's column_sum (torch's today).
BIAS_GRAD_SHAPES = {"smoke": [(64, 96)], "cpu": [(2048, 768)], "cuda": [(16384, 2304), (16384, 768), (16384, 3072)]}


@pytest.mark.parametrize("provider", ["torch", "zerofuse"])
def bench_bias_grad(measure, device, smoke, provider, bias_grad_shape):
    from zerofuse import kernels
    from zerofuse.kernels.bias_gelu import column_sum

    if device.type != "cuda" and provider == "zerofuse" and not (smoke and kernels.interpreted()):
        pytest.skip("column_sum is a Triton kernel: a GPU (or the interpreter at the smoke size)")
    rows, n = bias_grad_shape
    dy = torch.randn(rows, n, generator=torch.Generator().manual_seed(0)).to(device, _dtype(device))
    fn = (lambda: dy.sum(0)) if provider == "torch" else (lambda: column_sum(dy))
    got = fn()
    measure(fn, case=f"bias_grad/{_dtype(device)}/{rows}x{n}", provider=provider,
            bytes_moved=rows * n * dy.element_size())
    check_result(got, dy.double().sum(0), dy.sum(0), what=f"{provider} column sums")
