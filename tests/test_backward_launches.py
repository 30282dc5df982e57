"""Backwards that launch nothing they need not: an output that gets no gradient is not zero-filled
(the norms' unused h, the fused cross-entropy's lse and gradient outputs), and the cross-entropy
scales the gradients it made in the forward in one multi-tensor launch. Gradients still equal the
reference's. On the kernels' path (the interpreter), where the step's launches are counted."""
from __future__ import annotations

import pytest
import torch

from tolerances import assert_close
from zerofuse import kernels
from zerofuse.nn.functional import add_layer_norm, linear_cross_entropy
from zerofuse.train.launches import CountLaunches

pytestmark = pytest.mark.skipif(not kernels.triton_on_cpu(), reason="the kernels' path (interpreter)")


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


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
