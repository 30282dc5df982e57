"""``zerofuse::rotary_embedding`` (out of place, differentiable) and ``zerofuse::rotary_embedding_`` (in
place): RoPE of q and k (B, H, N, D) from cos/sin tables (L, R/2), optional positions (B, N),
half-split or interleaved pairs (kernels/rotary.py has the formulas). The backward is the inverse
rotation of the incoming gradients; the tables are constants (no gradient).

CUDA tensors run kernels/rotary.py; CPU tensors the same formulas in torch ops (fp32; float64 for
float64), or the Triton kernel in the interpreter under ZEROFUSE_TRITON_ON_CPU=1.
"""
from __future__ import annotations

import torch
from torch import Tensor

from zerofuse import kernels, reference
from zerofuse._overlap import shared
from zerofuse.kernels import rotary as K
from zerofuse.ops import eager_apply, first_order, empty_in_layout, register
from zerofuse.ops.signatures import batched

_NAME = "zerofuse::rotary_embedding"
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_args(fn: str, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None) -> None:
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4 or not t.is_floating_point() or (t.numel() and t.stride(-1) != 1):
            raise RuntimeError(f"{fn}: expected {name} to be a floating-point (batch, heads, seq, head_dim) tensor with "
                               f"a unit stride along head_dim, got {t.dtype} {list(t.shape)} strides {list(t.stride())}")
    b, _, n, d = q.shape
    if k.shape[0] != b or k.shape[2] != n or k.shape[3] != d or k.device != q.device:
        raise RuntimeError(f"{fn}: expected k of q's batch, seq and head_dim ({b}, *, {n}, {d}) on {q.device}, got "
                           f"{list(k.shape)} on {k.device}")
    if cos.dim() != 2 or cos.shape != sin.shape or not cos.is_floating_point() or cos.dtype != sin.dtype:
        raise RuntimeError(f"{fn}: expected cos and sin to be floating-point tables (positions, rotary_dim / 2) of one "
                           f"shape and dtype, got {cos.dtype} {list(cos.shape)} and {sin.dtype} {list(sin.shape)}")
    if not 1 <= 2 * cos.shape[1] <= d or cos.device != q.device or sin.device != q.device:
        raise RuntimeError(f"{fn}: expected tables of 1 to head_dim / 2 = {d // 2} columns on {q.device}, got "
                           f"{list(cos.shape)} on {cos.device}")
    if positions is not None and (tuple(positions.shape) != (b, n) or positions.is_floating_point()
                                  or positions.device != q.device):
        raise RuntimeError(f"{fn}: expected positions to be an integer tensor of shape ({b}, {n}) on {q.device}, got "
                           f"{positions.dtype} {list(positions.shape)} on {positions.device}")
    if positions is None and n > cos.shape[0]:
        raise RuntimeError(f"{fn}: sequence length {n} exceeds the {cos.shape[0]} positions of the tables")


def _rope_torch(x, out, cos, sin, positions, interleaved, inverse) -> None:
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    b, _, n, _ = x.shape
    half = cos.shape[1]
    pos = positions if positions is not None else torch.arange(n, device=x.device).expand(b, n)
    c, s = cos.to(acc)[pos].unsqueeze(1), sin.to(acc)[pos].unsqueeze(1)
    if inverse:
        s = -s
    sl1, sl2 = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved else (slice(0, half), slice(half, 2 * half))
    x1, x2 = x[..., sl1].to(acc), x[..., sl2].to(acc)
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    out[..., sl1] = o1
    out[..., sl2] = o2


def _on_triton(x: Tensor) -> bool:
    return x.dtype in _KERNEL_DTYPES and (x.is_cuda or (x.device.type == "cpu" and kernels.triton_on_cpu()))


def _rope(x, out, cos, sin, positions, interleaved, inverse) -> None:
    if _on_triton(x):
        K.rope(x, out, cos.contiguous(), sin.contiguous(), positions, interleaved, inverse)
    else:
        _rope_torch(x, out, cos, sin, positions, interleaved, inverse)


def _out_of_place(x, cos, sin, positions, interleaved, inverse) -> Tensor:
    # [Note: outputs follow their inputs' layout]; a batched x (a batched backward's gradient) gets a
    # batched out: an unbatched one could not take the batched values (aten::copy_ raised)
    out = torch.empty_like(x) if batched(x) else empty_in_layout(x)
    if 2 * cos.shape[1] < x.shape[-1]:  # partial rotary: the other dims as they are
        out.copy_(x)
    _rope(x, out, cos, sin, positions, interleaved, inverse)
    return out


def _check_values(fn, cos, positions) -> None:
    if positions is not None:
        from zerofuse.ops.ids import check_ids

        check_ids(fn, "positions", positions, cos.shape[0])


