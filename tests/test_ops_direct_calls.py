"""The torch ops called directly (torch.ops.zerofuse.*, the documented op surface) with arguments
their faces never pass: refused by name, by the op and by its fake alike, before any kernel reads
memory past an input (a review's reproductions, 2026-12-07: linear_cross_entropy_backward with a
short lse or a (2, T) dloss segfaulted the interpreter's kernels; the MoE backward ops read past a
short dout; in-place RoPE rotated elements q and k share twice; a norm's (2, 8) weight ran forward
and its (16,) gradient was refused by autograd)."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from zerofuse import reference
from zerofuse.nn import functional as ZF
import zerofuse.nn as zn

Z = torch.ops.zerofuse


def _both(call, exc, msg):
    """The op on real tensors, then its fake (the same arguments under FakeTensorMode)."""
    with pytest.raises(exc, match=msg):
        call(lambda t: t)
    with FakeTensorMode() as mode, pytest.raises(exc, match=msg):
        call(mode.from_tensor)


def _lce_inputs():
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(5, 8, generator=g), torch.randn(11, 8, generator=g)
    t = torch.randint(0, 11, (5,), generator=g)
    lse = Z.linear_cross_entropy(h, w, t, None, -100, 0.0, 0.0, 0.0, "none", 0, False)[1]
    return h, w, t, lse


@pytest.mark.parametrize("case, msg", [
    ("dloss 2-D", r"expected dloss to be a floating-point tensor of shape \(5,\) \(reduction 'none'\)"),
    ("dloss per token for mean", r"expected dloss to be a floating-point tensor of shape \(\) \(reduction 'mean'\)"),
    ("lse short", r"expected lse to be the forward's, torch.float32 of shape \(5,\)"),
    ("lse int", r"expected lse to be the forward's, torch.float32 of shape \(5,\) on cpu, got torch.int64")])
def test_linear_cross_entropy_backward_checks_dloss_and_lse(kernel_path, case, msg):
    h, w, t, lse = _lce_inputs()
    dloss, red = {"dloss 2-D": (torch.ones(2, 5), "none"), "dloss per token for mean": (torch.ones(5), "mean")}.get(
        case, (torch.ones(5), "none"))
    lse = {"lse short": lse[:3].clone(), "lse int": lse.long()}.get(case, lse)

    def call(f):
        Z.linear_cross_entropy_backward(f(dloss), f(h), f(w), f(t), None, f(lse), -100, 0.0, 0.0, 0.0, red, 0)
    _both(call, RuntimeError, msg)


def test_linear_cross_entropy_fake_refuses_grad_without_a_reduction():
    h, w, t, _ = _lce_inputs()
    _both(lambda f: Z.linear_cross_entropy(f(h), f(w), f(t), None, -100, 0.0, 0.0, 0.0, "none", 0, True),
          RuntimeError, r"grad=True needs reduction 'mean' or 'sum'")


def test_moe_backward_ops_check_their_inputs(kernel_path):
    g = torch.Generator().manual_seed(0)
    x, experts = torch.randn(5, 8, generator=g), torch.randint(0, 4, (5, 2), generator=g)
    y, pos, src, _ = Z.moe_permute(x, experts, 4)
    buf = torch.full((10, 8), 777.0)
    short3, short2, rows5, src4, w = buf[:3], buf[:2], buf[:5], src[:4], torch.ones(5, 2)
    _both(lambda f: Z.moe_permute_backward(f(short3), f(pos)), RuntimeError,
          r"moe_permute_backward: expected dout to be a floating-point tensor \[tokens \* top_k = 10, dim\]")
    _both(lambda f: Z.moe_unpermute_backward(f(short2), f(y), f(src), f(w)), RuntimeError,
          r"moe_unpermute_backward: expected dout to be a floating-point tensor \[5, 8\], got torch.float32 \[2, 8\]")
    _both(lambda f: Z.moe_unpermute_backward(f(rows5), f(y), f(src4), f(w)), RuntimeError,
          r"expected src to be int64 \[10\]")
    with pytest.raises(IndexError, match=r"moe_permute_backward: expected pos in \[0, 10\) or -1, got 10"):
        Z.moe_permute_backward(torch.ones(10, 8), pos + 1000)
    dx = Z.moe_permute_backward(torch.ones(10, 8), pos)  # what the checks let through is as before
    assert torch.equal(dx, torch.full((5, 8), 2.0))


def test_in_place_rope_refuses_q_and_k_sharing_elements_and_takes_slices_of_one_projection(kernel_path):
    cos, sin = zn.rope_tables(6, 8)
    q = torch.randn(1, 2, 6, 8)
    with pytest.raises(RuntimeError, match=r"expected q and k not to share memory"):
        Z.rotary_embedding_(q, q, cos, sin, None, False, False)
    buf = torch.randn(2, 3, 6, 8)
    before = buf.clone()
    with pytest.raises(RuntimeError, match=r"expected q and k not to share memory"):
        ZF.rotary_embedding(buf[:, :2], buf[:, 1:], cos, sin, inplace=True)  # heads 0-1 and 1-2
    assert torch.equal(buf, before)  # refused before rotating either
    k16 = q.view(torch.bfloat16)[..., :8]  # k of another dtype over q's bytes (a review of the check)
    with pytest.raises(RuntimeError, match=r"expected q and k not to share memory"):
        Z.rotary_embedding_(q, k16, cos.bfloat16(), sin.bfloat16(), None, False, False)
    qkv = torch.randn(2, 6, 48)  # q, k, v heads side by side in each row: disjoint, interleaved in memory
    q, k = (qkv[..., i * 16:(i + 1) * 16].view(2, 6, 2, 8).transpose(1, 2) for i in (0, 1))
    want = [reference.rotary_embedding(t.clone(), cos, sin) for t in (q, k)]
    ZF.rotary_embedding(q, k, cos, sin, inplace=True)
    torch.testing.assert_close(q, want[0])
    torch.testing.assert_close(k, want[1])


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_norm_ops_take_a_1d_weight(kernel_path, op):
    x, w = torch.randn(3, 16), torch.randn(2, 8)
    args = (w,) if op == "rms_norm" else (w, w)
    _both(lambda f: getattr(Z, op)(f(x), *(f(a) for a in args), None, 1e-5),
          RuntimeError, r"expected weight to be a 1-D floating-point tensor of 16 elements")
