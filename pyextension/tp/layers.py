"""Megatron-style tensor-parallel layers over zerofuse's Communicator.

Construction from full weights: each layer draws the *full* weight exactly as the unsharded
torch layer does (same init calls on the same RNG: ``torch.manual_seed(s); ColumnParallelLinear(...)``
holds the slices of ``torch.manual_seed(s); torch.nn.Linear(...)``) and keeps its slice, so parity
with the unsharded layer is exact and checkpoints consolidate. Sharded params carry a
``TPSpec`` (``param._zf_tp``, zerofuse/tp/spec.py) saying how they slice the full tensor.

Sequence parallelism (``sequence_parallel=True``): activations outside the column/row pair are
sharded along the sequence (dim 1); a column-parallel layer all-gathers its input (and gathers it
again in backward rather than keeping the full sequence), a row-parallel layer reduce-scatters its
output. Replicated params applied to a sequence shard (a row-parallel bias) get their grads summed
over the group by a hook.

Overlap: in a column-parallel backward the input gradient's all-reduce (reduce-scatter with SP)
is launched before the weight-gradient matmul and waited after it.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from zerofuse.nn.autocast import autocast_dtype, cast_all
from zerofuse.ops._optim import _only_counting_modes
from zerofuse import nn as znn
from zerofuse.tp import comm as C
from zerofuse.tp.spec import KeepsMarks, TPSpec, spec_of


def __getattr__(name: str):
    """Names that moved to zerofuse/tp/cross_entropy.py and zerofuse/tp/embedding.py (2026-12-07)."""
    if name in ("vocab_parallel_cross_entropy", "_VocabParallelCE"):
        from zerofuse.tp import cross_entropy  # noqa: PLC0415 - cross_entropy imports this module

        return getattr(cross_entropy, name)
    if name == "VocabParallelEmbedding":
        from zerofuse.tp import embedding  # noqa: PLC0415 - embedding imports this module

        return embedding.VocabParallelEmbedding
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _group(group):
    if not dist.is_initialized():
        raise RuntimeError("zerofuse.tp: torch.distributed is not initialized (call init_process_group first)")
    return group if group is not None else dist.distributed_c10d._get_default_group()


def _sharded(full: Tensor, spec: TPSpec, requires_grad: bool = True) -> torch.nn.Parameter:
    """This rank's slice of ``full`` as a Parameter that carries its spec."""
    p = torch.nn.Parameter(spec.slice(full), requires_grad=requires_grad)
    p._zf_tp = spec
    return p


def _adopt(layer, weight: Tensor, bias: Tensor | None, *, sharded_bias: bool):
    """Give a layer built on the meta device its slices of real full tensors (same specs), frozen
    where those are (new Parameters required grad: a frozen embedding or projection of a model
    sharded by zerofuse.shard trained; a review's reproduction, 2026-12-06)."""
    layer.weight = _sharded(weight.detach(), spec_of(layer.weight), weight.requires_grad)
    if bias is not None:
        layer.bias = (_sharded(bias.detach(), spec_of(layer.bias), bias.requires_grad) if sharded_bias
                      else torch.nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad))
    return layer


def _sizes_per_rank(spec: TPSpec, who: str, what: str) -> list[int]:
    sizes = [spec.local_size(r) for r in range(spec.tp)]
    if min(sizes) < 1:
        raise ValueError(f"zerofuse.tp.{who}: {what} leave a rank of the TP group of {spec.tp} with nothing")
    return sizes


class _TPModule(KeepsMarks, torch.nn.Module):
    def _setup(self, group, sequence_parallel: bool):
        self._keep_marks_on_load()  # the specs and hooks on its params survive to_empty / assign=True
        self.group = _group(group)
        self.comm = C.comm_for(self.group)
        self.tp, self.tp_rank = self.comm.world_size, self.comm.rank
        self.sequence_parallel = bool(sequence_parallel)


# ---------------------------------------------------------------------------- linear layers


