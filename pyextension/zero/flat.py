"""One ZeRO unit: a set of parameters laid out in one flat buffer and sharded over the ranks.

Layout: the params, flattened, one after another (``offsets``), padded with zeros to a multiple of
``world_size * align`` elements (``padded``); rank r owns elements [r * shard_numel, (r + 1) *
shard_numel). Every param's ``.data`` is a view into the unit's full buffer ``full``, so modules
and autograd see ordinary parameters. Stage 1/2 keep ``full`` resident and the rank's shard is a
view of it; stage 3 keeps its own ``shard`` and gives ``full``'s storage back between uses
(storage resized to 0: the views keep their shapes, nothing is reallocated by autograd).

Gradients: the grad-ready hook copies (or, accumulating, adds) each param's .grad into ``gflat``
(the unit's full-size local buffer, in the reduce dtype) and drops the .grad; a reduce-scatter (op
sum) of gflat, which the communicator reads in place, lands this rank's piece in ``gshard``.
Stage 1 keeps gflat and gshard is a view of it (after a sync gflat is zero except the rank's own
region); stage 2/3 keep only gshard and allocate gflat per backward. Stage 0 (plain data
parallel) lays a unit out for one rank (the shard is the whole buffer) and all-reduces gflat in
place, which then becomes gshard. Sums, not means: the optimizer multiplies by 1 / world_size in
its kernel, and repeated syncs before a step add up exactly (gradient accumulation with
communication).

``segments`` say which params own which parts of the shard: (param index in the unit, offset in
the shard, length, offset in the flattened param). Optimizers, norms and checkpoints use them.
"""
from __future__ import annotations

import dataclasses

import torch

FREE, GATHERING, GATHERED = "free", "gathering", "gathered"


@dataclasses.dataclass(frozen=True)
class Segment:
    param: int  # index in the unit
    shard_offset: int
    length: int
    param_offset: int  # in the flattened param


