"""Mixture of Experts on one process: the MoE layer (zerofuse.moe.MoE: moe_permute, grouped expert
GEMMs, moe_unpermute) against the per-expert loop most MoE code starts from (for each expert: the
tokens routed to it by a mask, its MLP, index_add of the weighted output), the same router, weights
and tokens; and the permute + unpermute ops alone against torch's index ops (GB/s against the copy
roofline: each moved row read and written once).

Times forward + backward. Expert-parallel runs (all-to-all on gloo) and DeepSpeed-MoE are not in
this suite yet.
"""
import os

import pytest
import torch

from zerofuse.moe import MoE
from zerofuse.ops.moe import moe_permute, moe_unpermute

# (tokens, dim, hidden, experts, top_k)
SHAPES = {"cuda": [(16384, 2048, 1408, 64, 6), (8192, 1024, 2816, 8, 2)], "cpu": [(4096, 256, 512, 8, 2)],
          "smoke": [(64, 32, 48, 8, 2)]}


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


@pytest.mark.parametrize("provider", ["loop", "zerofuse"])  # zerofuse last: its ratio to the loop
def bench_moe_layer(measure, device, provider, moe_shape):
    m, x = _layer(moe_shape, device)
    fn = m if provider == "zerofuse" else (lambda inp: _loop(m, inp))
    params = [x, m.w1, m.w2, m.router.weight]

    def run():
        return torch.autograd.grad(fn(x).float().pow(2).sum(), params)

    run()
    t, d, h, e, k = moe_shape
    flops = 3 * 2 * t * k * (d * 2 * h + h * d)  # forward + backward of the experts' GEMMs
    measure(run, case=f"moe_layer/fwd+bwd/{x.dtype}/{t}x{d}x{h}/E{e}k{k}", provider=provider, flops=flops)


@pytest.mark.parametrize("provider", ["torch", "zerofuse"])
def bench_moe_permute_unpermute(measure, device, provider, moe_shape, monkeypatch):
    """permute + unpermute forward and backward; provider torch: the op's torch index path."""
    if provider == "torch":
        from zerofuse.ops import moe as ops_moe

        monkeypatch.setattr(ops_moe, "_use_triton", lambda _x: False)
    elif device.type != "cuda":
        pytest.skip("the Triton kernels run on a GPU (the interpreter is for correctness, not speed)")
    t, d, _, e, k = moe_shape
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(t, d, generator=g).to(device, dtype).requires_grad_()
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)
    w = torch.rand(t, k, generator=g).to(device).requires_grad_()

    def run():
        rows, pos, src, _ = moe_permute(x, experts, e)
        z = moe_unpermute(rows, pos, src, w)
        return torch.autograd.grad(z.sum(), (x, w))

    run()
    row = d * x.element_size()
    moved = 2 * (2 * t * k * row)  # forward: t*k rows read and written by each op; backward alike
    measure(run, case=f"moe_permute_unpermute/fwd+bwd/{dtype}/{t}x{d}/E{e}k{k}", provider=provider,
            bytes_moved=moved)