class _ColumnLinear(torch.autograd.Function):
    """y = gather_seq(x) @ W^T + b (SP) or x @ W^T + b; backward launches the input gradient's
    all-reduce (reduce-scatter with SP) before computing the weight gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, sp):
        total = C.seq_all_gather(x, comm) if sp else x
        ctx.save_for_backward(x, weight)  # SP: the shard; the full sequence is gathered again in backward
        ctx.comm, ctx.sp, ctx.has_bias = comm, sp, bias is not None
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        comm, sp = ctx.comm, ctx.sp
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g = g.contiguous()
        if sp:
            buf, gather = C.seq_all_gather_start(x, comm)
        grad_x = work = None
        if need_x:
            grad_x = g.matmul(weight)  # this rank's partial sum of the input gradient
        if sp:
            total = C.seq_all_gather_finish(buf, gather)
            if need_x:
                grad_x, work = C.seq_reduce_scatter_start(grad_x, comm)
        else:
            total = x
            if need_x:
                work = C.all_reduce(grad_x, comm, wait=False)
        # overlaps the collective above
        g2 = g.reshape(-1, g.shape[-1])
        grad_w = g2.t().matmul(total.reshape(-1, total.shape[-1])) if need_w else None
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if work is not None:
            work.wait()
        return grad_x, grad_w, grad_b, None, None


class _RowLinear(torch.autograd.Function):
    """y = all_reduce(x @ W^T) or, SP, reduce_scatter_seq(x @ W^T); backward: the output
    gradient (all-gathered with SP) times W and x."""

    @staticmethod
    def forward(ctx, x, weight, comm, sp):
        partial = F.linear(x, weight)
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.sp = comm, sp
        if sp:
            return C.seq_reduce_scatter(partial, comm)
        # [Note: an in-place all-reduce under a dispatch mode] a TorchDispatchMode may keep the
        # matmul's output: torch's selective checkpoint caches mm outputs (zerofuse's "selective"
        # too), and its recompute returned the already-reduced output, reduced again (grads ~5% off
        # at tp 2 without SP, 2026-12-06). Under any mode the all-reduce takes a copy.
        partial = partial.contiguous()
        keeps = torch._C._len_torch_dispatch_stack() > 0 and not _only_counting_modes()  # (counters keep nothing)
        return C.all_reduce(partial.clone() if keeps else partial, comm)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        g = C.seq_all_gather(g, ctx.comm) if ctx.sp else g.contiguous()
        grad_x = g.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = g.reshape(-1, g.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
        return grad_x, grad_w, None, None


def _check_features(who: str, x: Tensor, n: int, what: str, sp: bool = False) -> None:
    if x.dim() == 0 or x.shape[-1] != n:
        raise ValueError(f"zerofuse.tp.{who}: expected an input whose last dimension is {n} ({what}), got shape "
                         f"{list(x.shape)}")
    if sp and x.dim() < 3:
        raise ValueError(f"zerofuse.tp.{who}: with sequence_parallel=True expected an input of shape (batch, seq, "
                         f"{n}) (the sequence along dim 1), got shape {list(x.shape)}")


def _init_linear_full(out_features: int, in_features: int, bias: bool, device, dtype):
    """torch.nn.Linear's initialisation of the full weight and bias, in the same RNG order."""
    w = torch.empty(out_features, in_features, device=device, dtype=dtype)
    torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    b = None
    if bias:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        b = torch.empty(out_features, device=device, dtype=dtype).uniform_(-bound, bound)
    return w, b


@torch.no_grad()
def _reset_linear(layer, *, sharded_bias: bool) -> None:
    w, b = _init_linear_full(layer.out_features, layer.in_features, layer.bias is not None, layer.weight.device,
                             layer.weight.dtype)
    layer.weight.copy_(spec_of(layer.weight).slice(w))
    if layer.bias is not None:
        layer.bias.copy_(spec_of(layer.bias).slice(b) if sharded_bias else b)


