"""Flash attention Triton kernels (kernels/attention.py) vs the fp64 reference, forward (out and
LSE) and backward (dq, dk, dv), in the interpreter on CPU tensors (or on a GPU when present).

The rule (flash-attention's): the kernel's max error vs fp64 is at most 2x the max error of the
same computation done by PyTorch in the input dtype, plus a small absolute floor."""
import pytest
import torch

from zerofuse import kernels, reference
from zerofuse.kernels import attention as K

from common import HAS_CUDA

DEVICE = "cuda" if HAS_CUDA else "cpu"
pytestmark = pytest.mark.skipif(not (HAS_CUDA or kernels.interpreted()),
                                reason="the Triton kernels need a GPU or the interpreter")

CASES = [  # (B, Hq, Hkv, Nq, Nk, D, causal)
    (1, 2, 2, 97, 97, 32, False),
    (1, 2, 2, 97, 97, 32, True),
    (2, 4, 1, 65, 130, 64, False),  # multi-query, Nq != Nk
    (1, 4, 2, 130, 65, 80, True),  # grouped-query, head_dim 80, Nq > Nk
    (1, 2, 1, 33, 33, 128, True),
]


def _inputs(b, hq, hkv, nq, nk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype)  # noqa: E731
    return mk(b, hq, nq, d), mk(b, hkv, nk, d), mk(b, hkv, nk, d), mk(b, hq, nq, d)


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_forward_and_backward_vs_float64(case, dtype):
    b, hq, hkv, nq, nk, d, causal = case
    q, k, v, dout = _inputs(b, hq, hkv, nq, nk, d, dtype)
    scale = 0.7 / d**0.5
    out, lse = K.attention_fwd(q, k, v, causal, scale)
    dq, dk, dv = K.attention_bwd(dout, q, k, v, out, lse, causal, scale)

    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    out64, lse64 = reference.attention(*leaves64, is_causal=causal, scale=scale)
    out64.backward(dout.double())
    # torch's own result in the input dtype (the baseline of the 2x rule)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out_t, _ = reference.attention(*leaves, is_causal=causal, scale=scale)
    out_t.backward(dout)

    floor = 1e-5 if dtype == torch.float32 else 1e-3
    assert _max_err(out, out64) <= 2 * _max_err(out_t, out64) + floor
    assert _max_err(lse, lse64) <= 1e-4
    for got, want, theirs in zip((dq, dk, dv), (t.grad for t in leaves64), (t.grad for t in leaves)):
        assert got.dtype == dtype and got.shape == want.shape
        assert _max_err(got, want) <= 2 * _max_err(theirs, want) + floor


def test_non_contiguous_inputs():
    """(B, N, H, D) storage viewed as (B, H, N, D): strides are passed through, no copies."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 97, 2, 32, generator=g).to(DEVICE).transpose(1, 2)
    k = torch.randn(1, 50, 2, 32, generator=g).to(DEVICE).transpose(1, 2)
    v = torch.randn(1, 50, 2, 32, generator=g).to(DEVICE).transpose(1, 2)
    out, lse = K.attention_fwd(q, k, v, False, 32**-0.5)
    want, want_lse = reference.attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


def test_bad_shapes_raise():
    q = torch.randn(1, 3, 8, 16, device=DEVICE)
    k = torch.randn(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"key/value heads \(2\) to divide the query heads \(3\)"):
        K.attention_fwd(q, k, k, False, 1.0)
    with pytest.raises(ValueError, match=r"expected 4-D"):
        K.attention_fwd(q[0], k, k, False, 1.0)
