"""Functional faces with torch.nn.functional's signatures, plus the fused residual-add variants.

    layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-05)
    rms_norm(input, normalized_shape, weight=None, eps=None)
    add_layer_norm(input, residual, normalized_shape, weight=None, bias=None, eps=1e-05) -> (y, h)
    add_rms_norm(input, residual, normalized_shape, weight=None, eps=None) -> (y, h)
    linear_cross_entropy(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean", ...)  (nn/loss.py)
    swiglu(gate, up=None), geglu(gate, up=None), bias_gelu(input, bias)  (nn/mlp.py; up=None: gate is [gate | up])
    rotary_embedding(q, k, cos, sin, positions=None, *, interleaved=False, inplace=False)  (nn/rotary.py)
    scaled_dot_product_attention(query, key, value, ..., document_ids=None), qkv_attention(qkv, num_heads, ...)  (nn/sdpa.py)

with h = input + residual, y = norm(h): the pre-norm transformer step in one pass. Triton kernels
on CUDA, C++ kernels on CPU (Triton in the interpreter under ZEROFUSE_TRITON_ON_CPU=1). Under
torch.compile they trace the zerofuse custom ops; in eager mode they call the same kernels through
ops.norms.EagerNorm, which skips custom_op's Python dispatch overhead, and the norms check their
arguments once per call signature ([Note: call signatures], zerofuse/ops/signatures.py).
"""
from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence

import torch
from torch import Tensor

from zerofuse import kernels as _kernels
from zerofuse.kernels.norms import FwdLaunch
from zerofuse.nn.autocast import cast_all
from zerofuse.ops import norms as _ops
from zerofuse.ops.signatures import Plans, autograd_modes, needs_autograd, signature, torch_only
from zerofuse.reference import default_rms_eps

_ShapeLike = int | Sequence[int] | torch.Size


def _shape(normalized_shape: _ShapeLike, fn: str = "layer_norm") -> tuple[int, ...]:
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    try:
        return tuple(operator.index(n) for n in normalized_shape)  # (numpy's ints too, as torch's)
    except TypeError:
        pass
    raise TypeError(f"zerofuse.nn.functional.{fn}: expected normalized_shape to be an int or a sequence of ints, got "
                    f"{normalized_shape!r}")


def _check(fn, input, shape, weight, bias, residual, input_bias=None) -> None:
    # The common case (every tensor well-formed) in few attribute reads: this runs on every call.
    if not isinstance(input, Tensor) or not input.is_floating_point():
        got = input.dtype if isinstance(input, Tensor) else type(input).__name__
        raise TypeError(f"zerofuse.nn.functional.{fn}: expected input to be a floating-point tensor, got {got}")
    k = len(shape)
    if k == 0 or k > input.dim() or input.shape[-k:] != shape:
        raise ValueError(
            f"zerofuse.nn.functional.{fn}: expected input whose trailing dimensions equal "
            f"normalized_shape={list(shape)}, got input of shape {list(input.shape)}"
        )
    device = input.device
    if weight is not None:
        _check_param(fn, "weight", weight, shape, device)
    if bias is not None:
        _check_param(fn, "bias", bias, shape, device)
    if input_bias is not None:
        _check_param(fn, "input_bias", input_bias, shape, device)
    if residual is not None:
        where = f"zerofuse.nn.functional.{fn}"
        if not isinstance(residual, Tensor):
            raise TypeError(f"{where}: expected residual to be a tensor, got {type(residual).__name__}")
        if residual.shape != input.shape:
            raise ValueError(f"{where}: expected residual of the input's shape {list(input.shape)}, got {list(residual.shape)}")
        if not residual.is_floating_point() or residual.device != device:
            raise ValueError(
                f"{where}: expected residual to be a floating-point tensor on {device}, "
                f"got {residual.dtype} on {residual.device}"
            )


