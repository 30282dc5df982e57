"""Rotary position embeddings: ``rotary_embedding(q, k, cos, sin, positions=None)`` and the module
``RotaryEmbedding`` that owns the tables. q and k are (batch, heads, seq, head_dim) (k may have fewer
heads: grouped-query attention), the tables (positions, rotary_dim / 2); pairs are half-split
(GPT-NeoX, Llama; default) or interleaved (GPT-J). Dims from rotary_dim on pass through (partial
rotary). Triton on CUDA, torch ops on the cpu; the tables get no gradient."""
from __future__ import annotations

import math
import numbers
import operator

import torch
from torch import Tensor

from zerofuse.nn.loss import wants_grad
from zerofuse.ops import rotary as _ops
from zerofuse.ops.signatures import needs_autograd, torch_only

_WHERE = "zerofuse.nn.functional.rotary_embedding"


def rotary_embedding(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None = None, *,
                     interleaved: bool = False, inplace: bool = False) -> tuple[Tensor, Tensor]:
    """(RoPE(q), RoPE(k)). positions: None (row n at position n), (seq,) or (batch, seq) integer
    positions into the tables (offsets, packed sequences). inplace=True rotates q and k themselves
    (and returns them): no autograd through it."""
    if torch_only():  # torch.func transforms, jit.trace, forward AD: the reference's torch ops
        return _torch_rope(q, k, cos, sin, positions, interleaved, inplace)
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(f"{_WHERE}: expected {name} to be a floating-point tensor, got {got}")
    if cos.requires_grad or sin.requires_grad:
        raise ValueError(f"{_WHERE}: the cos/sin tables get no gradient; pass them detached")
    if positions is not None:
        if not isinstance(positions, Tensor) or positions.dim() not in (1, 2):
            raise ValueError(f"{_WHERE}: expected positions of shape (seq,) or (batch, seq), got "
                             f"{getattr(positions, 'shape', type(positions).__name__)}")
        if q.dim() == 4 and positions.dim() == 1 and positions.shape[0] == q.shape[2]:
            positions = positions.expand(q.shape[0], q.shape[2])
        elif q.dim() == 4 and positions.dim() == 2 and positions.shape[0] == 1 and positions.shape[1] == q.shape[2]:
            positions = positions.expand(q.shape[0], q.shape[2])  # (Hugging Face's position_ids (1, seq))
    if inplace:
        if wants_grad(q, k):
            raise ValueError(f"{_WHERE}: inplace=True has no autograd; use inplace=False where gradients flow")
        torch.ops.zerofuse.rotary_embedding_(q, k, cos, sin, positions, bool(interleaved), False)
        return q, k
    if torch.compiler.is_compiling():
        return _ops.rotary_embedding(q, k, cos, sin, positions, bool(interleaved), False)
    # out of place: a head_dim of non-unit stride (a transposed layout) read through a copy, as sdpa's
    # face does (the kernels take unit-stride rows; inplace=True must write q and k themselves)
    q, k = (t.contiguous() if t.dim() == 4 and t.numel() and t.stride(-1) != 1 else t for t in (q, k))
    if needs_autograd(q, k):  # the op's autograd without custom_op's Python dispatch
        return _ops.eager_rope(q, k, cos, sin, positions, bool(interleaved))
    return _ops.rope_pair(q, k, cos, sin, positions, bool(interleaved), False)


def _torch_rope(q, k, cos, sin, positions, interleaved, inplace):
    """rotary_embedding by the reference's torch ops, in fp32 (float64 in float64), rounded once as
    the kernel (torch_only: torch.func transforms, jit.trace, forward AD)."""
    if q.dim() != 4 or k.dim() != 4:
        raise RuntimeError(f"{_WHERE}: under torch.func transforms or forward AD (torch's ops) expected 4-D q and k "
                           f"(batch, heads, seq, head_dim), got {q.dim()}-D and {k.dim()}-D")
    if inplace and wants_grad(q, k):
        raise ValueError(f"{_WHERE}: inplace=True has no autograd; use inplace=False where gradients flow")
    # the eager checks (a position past the tables wrapped round to another row, -1 to the last,
    # silently: a review's reproduction, 2026-12-07); the values where they can be read here (not a
    # tensor vmap batches, nor a trace, which would bake them in)
    _ops.check_args(_WHERE, q, k, cos, sin, positions)
    if positions is not None and not torch.jit.is_tracing() \
            and not torch._C._functorch.is_functorch_wrapped_tensor(positions):
        _ops._check_values(_WHERE, cos, positions)
    from zerofuse import reference  # noqa: PLC0415

    if positions is not None and positions.dim() == 1:
        positions = positions.expand(q.shape[0], q.shape[2])
    acc = torch.promote_types(q.dtype, torch.float32)
    rq, rk = (reference.rotary_embedding(t.to(acc), cos.to(acc), sin.to(acc), positions, interleaved).to(t.dtype)
              for t in (q, k))
    if inplace:
        with torch.no_grad():
            return q.copy_(rq), k.copy_(rk)
    return rq, rk


