"""Gradient buckets (Megatron-Core style: Bucket -> BucketGroup) on the Communicator.

``BucketPlan`` assigns parameters, in reverse registration order (the order their gradients
become ready in backward), to buckets of about ``bucket_mb``; each bucket's flat size is padded to
a multiple of ``world_size * align`` elements, so every rank's shard has the same size.
``BucketGroup`` runs one coalesced collective per bucket: ``start_grad_sync`` /
``finish_grad_sync`` (reduce-scatter into per-rank grad shards, or all-reduce in place) and
``start_param_sync`` / ``finish_param_sync`` (all-gather of per-rank param shards into the
params). With ``register_grad_ready_hooks()``, a bucket's reduce-scatter is launched from a
post-accumulate-grad hook as soon as its last gradient is ready, while backward goes on.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from zerofuse.comm.communicator import Communicator


@dataclasses.dataclass
class Bucket:
    index: int
    params: list[torch.nn.Parameter]
    offsets: list[int]  # of each param in the bucket's flat layout
    numel: int  # sum of the params' numel
    padded_numel: int  # multiple of world_size * align
    shard_numel: int  # padded_numel / world_size: each rank's piece


class BucketPlan:
    def __init__(self, params: Sequence[torch.nn.Parameter], bucket_mb: float = 25.0, world_size: int = 1,
                 align: int = 128):
        if not bucket_mb > 0:
            raise ValueError(f"zerofuse.comm.BucketPlan: expected bucket_mb > 0, got {bucket_mb}")
        if world_size < 1 or align < 1:
            raise ValueError(f"zerofuse.comm.BucketPlan: expected world_size >= 1 and align >= 1, got {world_size}, {align}")
        params = [p for p in params if p.requires_grad]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("zerofuse.comm.BucketPlan: a parameter appears twice")
        limit = bucket_mb * (1 << 20)
        unit = world_size * align
        self.world_size, self.align = world_size, align
        self.buckets: list[Bucket] = []
        cur: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(params):
            cur.append(p)
            size += p.numel() * p.element_size()
            if size >= limit:
                self._close(cur, unit)
                cur, size = [], 0
        if cur:
            self._close(cur, unit)

    def _close(self, params, unit):
        offsets, off = [], 0
        for p in params:
            offsets.append(off)
            off += p.numel()
        padded = max(unit, -(-off // unit) * unit)
        self.buckets.append(Bucket(len(self.buckets), list(params), offsets, off, padded, padded // self.world_size))

    def bucket_of(self, p: torch.nn.Parameter) -> Bucket:
        for b in self.buckets:
            if any(q is p for q in b.params):
                return b
        raise KeyError("zerofuse.comm.BucketPlan: parameter not in the plan")


class BucketGroup:
    """Collectives per bucket of ``plan`` through ``comm``.

    mode="reduce_scatter": after finish_grad_sync, ``grad_shards[i]`` (fp32 or ``reduce_dtype``)
    holds this rank's shard of bucket i's reduced gradients. mode="all_reduce": every param's
    .grad is reduced in place. ``events`` records (kind, bucket, time) of launches and finishes,
    to show overlap.
    """

    def __init__(self, plan: BucketPlan, comm: Communicator, *, mode: str = "reduce_scatter", op: str = "avg",
                 reduce_dtype: torch.dtype | None = None):
        if mode not in ("reduce_scatter", "all_reduce"):
            raise ValueError(f"zerofuse.comm.BucketGroup: expected mode 'reduce_scatter' or 'all_reduce', got {mode!r}")
        if plan.world_size != comm.world_size:
            raise ValueError(f"zerofuse.comm.BucketGroup: the plan is for world_size {plan.world_size}, the "
                             f"communicator has {comm.world_size}")
        self.plan, self.comm, self.mode, self.op, self.reduce_dtype = plan, comm, mode, op, reduce_dtype
        self._works: dict[int, object] = {}
        self._ready: dict[int, int] = {}
        self._hooks = []
        self.events: list[tuple[str, int, float]] = []
        self.grad_shards: list[torch.Tensor] = []
        self._pads: list[torch.Tensor] = []
        for b in plan.buckets:
            p0 = b.params[0]
            dtype = reduce_dtype or p0.dtype
            self.grad_shards.append(torch.zeros(b.shard_numel, dtype=dtype, device=p0.device))
            self._pads.append(torch.zeros(b.padded_numel - b.numel, dtype=p0.dtype, device=p0.device))

    # ---------------------------------------------------------------- grads

    def _grads(self, b: Bucket) -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]

    def start_grad_sync(self, bucket: Bucket | int | None = None) -> None:
        """Launch the collective of one bucket (or of every bucket not launched yet)."""
        if bucket is None:  # every bucket left: one fused launch where the transport can
            with self.comm.coalesce():
                for b in self.plan.buckets:
                    self._start(b)
        else:
            self._start(self._bucket(bucket))

    def _start(self, b: Bucket) -> None:
        if b.index in self._works:
            return
        self.events.append(("launch", b.index, time.perf_counter()))
        if self.mode == "reduce_scatter":
            self._works[b.index] = self.comm.reduce_scatter_coalesced(
                self._grads(b) + [self._pads[b.index]], self.grad_shards[b.index], op=self.op,
                reduce_dtype=self.reduce_dtype)
        else:
            grads = []
            for p in b.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            self._works[b.index] = self.comm.all_reduce_coalesced(grads, op=self.op, reduce_dtype=self.reduce_dtype)

    def finish_grad_sync(self) -> None:
        """Launch what is left, then wait for every bucket (buckets launched by hooks first)."""
        self.start_grad_sync()
        for index, work in sorted(self._works.items()):
            work.wait()
            self.events.append(("finish", index, time.perf_counter()))
        self._works.clear()
        self._ready.clear()

    def register_grad_ready_hooks(self) -> None:
        """Launch each bucket's collective from the post-accumulate-grad hook of its last ready param."""
        for b in self.plan.buckets:
            for p in b.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(b)))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _make_hook(self, b: Bucket):
        def hook(_param):
            n = self._ready.get(b.index, 0) + 1
            self._ready[b.index] = n
            if n == len(b.params):
                self.start_grad_sync(b)

        return hook

    # ---------------------------------------------------------------- params

    def param_shard(self, bucket: Bucket | int) -> torch.Tensor:
        """This rank's shard of the bucket's params (flat, padded with zeros), a new tensor."""
        b = self._bucket(bucket)
        flat = torch.zeros(b.padded_numel, dtype=b.params[0].dtype, device=b.params[0].device)
        torch.cat([p.detach().reshape(-1) for p in b.params], out=flat[: b.numel])
        r = self.comm.rank
        return flat[r * b.shard_numel:(r + 1) * b.shard_numel].clone()

    def start_param_sync(self, shards: Sequence[torch.Tensor]) -> None:
        """All-gather ``shards[i]`` (this rank's piece of bucket i) into the bucket's params."""
        if len(shards) != len(self.plan.buckets):
            raise ValueError(f"zerofuse.comm.BucketGroup: expected {len(self.plan.buckets)} shards, got {len(shards)}")
        self._param_works = []
        for b, shard in zip(self.plan.buckets, shards):
            targets = [p.data for p in b.params] + [self._pads[b.index].new_empty(b.padded_numel - b.numel)]
            self._param_works.append(self.comm.all_gather_coalesced(shard, targets))

    def finish_param_sync(self) -> None:
        for w in getattr(self, "_param_works", []):
            w.wait()
        self._param_works = []

    def _bucket(self, bucket: Bucket | int) -> Bucket:
        return self.plan.buckets[bucket] if isinstance(bucket, int) else bucket