def _check_param(fn, name, p, shape, device) -> None:
    if not isinstance(p, Tensor):
        raise TypeError(f"zerofuse.nn.functional.{fn}: expected {name} to be a tensor or None, got {type(p).__name__}")
    if p.shape != shape:
        raise ValueError(f"zerofuse.nn.functional.{fn}: expected {name} of shape {list(shape)} (normalized_shape), "
                         f"got {list(p.shape)}")
    if not p.is_floating_point():
        raise TypeError(f"zerofuse.nn.functional.{fn}: expected {name} to be a floating-point tensor, got {p.dtype}")
    if p.device != device:
        raise ValueError(f"zerofuse.nn.functional.{fn}: expected {name} on the device of input ({device}), got {p.device}")


def _check_eps(fn, eps) -> None:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"zerofuse.nn.functional.{fn}: expected eps to be a float, got {eps!r}")
    if not eps >= 0:  # a negative eps makes rows of small variance NaN; NaN fails this too
        raise ValueError(f"zerofuse.nn.functional.{fn}: expected eps >= 0, got {eps}")


def _flat(t: Tensor | None, n: int) -> Tensor | None:
    return t if t is None or t.dim() == 1 else t.reshape(n)


def _torch_norm(fn, is_rms, input, residual, normalized_shape, weight, bias, eps, input_bias):
    """The norm by torch's ops (torch_only: torch.func transforms, jit.trace, forward AD): (y, h), input_bias
    given its gradient by a zero-valued add."""
    shape = _shape(normalized_shape, fn)
    _check(fn, input, shape, weight, bias, residual, input_bias)
    if is_rms and eps is None:
        eps = default_rms_eps(input.dtype)
    _check_eps(fn, eps)
    if input_bias is not None:  # (a zero-valued add: its gradient is input's, through y and h, as eager's)
        input = input + (input_bias - input_bias.detach())
    h = input if residual is None else input + residual
    F = torch.nn.functional
    if is_rms:
        return F.rms_norm(h, shape, weight, eps), h
    # y in h's dtype, as eager's: params cast up to it where torch's CPU layer_norm would refuse them
    # (it takes fp32 params with a bf16/fp16 input, not bf16 params with an fp32 h a residual promoted)
    mixed = h.dtype in (torch.bfloat16, torch.float16)
    w, b = (t.to(h.dtype) if t is not None and t.dtype != h.dtype and not (mixed and t.dtype == torch.float32)
            else t for t in (weight, bias))
    return F.layer_norm(h, shape, w, b, eps), h


def _layer_norm(fn, input, residual, normalized_shape, weight, bias, eps, input_bias=None):
    if eps is not None and type(eps) is not float and (isinstance(eps, Tensor) or isinstance(eps, numbers.Real)
                                   and not isinstance(eps, bool)):  # (torch's takes a 0-dim tensor, numpy's
        eps = float(eps)  # numbers: their values; the Triton kernel failed on them)
    if torch_only():
        return _torch_norm(fn, False, input, residual, normalized_shape, weight, bias, eps, input_bias)
    # torch runs layer_norm and rms_norm in fp32 under CUDA autocast (its fp32 list: a bf16 input gives
    # an fp32 output); CPU autocast leaves them alone
    if isinstance(input, Tensor) and input.is_cuda and torch.is_autocast_enabled("cuda"):
        input, residual, weight, bias, input_bias = cast_all(torch.float32, input, residual, weight, bias, input_bias)
    if not torch.compiler.is_compiling():  # a plan for these arguments' signature: no checks, no choices
        key = signature(False, input, residual, normalized_shape, weight, bias, eps, input_bias, _kernels.TRITON_ON_CPU,
                        autograd_modes())
        plan = _PLANS.get(key)
        if plan is not None:
            return plan(input, residual, weight, bias, input_bias)
    shape = _shape(normalized_shape, fn)
    _check(fn, input, shape, weight, bias, residual, input_bias)
    _check_eps(fn, eps)
    input, input_bias = _bias_grad_carrier(input, input_bias)
    n = math.prod(shape)
    if n == 0:  # rows of no elements: nothing to normalise (and no row count to reshape to)
        h = input if residual is None else input + residual
        return torch.nn.functional.layer_norm(h, shape, weight, bias, eps), h
    x, r = _rows(input, residual, shape, n)
    w, b = _flat(weight, n), _flat(bias, n)
    if torch.compiler.is_compiling():
        y, h, _, _ = _ops.layer_norm(x, w, b, r, eps)
        return _as(y, input), (input if residual is None else _as(h, input))
    return _eager_norm(key, input, residual, x, r, w, b, eps, False, _flat(input_bias, n))


