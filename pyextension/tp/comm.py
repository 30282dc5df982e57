"""The collectives of tensor and sequence parallelism, as autograd Functions over zerofuse's
Communicator (one per TP group, cached).

Megatron's conjugate pairs (Shoeybi et al. 2019, Korthikanti et al. 2022), each the other's
backward:
    copy_to_tp           forward identity           backward all-reduce
    reduce_from_tp       forward all-reduce         backward identity
    gather_from_seq      forward all-gather (seq)   backward reduce-scatter (seq)
    reduce_scatter_to_seq forward reduce-scatter (seq) backward all-gather (seq)
    gather_last_dim      forward all-gather (last dim) backward split (last dim)
    split_last_dim       forward split (last dim)    backward all-gather (last dim)
Activations are (batch, seq, hidden); the sequence dim is 1, so a sequence shard is strided in
memory: sequence collectives copy through a rank-major buffer (rank, batch, seq/tp, hidden).

Every collective adds the bytes of the full tensor it stands for (b·s·h·itemsize) to
``comm_stats()``, so tests can hold the traffic of a step against the analytic count.
"""
from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from zerofuse._compile import opaque_to_compile
from zerofuse.comm import Communicator

_comms: list[tuple[dist.ProcessGroup, Communicator]] = []
_stats: collections.Counter = collections.Counter()


def comm_for(group: dist.ProcessGroup) -> Communicator:
    """The Communicator of ``group`` (one per live group: a group destroyed with its process group
    is dropped, even if a later group reuses its name)."""
    live = dist.distributed_c10d._world.pg_map
    _comms[:] = [(g, c) for g, c in _comms if g in live]
    for g, c in _comms:
        if g is group:
            return c
    comm = Communicator(group)
    _comms.append((group, comm))
    return comm


def comm_stats() -> dict[str, int]:
    """Bytes moved by TP collectives in this process since the last reset, per kind:
    {'all_reduce', 'all_gather', 'reduce_scatter'} (the full tensor's bytes per call)."""
    return dict(_stats)


def reset_comm_stats() -> None:
    _stats.clear()


def _count(kind: str, t: torch.Tensor, factor: int = 1) -> None:
    _stats[kind] += t.numel() * t.element_size() * factor


# ---------------------------------------------------------------------------- raw collectives


@opaque_to_compile  # the Communicator is opaque to dynamo: no retracing per shape
def all_reduce(x: torch.Tensor, comm: Communicator, op: str = "sum", wait: bool = True):
    """In place on a contiguous x; returns the Work when wait=False. x's version counter is bumped
    (the communicator writes outside the dispatcher): autograd or a selective-checkpoint cache that
    kept x refuses it as modified in place instead of using the reduced values unknowingly."""
    _count("all_reduce", x)
    work = comm.all_reduce_coalesced([x], op=op)
    torch.autograd.graph.increment_version(x)
    if wait:
        work.wait()
        return x
    return work


@opaque_to_compile  # the Communicator is opaque to dynamo: no retracing per shape
def seq_all_gather_start(x: torch.Tensor, comm: Communicator):
    """Start gathering the sequence shards x (b, s/tp, h) -> (buffer, work); finish with
    seq_all_gather_finish."""
    tp = comm.world_size
    if x.dim() < 2:  # (it failed after the all-gather, in seq_all_gather_finish's reshape)
        raise ValueError(f"zerofuse.tp.all_gather: sequence parallelism takes shards (b, s/tp, ...) with the "
                         f"sequence as dim 1, got shape {list(x.shape)}")
    shard = x.contiguous()
    buf = torch.empty((tp,) + tuple(shard.shape), dtype=shard.dtype, device=shard.device)
    _count("all_gather", buf)
    return buf, comm.all_gather_coalesced(shard.reshape(-1), [buf.view(-1)])


