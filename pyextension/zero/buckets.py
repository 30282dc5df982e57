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

Gradients: the grad-ready hook copies (or, accumulating, adds) each param's .grad, times
``grad_div`` (1 / the data-parallel world size: averages are pre-divided, so fp16 grads cannot
overflow in the reduction where they did not before it), into ``gflat`` (the bucket's full-size
local buffer, in the reduce dtype) and drops the .grad; a reduce-scatter (sum) of gflat, which the
communicator reads in place, lands this rank's piece in ``gshard``. Stage 1 keeps gflat and gshard
is a view of it (after a sync gflat is zero except the rank's own region); stage 2/3 keep only
gshard and allocate gflat per backward. Stage 0 (plain data parallel) lays a bucket out for one
rank (the shard is the whole buffer) and all-reduces gflat in place, which then becomes gshard; so
does stage 2 over one rank (``inplace``: no copy into a separate gshard), which then also keeps
its buffer between steps as stage 0 does: the grads sit at the same address every step, so the
optimizer's kernel tables are never rebuilt, not even while a CUDA graph of the step is captured.
Low-precision reduce dtypes (bf16/fp16 on the wire, opt-in) are reduced by an all-to-all and a local
fp32 sum, not by a ring that rounds at every hop.

[Note: bucket buffers]
- gflat of stage 0/2/3 lives from its bucket's first grad of a backward until its collective has
  been waited: the Work holds it, nothing else does (launch drops the bucket's reference).
- Stage 2/3 make gflat only when a bucket's last grad arrives: until then each grad stays in its
  param's .grad, as autograd made it (``defer_grad``), and then all of them are copied in and
  dropped (``add_deferred``). A bucket's grads grow while its backward frees that part of the
  activations, so the full-size buffer never coexists with them (FSDP2 builds its reduce-scatter
  input the same way; measured in bench_zero, ws 2, 41 MiB of grads: the backward peak of stage 3
  162.9 -> 158.1 MiB, of stage 2 with 25 MiB buckets 190.0 -> 164.6 MiB). A grad arriving again
  for a deferred param (re-entrant backward) was summed into .grad by autograd: nothing to do.
  Stage 0/1 keep their buffers between steps and add each grad as it arrives.
- At most ``max_inflight`` gradient collectives are in flight per lane ([Note: launch order]; one
  lane unless expert params have their own group): launching one more first waits for the oldest
  (FSDP2's rule), and so does making a gflat (``make_room``). So during backward at most
  max_inflight + 1 full-size gradient buffers per lane exist (the in-flight ones and the one filling),
  plus, at stage 2/3, the autograd grads of the one bucket whose backward is running.
- Stage 2/3 reduce straight into gshard when it holds nothing yet; otherwise (accumulation over
  several syncs) into a shard-sized temporary added at finish.
- Grad buffers are made when first needed (parallelize allocates params only). At stage 2/3
  ``zero_grad(set_to_none=True)`` (torch's default) frees gshard: nothing of the grads is held
  through the next forward, as FSDP2 (the optimizer's step plans drop their views of the shards
  then too: kept, they held every shard, 20 MiB per rank in bench_zero, through the next backward). Stage 0/1 keep their full-size buffers and only mark the
  grads absent, as DDP keeps its buckets (freed, they came back during backward while gloo's
  finished work still held the old ones: +25 MiB per rank in bench_zero). ``set_to_none=False``
  keeps every buffer, zeroed,
  so their addresses, and with them the optimizer's kept kernel tables, stay the same (on CUDA
  the caching allocator usually hands the same blocks back anyway).
- CUDA: Work.wait() orders the current stream after the collective; a buffer dropped after the
  wait is reused by the caching allocator on that stream only ([Note: stream ordering] in
  csrc/comm/nccl_transport.cu and [Note: Work lifetimes] in csrc/comm/communicator.h).

``segments`` say which params own which parts of the shard: (param index in the bucket, offset in
the shard, length, offset in the flattened param). Optimizers, norms and checkpoints use them.
"""
from __future__ import annotations

import dataclasses

import torch

from zerofuse.tp.spec import swap_keeping_marks

FREE, GATHERING, GATHERED = "free", "gathering", "gathered"
LOW_PRECISION = (torch.bfloat16, torch.float16)
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclasses.dataclass(frozen=True)
class Segment:
    param: int  # index in the bucket
    shard_offset: int
    length: int
    param_offset: int  # in the flattened param


class Bucket:
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
        # gradients
        self.gflat: torch.Tensor | None = None
        self.written = [False] * len(self.params)  # param regions of gflat holding values
        self.gshard_fresh = True  # gshard holds nothing of this accumulation window yet
        self.grad_none = True  # no grad since zero_grad(set_to_none=True) (or ever)
        self.gshard: torch.Tensor | None = None  # made by the first reduction (or read)
        self.ready = 0  # params whose grad arrived in this backward
        self.deferred = [False] * len(self.params)  # grads left in .grad until gflat exists
        self._deferred: list[int] = []  # their indices, in arrival order (no scan per arriving grad)
        self.pending: list[int] = []
        self.dirty = False  # gflat holds local grads not reduced yet
        self.launched = False
        self.complete = False  # every grad of this backward in, launched in order ([Note: launch order])
        self.arrived = [False] * len(self.params)  # params whose grad arrived in this backward
        self.twice = False  # a param's grad arrived twice in this backward: reduced again at its end
        self.rs_work = None
        self.rs_out: torch.Tensor | None = None

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

    # ------------------------------------------------------------------ grads

    def defer_grad(self, i: int) -> bool:
        """Stage 2/3, no gflat yet and not the bucket's last grad: param i's grad stays in its .grad
        (autograd's tensor) until the last one arrives ([Note: bucket buffers]). True if deferred."""
        if self.stage in (2, 3) and self.gflat is None and self.ready < len(self.params):
            self.defer(i)
            return True
        return False

    def defer(self, i: int) -> None:
        """Param i's grad stays in its .grad until add_deferred."""
        if not self.deferred[i]:
            self.deferred[i] = True
            self._deferred.append(i)

    def add_deferred(self, also: int | None = None) -> None:
        """Moves the deferred grads, and param ``also``'s (the one arriving), into gflat (made here)
        and drops them from .grad: those whose region holds nothing yet in one multi-tensor copy
        (zerofuse::flatten_into: one launch for the bucket, not one per param) and one multi-tensor
        scaling, the others one by one."""
        idx = self._deferred + ([also] if also is not None else [])
        if not idx:
            return
        for i in self._deferred:
            self.deferred[i] = False
        self._deferred = []
        idx = [i for i in idx if self.params[i].grad is not None]
        fresh = [i for i in idx if not self.written[i]]
        if len(fresh) > 1:
            self._make_gflat()
            grads = [self.params[i].grad for i in fresh]
            torch.ops.zerofuse.flatten_into(grads, self.gflat, [self.offsets[i] for i in fresh])
            if self.grad_div != 1.0:  # the same rounding as add_grad's copy_ then mul_
                torch._foreach_mul_([self.gflat[self.offsets[i]:self.offsets[i] + g.numel()]
                                     for i, g in zip(fresh, grads)], self.grad_div)
            for i in fresh:
                self.written[i] = True
                self.params[i].grad = None
            self.dirty = True
        for i in idx:
            p = self.params[i]
            if p.grad is not None:
                self.add_grad(i, p.grad)
                p.grad = None

    def _make_gflat(self) -> None:
        if self.gflat is None and self.kept:
            self._stage1_buffers()
        if self.gflat is None:  # stage 0/2/3: per backward, not zero-filled (each region is written once)
            if self.inplace and self.gshard_fresh and self.gshard is not None:
                # stage 0 reduces in place, so gshard is last step's gflat, dead since zero_grad:
                # reusing it keeps one grad buffer, as DDP does
                self.gflat = self.gshard
            else:
                self.gflat = torch.empty(self.padded, dtype=self.reduce_dtype, device=self.device)
            self.gflat[self.numel:].zero_()

    def add_grad(self, i: int, grad: torch.Tensor) -> None:
        """Param i's grad arrived: copied, times grad_div, into its region of gflat (added when the
        region already holds grads of this accumulation window)."""
        self._make_gflat()
        o = self.offsets[i]
        view = self.gflat[o:o + self.params[i].numel()]
        g = grad.reshape(-1)
        if self.written[i]:
            view.add_(g, alpha=self.grad_div)
        else:
            view.copy_(g)
            if self.grad_div != 1.0:
                view.mul_(self.grad_div)
            self.written[i] = True
        self.dirty = True

    def start_grad_sync(self, comm) -> None:
        """Reduce-scatter (sum of pre-divided grads) gflat into this rank's shard; stage 0
        all-reduces in place. The result lands at finish_grad_sync."""
        comm = self.comm or comm
        self._make_gflat()  # (no grad on this rank: it reduces zeros, [Note: launch order])
        for i, done in enumerate(self.written):  # params that got no grad
            if not done:
                o = self.offsets[i]
                self.gflat[o:o + self.params[i].numel()].zero_()
        low = self.reduce_dtype in LOW_PRECISION and comm.world_size > 1
        if self.inplace:  # every rank keeps the whole sum
            self.rs_out = self.gflat
            self.rs_work = (comm.reduce_scatter_fp32_sum(self.gflat, all_gather=True) if low
                            else comm.all_reduce_coalesced([self.gflat], op="sum", tag=self.name))
        else:
            if self.stage == 1 or not self.gshard_fresh:
                self.rs_out = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=self.device)
            else:
                if self.gshard is None:
                    self.gshard = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=self.device)
                self.rs_out = self.gshard
            self.rs_work = (comm.reduce_scatter_fp32_sum(self.gflat, self.rs_out) if low
                            else comm.reduce_scatter_coalesced([self.gflat], self.rs_out, op="sum", tag=self.name))
        self.launched = True
        self.dirty = False
        if not self.kept:  # [Note: bucket buffers]: the Work holds gflat until it is waited
            self.gflat = None
            self.written = [False] * len(self.params)

    def finish_grad_sync(self) -> None:
        if self.rs_work is None:
            return
        self.rs_work.wait()
        self.rs_work = None
        if self.views:
            pass  # reduced in place: gshard is gflat
        elif self.stage == 1:
            # gflat held the local sums (and, in the own region, the reduced sums of earlier
            # syncs): after the sync only the own region is non-zero and holds the total
            self.gflat.zero_()
            self.gshard.copy_(self.rs_out)
        elif self.inplace and (self.gshard_fresh or self.gshard is None):
            self.gshard = self.rs_out  # the reduced buffer becomes the grad: no copy
        elif self.rs_out is not self.gshard:
            self.gshard.add_(self.rs_out)
        self.rs_out = None
        self.gshard_fresh = False
        self.grad_none = False

    def _stage1_buffers(self) -> None:
        """Stage 1 keeps the full gradient: zeros, of which gshard is this rank's region."""
        self.gflat = torch.zeros(self.padded, dtype=self.reduce_dtype, device=self.device)
        self.written = [True] * len(self.params)
        self.gshard = self.gflat[self.lo:self.hi]

    def hold_grads_as_views(self) -> list[torch.Tensor]:
        """gradient_as_bucket_view over one rank ([Note: a world of one]): gflat kept, zeros, and
        reduced in place; returns each param's region of it, viewed in its shape (its .grad)."""
        self.views = self.kept = self.inplace = True
        self._stage1_buffers()
        self.gshard, self.gshard_fresh = self.gflat, False
        return [self.gflat[o:o + p.numel()].view(p.shape) for p, o in zip(self.params, self.offsets)]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if set_to_none and self.stage in (2, 3) and not self.inplace:  # [Note: bucket buffers]: nothing held
            self.gflat = self.gshard = None
            self.written = [False] * len(self.params)
            self.gshard_fresh = True
        elif self.views:  # the .grad views stay, zeroed (whatever wrote them: autograd does not say)
            self.gflat.zero_()
        elif self.stage == 1:
            if self.gflat is None:
                pass
            elif self.dirty:
                self.gflat.zero_()
            elif self.gshard is not None:  # after a sync only the own region is non-zero
                self.gshard.zero_()
        else:
            self.gflat = None
            self.written = [False] * len(self.params)
            self.gshard_fresh = True
            if not set_to_none:
                self.grad_shard()
        self.dirty = False
        self.grad_none = set_to_none
        self.deferred = [False] * len(self.params)  # their .grad is dropped by the engine
        self._deferred = []

    def has_grad(self) -> bool:
        """Whether the bucket holds a grad (False after zero_grad(set_to_none=True) until a sync)."""
        return not self.grad_none

    def grad_shard(self) -> torch.Tensor:
        """gshard ready for the optimizer (zeros when nothing was reduced since zero_grad)."""
        if self.gshard is None:
            if self.stage == 1:
                self._stage1_buffers()
            else:
                self.gshard = torch.zeros(self.shard_numel, dtype=self.reduce_dtype, device=self.device)
            self.gshard_fresh = False
        elif self.gshard_fresh and not self.kept:
            if self.gshard is self.gflat:  # stage 0 between no_sync backwards: the buffer holds local grads
                self.gshard = torch.zeros_like(self.gflat)
            else:
                self.gshard.zero_()
            self.gshard_fresh = False
        return self.gshard