_PLANS = Plans()  # [Note: call signatures]: both norms' (is_rms leads the signature)


class _NormPlan:
    """The eager norm for one signature: the Triton kernels' launch worked out, with autograd or
    without. Recorded where the kernels take the tensors as given: one normalised dim, every
    tensor contiguous, the Triton path (CUDA, or the interpreter on CPU)."""

    __slots__ = ("launch", "grad", "is_rms")

    def __init__(self, launch: FwdLaunch, grad: bool, is_rms: bool):
        self.launch, self.grad, self.is_rms = launch, grad, is_rms

    def __call__(self, input, residual, weight, bias, input_bias):
        if self.grad:
            y, h = _ops.eager_norm(input, weight, bias, residual, self.launch.eps, self.is_rms, input_bias, self.launch)
        else:
            y, h, _, _ = self.launch(input, weight, bias, residual)
        return y, (input if residual is None else h)


def _eager_norm(key, input, residual, x, r, w, b, eps, is_rms, input_bias):
    """The eager call of both norms, its arguments checked (x, r: input and residual as rows; w, b,
    input_bias: flat); records the plan of the call's signature (key) where one applies."""
    grad = _needs_grad(x, w, b, r, input_bias)
    # a plan where x is input (one normalised dim: later calls pass the tensors as given) and eps
    # a number (a plan holds no tensor's value)
    if key is not None and x is input and type(eps) in (float, int) and _ops._use_triton(x, r) and all(
            t is None or t.is_contiguous() for t in (x, w, b, r)):
        plan = _NormPlan(FwdLaunch(x, r, w, b, eps, is_rms, stats=grad), grad, is_rms)
        out = plan(input, residual, w, b, input_bias)
        _PLANS.put(key, plan)  # once it ran: a call that fails leaves no plan
        return out
    if grad:
        y, h = _ops.eager_norm(x, w, b, r, eps, is_rms, input_bias)
    else:  # nothing to differentiate: the kernels without autograd's bookkeeping
        y, h, _, _ = _ops._norm_fwd(x, w, b, r, eps, is_rms, stats=False)
    return _as(y, input), (input if residual is None else _as(h, input))


def _needs_grad(x, w, b, r, input_bias=None) -> bool:
    return needs_autograd(x, w, b, r, input_bias)


def _bias_grad_carrier(input, input_bias):
    """(input, input_bias) for the kernels: under torch.compile the bias's gradient is carried by a
    zero-valued add, input + (input_bias - input_bias.detach()), which the compiler fuses; eagerly
    EagerNorm's backward makes it (None returned here: nothing to carry)."""
    if input_bias is not None and torch.compiler.is_compiling():
        return input + (input_bias - input_bias.detach()), None
    return input, input_bias


def _rows(input, residual, shape, n):
    """input (and residual) with the normalised dims as one last dim of n (themselves when there is
    one normalised dim: no reshape)."""
    if len(shape) == 1:
        return input, residual
    x = input.reshape(*input.shape[: input.dim() - len(shape)], n)
    return x, (None if residual is None else residual.reshape(x.shape))


def _as(t: Tensor, like: Tensor) -> Tensor:
    return t if t.shape == like.shape else t.view(like.shape)


