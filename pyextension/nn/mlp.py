"""MLP activations. Gated MLPs: ``swiglu(gate, up)`` / ``geglu(gate, up)`` (act(gate) * up in one pass,
the product not kept for backward; ``swiglu(x)`` for x = [gate | up], a fused projection's output,
read in place and its gradient written whole) and ``GatedMLP``, the Llama MLP down_proj(act(gate_proj(x)) *
up_proj(x)) with Hugging Face's parameter names. GPT-2's: ``bias_gelu(input, bias)`` (gelu_tanh(input
+ bias) in one pass, the bias gradient summed by its backward kernel) and ``LinearGELU``, an
nn.Linear whose forward is gelu_tanh(linear(x)) as matmul + that. Triton kernels on CUDA, torch ops
on the cpu (Triton in the interpreter under ZEROFUSE_TRITON_ON_CPU=1); under torch.compile they
trace the zerofuse::swiglu / zerofuse::bias_gelu ops."""
from __future__ import annotations

import torch
from torch import Tensor

from zerofuse.ops import bias_gelu as _bias_gelu_ops
from zerofuse.ops import swiglu as _ops
from zerofuse.ops.signatures import torch_only

_F = torch.nn.functional


def _torch_glu(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    """act(gate) * up by torch's ops in fp32 (float64 in float64), rounded once as the fused op (torch_only)."""
    acc = torch.promote_types(gate.dtype, torch.float32)
    g = gate.to(acc)
    act = _F.silu(g) if activation == "silu" else _F.gelu(g, approximate="tanh")
    return (act * up.to(acc)).to(gate.dtype)


def _check(fn: str, gate, up) -> None:
    where = f"zerofuse.nn.functional.{fn}"
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(f"{where}: expected {name} to be a floating-point tensor, got {got}")
    if up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(f"{where}: expected up of gate's shape, dtype and device ({list(gate.shape)}, {gate.dtype}, "
                         f"{gate.device}), got {list(up.shape)}, {up.dtype}, {up.device}")


def _glu(fn: str, gate: Tensor, up: Tensor | None, activation: str) -> Tensor:
    if up is None:  # gate is [gate | up]: a fused projection's output
        _check_packed(fn, gate)
        if torch_only():
            return _torch_glu(*gate.chunk(2, dim=-1), activation)
        if torch.compiler.is_compiling():
            return _ops.swiglu_packed(gate, activation)
        return _ops.eager_swiglu_packed(gate, activation)
    _check(fn, gate, up)
    if torch_only():
        return _torch_glu(gate, up, activation)
    if torch.compiler.is_compiling():
        return _ops.swiglu(gate, up, activation)
    return _ops.eager_swiglu(gate, up, activation)


def _check_packed(fn: str, x) -> None:
    where = f"zerofuse.nn.functional.{fn}"
    if not isinstance(x, Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"{where}: expected gate to be a floating-point tensor, got {got}")
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"{where}: without up, expected gate to hold [gate | up] along an even last dim, got "
                         f"shape {list(x.shape)}")


def swiglu(gate: Tensor, up: Tensor | None = None) -> Tensor:
    """F.silu(gate) * up, fused (fp32 inside, one rounding). Without up, gate holds [gate | up]
    along its last dim (a fused gate/up projection's output): the halves are read in place and the
    gradient of the whole is written at once (no chunk and no concatenation of the halves' grads)."""
    return _glu("swiglu", gate, up, "silu")


def geglu(gate: Tensor, up: Tensor | None = None) -> Tensor:
    """F.gelu(gate, approximate="tanh") * up, fused (fp32 inside, one rounding); up=None as swiglu's."""
    return _glu("geglu", gate, up, "gelu_tanh")


def bias_gelu(input: Tensor, bias: Tensor) -> Tensor:
    """F.gelu(input + bias, approximate="tanh"), fused (fp32 inside, one rounding); bias of shape
    (input.shape[-1],) and input's dtype and device."""
    where = "zerofuse.nn.functional.bias_gelu"
    for name, t in (("input", input), ("bias", bias)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(f"{where}: expected {name} to be a floating-point tensor, got {got}")
    if input.dim() == 0 or bias.shape != (input.shape[-1],) or bias.dtype != input.dtype or bias.device != input.device:
        raise ValueError(f"{where}: expected bias of shape [input.shape[-1]] and input's dtype and device (input "
                         f"{list(input.shape)}, {input.dtype}, {input.device}), got {list(bias.shape)}, {bias.dtype}, "
                         f"{bias.device}")
    if torch_only():
        acc = torch.promote_types(input.dtype, torch.float32)
        return _F.gelu(input.to(acc) + bias.to(acc), approximate="tanh").to(input.dtype)
    if torch.compiler.is_compiling():
        return _bias_gelu_ops.bias_gelu(input, bias)
    return _bias_gelu_ops.eager_bias_gelu(input, bias)


class LinearGELU(torch.nn.Linear):
    """gelu_tanh(nn.Linear(x)) (GPT-2's MLP up-projection and activation): the matmul without its
    bias, then bias + GELU in one kernel, whose backward also sums the bias gradient (one launch
    fewer a backward than addmm + gelu). An nn.Linear (same params, state_dict keys, init); without
    a bias, linear then GELU. Under autocast the matmul runs in the autocast dtype and the bias is
    cast to it, as F.linear does."""

    def forward(self, x: Tensor) -> Tensor:
        if self.bias is None:
            return torch.nn.functional.gelu(torch.nn.functional.linear(x, self.weight), approximate="tanh")
        h = torch.nn.functional.linear(x, self.weight)
        return bias_gelu(h, self.bias.to(h.dtype))


class GatedMLP(torch.nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), act = silu (SwiGLU, Llama/Mistral/Qwen) or
    gelu_tanh (GeGLU, Gemma); parameter names as Hugging Face's LlamaMLP."""

    def __init__(self, dim: int, hidden: int, activation: str = "silu", bias: bool = False, *, device=None,
                 dtype=None):
        super().__init__()
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"zerofuse.nn.GatedMLP: expected activation 'silu' or 'gelu_tanh', got {activation!r}")
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.gate_proj = torch.nn.Linear(dim, hidden, **kw)
        self.up_proj = torch.nn.Linear(dim, hidden, **kw)
        self.down_proj = torch.nn.Linear(hidden, dim, **kw)
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(_glu("GatedMLP", self.gate_proj(x), self.up_proj(x), self.activation))


# torch.fx records these as calls when it traces the modules here (LinearGELU, GatedMLP), as zerofuse.nn.functional's
# (fx patches a name in the namespace of the module that calls it)
for _name in ("bias_gelu", "_glu",):
    torch.fx.wrap(_name)
del _name
