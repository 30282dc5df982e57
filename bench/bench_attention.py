"""Attention forward, backward and forward+backward: zerofuse vs torch SDPA (flash and cuDNN
backends on CUDA; torch's CPU kernel on CPU) and flash-attn (when installed).

GPU: bf16, B * N = 16k tokens, N of 1024, 4096 and 16384 (ZEROFUSE_BENCH_ATTENTION_N, e.g.
"512,1024,2048,4096,8192,16384", sets others: the default fits a 15-minute GPU lease beside the
other suites), head_dim 64 (32 heads) and 128 (16 heads), causal and not. FLOPs (the
FlashAttention convention): forward 4 * B * H * N^2 * D, halved when causal; backward 2.5x the
forward. TFLOP/s are reported with the ratio to the bf16 matmul peak measured in the same session
(``matmul_peak``). A peer that cannot run a case (no flash-attn wheel, a cuDNN backend refusing
the shape) is skipped with its reason, listed in pytest's summary. CPU: fp32 at small sizes (the
same code path users get on CPU); smoke: one tiny shape. The zerofuse provider runs last, so its
extra_info holds its speedup over each peer measured in the same run. Every provider's result from
its warm-up call (out, or the grads of q, k, v) is checked against zerofuse.reference.attention in
float64 by the reference rule, the same reference in the dtype the peer ([Note: checked results] in
bench/conftest.py), on the first batch row and as many heads as keep the float64 N x N scores at
2^26 elements (one head from N = 8192 on): heads and rows are computed independently.
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

import zerofuse.nn.functional as ZF
from conftest import cached_reference, check_result, float64, import_peer, timed  # bench/conftest.py
from zerofuse import reference as R

GPU_N = [int(n) for n in os.environ.get("ZEROFUSE_BENCH_ATTENTION_N", "1024,4096,16384").split(",")]
GPU_TOKENS = 16384
CPU_N = [256, 1024]
CPU_TOKENS = 2048


def _cases(device: torch.device, smoke: bool):
    if smoke:
        return [(2, 2, 128, 64)]
    if device.type == "cuda":
        return [(GPU_TOKENS // n, 2048 // d, n, d) for d in (64, 128) for n in GPU_N]
    return [(CPU_TOKENS // n, 4, n, 64) for n in CPU_N]


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        smoke = metafunc.config.getoption("--smoke") or os.environ.get("ZEROFUSE_BENCH_SMOKE") == "1"
        dev = metafunc.config.getoption("--bench-device") or ("cuda" if torch.cuda.is_available() else "cpu")
        cases = _cases(torch.device(dev), smoke)
        metafunc.parametrize("case", cases, ids=[f"B{b}H{h}N{n}D{d}" for b, h, n, d in cases])


@pytest.fixture(scope="session")
def matmul_peak(device, smoke) -> float:
    """Measured matmul TFLOP/s (bf16 on CUDA, fp32 on CPU): the compute roofline."""
    import statistics

    n = 256 if smoke else (8192 if device.type == "cuda" else 1024)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    t = statistics.median(timed(lambda: a @ b, device) for _ in range(3 if smoke else 20))
    return 2 * n ** 3 / t / 1e12


def _heads(h: int, n: int) -> int:
    """Heads of the first batch row that the check compares (float64 scores of 2^26 elements at most)."""
    return max(1, min(h, (1 << 26) // (n * n)))


def _part(ts, hc: int):
    """The compared part of (B, H, N, D) tensors: batch row 0, heads :hc."""
    return [t.detach()[:1, :hc] for t in ts]


def _reference(q, k, v, dout, causal: bool, grads: bool, ids=None):
    """(float64 reference, the same in q's dtype) of the out (grads=False) or the grads of q, k, v,
    on _part of them."""
    hc = _heads(q.shape[1], q.shape[2])
    ours, peer = float64(*_part((q, k, v), hc), grad=grads), [t.requires_grad_(grads) for t in _part((q, k, v), hc)]
    ids = None if ids is None else ids[:1]
    if not grads:
        with torch.no_grad():
            return R.attention(*ours, causal, document_ids=ids)[0], R.attention(*peer, causal, document_ids=ids)[0]
    dout = _part([dout], hc)[0]
    return (torch.autograd.grad(R.attention(*ours, causal, document_ids=ids)[0], ours, dout.double()),
            torch.autograd.grad(R.attention(*peer, causal, document_ids=ids)[0], peer, dout))


def _sdpa(provider: str):
    F = torch.nn.functional
    if provider == "zerofuse":
        return ZF.scaled_dot_product_attention, contextlib.nullcontext
    if provider == "flash_attn":
        fa = import_peer("flash_attn")

        def fn(q, k, v, is_causal):  # flash-attn's layout is (B, N, H, D)
            return fa.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                      causal=is_causal).transpose(1, 2)

        return fn, contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"torch_flash": SDPBackend.FLASH_ATTENTION, "torch_cudnn": SDPBackend.CUDNN_ATTENTION,
               "torch_sdpa": None}[provider]
    ctx = contextlib.nullcontext if backend is None else (lambda: sdpa_kernel(backend))
    return F.scaled_dot_product_attention, ctx


PROVIDERS = ["torch_sdpa", "torch_flash", "torch_cudnn", "flash_attn", "zerofuse"]


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd+bwd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def bench_attention(measure, device, smoke, matmul_peak, benchmark, causal, mode, provider, case):
    cuda = device.type == "cuda"
    if cuda and provider == "torch_sdpa":
        pytest.skip("on CUDA the flash and cuDNN backends are measured separately")
    if not cuda and provider in ("torch_flash", "torch_cudnn", "flash_attn"):
        pytest.skip(f"{provider} needs CUDA")
    b, h, n, d = case
    dtype = torch.bfloat16 if cuda else torch.float32
    fn, ctx = _sdpa(provider)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(b, h, n, d, device=device, dtype=dtype, generator=g)
    fwd_flops = 4 * b * h * n * n * d / (2 if causal else 1)
    flops = {"fwd": fwd_flops, "bwd": 2.5 * fwd_flops, "fwd+bwd": 3.5 * fwd_flops}[mode]
    setup = None
    with ctx():
        if mode == "fwd":
            def run():
                with torch.no_grad():
                    return fn(q, k, v, is_causal=causal)
        elif mode == "bwd":
            def graph():  # a fresh graph each round, outside the timing
                return (fn(q, k, v, is_causal=causal),)

            setup = graph

            def run(out):
                return torch.autograd.grad(out, (q, k, v), dout)
        else:
            def run():
                return torch.autograd.grad(fn(q, k, v, is_causal=causal), (q, k, v), dout)
        try:
            got = run(*(setup() if setup else ()))  # autotune / warm up outside the timing; its result checked
        except RuntimeError as e:  # a torch backend without a kernel for this case: listed, not timed
            if provider == "zerofuse":
                raise
            pytest.skip(f"{provider} cannot run B{b}H{h}N{n}D{d}: {str(e).splitlines()[0][:200]}")
        measure(run, case=f"{mode}/{'causal' if causal else 'full'}/{dtype}/B{b}H{h}N{n}D{d}", provider=provider,
                flops=flops, setup=setup)
    grads = mode != "fwd"
    want, peer = cached_reference(("attention", causal, grads, dtype, case, device),
                           lambda: _reference(q, k, v, dout, causal, grads))
    check_result(_part(got if grads else [got], _heads(h, n)), want if grads else [want], peer if grads else [peer],
                 what=f"{provider} attention {mode} {'grads' if grads else 'out'}")
    if benchmark.stats is not None:
        tflops = benchmark.extra_info["TFLOP/s"]
        benchmark.extra_info.update({"matmul_peak_TFLOP/s": round(matmul_peak, 2),
                                     "peak_ratio": round(tflops / matmul_peak, 3)})


def _documents(b: int, n: int, device) -> torch.Tensor:
    """Document ids (B, N) of a packed batch: lengths cycling through n/2, n/8, n/4, n/16, ... (a
    pre-training mix), cut at the row's end; each row starts the cycle at another place."""
    cycle = [max(1, n // f) for f in (2, 8, 4, 16, 8, 32)]
    rows = []
    for r in range(b):
        lengths, i = [], r
        while sum(lengths) < n:
            lengths.append(cycle[i % len(cycle)])
            i += 1
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:n])
    return torch.stack(rows).to(device)


DOC_PROVIDERS = ["torch_sdpa_mask", "flex_attention", "zerofuse_causal", "zerofuse"]


@pytest.mark.parametrize("provider", DOC_PROVIDERS)
def bench_attention_documents(measure, device, smoke, benchmark, provider, case):
    """Packed documents, causal within each, forward + backward: zerofuse's document_ids against
    torch's sdpa with the (B, 1, N, N) bool mask and (CUDA) flex_attention with a block mask;
    zerofuse_causal is plain causal attention over the whole row (the work documents save).
    FLOPs count the pairs each query sees (sum of L^2 / 2 over documents, as the causal rule)."""
    cuda = device.type == "cuda"
    if provider == "flex_attention" and not cuda:
        pytest.skip("flex_attention is measured on CUDA (compiled)")
    b, h, n, d = case
    dtype = torch.bfloat16 if cuda else torch.float32
    ids = _documents(b, n, device)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(b, h, n, d, device=device, dtype=dtype, generator=g)
    if provider == "zerofuse":
        def fn():
            return ZF.scaled_dot_product_attention(q, k, v, is_causal=True, document_ids=ids)
    elif provider == "zerofuse_causal":
        def fn():
            return ZF.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif provider == "torch_sdpa_mask":
        from zerofuse.ops.attention import document_bounds, document_mask

        mask = document_mask(document_bounds(ids))

        def fn():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def doc_causal(bi, hi, qi, ki):
            return (ids[bi, qi] == ids[bi, ki]) & (ki <= qi)

        block_mask = create_block_mask(doc_causal, b, None, n, n, device=device)
        flex = torch.compile(flex_attention, dynamic=False)

        def fn():
            return flex(q, k, v, block_mask=block_mask)

    def run():
        return torch.autograd.grad(fn(), (q, k, v), dout)

    got = run()  # autotune / compile outside the timing; its result checked below
    pairs = 0.0  # (query, key) pairs seen: L (L + 1) / 2 per document of L tokens
    for row in ids.cpu():
        lengths = torch.unique_consecutive(row, return_counts=True)[1].double()
        pairs += float((lengths * (lengths + 1) / 2).sum())
    measure(run, case=f"fwd+bwd/documents/{dtype}/B{b}H{h}N{n}D{d}", provider=provider,
            flops=3.5 * 4 * h * d * pairs)
    causal_only = provider == "zerofuse_causal"  # (causal over the whole row: its own reference)
    want, peer = cached_reference(("attention_documents", causal_only, dtype, case, device),
                           lambda: _reference(q, k, v, dout, True, True, None if causal_only else ids))
    check_result(_part(got, _heads(h, n)), want, peer, what=f"{provider} attention grads")