def _rms_norm(fn, input, residual, normalized_shape, weight, eps, input_bias=None):
    if eps is not None and type(eps) is not float and (isinstance(eps, Tensor) or isinstance(eps, numbers.Real)
                                   and not isinstance(eps, bool)):  # (as _layer_norm's)
        eps = float(eps)
    if torch_only():
        return _torch_norm(fn, True, input, residual, normalized_shape, weight, None, eps, input_bias)
    if isinstance(input, Tensor) and input.is_cuda and torch.is_autocast_enabled("cuda"):
        input, residual, weight, input_bias = cast_all(torch.float32, input, residual, weight, input_bias)
    if not torch.compiler.is_compiling():
        key = signature(True, input, residual, normalized_shape, weight, eps, input_bias, _kernels.TRITON_ON_CPU,
                        autograd_modes())
        plan = _PLANS.get(key)
        if plan is not None:
            return plan(input, residual, weight, None, input_bias)
    shape = _shape(normalized_shape, fn)
    _check(fn, input, shape, weight, None, residual, input_bias)
    input, input_bias = _bias_grad_carrier(input, input_bias)
    if eps is None:  # torch's: the epsilon of the dtype it computes in (fp32 for bf16/fp16 inputs)
        eps = default_rms_eps(input.dtype)
    _check_eps(fn, eps)
    n = math.prod(shape)
    if n == 0:
        h = input if residual is None else input + residual
        return torch.nn.functional.rms_norm(h, shape, weight, eps), h
    x, r = _rows(input, residual, shape, n)
    w = _flat(weight, n)
    if torch.compiler.is_compiling():
        y, h, _ = _ops.rms_norm(x, w, r, eps)
        return _as(y, input), (input if residual is None else _as(h, input))
    return _eager_norm(key, input, residual, x, r, w, None, eps, True, _flat(input_bias, n))


def layer_norm(input: Tensor, normalized_shape: _ShapeLike, weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Drop-in for torch.nn.functional.layer_norm."""
    return _layer_norm("layer_norm", input, None, normalized_shape, weight, bias, eps)[0]


def rms_norm(input: Tensor, normalized_shape: _ShapeLike, weight: Tensor | None = None,
             eps: float | None = None) -> Tensor:
    """Drop-in for torch.nn.functional.rms_norm (eps=None: torch's default, the epsilon of the dtype
    it computes in: fp32's for bf16/fp16 inputs, although torch's docs say the input's)."""
    return _rms_norm("rms_norm", input, None, normalized_shape, weight, eps)[0]


def add_layer_norm(input: Tensor, residual: Tensor, normalized_shape: _ShapeLike, weight: Tensor | None = None,
                   bias: Tensor | None = None, eps: float = 1e-5, *,
                   input_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(layer_norm(h), h) with h = input + residual, fused; gradients flow to input and residual.
    input_bias (of normalized_shape): a bias already added into input by its producer without a
    gradient path (e.g. F.linear(a, w, b.detach())); never read, it receives its gradient, the sum
    of input's gradient over the rows, from the norm's backward kernel (no separate sum)."""
    return _layer_norm("add_layer_norm", input, residual, normalized_shape, weight, bias, eps, input_bias)


def add_rms_norm(input: Tensor, residual: Tensor, normalized_shape: _ShapeLike, weight: Tensor | None = None,
                 eps: float | None = None, *, input_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(rms_norm(h), h) with h = input + residual, fused; gradients flow to input and residual;
    input_bias as add_layer_norm's."""
    return _rms_norm("add_rms_norm", input, residual, normalized_shape, weight, eps, input_bias)


from zerofuse.nn.loss import linear_cross_entropy  # noqa: E402,F401  (its own module: the fused head + loss)
from zerofuse.nn.mlp import bias_gelu, geglu, swiglu  # noqa: E402,F401  (MLP activations)
from zerofuse.nn.rotary import rotary_embedding  # noqa: E402,F401  (RoPE)
from zerofuse.nn.sdpa import _warned, qkv_attention, scaled_dot_product_attention  # noqa: E402,F401  (attention)

# torch.fx: symbolic tracing records these as calls (leaves), as it records torch.nn.functional's:
# a traced zerofuse norm module (not a leaf as torch.nn's are) handed them Proxies, refused as "not a
# floating-point tensor". fx patches these names in this module's namespace while it traces, so the
# modules' ``F.layer_norm(...)`` lookups find the recording wrapper; no cost outside tracing.
for _name in ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "linear_cross_entropy", "swiglu",
              "geglu", "bias_gelu", "rotary_embedding", "scaled_dot_product_attention"):
    torch.fx.wrap(_name)
del _name