def rope_pair(q, k, cos, sin, positions, interleaved: bool, inverse: bool, checked: bool = False):
    """(RoPE(q), RoPE(k)) in new tensors laid out as q and k: the op's body, EagerRope's and the
    face's without autograd. checked: the arguments and positions were checked (EagerRope's
    backward: the forward checked the same saved, unmodified positions)."""
    if not checked:
        check_args(_NAME, q, k, cos, sin, positions)
        _check_values(_NAME, cos, positions)
    return (_out_of_place(q, cos, sin, positions, interleaved, inverse),
            _out_of_place(k, cos, sin, positions, interleaved, inverse))


@torch.library.custom_op(_NAME, mutates_args=())
def rotary_embedding(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None, interleaved: bool,
                     inverse: bool) -> tuple[Tensor, Tensor]:
    """(RoPE(q), RoPE(k)) in new tensors laid out as q and k; inverse=True rotates back (the backward)."""
    return rope_pair(q, k, cos, sin, positions, interleaved, inverse)


@rotary_embedding.register_fake
def _(q, k, cos, sin, positions, interleaved, inverse):
    check_args(_NAME, q, k, cos, sin, positions)
    return empty_in_layout(q), empty_in_layout(k)


def _setup(ctx, inputs, output):
    _, _, cos, sin, positions, interleaved, inverse = inputs
    ctx.args = (interleaved, not inverse)
    ctx.save_for_backward(cos, sin, positions)


def _unit_last(t: Tensor) -> Tensor:
    """A gradient the kernels read in place (any strides with a unit one along head_dim): the
    gradients keep their layout (a (B, N, H, D) one gives a (B, N, H, D) one back)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _backward(ctx, dq, dk):
    cos, sin, positions = ctx.saved_tensors
    dq, dk = rotary_embedding(_unit_last(dq), _unit_last(dk), cos, sin, positions, *ctx.args)
    return dq, dk, None, None, None, None, None


rotary_embedding.register_autograd(_backward, setup_context=_setup)


class EagerRope(torch.autograd.Function):
    """The op above for eager mode without custom_op's Python dispatch (as ops.norms.EagerNorm):
    apply(q, k, cos, sin, positions, interleaved) -> (RoPE(q), RoPE(k)). The positions are checked
    once, in forward (on a GPU their check is a few launches): the backward rotates the gradients
    back by the same saved positions (autograd refuses them if modified in between)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, positions, interleaved):
        ctx.interleaved = interleaved
        ctx.save_for_backward(cos, sin, positions)
        if torch.autograd.forward_ad._current_level >= 0:  # (RoPE is linear in q and k: jvp below)
            ctx.save_for_forward(cos, sin, positions)
            ctx.like = (q, k)
            ctx.set_materialize_grads(False)  # (a tangent of the tables is then None unless they are dual)
        return rope_pair(q, k, cos, sin, positions, interleaved, False)

    @staticmethod
    def jvp(ctx, tq, tk, tcos, tsin, _tpos, _interleaved):
        """Forward-mode AD: the tangents rotated as q and k are (the face sent a dual tensor to the
        kernels alone, which dropped its tangent silently)."""
        if tcos is not None or tsin is not None:
            raise NotImplementedError(f"{_NAME}: forward-mode AD through the cos/sin tables (constants) is not "
                                      "supported")
        cos, sin, positions = ctx.saved_tensors
        q, k = ctx.like
        tq = torch.zeros_like(q) if tq is None else tq
        tk = torch.zeros_like(k) if tk is None else tk
        return rope_pair(_unit_last(tq), _unit_last(tk), cos, sin, positions, ctx.interleaved, False, checked=True)

    @staticmethod
    @first_order
    def backward(ctx, dq, dk):
        cos, sin, positions = ctx.saved_tensors
        if dq is None or dk is None:  # (grads not materialized: the forward-AD case above)
            dq = torch.zeros_like(ctx.like[0]) if dq is None else dq
            dk = torch.zeros_like(ctx.like[1]) if dk is None else dk
        dq, dk = rope_pair(_unit_last(dq), _unit_last(dk), cos, sin, positions, ctx.interleaved, True, checked=True)
        return dq, dk, None, None, None, None


eager_rope = eager_apply(EagerRope)


@torch.library.custom_op(_NAME + "_", mutates_args=("q", "k"))
def rotary_embedding_(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None, interleaved: bool,
                      inverse: bool) -> None:
    """RoPE of q and k in place (no autograd)."""
    check_args(_NAME + "_", q, k, cos, sin, positions)
    _check_values(_NAME + "_", cos, positions)
    for name, t in (("q", q), ("k", k)):  # (the kernel would rotate shared elements once per alias)
        if torch._debug_has_internal_overlap(t) == 1:
            raise RuntimeError(f"{_NAME}_: unsupported operation: more than one element of {name} (shape "
                               f"{list(t.shape)}, strides {list(t.stride())}) refers to a single memory location; "
                               f"clone it before rotating in place")
    _refuse_shared(q, k)
    _rope(q, q, cos, sin, positions, interleaved, inverse)
    _rope(k, k, cos, sin, positions, interleaved, inverse)


