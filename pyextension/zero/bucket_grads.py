"""The gradient half of ZeRO's ``Bucket`` (zero/buckets.py: layout and params), a mixin.

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
  then too: kept, they held every shard, 20 MiB per rank in bench_zero, through the next
  backward). Stage 0/1 keep their full-size buffers and only mark the grads absent, as DDP keeps
  its buckets (freed, they came back during backward while gloo's finished work still held the old
  ones: +25 MiB per rank in bench_zero). ``set_to_none=False`` keeps every buffer, zeroed, so their
  addresses, and with them the optimizer's kept kernel tables, stay the same (on CUDA
  the caching allocator usually hands the same blocks back anyway).
- CUDA: Work.wait() orders the current stream after the collective; a buffer dropped after the
  wait is reused by the caching allocator on that stream only ([Note: stream ordering] in
  csrc/comm/nccl_transport.cu and [Note: Work lifetimes] in csrc/comm/communicator.h).
"""
from __future__ import annotations

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


class BucketGrads:
    """Bucket's gradient buffers and their collectives; reads the layout Bucket.__init__ set
    (params, offsets, padded, shard_numel, lo/hi, stage, inplace, kept, comm, dtypes)."""

    def _init_grads(self) -> None:
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
        if self.grad_div != 1.0 and self.reduce_dtype in LOW_PRECISION:
            fresh = []  # (one by one: add_grad divides before the cast, see there)
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
        elif self.grad_div != 1.0 and self.reduce_dtype in LOW_PRECISION:
            # divided in the grad's precision, rounded once into the bf16/fp16 buffer (cast first, a
            # grad between 65504 and 65504 x world size was inf in fp16 before the division meant to
            # keep it finite, and bf16 rounded twice: a review's reproduction, 2026-12-07)
            torch.mul(g.detach(), self.grad_div, out=view)  # (detached: out= takes no autograd, create_graph)
            self.written[i] = True
        else:
            view.copy_(g)  # (fp32 buffer: the copy is exact or the one rounding, then one multiply)
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
