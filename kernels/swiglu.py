"""SwiGLU and GeGLU in Triton, forward and backward, elementwise (Shazeer 2020, "GLU Variants
Improve Transformer"; the Llama MLP's down(silu(gate(x)) * up(x))).

Forward, in fp32, one rounding:  y = act(g) * u
    silu:       act(g) = g * s(g),                     s = sigmoid
    gelu_tanh:  act(g) = 0.5 g (1 + tanh(k (g + 0.044715 g^3))),  k = sqrt(2 / pi)
Backward recomputes act(g) from the saved inputs (the product is never stored):
    du = dy * act(g),   dg = dy * u * act'(g)
    silu':      s (1 + g (1 - s))
    gelu_tanh': 0.5 (1 + t) + 0.5 g sech^2 k (1 + 3 * 0.044715 g^2),   t = tanh(k (g + 0.044715 g^3)),
                sech^2 = 1 - t^2 computed without cancellation (kernels/common.py _tanh_sech2)
Each program handles BLOCK contiguous elements (inputs of the same shape, contiguous).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zerofuse.kernels import interpreted
from zerofuse.kernels.common import _cast, _tanh_sech2, cdiv
from zerofuse.kernels.launch import launch_triton

ACTIVATIONS = ("silu", "gelu_tanh")
_K = 0.7978845608028654  # sqrt(2 / pi)


@triton.jit
def _act_and_grad(g, GELU: tl.constexpr, NEED_GRAD: tl.constexpr):
    if GELU:
        t, sech2 = _tanh_sech2(0.7978845608028654 * (g + 0.044715 * g * g * g))
        act = 0.5 * g * (1.0 + t)
        if NEED_GRAD:
            d = 0.5 * (1.0 + t) + 0.5 * g * sech2 * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
        else:
            d = act
    else:
        s = 1.0 / (1.0 + tl.exp(-g))
        act = g * s
        if NEED_GRAD:
            d = s * (1.0 + g * (1.0 - s))
        else:
            d = act
    return act, d


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, n, GELU: tl.constexpr, BLOCK: tl.constexpr, EMULATE_RNE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    act, _ = _act_and_grad(g, GELU, False)
    tl.store(Y + offs, _cast(act * u, Y.dtype.element_ty, EMULATE_RNE), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, n, GELU: tl.constexpr, BLOCK: tl.constexpr, EMULATE_RNE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    act, d = _act_and_grad(g, GELU, True)
    tl.store(DU + offs, _cast(dy * act, DU.dtype.element_ty, EMULATE_RNE), mask=mask)
    tl.store(DG + offs, _cast(dy * u * d, DG.dtype.element_ty, EMULATE_RNE), mask=mask)


def _block() -> int:
    return 65536 if interpreted() else 1024  # the interpreter's cost is per program


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for contiguous gate/up of one shape and dtype."""
    y = torch.empty_like(gate)
    n = gate.numel()
    if n:
        block = _block()
        launch_triton(_swiglu_fwd_kernel, (cdiv(n, block),), gate, up, y, n, GELU=activation == "gelu_tanh",
                      BLOCK=block, EMULATE_RNE=interpreted(), num_warps=4)
    return y


def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str):
    """(dgate, dup) for contiguous dy/gate/up of one shape and dtype."""
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        block = _block()
        launch_triton(_swiglu_bwd_kernel, (cdiv(n, block),), dy, gate, up, dg, du, n, GELU=activation == "gelu_tanh",
                      BLOCK=block, EMULATE_RNE=interpreted(), num_warps=4)
    return dg, du
