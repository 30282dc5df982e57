"""The faces under torch.func transforms (vmap, grad) and torch.jit.trace compute with torch's own
ops (zerofuse.ops.signatures.torch_only): on the Triton path vmap raised "Cannot access storage of
BatchedTensorImpl", every grad transform raised on the autograd Functions' missing setup_context,
and a jit trace of a norm baked its traced shape (another input's shape came back wrong, silently;
a review's reproductions, 2026-12-06). Compared with torch's functions under the same transform."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

import zerofuse.nn as zn
from zerofuse import reference
from zerofuse.nn import functional as ZF

from tolerances import assert_close


def _faces(w, b):
    """(zerofuse's, torch's) of each face on x (..., 8)."""
    return [
        (lambda x: ZF.layer_norm(x, (8,), w, b), lambda x: F.layer_norm(x, (8,), w, b)),
        (lambda x: ZF.rms_norm(x, (8,), w), lambda x: F.rms_norm(x, (8,), w)),
        (lambda x: ZF.add_layer_norm(x, x * 2, (8,), w, b)[0], lambda x: F.layer_norm(x + x * 2, (8,), w, b)),
        (lambda x: ZF.swiglu(x, x.flip(-1)), lambda x: F.silu(x) * x.flip(-1)),
        (lambda x: ZF.geglu(x), lambda x: F.gelu(x[..., :4], approximate="tanh") * x[..., 4:]),
        (lambda x: ZF.bias_gelu(x, b), lambda x: F.gelu(x + b, approximate="tanh")),
    ]


def test_vmap_and_grad_of_the_faces_are_torchs(kernel_path):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    w, b = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    faces = _faces(w, b)
    for i, (ours, theirs) in enumerate(faces):
        assert_close(vmap(ours)(x), vmap(theirs)(x), msg=f"vmap {i}")
        assert_close(grad(lambda x: ours(x).square().sum())(x), grad(lambda x: theirs(x).square().sum())(x),
                     msg=f"grad {i}")
    q, k, v = (torch.randn(2, 4, 6, 8, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        ours = vmap(lambda q, k, v: ZF.scaled_dot_product_attention(q, k, v, is_causal=causal))(q, k, v)
        theirs = vmap(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal))(q, k, v)
        assert_close(ours, theirs, msg=f"sdpa causal={causal}")
    qkv = torch.randn(3, 2, 6, 3 * 16, dtype=torch.float64)  # (vmapped over 3; 2 heads of 8)
    for causal in (False, True):
        ours = vmap(lambda t: ZF.qkv_attention(t, 2, is_causal=causal))(qkv)
        theirs = vmap(lambda t: F.scaled_dot_product_attention(
            *(h.unflatten(-1, (2, 8)).transpose(1, 2) for h in t.chunk(3, -1)), is_causal=causal
        ).transpose(1, 2).flatten(-2))(qkv)
        assert_close(ours, theirs, msg=f"qkv causal={causal}")
    cos, sin = zn.rope_tables(6, 8)
    got = grad(lambda q: ZF.rotary_embedding(q, k, cos, sin)[0].square().sum())(q)
    want = grad(lambda q: reference.rotary_embedding(q, cos, sin).square().sum())(q)
    assert_close(got, want, msg="rope")


def test_a_jit_trace_of_a_norm_takes_other_shapes(kernel_path):
    m, t = zn.LayerNorm(8).eval(), torch.nn.LayerNorm(8).eval()
    with torch.no_grad():
        traced = torch.jit.trace(m, torch.randn(2, 3, 8))
        for shape in ((3, 2, 8), (6, 8), (4, 3, 8)):
            x = torch.randn(shape)
            assert traced(x).shape == x.shape
            assert_close(traced(x), t(x), msg=str(shape))


def test_torch_fx_traces_the_faces_as_calls(kernel_path):
    """torch.fx.symbolic_trace of a model holding zerofuse norms (not leaves, as torch.nn's are) handed
    the faces Proxies: "expected input to be a floating-point tensor, got Proxy". The faces are
    recorded as calls (torch.fx.wrap), and the traced module computes what the model does."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.rms, self.lin = zn.LayerNorm(8), zn.RMSNorm(8), torch.nn.Linear(8, 8)

        def forward(self, x):
            y, h = self.ln(x, x * 2)
            return ZF.swiglu(self.lin(self.rms(y)), h) + ZF.bias_gelu(h, self.lin.bias)

    net = Net()
    traced = torch.fx.symbolic_trace(net)
    called = {n.target.__name__ for n in traced.graph.nodes if n.op == "call_function"}
    assert {"_layer_norm", "_rms_norm", "swiglu", "bias_gelu"} <= called, called
    for shape in ((3, 8), (2, 5, 8)):
        x = torch.randn(shape)
        assert torch.equal(traced(x), net(x))
    # the modules that call the faces by their own module's names (a review: they got Proxies still);
    # a norm traced as the root (its residual=None a placeholder: the graph returned (norm(h), h))
    for module, args in ((zn.LayerNorm(8), (torch.randn(3, 8),)), (zn.RMSNorm(8), (torch.randn(3, 8),)),
                         (zn.LayerNorm(8), (torch.randn(3, 8), torch.randn(3, 8))),
                         (zn.LinearGELU(8, 8), (torch.randn(3, 8),)), (zn.GatedMLP(8, 16), (torch.randn(3, 8),)),
                         (zn.RotaryEmbedding(8, 16), (torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))),
                         (zn.LinearCrossEntropyLoss(), (torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, 2, 3, 1])))):
        traced = torch.fx.symbolic_trace(module)
        got, want = (torch.utils._pytree.tree_leaves(f(*args)) for f in (traced, module))
        assert len(got) == len(want) and all(map(torch.equal, got, want)), type(module).__name__


