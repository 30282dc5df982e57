"""Every zerofuse op's outputs have the strides its fake impl promises (torch.compile asserts them;
opcheck compares shapes and dtypes only), for inputs that are not contiguous, on both CPU paths
(the Triton kernels in the interpreter, the torch/C++ cpu path). Found by this sweep: the norm
backwards' and moe_unpermute_backward's fakes followed x's / y's layout, bias_gelu's torch path and
attention_qkv's cpu path followed their inputs' while their fakes promised contiguous outputs."""
import pytest
import torch

from common import assert_fake_strides

Z = torch.ops.zerofuse


def _swapped(*s):
    """A tensor of shape s whose first two dims are swapped in memory (a unit last stride)."""
    return torch.randn(s[1], s[0], *s[2:]).transpose(0, 1)


def _transposed(m, n):
    return torch.randn(n, m).t()


def _cases():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    x, w, b = _swapped(3, 5, 16), torch.randn(16), torch.randn(16)
    yield "layer_norm", Z.layer_norm.default, (x, w, b, _swapped(3, 5, 16), 1e-5)
    yield "layer_norm-transposed", Z.layer_norm.default, (_transposed(15, 16), w, b, None, 1e-5)
    yield "rms_norm", Z.rms_norm.default, (x, w, _swapped(3, 5, 16), 1e-5)
    _, _, mean, rstd = Z.layer_norm(x, w, b, None, 1e-5)
    yield "layer_norm_backward", Z.layer_norm_backward.default, (_swapped(3, 5, 16), None, x, w, b, mean, rstd)
    _, _, rstd = Z.rms_norm(x, w, None, 1e-5)
    yield "rms_norm_backward", Z.rms_norm_backward.default, (_swapped(3, 5, 16), None, x, w, rstd)
    yield "bias_gelu", Z.bias_gelu.default, (_transposed(15, 16), b)
    yield "bias_gelu_backward", Z.bias_gelu_backward.default, (_swapped(3, 5, 16), _swapped(3, 5, 16), b)
    gate, up = _transposed(7, 12), _transposed(7, 12)
    yield "swiglu", Z.swiglu.default, (gate, up, "silu")
    yield "swiglu_backward", Z.swiglu_backward.default, (_transposed(7, 12), gate, up, "gelu_tanh")
    packed = _swapped(3, 5, 24)
    yield "swiglu_packed", Z.swiglu_packed.default, (packed, "silu")
    yield "swiglu_packed_backward", Z.swiglu_packed_backward.default, (_swapped(3, 5, 12), packed, "gelu_tanh")
    qkv = _swapped(2, 7, 3 * 2 * 8)
    yield "attention_qkv", Z.attention_qkv.default, (qkv, 2, 2, True, 0.3)
    out, lse = Z.attention_qkv(qkv, 2, 2, True, 0.3)
    yield "attention_qkv_backward", Z.attention_qkv_backward.default, (_swapped(2, 7, 16), qkv, out, lse, 2, 2, True, 0.3)
    q, k = (torch.randn(2, 9, h, 8).transpose(1, 2) for h in (4, 2))
    yield "attention", Z.attention.default, (q, k, k, True, 0.3)
    out, lse = Z.attention(q, k, k, True, 0.3)
    yield "attention_backward", Z.attention_backward.default, (out.clone(), q, k, k, out, lse, True, 0.3)
    cos, sin = torch.randn(12, 4), torch.randn(12, 4)
    yield "rotary_embedding", Z.rotary_embedding.default, (q, k, cos, sin, None, False, False)
    hid, weight, tgt = _transposed(9, 16), torch.randn(33, 16), torch.randint(0, 33, (9,), generator=g)
    for red in ("mean", "none"):
        yield f"linear_cross_entropy-{red}", Z.linear_cross_entropy.default, (
            hid, weight, tgt, None, -100, 0.0, 0.0, 0.0, red, 4, red == "mean")
    res = Z.linear_cross_entropy(hid, weight, tgt, None, -100, 0.0, 0.0, 0.0, "none", 4, False)
    yield "linear_cross_entropy_backward", Z.linear_cross_entropy_backward.default, (
        torch.randn(9), hid, weight, tgt, None, res[1], -100, 0.0, 0.0, 0.0, "none", 4)
    xm, experts = _transposed(7, 16), torch.randint(0, 4, (7, 2), generator=g)
    yield "moe_permute", Z.moe_permute.default, (xm, experts, 4)
    perm = Z.moe_permute(xm, experts, 4)
    yield "moe_permute_backward", Z.moe_permute_backward.default, (_transposed(14, 16), perm[1])
    y, weights = _transposed(14, 16), _transposed(7, 2)
    yield "moe_unpermute", Z.moe_unpermute.default, (y, perm[1], perm[2], weights)
    yield "moe_unpermute_backward", Z.moe_unpermute_backward.default, (_transposed(7, 16), y, perm[2], weights)


def test_every_op_with_outputs_is_swept():
    """A new op with outputs joins the sweep (the in-place ones return nothing to compare)."""
    import zerofuse

    swept = {name.split("-")[0] for name, _, _ in _cases()}
    with_outputs = {n.split("::")[1] for n in zerofuse.ops.list_ops()
                    if getattr(Z, n.split("::")[1]).default._schema.returns}
    # (l2norm: fp32 norms, 1-D; the C++ norm kernels: the norm ops' cpu path, swept through them)
    assert with_outputs - swept <= {"l2norm", "norm_fwd_cpu", "norm_bwd_cpu"}, with_outputs - swept


@pytest.mark.parametrize("name", [c[0] for c in _cases()])
def test_real_strides_are_the_fakes(name, kernel_path):
    op, args = next((op, args) for n, op, args in _cases() if n == name)
    assert_fake_strides(op, *args)
