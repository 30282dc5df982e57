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
Each program handles a (BLOCK_M rows, BLOCK_N columns) tile. gate and up may be views whose rows are
evenly spaced (e.g. the two halves of one fused projection's output, ``fc(x).chunk(2, -1)``): read
in place at their row strides, no contiguous copies; y and dy are contiguous, and the backward can
write dgate and dup into the two halves of one fused gradient.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zerofuse.kernels import interpreted
from zerofuse.kernels.common import _cast, _tanh_sech2, cdiv, next_power_of_2
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
def _gate_up_tile(G, U, M, H, sg, su, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's (BLOCK_M, BLOCK_N) tile: (row offsets (int64, a column), columns, mask, gate and
    up in fp32, read at their row strides)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < H)[None, :]
    r = rows.to(tl.int64)[:, None]
    g = tl.load(G + r * sg + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + r * su + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return r, cols, mask, g, u


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, M, H, sg, su, GELU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       EMULATE_RNE: tl.constexpr):
    r, cols, mask, g, u = _gate_up_tile(G, U, M, H, sg, su, BLOCK_M, BLOCK_N)
    act, _ = _act_and_grad(g, GELU, False)
    tl.store(Y + r * H + cols[None, :], _cast(act * u, Y.dtype.element_ty, EMULATE_RNE), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, M, H, sg, su, sdg, sdu, GELU: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, EMULATE_RNE: tl.constexpr):
    r, cols, mask, g, u = _gate_up_tile(G, U, M, H, sg, su, BLOCK_M, BLOCK_N)
    dy = tl.load(DY + r * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    act, d = _act_and_grad(g, GELU, True)
    tl.store(DU + r * sdu + cols[None, :], _cast(dy * act, DU.dtype.element_ty, EMULATE_RNE), mask=mask)
    tl.store(DG + r * sdg + cols[None, :], _cast(dy * u * d, DG.dtype.element_ty, EMULATE_RNE), mask=mask)


def _launch_shape(m: int, h: int, activation: str) -> tuple[tuple[int, int], dict]:
    """(grid, constexprs and options) of both kernels over (m, h): ~1024 elements a program on a
    GPU; the interpreter pays per program."""
    block_n = min(next_power_of_2(h), 65536 if interpreted() else 1024)  # (plain ints: triton's are
    block_m = max(1, (65536 if interpreted() else 1024) // block_n)  # ConstexprFunctions, slower per call)
    return ((cdiv(m, block_m), cdiv(h, block_n)),
            dict(GELU=activation == "gelu_tanh", BLOCK_M=block_m, BLOCK_N=block_n, EMULATE_RNE=interpreted(),
                 num_warps=4))


def rows(t: torch.Tensor) -> torch.Tensor:
    """t as (rows, t.shape[-1]) with a unit column stride: a view where t's rows are evenly spaced
    (contiguous, or a slice along the last dim such as one half of a fused gate/up projection's
    output: no copy), else a contiguous copy. A 0-dim t is one row of one element."""
    n = t.shape[-1] if t.dim() else 1
    if t.dim() >= 1 and t.stride(-1) == 1:
        try:
            return t.view(-1, n)
        except RuntimeError:  # rows not evenly spaced
            pass
    return t.contiguous().view(-1, n)


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for gate/up of one shape and dtype, rows at any even spacing (``rows``); y
    contiguous."""
    y = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
    if gate.numel():
        g2, u2 = rows(gate), rows(up)
        grid, tiles = _launch_shape(*g2.shape, activation)
        launch_triton(_swiglu_fwd_kernel, grid, g2, u2, y, *g2.shape, g2.stride(0), u2.stride(0), **tiles)
    return y


def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str,
               dgrad: torch.Tensor | None = None):
    """(dgate, dup) for contiguous dy and gate/up as swiglu_fwd takes them: contiguous, or with
    ``dgrad`` (gate's shape with a last dim twice as wide, contiguous) its two halves, written in
    place (the gradient of a fused [gate | up] tensor, no concatenation)."""
    if dgrad is None:
        dg = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
        du = torch.empty(up.shape, device=up.device, dtype=up.dtype)
    else:
        dg, du = dgrad.chunk(2, -1)
    if gate.numel():
        g2, u2, dg2, du2 = rows(gate), rows(up), rows(dg), rows(du)
        grid, tiles = _launch_shape(*g2.shape, activation)
        launch_triton(_swiglu_bwd_kernel, grid, dy, g2, u2, dg2, du2, *g2.shape, g2.stride(0), u2.stride(0),
                      dg2.stride(0), du2.stride(0), **tiles)
    return dg, du
