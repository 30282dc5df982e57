"""zerofuse.nn's faces against the torch functions they replace, where a review (2026-11-27) found
them silently different (each test failed before its fix): rms_norm's default eps, second-order
gradients (create_graph=True), sdpa under autocast and on inputs the kernel does not take, RoPE in
place on tensors whose elements share memory."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zerofuse
import zerofuse.nn.functional as ZF
from tolerances import tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norms_default_eps_is_torchs(dtype, kernel_path):
    """torch's rms_norm(eps=None) takes the epsilon of the dtype it computes in (fp32 for bf16/fp16,
    whatever its docs say): with bf16's epsilon zerofuse was 1.6 off on inputs of size 0.05."""
    x = (torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 0.01).to(dtype)
    w = torch.rand(40).to(dtype)
    torch.testing.assert_close(ZF.rms_norm(x, (40,), w), F.rms_norm(x, (40,), w), **tol(dtype))
    module = zerofuse.nn.RMSNorm(40, dtype=dtype)
    torch.testing.assert_close(module(x), torch.nn.RMSNorm(40, dtype=dtype)(x), **tol(dtype))


def _faces():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 16, generator=g, dtype=torch.float64).float()
    w, b = torch.rand(16), torch.rand(16)
    q, k, v = (torch.randn(1, 2, 7, 8, generator=g) for _ in range(3))
    cos, sin = zerofuse.nn.rope_tables(7, 8)
    return {
        "layer_norm": ((x,), lambda x: ZF.layer_norm(x, (16,), w, b)),
        "rms_norm": ((x,), lambda x: ZF.rms_norm(x, (16,), w)),
        "add_layer_norm": ((x,), lambda x: ZF.add_layer_norm(x, x.flip(0), (16,), w, b)[0]),
        "sdpa": ((q, k, v), lambda q, k, v: ZF.scaled_dot_product_attention(q, k, v, is_causal=True)),
        "swiglu": ((x, x.flip(1)), lambda a, b: ZF.swiglu(a, b)),
        "bias_gelu": ((x,), lambda x: ZF.bias_gelu(x, b)),
        "rotary": ((q, k), lambda q, k: ZF.rotary_embedding(q, k, cos, sin)[0]),
        "linear_cross_entropy": ((x, torch.randn(11, 16, generator=g)),
                                 lambda x, w: ZF.linear_cross_entropy(x, w, torch.arange(15).view(3, 5) % 11)),
    }


@pytest.mark.parametrize("face", list(_faces()))
def test_differentiating_a_faces_gradients_raises_not_drops_the_second_order_term(face, kernel_path):
    """A gradient penalty (d loss / dx with create_graph=True, then its square in the loss): the
    faces' backward kernels make first-order gradients only; x.grad silently missed the penalty's
    gradient (layer_norm: 137 off torch's; the fused loss: None). Now differentiating those
    gradients raises; used as values (create_graph=True for another reason) they are fine, and a
    plain backward is unchanged."""
    inputs, fn = _faces()[face]
    leaves = [t.clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    grads = torch.autograd.grad((y * y).sum(), leaves, create_graph=True)
    with pytest.raises(RuntimeError, match="has no double backward"):
        sum((g * g).sum() for g in grads).backward()
    leaves = [t.clone().requires_grad_() for t in inputs]
    (fn(*leaves) ** 2).sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)


@pytest.mark.parametrize("face", list(_faces()))
@pytest.mark.parametrize("ask", ["grad", "backward_inputs"])
def test_a_penalty_differentiated_for_a_param_upstream_of_a_face_raises(face, ask, kernel_path):
    """x -> Linear -> face, g = d(y^2)/dx with create_graph=True, then d|g|^2 / d linear.weight: the
    raising node hung off detached copies of the gradients, on no path to the Linear, so
    torch.autograd.grad(penalty, linear.weight) and penalty.backward(inputs=[...]) returned a
    gradient without the face's second-order term (layer_norm: 2093 off torch's; a review's
    reproduction, 2026-12-06)."""
    inputs, fn = _faces()[face]
    lin = torch.nn.Linear(inputs[0].shape[-1], inputs[0].shape[-1])
    x = inputs[0].clone().requires_grad_()
    y = fn(lin(x), *inputs[1:])
    g, = torch.autograd.grad((y * y).sum(), x, create_graph=True)
    penalty = (g * g).sum()
    with pytest.raises(RuntimeError, match="has no double backward"):
        if ask == "grad":
            torch.autograd.grad(penalty, lin.weight)
        else:
            penalty.backward(inputs=[lin.weight])


def test_sdpa_under_autocast_and_on_inputs_the_kernel_does_not_take_is_torchs(kernel_path):
    """Under autocast torch's sdpa computes in the autocast dtype (fp32 inputs: a bf16 output; mixed
    dtypes accepted): zerofuse returned fp32 and refused the mix. A value head dim other than query's
    and key/value batches broadcast against query's run torch's sdpa (they raised)."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 9, 16, generator=g) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for args in ((q, k, v), (q, k, v.bfloat16())):
            got = ZF.scaled_dot_product_attention(*args, is_causal=True)
            want = F.scaled_dot_product_attention(*args, is_causal=True)
            assert got.dtype == want.dtype == torch.bfloat16
            torch.testing.assert_close(got, want, **tol(torch.bfloat16))
        q64 = q.double()  # autocast leaves float64 alone (torch's sdpa stays float64)
        got = ZF.scaled_dot_product_attention(q64, q64, q64, is_causal=True)
        assert got.dtype == F.scaled_dot_product_attention(q64, q64, q64, is_causal=True).dtype == torch.float64
    with pytest.warns(UserWarning, match="running torch's implementation"):
        for args in ((q, k, v[..., :8]), (q, k[:1], v[:1])):
            got = ZF.scaled_dot_product_attention(*args, is_causal=True)
            torch.testing.assert_close(got, F.scaled_dot_product_attention(*args, is_causal=True),
                                       **tol(torch.float32))
            zerofuse.nn.sdpa._warned.clear()


def test_rope_in_place_refuses_tensors_whose_elements_share_memory(kernel_path):
    """An expanded q (stride 0): the in-place kernel rotated the shared elements once per alias
    (2.39 off); torch's in-place ops refuse such a tensor, and so does zerofuse's now."""
    q = torch.randn(1, 2, 1, 8).expand(2, 2, 5, 8)
    k = torch.randn(2, 2, 5, 8)
    cos, sin = zerofuse.nn.rope_tables(5, 8)
    with pytest.raises(RuntimeError, match="more than one element of q .* refers to a single memory location"):
        ZF.rotary_embedding(q, k, cos, sin, inplace=True)
    q2 = q.clone()
    ZF.rotary_embedding(q2, k, cos, sin, inplace=True)  # a clone is fine


def test_vocab_parallel_loss_under_autocast_takes_what_the_plain_one_takes(world_of_one, cpu_kernels):
    """bf16 hidden and an fp32 weight under autocast (an autocast model's last hidden state and its
    fp32 head): the plain fused loss casts as F.linear; the vocabulary-parallel one refused the mix
    ('expected weight of hidden's dtype') because it checked dtypes before casting."""
    g = torch.Generator().manual_seed(4)
    h = torch.randn(6, 16, generator=g).bfloat16()
    w = torch.randn(23, 16, generator=g)
    t = torch.randint(0, 23, (6,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ZF.linear_cross_entropy(h, w, t)
        got = zerofuse.tp.vocab_parallel_linear_cross_entropy(h, w, t)
    torch.testing.assert_close(got, want, **tol(torch.bfloat16))