def _count(name: str, v, what: str, who: str = "zerofuse.nn.rope_tables") -> int:
    try:
        if isinstance(v, bool):
            raise TypeError
        return operator.index(v)
    except TypeError:
        got = f"a tensor of shape {list(v.shape)}" if isinstance(v, Tensor) else repr(v)
        raise TypeError(f"{who}: expected {name} to be an int ({what}), got {got}") from None


_LLAMA3 = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_rope_scaling(scaling, who: str) -> tuple | None:
    """None, or Llama 3's frequency scaling in Hugging Face's form: {"rope_type": "llama3", "factor",
    "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"} (Llama 3.1/3.2's
    checkpoints: 8, 1, 4, 8192 / 32, 1, 4, 8192); returned as a tuple of those four numbers."""
    if scaling is None:
        return None
    want = {"rope_type": "llama3", **dict.fromkeys(_LLAMA3, "a finite number > 0")}
    if not isinstance(scaling, dict) or scaling.get("rope_type", scaling.get("type")) != "llama3":
        raise ValueError(f"{who}: expected rope_scaling None or {want} (Llama 3's; no other kind is "
                         f"implemented), got {scaling!r}")
    extra = set(scaling) - set(want) - {"type", "rope_theta"}  # (transformers 5 adds the base: rope_base's)
    vals = tuple(scaling.get(k) for k in _LLAMA3)
    if extra or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf for v in vals):
        raise ValueError(f"{who}: expected rope_scaling {want}, got {scaling!r}")
    if vals[1] >= vals[2]:  # (equal: Hugging Face's smoothing divides by zero)
        raise ValueError(f"{who}: expected rope_scaling's low_freq_factor < high_freq_factor, got {scaling!r}")
    return tuple(float(v) for v in vals)


def rope_tables(positions: int, rotary_dim: int, base: float = 10000.0, device=None,
                scaling: dict | None = None) -> tuple[Tensor, Tensor]:
    """cos/sin (positions, rotary_dim / 2) in fp32, angle p * base^(-2i / rotary_dim) (the original
    RoPE frequencies, as Llama's and GPT-NeoX's), computed in float64 then rounded. positions: how
    many (the table's rows 0..positions-1; rotary_embedding's positions= then index it). scaling:
    Llama 3's (check_rope_scaling): frequencies whose wavelength exceeds original / low_freq_factor
    divided by factor, those under original / high_freq_factor kept, the ones between interpolated
    (transformers' _compute_llama3_parameters, in float64)."""
    positions = _count("positions", positions, "the number of positions in the table")
    rotary_dim = _count("rotary_dim", rotary_dim, "the number of rotated dims")
    if rotary_dim < 2 or rotary_dim % 2 or positions < 1:
        raise ValueError(f"zerofuse.nn.rope_tables: expected an even rotary_dim >= 2 and positions >= 1, got "
                         f"rotary_dim={rotary_dim}, positions={positions}")
    inv = rope_frequencies(rotary_dim, base, scaling)
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float().to(device), ang.sin().float().to(device)


