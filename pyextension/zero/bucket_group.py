"""ZeRO's ``BucketGroup``: every bucket's gradient and parameter collectives, with at most
``max_inflight`` gradient reductions in flight ([Note: bucket buffers] in zerofuse/zero/bucket_grads.py;
the ``Bucket`` itself in zerofuse/zero/buckets.py).

[Note: launch order]
Every rank launches the buckets' reductions in one fixed order, the order their grads become ready
in backward (``order``), whatever the order they complete in there, as DDP's reducer does: a bucket
complete before one ahead of it waits for it, and the end of backward launches, in that order,
every bucket not launched yet, one that got no grad on this rank too (it reduces zeros). So a param
with a grad on some ranks only (a rank-dependent branch, an output used on some ranks) delays that
rank's launches to the end of backward but pairs every collective with the same bucket's on the
other ranks; launched as each bucket completed, the ranks' collectives differed: the step hung or,
where the buckets paired up had one size, reduced one bucket's grads with another's, silently.
Buckets over different communicators (the expert buckets' group) keep one order per communicator
(a lane): none waits for another lane's, and each lane has its own ``max_inflight`` window (one
window over both made a dense launch wait for an expert reduction: a rank whose dense lane was held
back waited, at its end of backward, for an expert reduction the other ranks launched only after the
dense one it held: a hang, 2026-12-06). Collectives over different groups need no common order.

A bucket that got a param's grad twice in one backward (a module used twice under re-entrant
checkpointing) is reduced again at the end of backward on every rank, with the grads that arrived
after its first reduction or zeros: whether its first launch came before the second grad depends on
how far the rank's lane got, so deciding by that made one rank launch it once and the others twice.

Limit: a rank whose lane is held back by a param without a grad launches the rest at its end of
backward, while the other ranks block once ``max_inflight`` reductions are in flight: a collective
the held-back rank runs later in its backward (MoE's all-to-all, tensor parallelism's all-reduce)
then waits for ranks that wait for it, until the communicator's timeout fails the step. Such a
model needs parallelize(find_unused_parameters=True), which marks them ready when backward starts
([Note: unused params] in zero/unused.py), or every param to get a grad on every rank."""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zerofuse.zero.buckets import Bucket


class BucketGroup:
    """Every bucket's collectives: ``start_grad_sync(bucket)`` launches one bucket's reduction,
    first waiting for the oldest in flight when ``max_inflight`` are ([Note: bucket buffers]);
    ``finish_grad_sync()`` launches what is left and waits for all; ``start_param_sync()`` /
    ``finish_param_sync()`` all-gather every bucket's shard into its params (stage 1/2, after a
    step; stage 3 gathers unit by unit through the buckets)."""

    def __init__(self, buckets: list[Bucket], comm, max_inflight: int, order: list[Bucket] | None = None):
        self.buckets, self.comm, self.max_inflight = buckets, comm, max_inflight
        self.on_reduced = None  # callable(bucket) once a bucket's reduction completed (offload: [Note: offloaded steps])
        lanes: dict[int, list[Bucket]] = {}  # [Note: launch order]: one per communicator
        for b in (order if order is not None else buckets):
            lanes.setdefault(id(b.comm), []).append(b)
        self._lanes = list(lanes.values())
        self._lane_of = {id(b): i for i, lane in enumerate(self._lanes) for b in lane}
        self._cursor = [0] * len(self._lanes)  # per lane: the buckets before it are launched
        self._inflight: list[collections.deque[Bucket]] = [collections.deque() for _ in self._lanes]  # per lane

    def __iter__(self):
        return iter(self.buckets)

    def __len__(self):
        return len(self.buckets)

    def __getitem__(self, i):
        return self.buckets[i]

    def make_room(self, bucket: Bucket) -> None:
        """Waits for the oldest reductions of ``bucket``'s lane until fewer than max_inflight are in
        flight there."""
        window = self._inflight[self._lane_of[id(bucket)]]
        while len(window) >= self.max_inflight:
            self._finish(window.popleft())

    def _finish(self, b: Bucket) -> None:
        b.finish_grad_sync()
        if self.on_reduced is not None:
            self.on_reduced(b)

    def finish(self, bucket: Bucket) -> None:
        """Wait for ``bucket``'s reduction if it is in flight."""
        li = self._lane_of[id(bucket)]
        if any(b is bucket for b in self._inflight[li]):
            self._inflight[li] = collections.deque(b for b in self._inflight[li] if b is not bucket)
            self._finish(bucket)

    def start_grad_sync(self, bucket: Bucket) -> None:
        self.make_room(bucket)
        bucket.start_grad_sync(self.comm)
        self._inflight[self._lane_of[id(bucket)]].append(bucket)

    def clear_inflight(self) -> None:
        """Forget the reductions in flight (an abandoned backward: grads.abandon_backward)."""
        for window in self._inflight:
            window.clear()

    def ready(self, bucket: Bucket) -> list[Bucket]:
        """``bucket``'s grads of this backward are all in: launched once every bucket ahead of it in
        its lane is, with the complete ones behind it that waited for it ([Note: launch order]).
        Returns the buckets launched."""
        bucket.complete = True
        li = self._lane_of[id(bucket)]
        lane, k, out = self._lanes[li], self._cursor[li], []
        while k < len(lane) and (lane[k].launched or lane[k].complete):
            if not lane[k].launched:
                self.start_grad_sync(lane[k])
                out.append(lane[k])
            k += 1
        self._cursor[li] = k
        return out

    def restart(self) -> None:
        """A new backward: every lane's order starts again."""
        self._cursor = [0] * len(self._lanes)
        for b in self.buckets:
            b.launched = b.complete = b.twice = False
            b.arrived = [False] * len(b.params)

    def finish_grad_sync(self, launch_rest: bool = False) -> list[Bucket]:
        """Wait for every reduction in flight; with launch_rest (the end of a synced backward), first
        launch, in each lane's order, every bucket not launched yet (unused params, overlap off; a
        bucket without grads reduces zeros: [Note: launch order]), then those holding grads that
        arrived after their bucket's reduction. Returns the buckets launched here."""
        late = []
        if launch_rest:
            again = [b for b in self.buckets if b.twice]  # (the same on every rank: see the note)
            for li, lane in enumerate(self._lanes):
                for b in lane[self._cursor[li]:]:
                    if not b.launched:
                        self.start_grad_sync(b)
                        late.append(b)
                self._cursor[li] = len(lane)
            for b in again:
                self.finish(b)  # (launched just above on a rank that got both grads before its launch)
                self.start_grad_sync(b)
                late.append(b)
        for window in self._inflight:
            while window:
                self._finish(window.popleft())
        return late

    def start_param_sync(self) -> None:
        for b in reversed(self.buckets):  # the forward's first params first
            b.start_param_sync(self.comm)

    def finish_param_sync(self) -> None:
        for b in reversed(self.buckets):
            b.finish_param_sync(self.comm)