class FlatUnit:
    def __init__(self, index: int, name: str, named_params: list[tuple[str, torch.nn.Parameter]], *, rank: int,
                 world_size: int, align: int, stage: int, reduce_dtype: torch.dtype | None):
        self.index, self.name, self.stage = index, name, stage
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        p0 = self.params[0]
        for n, p in named_params:
            if p.dtype != p0.dtype or p.device != p0.device:
                raise ValueError(f"zerofuse.zero: unit {name!r} mixes {p0.dtype} on {p0.device} ({self.names[0]}) with "
                                 f"{p.dtype} on {p.device} ({n}); expected one dtype and device per unit")
        self.dtype, self.device = p0.dtype, p0.device
        self.reduce_dtype = reduce_dtype or self.dtype
        self.offsets, off = [], 0
        for p in self.params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        unit = world_size * align
        self.padded = max(unit, -(-off // unit) * unit)
        self.shard_numel = self.padded // world_size
        self.lo, self.hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        self.segments = []
        for i, p in enumerate(self.params):
            a, b = max(self.offsets[i], self.lo), min(self.offsets[i] + p.numel(), self.hi)
            if a < b:
                self.segments.append(Segment(i, a - self.lo, b - a, a - self.offsets[i]))

        with torch.no_grad():
            self.full = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
            for p, o in zip(self.params, self.offsets):
                self.full[o:o + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.full[o:o + p.numel()].view(p.shape)
        self._full_bytes = self.padded * self.full.element_size()
        self.state = GATHERED
        self.gather_work = None
        if stage == 3:
            self.shard = self.full[self.lo:self.hi].clone()
            self.free()
        else:
            self.shard = self.full[self.lo:self.hi]
        # gradients
        self.gflat: torch.Tensor | None = None
        self.written = [False] * len(self.params)  # param regions of gflat holding values
        self.gshard_fresh = True  # gshard holds nothing of this accumulation window yet
        if stage == 1:
            self.gflat = torch.zeros(self.padded, dtype=self.reduce_dtype, device=self.device)
            self.written = [True] * len(self.params)
            self.gshard = self.gflat[self.lo:self.hi]
        else:
            self.gshard = torch.zeros(self.shard_numel, dtype=self.reduce_dtype, device=self.device)
        self.ready = 0  # params whose grad arrived in this backward
        self.dirty = False  # gflat holds local grads not reduced yet
        self.launched = False
        self.rs_work = None
        self.rs_out: torch.Tensor | None = None

    # ------------------------------------------------------------------ params (stage 3)

    def free(self) -> None:
        if self.state == GATHERING:  # the all-gather still writes into full: finish it first
            self.gather_work.wait()
            self.gather_work = None
        self.full.untyped_storage().resize_(0)
        self.state = FREE

    def start_gather(self, comm) -> None:
        if self.state != FREE:
            return
        self.full.untyped_storage().resize_(self._full_bytes)
        self.gather_work = comm.all_gather_coalesced(self.shard, [self.full])
        self.state = GATHERING

    def wait_gather(self, comm) -> None:
        if self.state == FREE:
            self.start_gather(comm)
        if self.state == GATHERING:
            self.gather_work.wait()
            self.gather_work = None
            self.state = GATHERED

    # ------------------------------------------------------------------ grads

    def add_grad(self, i: int, grad: torch.Tensor) -> None:
        """Param i's grad arrived: copied into its region of gflat (added when the region already
        holds grads of this accumulation window)."""
        if self.gflat is None:  # stage 0/2/3: per backward, not zero-filled (each region is written once)
            if self.stage == 0 and self.gshard_fresh:
                # stage 0 reduces in place, so gshard is last step's gflat, dead since zero_grad:
                # reusing it keeps one grad buffer, as DDP does (a new one each backward held two)
                self.gflat = self.gshard
            else:
                self.gflat = torch.empty(self.padded, dtype=self.reduce_dtype, device=self.device)
            self.gflat[self.numel:].zero_()
        o = self.offsets[i]
        view = self.gflat[o:o + self.params[i].numel()]
        if self.written[i]:
            view.add_(grad.reshape(-1))
        else:
            view.copy_(grad.reshape(-1))
            self.written[i] = True
        self.dirty = True

    def launch_reduce(self, comm) -> None:
        """Reduce-scatter (sum) gflat into this rank's shard (gflat is the communicator's flat
        buffer: no copy); the result lands at finish_reduce."""
        for i, done in enumerate(self.written):  # params that got no grad
            if not done:
                o = self.offsets[i]
                self.gflat[o:o + self.params[i].numel()].zero_()
        if self.stage == 0:  # every rank keeps the whole sum: all-reduce in place
            self.rs_out = self.gflat
            self.rs_work = comm.all_reduce_coalesced([self.gflat], op="sum")
        else:
            if self.stage == 1 or not self.gshard_fresh:
                self.rs_out = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=self.device)
            else:
                self.rs_out = self.gshard
            self.rs_work = comm.reduce_scatter_coalesced([self.gflat], self.rs_out, op="sum")
        self.launched = True
        self.dirty = False
        if self.stage != 1:  # the communicator holds gflat until the reduce is done
            self.gflat = None
            self.written = [False] * len(self.params)

    def finish_reduce(self) -> None:
        if self.rs_work is None:
            return
        self.rs_work.wait()
        self.rs_work = None
        if self.stage == 1:
            # gflat held the local sums (and, in the own region, the reduced sums of earlier
            # syncs): after the sync only the own region is non-zero and holds the total
            self.gflat.zero_()
            self.gshard.copy_(self.rs_out)
        elif self.stage == 0 and self.gshard_fresh:
            self.gshard = self.rs_out  # the reduced buffer becomes the grad: no copy
        elif self.rs_out is not self.gshard:
            self.gshard.add_(self.rs_out)
        self.rs_out = None
        self.gshard_fresh = False

    def zero_grad(self) -> None:
        if self.stage == 1:
            if self.dirty:
                self.gflat.zero_()
            else:
                self.gshard.zero_()
        else:
            self.gflat = None
            self.written = [False] * len(self.params)
            self.gshard_fresh = True
        self.dirty = False

    def grad_shard(self) -> torch.Tensor:
        """gshard ready for the optimizer (zeros when nothing was reduced since zero_grad)."""
        if self.gshard_fresh and self.stage != 1:
            if self.gshard is self.gflat:  # stage 0 between no_sync backwards: the buffer holds local grads
                self.gshard = torch.zeros_like(self.gflat)
            else:
                self.gshard.zero_()
            self.gshard_fresh = False
        return self.gshard
