"""Expert-parallel token dispatch: the experts of an MoE layer split over an ``ep`` group (rank r
holds experts r * E/ep .. (r + 1) * E/ep - 1), tokens sent to their experts' ranks and back by
the Communicator's all-to-all (per-rank row counts).

One dispatch, on each rank, after moe_permute grouped its rows by (global) expert:
1. the counts per (destination rank, local expert) go out first (an all-to-all of ep x E/ep
   integers), so every rank knows how many rows it gets from each rank for each of its experts;
   the row splits are read on the host (one sync per layer call, as Megatron's alltoall
   dispatcher);
2. the kept rows go to their experts' ranks (all-to-all; they arrive by source rank, then local
   expert) and are regrouped by local expert (a stable index_select) for the grouped GEMM;
3. combine is the reverse: ungroup, all-to-all back with the splits swapped. The backward of each
   all-to-all is the all-to-all with the splits swapped.
A rank may send or receive no rows at all (splits of 0): every rank still takes part.
"""
from __future__ import annotations

import time

import torch
from torch import Tensor

from zerofuse.comm import Communicator


_exposed = [0.0, 0]  # host seconds waiting for the all-to-alls, bytes of rows sent (forward and backward)


def exposed_seconds() -> float:
    """Host seconds this process has waited for MoE all-to-alls (counts, tokens, combine, and their
    backward): on the CPU, where each wait blocks the host, the all-to-all time not overlapped."""
    return _exposed[0]


def sent_bytes() -> int:
    """Bytes of token rows this process has sent by MoE all-to-alls (to itself included; the
    counts' few integers not): dispatch, combine and their backward, 4 x T x k x dim x itemsize
    per dropless layer and step summed over the ep group."""
    return _exposed[1]


def _wait(work) -> None:
    t0 = time.perf_counter()
    work.wait()
    _exposed[0] += time.perf_counter() - t0


def _send(comm, out, x, out_splits, in_splits) -> None:
    _exposed[1] += x.numel() * x.element_size()
    _wait(comm.all_to_all(out, x, out_splits, in_splits))


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, comm: Communicator, out_splits: list[int], in_splits: list[int]) -> Tensor:
        ctx.comm, ctx.splits = comm, (out_splits, in_splits)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        _send(comm, out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        out_splits, in_splits = ctx.splits
        dx = g.new_empty((sum(in_splits), *g.shape[1:]))
        _send(ctx.comm, dx, g.contiguous(), in_splits, out_splits)
        return dx, None, None, None


def all_to_all(x: Tensor, comm: Communicator, out_splits: list[int], in_splits: list[int]) -> Tensor:
    """Rows of x to every rank (in_splits[r] to rank r), out_splits[r] rows from each: autograd-aware."""
    return _AllToAll.apply(x, comm, list(out_splits), list(in_splits))


class Dispatch:
    """One layer call's routing over the ep group (see the module docstring)."""

    def __init__(self, comm: Communicator, counts: Tensor):
        """counts [E]: this rank's kept rows per global expert (moe_permute's)."""
        ep = comm.world_size
        if counts.dim() != 1 or counts.numel() % ep or counts.is_floating_point():
            # (a count of experts the group does not divide failed in view(), not naming either)
            raise ValueError(f"zerofuse.moe.Dispatch: expected counts to be an integer tensor [E] with E divisible "
                             f"by the ep group's size {ep}, got {counts.dtype} {list(counts.shape)}")
        self.comm = comm
        send = counts.view(ep, -1)  # [destination rank, local expert]
        recv = torch.empty_like(send)
        _wait(comm.all_to_all(recv, send.contiguous(), [1] * ep, [1] * ep))  # [source rank, local expert]
        splits = torch.stack([send.sum(1), recv.sum(1)]).tolist()  # the one host sync
        self.in_splits, self.out_splits = splits[0], splits[1]
        self.local_counts = recv.sum(0)  # rows per local expert, all sources
        local = recv.shape[1]
        # received rows are ordered (source, local expert); grouped they are (local expert, source)
        key = (torch.arange(local, device=counts.device) * ep).unsqueeze(0) + torch.arange(ep, device=counts.device).unsqueeze(1)
        labels = torch.repeat_interleave(key.reshape(-1), recv.reshape(-1))
        self.group_order = torch.argsort(labels, stable=True)

    def send(self, rows: Tensor) -> Tensor:
        """This rank's kept rows (grouped by global expert) -> the rows for this rank's experts,
        grouped by local expert."""
        self.dtype = rows.dtype  # (the same on every rank: the layer's input's)
        got = all_to_all(rows[:sum(self.in_splits)], self.comm, self.out_splits, self.in_splits)
        return got.index_select(0, self.group_order)

    def receive(self, out: Tensor, total_rows: int) -> Tensor:
        """The experts' outputs (grouped by local expert) -> this rank's rows back in moe_permute's
        order, total_rows of them (the dropped rows past the kept ones are zeros)."""
        # back in the rows' dtype: under autocast an expert's matmuls may come out another (bf16 on a rank
        # whose experts got no rows, fp32 on the others: gloo aborted on the byte counts; 2026-12-07)
        out = out.to(getattr(self, "dtype", out.dtype))
        ungrouped = torch.empty_like(out).index_copy(0, self.group_order, out) if out.shape[0] else out
        back = all_to_all(ungrouped, self.comm, self.in_splits, self.out_splits)
        pad = total_rows - back.shape[0]
        return torch.cat([back, back.new_zeros(pad, *back.shape[1:])]) if pad else back