def _refuse_shared(q: Tensor, k: Tensor) -> None:
    """q and k sharing an element: rotated twice, silently (q is k, or overlapping heads of one
    buffer; a review's reproduction, 2026-12-07). Exact (zerofuse/_overlap.py), so q and k as
    disjoint slices of one fused projection still rotate in place (their spans cross: a scratch
    mask's work per call); on CUDA the refusal is a device-side assert, as the ids' checks."""
    both = shared(q, k)
    if both is None:
        return
    msg = (f"{_NAME}_: expected q and k not to share memory (both are rotated in place: a shared element is rotated "
           f"twice), got q {list(q.shape)} and k {list(k.shape)} over the same elements; rotate a clone of one")
    if q.device.type == "cpu":
        if bool(both):
            raise RuntimeError(msg)
    else:
        torch._assert_async(~both, msg)


@rotary_embedding_.register_fake
def _(q, k, cos, sin, positions, interleaved, inverse):
    check_args(_NAME + "_", q, k, cos, sin, positions)


def _qk_heads(t: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """The first n_heads heads of t (B, N, heads * head_dim) as a (B, n_heads, N, head_dim) view."""
    b, n = t.shape[:2]  # (heads spelled out: -1 is ambiguous for an empty batch or sequence)
    return t.view(b, n, t.shape[-1] // head_dim, head_dim)[:, :, :n_heads].transpose(1, 2)


def _rotated_copy(t: Tensor, cos: Tensor, sin: Tensor, n_heads: int, head_dim: int, interleaved: bool,
                  inverse: bool) -> Tensor:
    """t with its first n_heads heads rotated, in a new contiguous tensor: one kernel pass (the rest
    copied by it) on the kernels' path, a copy then the rotation in place on torch's."""
    if _on_triton(t):
        t = t if t.is_contiguous() else t.contiguous()  # (a gradient may come expanded or strided)
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        b, n, h = t.shape[0], t.shape[1], t.shape[-1] // head_dim
        x_all = t.view(b, n, h, head_dim).transpose(1, 2)
        K.rope(x_all, out.view(b, n, h, head_dim).transpose(1, 2), cos.contiguous(), sin.contiguous(), None,
               interleaved, inverse, rotate_heads=n_heads)
        return out
    out = t.clone(memory_format=torch.contiguous_format)
    heads = _qk_heads(out, n_heads, head_dim)
    _rope(heads, heads, cos, sin, None, interleaved, inverse)
    return out


class EagerRopeQKV(torch.autograd.Function):
    """RoPE of the q and k heads of a fused QKV projection's output qkv (B, N, (Hq + 2 Hkv) * D) at
    positions 0..N-1, v as it is, in the same packed layout, eagerly: one kernel pass writes the copy
    with its first n_heads = Hq + Hkv heads (q's and k's, adjacent) rotated, the backward likewise on
    the gradient. zerofuse::attention_qkv then reads it as it reads an unrotated one: no
    split heads, no three qkv-sized zero-filled slice gradients summed, no transposes
    (zerofuse.nn.Attention with a RotaryEmbedding). The face (RotaryEmbedding.rotate_packed) checked
    the arguments."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, n_heads, head_dim, interleaved):
        ctx.args = (n_heads, head_dim, interleaved)
        ctx.save_for_backward(cos, sin)
        return _rotated_copy(qkv, cos, sin, n_heads, head_dim, interleaved, False)

    @staticmethod
    @first_order
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotated_copy(grad, cos, sin, *ctx.args, True), None, None, None, None, None


eager_rope_qkv = eager_apply(EagerRopeQKV)


def _selftest(device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    q64, k64 = torch.randn(2, 3, 37, 80, generator=g, dtype=torch.float64), torch.randn(2, 1, 37, 80, generator=g,
                                                                                          dtype=torch.float64)
    ang = torch.rand(50, 20, generator=g, dtype=torch.float64) * 6
    cos, sin = ang.cos().float().to(device), ang.sin().float().to(device)
    pos = torch.randint(0, 50, (2, 37), generator=g)
    for interleaved in (False, True):
        q, k = (t.float().to(device).requires_grad_() for t in (q64, k64))
        oq, ok = rotary_embedding(q, k, cos, sin, pos.to(device), interleaved, False)
        for out, x in ((oq, q64), (ok, k64)):
            want = reference.rotary_embedding(x, cos.double().cpu(), sin.double().cpu(), pos, interleaved)
            torch.testing.assert_close(out.double().cpu(), want, atol=1e-5, rtol=1e-5)
        (oq.sum() + ok.square().sum()).backward()  # the inverse rotation of the gradients
        back, _ = rotary_embedding(torch.ones_like(oq), 2 * ok.detach(), cos, sin, pos.to(device), interleaved, True)
        torch.testing.assert_close(q.grad, back, atol=1e-6, rtol=1e-6)
        qi, ki = q.detach().clone(), k.detach().clone()  # the in-place op (the doctor passed it without a call)
        rotary_embedding_(qi, ki, cos, sin, pos.to(device), interleaved, False)
        torch.testing.assert_close(qi, oq.detach(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ki, ok.detach(), atol=1e-6, rtol=1e-6)


register(_NAME, "Triton", _selftest)
register(_NAME + "_", "Triton", _selftest)
