"""ZeRO's one bucket mechanism (Megatron-Core's names): a ``Bucket`` is a set of parameters laid out
in one flat buffer and sharded over the ranks; a ``BucketGroup`` (zero/bucket_group.py) runs every bucket's gradient and
parameter collectives. Stages 0-3 all run on it (stage 3 calls its buckets units: one per wrapped
module).

Layout: the params, flattened, one after another (``offsets``), padded with zeros to a multiple of
``world_size * align`` elements (``padded``); rank r owns elements [r * shard_numel, (r + 1) *
shard_numel). Every param's ``.data`` is a view into the bucket's full buffer ``full``, so modules
and autograd see ordinary parameters. Stage 1/2 keep ``full`` resident and the rank's shard is a
view of it; stage 3 keeps its own ``shard`` and gives ``full``'s storage back between uses
(storage resized to 0: autograd's saved views of the params keep their shapes and are filled again
by the next gather, nothing is reallocated). While freed, each param's ``.data`` is a NaN
placeholder of its shape (one element expanded, no memory): read outside a forward/backward or
``full_params``, a param gives NaNs, its shape, dtype and numel stay the model's, and an in-place
write raises; the freed views themselves, read, crashed the process (SIGSEGV: no storage behind
them). A gather puts the views back (``finish_param_sync``).

Gradients: zero/bucket_grads.py (the grad half of ``Bucket``, with [Note: bucket buffers]).

``segments`` say which params own which parts of the shard: (param index in the bucket, offset in
the shard, length, offset in the flattened param). Optimizers, norms and checkpoints use them.
"""
from __future__ import annotations

import dataclasses

import torch

from zerofuse.tp.spec import swap_keeping_marks
from zerofuse.zero.bucket_grads import BucketGrads

FREE, GATHERING, GATHERED = "free", "gathering", "gathered"
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclasses.dataclass(frozen=True)
class Segment:
    param: int  # index in the bucket
    shard_offset: int
    length: int
    param_offset: int  # in the flattened param


