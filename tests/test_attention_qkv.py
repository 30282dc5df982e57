"""zerofuse::attention_qkv (ops/attention_qkv.py, face zerofuse.nn.functional.qkv_attention): attention
straight from the fused QKV projection, the gradient of qkv packed. Against the fp64 reference by
test_attention.py's rule (max error at most 2x the same computation's in the input dtype, plus a
floor), on both CPU paths; the module's result and gradients equal the split-heads path bit for bit
with none of its copies; opcheck and torch.compile; bad input."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zerofuse.nn.functional as ZF
from zerofuse import reference
from zerofuse.nn import Attention

from common import HAS_CUDA

DEVICE = "cuda" if HAS_CUDA else "cpu"
# On a GPU machine every test here runs on CUDA, so the module belongs to `-m gpu` there.
pytestmark = [pytest.mark.gpu] if HAS_CUDA else []

CASES = [  # (B, Hq, Hkv, N, D, causal)
    (1, 2, 2, 97, 32, False),
    (1, 2, 2, 97, 32, True),
    (2, 4, 1, 65, 64, False),  # multi-query
    (1, 4, 2, 130, 80, True),  # grouped-query, head_dim 80
    (1, 2, 1, 33, 128, True),
]


@pytest.fixture(params=["triton", "torch"])
def path(request):
    if request.param == "torch":
        request.getfixturevalue("cpu_kernels")
    return request.param


def _inputs(b, hq, hkv, n, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, n, (hq + 2 * hkv) * d, generator=g).to(DEVICE, dtype)
    return qkv, torch.randn(b, n, hq * d, generator=g).to(DEVICE, dtype)


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_forward_and_packed_gradient_vs_float64(path, case, dtype):
    b, hq, hkv, n, d, causal = case
    qkv, dout = _inputs(b, hq, hkv, n, d, dtype)
    scale = 0.7 / d ** 0.5
    mine = qkv.clone().requires_grad_()
    out = ZF.qkv_attention(mine, hq, hkv, is_causal=causal, scale=scale)
    out.backward(dout)
    ref = qkv.double().requires_grad_()
    out64, _ = reference.attention_qkv(ref, hq, hkv, is_causal=causal, scale=scale)
    out64.backward(dout.double())
    theirs = qkv.clone().requires_grad_()
    out_t, _ = reference.attention_qkv(theirs, hq, hkv, is_causal=causal, scale=scale)
    out_t.backward(dout)
    floor = 1e-5 if dtype == torch.float32 else 1e-3
    assert out.shape == (b, n, hq * d) and out.is_contiguous() and mine.grad.shape == qkv.shape
    assert _max_err(out, out64) <= 2 * _max_err(out_t, out64) + floor
    assert _max_err(mine.grad, ref.grad) <= 2 * _max_err(theirs.grad, ref.grad) + floor


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rope", [None, "half", "interleaved", "partial"])
def test_module_equals_the_split_heads_path_without_its_copies(path, rope):
    """Without RoPE and with it (ops.rotary.EagerRopeQKV: one kernel pass writes a copy of the packed
    qkv with its q and k heads rotated, forward, and of its gradient, backward): the split-heads
    path's bits, without its copies and fills."""
    from zerofuse.nn import RotaryEmbedding

    torch.manual_seed(0)
    rot = None if rope is None else RotaryEmbedding(16, 64, rotary_dim=8 if rope == "partial" else None,
                                                     interleaved=rope == "interleaved")
    packed = Attention(96, num_heads=6, num_kv_heads=2, rope=rot).to(DEVICE)
    split = Attention(96, num_heads=6, num_kv_heads=2, rope=rot,
                      sdpa=lambda *a, **k: ZF.scaled_dot_product_attention(*a, **k))
    split.load_state_dict(packed.state_dict())
    split.to(DEVICE)
    x = torch.randn(2, 37, 96, device=DEVICE)
    results = []
    for m in (packed, split):
        xx = x.clone().requires_grad_()
        with _CountOps() as ops:
            y = m(xx)
            y.backward(torch.ones_like(y))
        results.append((y, xx.grad, m.qkv.weight.grad, None, ops.names))
    (y1, g1, w1, _, ops1), (y2, g2, w2, _, ops2) = results
    assert torch.equal(y1, y2) and torch.equal(g1, g2) and torch.equal(w1, w2)
    # (copy_ is not counted: the Triton interpreter copies every argument in and out of its launches)
    copies = {"slice_backward", "clone", "add", "zeros", "cat", "contiguous"}
    if path == "triton":  # the kernels read and write through views (RoPE's copy is its kernel's own pass)
        assert not copies & set(ops1), ops1
    assert [n for n in ops2 if n in copies], ops2  # the split path makes them


