"""zerofuse's torch ops, and the registry that lists them.

Every op is a ``torch.ops.zerofuse.<name>``: C++ ops get their schema in csrc/registration.cpp and
their fake impl here; Triton ops are ``torch.library.custom_op``s. Each op module registers an
:class:`OpInfo` with a self-test (used by ``python -m zerofuse.doctor``) that checks the op against
``zerofuse.reference`` on a given device.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class OpInfo:
    name: str  # qualified, "zerofuse::flatten_into"
    kind: str  # "C++" or "Triton": where the device kernels come from
    selftest: Callable[[torch.device], None]  # raises AssertionError on a wrong result


OPS: dict[str, OpInfo] = {}


def register(name: str, kind: str, selftest: Callable[[torch.device], None]) -> None:
    OPS[name] = OpInfo(name, kind, selftest)


def eager_apply(cls: type[torch.autograd.Function]) -> Callable:
    """``cls.apply`` for the ops' eager autograd paths (EagerNorm, EagerSwiGLU, EagerQKVAttention)
    without torch.autograd.Function.apply's Python wrapper, whose per-call argument binding and
    functorch dead-wrapper unwrapping cost ~2.6 us of a ~13 us LayerNorm call on this project's CPU
    (a third of the autograd bookkeeping). Under functorch transforms (torch.func.grad, vmap) it
    goes through cls.apply, whose wrapper those need."""
    c_apply = super(torch.autograd.Function, cls).apply
    functorch_active = torch._C._are_functorch_transforms_active

    def apply(*args):
        return cls.apply(*args) if functorch_active() else c_apply(*args)

    return apply


class _Unpacked:
    """A backward's ctx whose saved tensors were unpacked already; every other attribute is ctx's."""

    __slots__ = ("_ctx", "saved_tensors")

    def __init__(self, ctx, saved):
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "saved_tensors", saved)

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def __setattr__(self, name, value):
        setattr(self._ctx, name, value)


def first_order(backward: Callable | None = None, *, name: str | None = None,
                batched_ok: Callable | None = None) -> Callable:
    """For the backward of an autograd Function whose gradients carry no graph (the Eager* ones, the
    fused loss's): under create_graph=True (a gradient penalty, a Hessian-vector product) its
    gradients come out with a graph node that raises when they are differentiated, instead of
    gradients whose own second-order term would be silently missing (a penalty on d(loss)/dx of a
    norm was 137 off torch's: a review's reproduction, 2026-11-27). Used only as values they are
    fine. torch's once_differentiable does this only when the incoming gradients require grad,
    which a penalty's do not. Batched incoming gradients (is_grads_batched=True, vmap over a
    backward) are refused on the Triton path unless ``batched_ok(ctx)`` says this backward runs no
    kernel; the CPU's C++/aten path takes them."""
    if backward is None:
        return lambda fn: first_order(fn, name=name, batched_ok=batched_ok)
    label = name or backward.__qualname__.split(".")[0]
    message = (f"zerofuse: {label} has no double backward: differentiating its gradients (create_graph=True) "
               f"would miss their second-order term; compute that part with torch's ops").encode()

    def run(ctx, *grads):
        if any(map(batched, grads)) and _on_triton(grads) and not (batched_ok and batched_ok(ctx)):
            raise NotImplementedError(
                f"zerofuse: {label}'s backward has no batched rule for its Triton kernels: it was given batched "
                "gradients (torch.autograd.grad(..., is_grads_batched=True), jacobian(vectorize=True), or "
                "torch.func.vmap over a backward); loop over the gradient outputs instead, or apply torch.func's "
                "transforms to the whole forward (zerofuse's faces compute with torch's ops under them)")
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():  # (traced backwards: the compiler's)
            return backward(ctx, *grads)
        saved = ctx.saved_tensors  # (unpacked once: a second unpack raises under non-reentrant checkpointing)
        with torch.no_grad():
            out = backward(_Unpacked(ctx, saved), *grads)
        outs = out if isinstance(out, tuple) else (out,)
        fake = [t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                for t in outs]
        # the raising node's inputs: the gradients, and what they were computed from that has a graph
        # (the incoming gradients, the saved inputs): differentiated with respect to a param upstream
        # (torch.autograd.grad(penalty, linear.weight)), a path from the gradients to it ran through
        # no node of this one, and the second-order term was silently missing (a review's
        # reproduction, 2026-12-06: every first-order face, e.g. LayerNorm's 2093 off torch's)
        anchors = [t for t in (*grads, *saved) if isinstance(t, torch.Tensor) and t.requires_grad]
        wrapped = torch._C._functions.DelayedError(message, len(fake) + len(anchors))(*fake, *anchors)
        wrapped = (wrapped if isinstance(wrapped, tuple) else (wrapped,))[:len(fake)]
        return wrapped if isinstance(out, tuple) else wrapped[0]

    run.__name__, run.__qualname__, run.__doc__ = backward.__name__, backward.__qualname__, backward.__doc__
    return run