class Bucket(BucketGrads):
    def __init__(self, index: int, name: str, named_params: list[tuple[str, torch.nn.Parameter]], *, rank: int,
                 world_size: int, align: int, stage: int, dtype: torch.dtype, reduce_dtype: torch.dtype,
                 grad_div: float, device: torch.device, comm=None):
        self.index, self.name, self.stage = index, name, stage
        # the group this bucket reduces and gathers over when it is not the engine's (rank and
        # world_size are then this group's): expert params over the expert-data-parallel group
        self.comm = comm
        self.companion: Bucket | None = None  # stage 3: the expert params of the same wrapped module
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.dtype, self.device, self.reduce_dtype, self.grad_div = dtype, device, reduce_dtype, grad_div
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
        # a model built on the meta device: the values come from materialize() (see engine)
        self.meta = any(p.is_meta for p in self.params)
        with torch.no_grad():
            self.full = torch.empty(self.padded, dtype=dtype, device=device)
            self.full[self.numel:].zero_()
            for p, o in zip(self.params, self.offsets):
                view = self.full[o:o + p.numel()].view(p.shape)
                if p.is_meta:  # .data cannot move a tensor off meta: swap in an empty one first (the
                    # param keeps its own version counter, not one shared with ``full``'s other views;
                    # and its TP spec and SP grad hooks: lost, a checkpoint held each TP rank's slice
                    # as the full tensor and the replicated grads stayed partial sums)
                    swap_keeping_marks(p, torch.empty(0, dtype=dtype, device=device))
                else:
                    view.copy_(p.detach())
                p.data = view
        self._views = [p.data for p in self.params]
        self._placeholders = None
        if stage == 3:  # one NaN (0 for an integer param) per dtype, expanded to each param's shape
            fill = float("nan") if dtype.is_floating_point else 0
            one = torch.full((), fill, dtype=dtype, device=device)
            self._placeholders = [one.expand(p.shape) for p in self.params]
        self._full_bytes = self.padded * self.full.element_size()
        self.state = GATHERED
        self.gather_work = None
        self.shard = self.full[self.lo:self.hi].clone() if stage == 3 else self.full[self.lo:self.hi]
        # gflat reduced in place and kept as the grad: stage 0, and stage 2 over one rank (its shard
        # is the whole buffer: a reduce-scatter into a separate gshard would be a copy)
        self.inplace = stage == 0 or (stage == 2 and world_size == 1)
        self.kept = stage == 1  # gflat kept between steps, zero where it holds no grad (_stage1_buffers)
        self.views = False  # gflat's regions are the params' .grad (hold_grads_as_views)
        self.host_shard = False  # stage 3, offload="optimizer+params": shard in host memory (offload_shard)
        self._staged: torch.Tensor | None = None  # its device copy while a gather reads it
        self.uploaded = None  # CUDA: an event after the last copy up of a host shard (written once it passed)
        if stage == 3 and not self.meta:
            self.free()
        self._init_grads()

    def materialize(self, init, seen=None) -> None:
        """Meta model: ``init(params)`` writes every param's value (in fp32 where the bucket's dtype
        is lower, so the values equal an fp32 init cast down); ``seen(params)`` reads them whole;
        then stage 3 keeps its shard and frees the full buffer. Memory: the full buffer (+ an fp32
        copy) of this bucket only."""
        with torch.no_grad():
            if self.dtype != torch.float32:
                tmp = torch.empty(self.numel, dtype=torch.float32, device=self.device)
                for p, o in zip(self.params, self.offsets):
                    p.data = tmp[o:o + p.numel()].view(p.shape)
                init(self.params)
                self.full[:self.numel].copy_(tmp)
                del tmp
                for p, v in zip(self.params, self._views):
                    p.data = v
            else:
                init(self.params)
            if seen is not None:
                seen(self.params)
            self.meta = False
            if self.stage == 3:
                self.shard.copy_(self.full[self.lo:self.hi])
                self.free()

    # ------------------------------------------------------------------ params

    def offload_shard(self) -> None:
        """Stage 3 parameter offload: this rank's shard moves to host memory (pinned for a GPU);
        each gather copies it up first (start_param_sync)."""
        pin = self.device.type == "cuda"
        host = torch.empty(self.shard.shape, dtype=self.shard.dtype, device="cpu", pin_memory=pin)
        host.copy_(self.shard)
        self.shard, self.host_shard = host, True

    def free(self) -> None:
        """Stage 3: give the full buffer's storage back; the params hold NaN placeholders until the next gather."""
        if self.state == GATHERING:  # the all-gather still writes into full: finish it first
            self.gather_work.wait()
            self.gather_work = None
            self._staged = None
        self.full.untyped_storage().resize_(0)
        self.state = FREE
        for p, ph in zip(self.params, self._placeholders):
            p.data = ph

    def write_back(self) -> bool:
        """Stage 3, gathered: this rank's part of ``full`` into ``shard`` where a write changed it
        (compared bit for bit: a block that only read leaves the shard, and the optimizer's fp32
        masters, untouched). Returns whether it did."""
        mine = self.full[self.lo:self.hi]
        if mine.device != self.shard.device:  # (offloaded shard: in host memory)
            mine = mine.to(self.shard.device)
        bits = INT_OF_SIZE[mine.element_size()]
        if torch.equal(mine.view(bits), self.shard.view(bits)):
            return False
        self.shard.copy_(mine)
        return True

    def start_param_sync(self, comm) -> None:
        """All-gather every rank's shard into ``full`` (stage 3: only when freed)."""
        if self.stage == 3:
            if self.state != FREE:
                return
            self.full.untyped_storage().resize_(self._full_bytes)
        comm = self.comm or comm
        src = self.shard
        if self.host_shard:  # up to the device first (a copy on the current stream, which the gather follows)
            src = self._staged = self.shard.to(self.device, non_blocking=True, copy=True)
            if src.is_cuda:
                self.uploaded = torch.cuda.current_stream(src.device).record_event()
        self.gather_work = comm.all_gather_coalesced(src, [self.full])
        self.state = GATHERING

    def finish_param_sync(self, comm=None) -> None:
        """The params hold their full values once this returns (stage 3: gathered if free)."""
        if self.state == FREE:
            self.start_param_sync(self.comm or comm)
        if self.state == GATHERING:
            self.gather_work.wait()
            self.gather_work = None
            self._staged = None
            self.state = GATHERED
            if self.stage == 3:
                for p, v in zip(self.params, self._views):
                    p.data = v