def test_a_tensor_eps_is_its_value(kernel_path):
    x, w = torch.randn(4, 8), torch.randn(8)
    assert_close(ZF.layer_norm(x, (8,), w, None, torch.tensor(1e-3)), ZF.layer_norm(x, (8,), w, None, 1e-3),
                 msg="layer_norm")
    assert_close(ZF.rms_norm(x, (8,), w, torch.tensor(1e-3)), ZF.rms_norm(x, (8,), w, 1e-3), msg="rms")
    import numpy as np  # numpy's numbers as torch's faces take them (refused by the first type checks)

    assert torch.equal(ZF.layer_norm(x, [np.int64(8)], w, None, np.float32(1e-3)), ZF.layer_norm(x, (8,), w, None,
                                                                                               float(np.float32(1e-3))))


def test_the_fallbacks_keep_the_faces_semantics(kernel_path):
    """A review of the fallbacks (2026-12-06): input_bias got no gradient through h; an fp32 h (a
    bf16 input plus an fp32 residual) with bf16 params raised in torch's layer_norm; RoPE in place
    under grad returned the identity's gradient where eager refuses; Attention's packed RoPE still
    hit the autograd Function; the bf16 RoPE fallback rounded several times."""
    import pytest

    torch.manual_seed(1)
    x, r = (torch.randn(4, 8, dtype=torch.float64) for _ in range(2))
    w, b, ib = (torch.randn(8, dtype=torch.float64) for _ in range(3))

    def loss(ib):
        y, h = ZF.add_layer_norm(x, r, (8,), w, b, input_bias=ib)
        return y.sin().sum() + (h * h).sum()

    eager_ib = ib.clone().requires_grad_()
    loss(eager_ib).backward()
    assert_close(grad(loss)(ib), eager_ib.grad, msg="input_bias")
    xb, wb = x.bfloat16(), w.bfloat16()
    y, h = vmap(lambda x, r: ZF.add_layer_norm(x, r, (8,), wb, wb))(xb.unsqueeze(1), r.float().unsqueeze(1))
    want, _ = ZF.add_layer_norm(xb, r.float(), (8,), wb, wb)
    assert y.dtype == h.dtype == torch.float32
    assert_close(y.squeeze(1), want, msg="promoted h")
    q, k = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = zn.rope_tables(5, 8)
    with pytest.raises(ValueError, match="inplace=True has no autograd"):
        grad(lambda q: ZF.rotary_embedding(q, k, cos, sin, inplace=True)[0].sum())(q)
    qb, kb = q.bfloat16(), k.bfloat16()
    eager = ZF.rotary_embedding(qb, kb, cos, sin)
    traced = vmap(lambda q, k: ZF.rotary_embedding(q, k, cos, sin))(qb.unsqueeze(0), kb.unsqueeze(0))
    for a, e in zip((t.squeeze(0) for t in traced), eager):
        assert_close(a, e, msg="bf16 rope")
    attn = zn.Attention(16, 2, rope=zn.RotaryEmbedding(8, 5)).double()
    xs = torch.randn(2, 5, 16, dtype=torch.float64)
    params = dict(attn.named_parameters())
    got = grad(lambda p: torch.func.functional_call(attn, p, (xs,)).square().sum())(params)
    attn(xs).square().sum().backward()
    for n, p in attn.named_parameters():
        assert_close(got[n], p.grad, msg=n)


def _batched_backwards(ours, theirs, inputs, how):
    """The gradients of ours(*inputs) and theirs(*inputs) for 3 grad outputs at once: autograd.grad's
    is_grads_batched, or torch.func.vmap over autograd.grad of a graph built outside it."""
    grads = []
    for f in (ours, theirs):
        xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        y = f(*xs)
        wrt = [t for t in xs if t.requires_grad]
        v = torch.randn(3, *y.shape, generator=torch.Generator().manual_seed(1))
        if how == "is_grads_batched":
            grads.append(torch.autograd.grad(y, wrt, v, is_grads_batched=True))
        else:
            grads.append(vmap(lambda g: torch.autograd.grad(y, wrt, g, retain_graph=True))(v))
    return grads