def _on_triton(grads) -> bool:
    """Whether a backward given these gradients runs Triton kernels: on CUDA, and on the CPU in the
    interpreter (ZEROFUSE_TRITON_ON_CPU=1); the CPU's C++/aten path runs batched tensors through
    the dispatcher's batching rules and fallbacks."""
    from zerofuse import kernels
    device = next((g.device for g in grads if isinstance(g, torch.Tensor)), None)
    return device is not None and (device.type == "cuda" or (device.type == "cpu" and kernels.triton_on_cpu()))


def layout_strides(t: torch.Tensor) -> tuple[int, ...]:
    """[Note: outputs follow their inputs' layout] The strides of a dense tensor of t's shape whose
    memory orders the dims as t's strides do (outermost the largest; ties keep the dim order; the
    last dim innermost): a (B, H, N, D) view of a (B, N, H, D) buffer (a Hugging Face projection's
    heads) gives (B, N, H, D) memory seen as (B, H, N, D), a contiguous t contiguous strides.
    Attention's and RoPE's outputs and gradients take their inputs' layout this way, on every path
    and in their fake impls, so the views and transposes a model puts around them stay views
    (no copy for the output projection, none for the projections' gradients)."""
    n = t.dim()
    if t.is_contiguous() or any(s == 0 and z > 1 for s, z in zip(t.stride(), t.shape)):  # (expanded: no order)
        order = list(range(n))
    else:
        order = sorted(range(n - 1), key=lambda i: (-t.stride(i), i)) + [n - 1]
    strides, step = [0] * n, 1
    for i in reversed(order):
        strides[i] = step
        step *= max(t.shape[i], 1)
    return tuple(strides)


def empty_in_layout(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new tensor of t's shape and device in t's layout ([Note: outputs follow their inputs' layout])."""
    if t.is_contiguous():
        return torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device)
    return torch.empty_strided(t.shape, layout_strides(t), dtype=dtype or t.dtype, device=t.device)


def in_layout(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """t (of like's shape) in like's layout: t itself where its strides are those already."""
    want = layout_strides(like)
    if all(a == b or s <= 1 for a, b, s in zip(t.stride(), want, t.shape)):
        return t
    return torch.empty_strided(like.shape, want, dtype=t.dtype, device=like.device).copy_(t)


def list_ops() -> list[str]:
    """Qualified names of zerofuse's registered ops."""
    return sorted(OPS)


def registered_in_torch() -> list[str]:
    """Every zerofuse:: op the dispatcher knows, to check nothing ships without a self-test."""
    return sorted(
        {n.split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("zerofuse::")}
    )


from zerofuse.ops.signatures import batched  # noqa: E402
from zerofuse.ops.flatten import flatten_into, packed_offsets, unflatten_from  # noqa: E402
from zerofuse.ops import norms  # noqa: E402,F401
from zerofuse.ops import norms_cpu  # noqa: E402,F401
from zerofuse.ops import attention  # noqa: E402,F401
from zerofuse.ops import attention_qkv  # noqa: E402,F401
from zerofuse.ops import linear_cross_entropy  # noqa: E402,F401
from zerofuse.ops import swiglu  # noqa: E402,F401
from zerofuse.ops import bias_gelu  # noqa: E402,F401
from zerofuse.ops import rotary  # noqa: E402,F401
from zerofuse.ops import moe  # noqa: E402,F401
from zerofuse.ops.adam import adam_  # noqa: E402
from zerofuse.ops.l2norm import l2norm  # noqa: E402
from zerofuse.ops.lamb import lamb_, lamb_stage1_, lamb_stage2_  # noqa: E402
from zerofuse.ops.lars import lars_  # noqa: E402

__all__ = ["OPS", "OpInfo", "list_ops", "registered_in_torch", "flatten_into", "unflatten_from", "packed_offsets", "adam_", "l2norm",
           "lamb_", "lamb_stage1_", "lamb_stage2_", "lars_"]