def test_opcheck_and_compile():
    qkv, dout = _inputs(1, 4, 2, 33, 32, torch.float32)
    torch.library.opcheck(torch.ops.zerofuse.attention_qkv.default, (qkv, 4, 2, True, 0.3))
    out, lse = torch.ops.zerofuse.attention_qkv(qkv, 4, 2, True, 0.3)
    torch.library.opcheck(torch.ops.zerofuse.attention_qkv_backward.default, (dout, qkv, out, lse, 4, 2, True, 0.3))

    def f(qkv):
        return ZF.qkv_attention(qkv, 4, 2, is_causal=True).square().sum()

    a, b = qkv.clone().requires_grad_(), qkv.clone().requires_grad_()
    torch.compile(f, fullgraph=True, backend="aot_eager")(a).backward()
    f(b).backward()
    torch.testing.assert_close(a.grad, b.grad)


def test_empty_sequence_and_bad_input():
    qkv = torch.randn(2, 0, 4 * 8, device=DEVICE, requires_grad=True)
    out = ZF.qkv_attention(qkv, 2, 1)
    out.sum().backward()
    assert out.shape == (2, 0, 16) and qkv.grad.shape == qkv.shape
    x = torch.randn(2, 5, 30, device=DEVICE)
    with pytest.raises(ValueError, match=r"last dim \(30\) to be a positive multiple of num_heads \+ 2 \* "
                                         r"num_kv_heads = 4"):
        ZF.qkv_attention(x, 2, 1)
    with pytest.raises(ValueError, match=r"num_kv_heads \(2\) >= 1 to divide num_heads \(3\)"):
        ZF.qkv_attention(x, 3, 2)
    with pytest.raises(ValueError, match="expected qkv to be a 3-D"):
        ZF.qkv_attention(x[0], 2, 1)
    with pytest.raises(ValueError, match="last dim to be contiguous"):
        ZF.qkv_attention(torch.randn(2, 32, 5, device=DEVICE).transpose(1, 2), 2, 1)


def test_rope_on_packed_qkv_takes_a_strided_gradient():
    """The gradient reaching the packed RoPE may be strided (here: a transposed one): it is made
    contiguous, and the input gradient equals the one from the same values laid out contiguously."""
    from zerofuse.nn import RotaryEmbedding

    torch.manual_seed(0)
    m = Attention(64, 4, 2, rope=RotaryEmbedding(16, 32)).to(DEVICE)
    g = torch.randn(9, 2, 64, device=DEVICE).transpose(0, 1)
    grads = []
    for grad in (g, g.contiguous()):
        x = torch.randn(2, 9, 64, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1)).requires_grad_()
        m(x).backward(grad)
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


def test_lse_is_not_differentiable_and_the_backward_op_checks_dtypes():
    """Both attention ops return lse, whose gradient they do not compute: it is marked so (before, a
    loss through lse backpropagated a silent zero). The backward op refuses a dout or out of another
    dtype than qkv, naming itself (the Triton path ran on it; the torch path named another op)."""
    qkv, dout = _inputs(1, 4, 2, 9, 16, torch.float32)
    qkv.requires_grad_()
    out, lse = torch.ops.zerofuse.attention_qkv(qkv, 4, 2, True, 0.3)
    assert out.requires_grad and not lse.requires_grad
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 9, 16, generator=g).to(DEVICE).requires_grad_() for h in (4, 2, 2))  # (B, H, N, D)
    out2, lse2 = torch.ops.zerofuse.attention(q, k, v, True, 0.3)
    assert out2.requires_grad and not lse2.requires_grad
    with pytest.raises(ValueError, match=r"zerofuse::attention_qkv_backward: expected dout to be a torch.float32 "
                                         r"tensor \(qkv's dtype\)"):
        torch.ops.zerofuse.attention_qkv_backward(dout.double(), qkv.detach(), out.detach(), lse, 4, 2, True, 0.3)
    with pytest.raises(ValueError, match=r"expected out to be a torch.float32 tensor"):
        torch.ops.zerofuse.attention_qkv_backward(dout, qkv.detach(), out.detach().half(), lse, 4, 2, True, 0.3)