class ColumnParallelLinear(_TPModule):
    """y = x A^T + b with A split by rows (output features) over the TP group: each rank computes
    its slice of y. gather_output=True all-gathers y (forward all-gather, backward split);
    otherwise y stays split (feed it to a RowParallelLinear). The input is replicated (its
    gradient is all-reduced in backward), or with sequence_parallel=True sequence-sharded
    (all-gathered in forward, gradient reduce-scattered). partition_sizes: a fused projection's
    parts (e.g. q, k, v) each split over the ranks, so every rank holds whole heads of each."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group=None, sequence_parallel: bool = False, *, partition_sizes=None, device=None, dtype=None):
        super().__init__()
        self._setup(group, sequence_parallel)
        parts = tuple(partition_sizes) if partition_sizes is not None else (out_features,)
        if sum(parts) != out_features or any(n < 1 for n in parts):
            raise ValueError(f"zerofuse.tp.ColumnParallelLinear: expected partition_sizes of positive sizes summing "
                             f"to out_features ({out_features}), got {list(parts)}")
        if gather_output and len(parts) > 1:
            raise ValueError("zerofuse.tp.ColumnParallelLinear: gather_output=True needs a single partition")
        self.in_features, self.out_features, self.gather_output = in_features, out_features, gather_output
        self.partition_sizes = parts
        wspec = TPSpec(0, parts, (out_features, in_features), self.tp, self.tp_rank)
        self.out_per_rank = _sizes_per_rank(wspec, "ColumnParallelLinear",
                                            f"out_features {out_features} (parts {list(parts)})")
        w, b = _init_linear_full(out_features, in_features, bias, device, dtype)
        self.weight = _sharded(w, wspec)
        if bias:
            self.bias = _sharded(b, TPSpec(0, parts, (out_features,), self.tp, self.tp_rank))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_full(cls, weight: Tensor, bias: Tensor | None = None, **kwargs):
        """The layer holding its slices of a given full weight (out, in) and bias, e.g. a loaded
        model's torch.nn.Linear, instead of a fresh initialisation; kwargs as the constructor's."""
        layer = cls(weight.shape[1], weight.shape[0], bias is not None, device="meta", dtype=weight.dtype, **kwargs)
        return _adopt(layer, weight, bias, sharded_bias=True)

    def reset_parameters(self) -> None:
        """torch.nn.Linear's initialisation of the full weight and bias, this rank's slices written
        in place (a model built on meta, materialized by zerofuse.zero.parallelize: it had no
        reset_parameters and was refused). Every TP rank draws the same full tensors: the same RNG
        state on each, as for the constructor."""
        _reset_linear(self, sharded_bias=True)

    def forward(self, x: Tensor) -> Tensor:
        _check_features("ColumnParallelLinear", x, self.in_features, "in_features", self.sequence_parallel)
        # under autocast: the GEMM's inputs in its dtype, as torch's linear (backward, run without
        # autocast, multiplied a bf16 grad by the fp32 weight and failed)
        x, w, b = cast_all(autocast_dtype(x), x, self.weight, self.bias)
        y = _ColumnLinear.apply(x, w, b, self.comm, self.sequence_parallel)
        return C.gather_last_dim(y, self.comm, self.out_per_rank) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(this rank {self.weight.shape[0]}), tp={self.tp}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(_TPModule):
    """y = x A^T + b with A split by columns (input features): each rank multiplies its slice of
    x and the partial sums are all-reduced (reduce-scattered along the sequence with
    sequence_parallel=True); the bias is replicated and added after the reduction.
    input_is_parallel=False splits a replicated input first."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 group=None, sequence_parallel: bool = False, *, device=None, dtype=None):
        super().__init__()
        self._setup(group, sequence_parallel)
        self.in_features, self.out_features, self.input_is_parallel = in_features, out_features, input_is_parallel
        wspec = TPSpec(1, (in_features,), (out_features, in_features), self.tp, self.tp_rank)
        self.in_per_rank = _sizes_per_rank(wspec, "RowParallelLinear", f"in_features {in_features}")
        w, b = _init_linear_full(out_features, in_features, bias, device, dtype)
        self.weight = _sharded(w, wspec)
        if bias:
            self.bias = torch.nn.Parameter(b)
            C.sync_replicated_grads([self.bias], self.comm, when=lambda: self.sequence_parallel)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_full(cls, weight: Tensor, bias: Tensor | None = None, **kwargs):
        """As ColumnParallelLinear.from_full: the slices of a given full weight; the bias replicated."""
        layer = cls(weight.shape[1], weight.shape[0], bias is not None, device="meta", dtype=weight.dtype, **kwargs)
        _adopt(layer, weight, bias, sharded_bias=False)
        if bias is not None:
            C.sync_replicated_grads([layer.bias], layer.comm, when=lambda: layer.sequence_parallel)
        return layer

    def reset_parameters(self) -> None:
        """As ColumnParallelLinear.reset_parameters; the bias replicated."""
        _reset_linear(self, sharded_bias=False)

    def forward(self, x: Tensor, bias_grad: bool = True) -> Tensor:
        """bias_grad=False: the bias is added without a gradient path to it (the caller gives it
        its gradient, as zerofuse.nn.Attention's proj_bias_grad=False asks)."""
        if not self.input_is_parallel:
            _check_features("RowParallelLinear", x, self.in_features, "in_features", self.sequence_parallel)
            x = C.split_last_dim(x, self.comm, self.in_per_rank)
        else:
            _check_features("RowParallelLinear", x, self.weight.shape[1],
                            f"this rank's slice of in_features {self.in_features} (input_is_parallel=True)",
                            self.sequence_parallel)
        if self.sequence_parallel:  # (named by the op it reached before: "reduce_scatter", the matmul's shape)
            C.check_seq(x, self.tp, "RowParallelLinear", "x")
        dt = autocast_dtype(x)  # (as ColumnParallelLinear's; the bias too: y stays in autocast's dtype)
        x, w = cast_all(dt, x, self.weight)
        y = _RowLinear.apply(x, w, self.comm, self.sequence_parallel)
        if self.bias is None:
            return y
        return y + cast_all(dt, self.bias if bias_grad else self.bias.detach())[0]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this rank {self.weight.shape[1]}), out_features={self.out_features}, "
                f"tp={self.tp}, sequence_parallel={self.sequence_parallel}")