def _backward_faces():
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
    w, b = torch.randn(16, generator=g), torch.randn(16, generator=g)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=g) for _ in range(3))
    h, W, t = torch.randn(6, 16, generator=g), torch.randn(11, 16, generator=g), torch.randint(0, 11, (6,), generator=g)
    eps = torch.finfo(torch.float32).eps
    cos, sin = zn.rope_tables(5, 8)
    qkv = torch.randn(2, 5, 3 * 16, generator=g)
    return {
        "layer_norm": (lambda x, w, b: ZF.layer_norm(x, (16,), w, b), lambda x, w, b: F.layer_norm(x, (16,), w, b),
                       (x, w, b)),
        "add_rms_norm": (lambda x, r, w: ZF.add_rms_norm(x, r, (16,), w)[0],
                         lambda x, r, w: F.rms_norm(x + r, (16,), w, eps=eps), (x, r, w)),
        "swiglu": (lambda a, c: ZF.swiglu(a, c), lambda a, c: F.silu(a) * c, (x, r)),
        "geglu packed": (lambda a: ZF.geglu(a), lambda a: F.gelu(a[:, :8], approximate="tanh") * a[:, 8:], (x,)),
        "bias_gelu": (lambda a, c: ZF.bias_gelu(a, c), lambda a, c: F.gelu(a + c, approximate="tanh"), (x, b)),
        "sdpa": (lambda q, k, v: ZF.scaled_dot_product_attention(q, k, v, is_causal=True),
                 lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v)),
        "linear_cross_entropy": (lambda h, W, t: ZF.linear_cross_entropy(h, W, t),
                                 lambda h, W, t: F.cross_entropy(h @ W.T, t), (h, W, t)),
        "rotary_embedding": (lambda q, k: torch.cat(ZF.rotary_embedding(q, k, cos, sin)),
                             lambda q, k: torch.cat([reference.rotary_embedding(t, cos, sin) for t in (q, k)]), (q, k)),
        "qkv_attention": (lambda t: ZF.qkv_attention(t, 2, is_causal=True),
                          lambda t: F.scaled_dot_product_attention(
                              *(h.unflatten(-1, (2, 8)).transpose(1, 2) for h in t.chunk(3, -1)), is_causal=True
                          ).transpose(1, 2).flatten(-2), (qkv,)),
    }


@pytest.mark.parametrize("how", ["is_grads_batched", "vmap"])
def test_a_batched_backward_through_the_faces(how, kernel_path):
    """jacobian(vectorize=True) / is_grads_batched / vmap over a backward hand the faces' backwards
    batched gradients: the CPU path's swiglu (an in-place mul_) and the fused loss (_foreach_mul_)
    raised torch's batching errors, and the Triton path read the batched tensors' storage
    ("Cannot access storage of BatchedTensorImpl"). Now the CPU path gives torch's gradients and the
    Triton path refuses by name, except the loss whose gradients were made in its forward (scaled
    only: no kernel)."""
    for name, (ours, theirs, inputs) in _backward_faces().items():
        if kernel_path == "triton" and name != "linear_cross_entropy":
            with pytest.raises(NotImplementedError, match="backward has no batched rule for its Triton kernels"):
                _batched_backwards(ours, theirs, inputs, how)
            continue
        got, want = _batched_backwards(ours, theirs, inputs, how)
        for i, (a, e) in enumerate(zip(got, want)):
            assert a.shape == e.shape
            assert_close(a, e, msg=f"{name} grad {i} ({how})")


def test_rope_under_torch_func_checks_as_eager_and_sdpa_fallbacks_compile_fullgraph(kernel_path):
    """Under torch.func the rope face skipped every check: position -1 rotated by the table's last
    row, silently; sdpa's fallback warning (attn_mask, dropout, ...) is untraceable: fullgraph
    compile failed (other modes broke the graph) until the warning had been given once eagerly (a
    review's reproductions, 2026-12-07)."""
    cos, sin = zn.rope_tables(8, 8)
    q, k = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8)
    bad = torch.tensor([[-1, 0]])
    with pytest.raises(IndexError, match=r"expected positions in \[0, 8\), got -1"):
        grad(lambda a: ZF.rotary_embedding(a, k, cos, sin, bad)[0].sum())(q)
    ok = torch.tensor([[3, 0]])
    got = grad(lambda a: (ZF.rotary_embedding(a, k, cos, sin, ok)[0] * k).sum())(q)
    want = grad(lambda a: (reference.rotary_embedding(a, cos, sin, ok) * k).sum())(q)
    assert_close(got, want)
    from zerofuse.nn import sdpa

    sdpa._warned.clear()
    torch._dynamo.reset()
    qa, ka, va = (torch.randn(1, 2, 5, 8) for _ in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    fn = torch.compile(lambda a, b, c: ZF.scaled_dot_product_attention(a, b, c, attn_mask=mask), fullgraph=True,
                       backend="aot_eager")
    assert_close(fn(qa, ka, va), F.scaled_dot_product_attention(qa, ka, va, attn_mask=mask))
