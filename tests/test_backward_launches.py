"""Backwards that launch nothing they need not: an output that gets no gradient is not zero-filled
(the norms' unused h, the fused cross-entropy's lse and gradient outputs), and the cross-entropy
scales the gradients it made in the forward in one multi-tensor launch. Gradients still equal the
reference's. On the kernels' path (the interpreter), where the step's launches are counted; the
input_bias gradient also on the native CPU path."""
from __future__ import annotations

import pytest
import torch

from tolerances import assert_close
from zerofuse import kernels
from zerofuse.nn.functional import add_layer_norm, linear_cross_entropy
from zerofuse.train.launches import CountLaunches

interp = pytest.mark.skipif(not kernels.triton_on_cpu(), reason="the kernels' path (interpreter)")


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


@interp
@pytest.mark.parametrize("use", ["y", "h", "both"])
def test_add_layer_norm_backward_zero_fills_no_unused_output(use):
    from zerofuse.kernels import colsum

    colsum.arrival_counter(torch.device("cpu"))  # made (zero-filled) once per process, before counting
    g = torch.Generator().manual_seed(0)
    x, r, w, b = torch.randn(7, 33, generator=g), torch.randn(7, 33, generator=g), torch.randn(33), torch.randn(33)
    dy, dh = torch.randn(7, 33, generator=g), torch.randn(7, 33, generator=g)
    ours, ref = _leaves(x, r, w, b), _leaves(x, r, w, b)
    y, h = add_layer_norm(ours[0], ours[1], 33, ours[2], ours[3])
    out = {"y": [(y, dy)], "h": [(h, dh)], "both": [(y, dy), (h, dh)]}[use]
    with CountLaunches() as c:
        torch.autograd.backward([t for t, _ in out], [d for _, d in out])
    assert "zeros" not in c.names and "add" not in c.names, c.names
    h_ref = ref[0] + ref[1]
    y_ref = torch.nn.functional.layer_norm(h_ref, (33,), ref[2], ref[3])
    pairs = {"y": [(y_ref, dy)], "h": [(h_ref, dh)], "both": [(y_ref, dy), (h_ref, dh)]}[use]
    torch.autograd.backward([t for t, _ in pairs], [d for _, d in pairs])
    for name, a, e in zip(("x", "residual", "weight", "bias"), ours, ref):
        if e.grad is None:
            assert a.grad is None or not a.grad.any(), name
        else:
            assert_close(a.grad, e.grad, atol=1e-5, rtol=1e-4, msg=name)


@interp
def test_fused_cross_entropy_backward_scales_in_one_launch():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(13, 24, generator=g), torch.randn(50, 24, generator=g) * 0.3
    target = torch.randint(0, 50, (13,), generator=g)
    ours, ref = _leaves(hidden, weight), _leaves(hidden, weight)
    loss = linear_cross_entropy(ours[0], ours[1], target)
    with CountLaunches() as c:
        (loss * 0.5).backward()
    assert c.names.get("_foreach_mul_") == 1 and "mul_" not in c.names and "zeros" not in c.names, c.names
    (torch.nn.functional.cross_entropy(ref[0] @ ref[1].T, target) * 0.5).backward()
    for a, e in zip(ours, ref):
        assert_close(a.grad, e.grad, atol=1e-6, rtol=1e-5)


@interp
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_input_bias_gets_its_gradient_from_the_norm(rms, compiled):
    """A bias added into the norm's input by its producer, detached (F.linear(a, w, b.detach())),
    and handed to the norm as input_bias: b's gradient, the sum of the input's gradient over the
    rows, comes from the norm's backward (eagerly: its kernel; compiled: a fused zero-valued add),
    equal to the unfused graph's where the add carries it; the output is unchanged."""
    from zerofuse.nn.functional import add_rms_norm

    norm = add_rms_norm if rms else add_layer_norm
    g = torch.Generator().manual_seed(0)
    a, r, b, w = torch.randn(3, 5, 16, generator=g), torch.randn(3, 5, 16, generator=g), torch.randn(16), torch.randn(16)
    dy, dh = torch.randn(3, 5, 16, generator=g), torch.randn(3, 5, 16, generator=g)
    ours, ref = _leaves(a, r, b, w), _leaves(a, r, b, w)

    def fused(a, r, b, w):
        return norm(a + b.detach(), r, 16, w, input_bias=b)

    f = torch.compile(fused, backend="aot_eager", fullgraph=True) if compiled else fused
    y, h = f(*ours)
    torch.autograd.backward([y, h], [dy, dh])
    y_ref, h_ref = norm(ref[0] + ref[2], ref[1], 16, ref[3])
    torch.autograd.backward([y_ref, h_ref], [dy, dh])
    assert torch.equal(y, y_ref.detach()) and torch.equal(h, h_ref.detach())
    for name, got, want in zip(("input", "residual", "input_bias", "weight"), ours, ref):
        assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_input_bias_of_the_wrong_shape_is_refused():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="expected input_bias of shape \\[8\\]"):
        add_layer_norm(x, x, 8, input_bias=torch.randn(7))


@interp
def test_gpt_block_attention_bias_gradient_from_norm2():
    """gpt.Block adds the attention's output bias in its projection and takes its gradient from
    norm2's backward: the same gradients (every param) as the block without the fold, and no sum
    over the attention output in the backward."""
    from zerofuse.models import gpt

    cfg = gpt.config("tiny", dim=32, n_head=2, n_layer=1, bias=True)
    torch.manual_seed(0)
    block = gpt.Block(cfg)
    assert block.fold_attn_bias
    x, delta, dx, dd = (torch.randn(2, 5, 32) for _ in range(4))
    proj_calls = []  # the projection runs as a module (its hooks, e.g. a ZeRO-3 gather, fire)
    block.attn.proj.register_forward_pre_hook(lambda mod, args: proj_calls.append(1))
    grads = {}
    for fold in (True, False):
        block.fold_attn_bias = fold
        block.zero_grad()
        with CountLaunches() as c:
            out = block(x, delta)
            torch.autograd.backward(out, [dx, dd])
        grads[fold] = ({n: p.grad.clone() for n, p in block.named_parameters()}, c.names.get("sum", 0))
    for n, want in grads[False][0].items():
        assert_close(grads[True][0][n], want, atol=1e-5, rtol=1e-5, msg=n)
    assert grads[True][1] == grads[False][1] - 1, (grads[True][1], grads[False][1])
    assert len(proj_calls) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_input_bias_on_the_cpu_kernels(cpu_kernels, dtype):
    """The same input_bias gradient on the native CPU path (C++ kernels; float64: torch's), where the
    norm's backward sums the rows in torch."""
    g = torch.Generator().manual_seed(0)
    a, r = (torch.randn(2, 7, 12, generator=g, dtype=dtype) for _ in range(2))
    b, w = torch.randn(12, dtype=dtype), torch.randn(12, dtype=dtype)
    dy = torch.randn(2, 7, 12, generator=g, dtype=dtype)
    ours, ref = _leaves(a, r, b, w), _leaves(a, r, b, w)
    y, _ = add_layer_norm(ours[0] + ours[2].detach(), ours[1], 12, ours[3], input_bias=ours[2])
    y.backward(dy)
    y_ref, _ = add_layer_norm(ref[0] + ref[2], ref[1], 12, ref[3])
    y_ref.backward(dy)
    for name, got, want in zip(("input", "residual", "input_bias", "weight"), ours, ref):
        assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5, msg=name)