# ---------------------------------------------------------------------------- attention, MLP


class ParallelAttention(znn.Attention):
    """zerofuse.nn.Attention with heads split over the TP group: the fused QKV projection is
    column-parallel (each rank holds num_heads / tp query heads and num_kv_heads / tp kv heads),
    the output projection row-parallel. One all-reduce forward, one backward (or the RS/AG pairs
    with sequence parallelism)."""

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, *, group=None,
                 sequence_parallel: bool = False, bias: bool = False, causal: bool = True, sdpa=None, rope=None,
                 device=None, dtype=None):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for arg, value in (("embed_dim", embed_dim), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if value < 1:
                raise ValueError(f"zerofuse.tp.ParallelAttention: expected {arg} >= 1, got {value}")
        tp = dist.get_world_size(_group(group))
        for key, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if n % tp:
                raise ValueError(f"zerofuse.tp.ParallelAttention: expected {key} ({n}) to divide by the TP size {tp}")
        if embed_dim % num_heads:
            raise ValueError(f"zerofuse.tp.ParallelAttention: expected num_heads ({num_heads}) to divide embed_dim "
                             f"({embed_dim})")
        if num_heads % num_kv_heads:
            raise ValueError(f"zerofuse.tp.ParallelAttention: expected num_kv_heads ({num_kv_heads}) to divide "
                             f"num_heads ({num_heads})")
        torch.nn.Module.__init__(self)  # not Attention's: it would draw the unsharded projections
        self.embed_dim, self.head_dim, self.causal = embed_dim, embed_dim // num_heads, causal
        self.sdpa = znn.functional.scaled_dot_product_attention if sdpa is None else sdpa
        d = self.head_dim
        kw = dict(bias=bias, group=group, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.qkv = ColumnParallelLinear(embed_dim, (num_heads + 2 * num_kv_heads) * d,
                                        partition_sizes=(num_heads * d, num_kv_heads * d, num_kv_heads * d), **kw)
        self.proj = RowParallelLinear(num_heads * d, embed_dim, **kw)
        self.rope = rope
        self.num_heads, self.num_kv_heads = num_heads // tp, num_kv_heads // tp  # this rank's heads


def tp_modules(module: torch.nn.Module):
    """The TP layers inside ``module`` (to switch sequence parallelism off for generation)."""
    return [m for m in module.modules() if isinstance(m, _TPModule)]