def rope_frequencies(rotary_dim: int, base: float = 10000.0, scaling: dict | None = None) -> Tensor:
    """The rotary_dim / 2 angular frequencies of rope_tables, float64."""
    scale = check_rope_scaling(scaling, "zerofuse.nn.rope_tables")
    if isinstance(base, bool) or not isinstance(base, numbers.Real) or not 0 < base < math.inf:
        raise ValueError(f"zerofuse.nn.rope_tables: expected base to be a finite number > 0, got {base!r}")  # (NaN tables)
    inv = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    if scale is None:
        return inv
    factor, low, high, old = scale
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    between = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(between, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


class RotaryEmbedding(torch.nn.Module):
    """forward(q, k, positions=None) -> (q, k) rotated. The fp32 tables are made on first use on each
    device and cached on the module, not as buffers: nothing in the state_dict (as Hugging Face's
    non-persistent ones), and a model built on the meta device, materialized by ZeRO in bf16, still
    rotates with exact fp32 tables."""

    def __init__(self, head_dim: int, max_positions: int, base: float = 10000.0, rotary_dim: int | None = None,
                 interleaved: bool = False, scaling: dict | None = None):
        super().__init__()
        head_dim = _count("head_dim", head_dim, "each head's size", "zerofuse.nn.RotaryEmbedding")
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim > head_dim:
            raise ValueError(f"zerofuse.nn.RotaryEmbedding: rotary_dim {rotary_dim} exceeds head_dim {head_dim}")
        if _count("max_positions", max_positions, "the positions of the tables", "zerofuse.nn.RotaryEmbedding") < 1:  # (refused at the first forward)
            raise ValueError(f"zerofuse.nn.RotaryEmbedding: expected max_positions >= 1, got {max_positions}")
        rope_tables(1, rotary_dim, base, scaling=scaling)  # checks the arguments now
        self.head_dim = head_dim  # (a q of another head_dim was rotated in part, or across heads, silently)
        self.max_positions, self.rotary_dim, self.base, self.interleaved = max_positions, rotary_dim, base, interleaved
        self.scaling = dict(scaling) if scaling is not None else None
        self._tables: dict[torch.device, tuple[Tensor, Tensor]] = {}
        self._made_for = self._key()  # what the tables are for

    def _key(self):
        # (every forward reads it: the scaling's items, checked only when rope_tables remakes the tables)
        scaling = None if self.scaling is None else tuple(self.scaling.items())
        return self.max_positions, self.rotary_dim, self.base, scaling

    def tables(self, device) -> tuple[Tensor, Tensor]:
        """The (cos, sin) tables on ``device``, made again after max_positions, rotary_dim or base
        changed (a longer context, a RoPE base rescaled after construction: the old tables stayed)."""
        device = torch.device(device)
        made_for = self._key()
        if self._made_for != made_for:
            self._tables, self._made_for = {}, made_for
        if device not in self._tables:
            # (made under inference_mode they were inference tensors, kept: every later forward with
            # autograd raised "Inference tensors cannot be saved for backward")
            with torch.inference_mode(False):
                self._tables[device] = rope_tables(self.max_positions, self.rotary_dim, self.base, device,
                                                   self.scaling)
        return self._tables[device]

    def _check_head_dim(self, got: int, what: str) -> None:
        if got != self.head_dim:
            raise ValueError(f"zerofuse.nn.RotaryEmbedding: expected {what} of head_dim {self.head_dim} (the module's; "
                             f"rotary_dim={self.rotary_dim} of it rotated), got head_dim {got}")

    def forward(self, q: Tensor, k: Tensor, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        for name, t in (("q", q), ("k", k)):
            if isinstance(t, Tensor) and t.dim():
                self._check_head_dim(t.shape[-1], name)
        cos, sin = self.tables(q.device)
        return rotary_embedding(q, k, cos, sin, positions, interleaved=self.interleaved)

    def rotate_packed(self, qkv: Tensor, n_heads: int, head_dim: int) -> Tensor:
        """qkv (B, N, heads * head_dim) with its first n_heads heads rotated at positions 0..N-1 and the
        rest as they are, in qkv's layout (a fused QKV projection's output: n_heads = Hq + Hkv), eagerly
        (ops.rotary.EagerRopeQKV)."""
        self._check_head_dim(head_dim, "an attention")
        cos, sin = self.tables(qkv.device)
        if qkv.dim() != 3 or qkv.shape[-1] % head_dim or n_heads * head_dim > qkv.shape[-1]:
            raise ValueError(f"zerofuse.nn.RotaryEmbedding.rotate_packed: expected qkv (batch, seq, heads * {head_dim}) of at least "
                             f"{n_heads} heads, got {list(qkv.shape)}")
        if qkv.shape[1] > cos.shape[0]:
            raise ValueError(f"zerofuse.nn.RotaryEmbedding.rotate_packed: sequence length {qkv.shape[1]} exceeds the "
                             f"{cos.shape[0]} positions of the tables (max_positions)")
        return _ops.eager_rope_qkv(qkv, cos, sin, n_heads, head_dim, self.interleaved)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_positions={self.max_positions}, base={self.base}, "
                f"interleaved={self.interleaved}" + (f", scaling={self.scaling}" if self.scaling else ""))


# torch.fx records these as calls when it traces RotaryEmbedding, as zerofuse.nn.functional's
# (fx patches a name in the namespace of the module that calls it)
for _name in ("rotary_embedding",):
    torch.fx.wrap(_name)
del _name