@opaque_to_compile  # the Communicator is opaque to dynamo: no retracing per shape
def seq_all_gather_finish(buf: torch.Tensor, work) -> torch.Tensor:
    work.wait()
    tp, b, s, h = buf.shape[0], buf.shape[1], buf.shape[2], buf.shape[3:]
    return buf.transpose(0, 1).reshape((b, tp * s) + tuple(h))


def seq_all_gather(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return seq_all_gather_finish(*seq_all_gather_start(x, comm))


def check_seq(x: torch.Tensor, tp: int, who: str, name: str = "the input") -> None:
    """The sequence (dim 1) of x splits evenly over the TP group; who/name: the layer and argument
    an error names (the layers check their input before the matmul that leads to the scatter)."""
    if x.dim() < 2 or x.shape[1] % tp:
        raise ValueError(f"zerofuse.tp.{who}: sequence parallelism needs the sequence length (dim 1) to divide by "
                         f"the TP size {tp}, got {name} of shape {list(x.shape)}")


@opaque_to_compile  # the Communicator is opaque to dynamo: no retracing per shape
def seq_reduce_scatter_start(x: torch.Tensor, comm: Communicator):
    """Start reduce-scattering x (b, s, h) (sum) into this rank's sequence shard (b, s/tp, h) ->
    (shard, work); the shard holds the result after work.wait()."""
    tp = comm.world_size
    check_seq(x, tp, "reduce_scatter")
    b, s = x.shape[0], x.shape[1]
    rank_major = x.reshape((b, tp, s // tp) + tuple(x.shape[2:])).transpose(0, 1).contiguous()
    if rank_major.data_ptr() == x.data_ptr():  # a batch of 1: a view of x, which gloo's reduce-scatter
        rank_major = rank_major.clone()  # sums in place (x held every rank's sum after: selective
        # recompute's kept matmul output reduced twice; a review's reproduction, 2026-12-07)
    out = torch.empty((b, s // tp) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
    _count("reduce_scatter", rank_major)
    return out, comm.reduce_scatter_coalesced([rank_major.reshape(-1)], out.reshape(-1), op="sum")


def seq_reduce_scatter(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    out, work = seq_reduce_scatter_start(x, comm)
    work.wait()
    return out


def seq_shard(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    tp = comm.world_size
    check_seq(x, tp, "seq_shard")
    n = x.shape[1] // tp
    return x[:, comm.rank * n:(comm.rank + 1) * n].contiguous()


# ---------------------------------------------------------------------------- autograd pairs


def _identity(x, comm):
    return x.view_as(x)


def _summed(x, comm):
    return all_reduce(x.contiguous().clone(), comm)


def _gather_last(x, comm, sizes):
    """All-gather along the last dim; shards may differ in size by one (sizes per rank)."""
    tp, width = comm.world_size, max(sizes)
    pad = torch.zeros(x.shape[:-1] + (width,), dtype=x.dtype, device=x.device)
    pad[..., :x.shape[-1]] = x
    buf = torch.empty((tp,) + tuple(pad.shape), dtype=x.dtype, device=x.device)
    _count("all_gather", buf)
    comm.all_gather_coalesced(pad.reshape(-1), [buf.view(-1)]).wait()
    return torch.cat([buf[r, ..., :sizes[r]] for r in range(tp)], dim=-1)


def _split_last(x, comm, sizes):
    start = sum(sizes[:comm.rank])
    return x[..., start:start + sizes[comm.rank]].contiguous()


class _Conjugate(torch.autograd.Function):
    """forward(x) = fwd(x, comm, *extra), backward(g) = bwd(g, comm, *extra): every TP collective
    below is such a pair, each the other's transpose."""

    @staticmethod
    def forward(ctx, x, comm, fwd, bwd, *extra):
        ctx.comm, ctx.bwd, ctx.extra = comm, bwd, extra
        return fwd(x, comm, *extra)

    @staticmethod
    def backward(ctx, g):
        return (ctx.bwd(g.contiguous(), ctx.comm, *ctx.extra), None, None, None) + (None,) * len(ctx.extra)


def copy_to_tp(x, comm):
    """forward: identity; backward: all-reduce (sum) of the gradient over the TP group."""
    return _Conjugate.apply(x, comm, _identity, _summed)


def reduce_from_tp(x, comm):
    """forward: all-reduce (sum) over the TP group; backward: identity."""
    return _Conjugate.apply(x, comm, _summed, _identity)


def gather_from_seq(x, comm):
    """forward: all-gather of the sequence shards (b, s/tp, h) -> (b, s, h); backward:
    reduce-scatter (sum) of the gradient back to this rank's shard."""
    return _Conjugate.apply(x, comm, seq_all_gather, seq_reduce_scatter)


def reduce_scatter_to_seq(x, comm):
    """forward: reduce-scatter (sum) of (b, s, h) partial sums into this rank's shard
    (b, s/tp, h); backward: all-gather of the gradient shards."""
    return _Conjugate.apply(x, comm, seq_reduce_scatter, seq_all_gather)


def scatter_to_seq(x, comm):
    """forward: this rank's sequence shard of a replicated (b, s, h); backward: all-gather."""
    return _Conjugate.apply(x, comm, seq_shard, seq_all_gather)


def gather_last_dim(x, comm, sizes):
    """forward: all-gather along the last dim (rank r holds sizes[r]); backward: this rank's
    slice of the gradient."""
    return _Conjugate.apply(x, comm, _gather_last, _split_last, list(sizes))


def split_last_dim(x, comm, sizes):
    """forward: this rank's slice of the last dim (sizes[r] per rank); backward: all-gather."""
    return _Conjugate.apply(x, comm, _split_last, _gather_last, list(sizes))


def sync_replicated_grads(params, comm: Communicator, when=lambda: True) -> list:
    """Sequence parallelism: params replicated over the TP group but applied to a sequence shard
    (norm weights, position embeddings, row-parallel biases) get partial grads on each rank; a hook
    sums them over the group (while ``when()``) before they are accumulated into .grad (so before
    any post-accumulate-grad hook, e.g. ZeRO's). Returns the hook handles. A frozen param gets no
    hook (it has no grad; torch refuses a hook on it): one unfrozen later is not summed."""
    def hook(g):
        return all_reduce(g.contiguous().clone(), comm) if when() else g

    return [p.register_hook(hook) for p in params if p.requires_grad]


def check_same_inputs(comm: Communicator, who: str, **tensors) -> None:
    """Under the collective checker (ZEROFUSE_CHECK_COLLECTIVES=1): every TP rank got the same
    integer inputs (tokens, targets, document ids; None for absent), compared by a fingerprint
    (shape, sum, position-weighted sum) over the group. Ranks given different ones (document ids
    differing by rank trained each rank's heads on other masks, silently: a review's reproduction,
    2026-12-06) raise a ValueError on every rank naming the inputs that differ."""
    if not comm.check or comm.world_size == 1:
        return
    device = next(t.device for t in tensors.values() if t is not None)  # (NCCL gathers device tensors)
    rows = []
    for t in tensors.values():  # on the device: no host read per input
        if t is None:
            rows.append(torch.tensor([-1, 0, 0, 0], device=device))
            continue
        flat = t.detach().reshape(-1).long()
        pos = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.long)
        rows.append(torch.stack([torch.tensor(t.dim(), device=device), torch.tensor(flat.numel(), device=device),
                                 flat.sum(), (flat * pos).sum()]))
    mine = torch.stack(rows)
    every = [torch.empty_like(mine) for _ in range(comm.world_size)]
    dist.all_gather(every, mine, group=comm.group)
    differ = [name for i, name in enumerate(tensors) if any(not torch.equal(e[i], every[0][i]) for e in every)]
    if differ:
        raise ValueError(f"{who}: expected the same {differ} on every rank of the tensor-parallel group (each rank "
                         "computes part of the same layers), got inputs that differ between ranks")
