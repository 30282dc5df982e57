"""ZeRO's ``BucketGroup``: every bucket's gradient and parameter collectives, with at most
``max_inflight`` gradient reductions in flight ([Note: bucket buffers] in zerofuse/zero/buckets.py,
which holds the ``Bucket`` itself).

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
(a lane): none waits for another lane's. Collectives over different groups need no common order."""
from __future__ import annotations

import collections


class BucketGroup:
    """Every bucket's collectives: ``start_grad_sync(bucket)`` launches one bucket's reduction,
    first waiting for the oldest in flight when ``max_inflight`` are ([Note: bucket buffers]);
    ``finish_grad_sync()`` launches what is left and waits for all; ``start_param_sync()`` /
    ``finish_param_sync()`` all-gather every bucket's shard into its params (stage 1/2, after a
    step; stage 3 gathers unit by unit through the buckets)."""

    def __init__(self, buckets: list[Bucket], comm, max_inflight: int, order: list[Bucket] | None = None):
        self.buckets, self.comm, self.max_inflight = buckets, comm, max_inflight
        self._inflight: collections.deque[Bucket] = collections.deque()
        self.on_reduced = None  # callable(bucket) once a bucket's reduction completed (offload: [Note: offloaded steps])
        lanes: dict[int, list[Bucket]] = {}  # [Note: launch order]: one per communicator
        for b in (order if order is not None else buckets):
            lanes.setdefault(id(b.comm), []).append(b)
        self._lanes = list(lanes.values())
        self._lane_of = {id(b): i for i, lane in enumerate(self._lanes) for b in lane}
        self._cursor = [0] * len(self._lanes)  # per lane: the buckets before it are launched

    def __iter__(self):
        return iter(self.buckets)

    def __len__(self):
        return len(self.buckets)

    def __getitem__(self, i):
        return self.buckets[i]

    def make_room(self) -> None:
        """Waits for the oldest reductions until fewer than max_inflight are in flight."""
        while len(self._inflight) >= self.max_inflight:
            self._finish(self._inflight.popleft())

    def _finish(self, b: Bucket) -> None:
        b.finish_grad_sync()
        if self.on_reduced is not None:
            self.on_reduced(b)

    def finish(self, bucket: Bucket) -> None:
        """Wait for ``bucket``'s reduction if it is in flight."""
        if any(b is bucket for b in self._inflight):
            self._inflight = collections.deque(b for b in self._inflight if b is not bucket)
            self._finish(bucket)

    def start_grad_sync(self, bucket: Bucket) -> None:
        self.make_room()
        bucket.start_grad_sync(self.comm)
        self._inflight.append(bucket)

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
            b.launched = b.complete = False

    def finish_grad_sync(self, launch_rest: bool = False) -> list[Bucket]:
        """Wait for every reduction in flight; with launch_rest (the end of a synced backward), first
        launch, in each lane's order, every bucket not launched yet (unused params, overlap off; a
        bucket without grads reduces zeros: [Note: launch order]), then those holding grads that
        arrived after their bucket's reduction. Returns the buckets launched here."""
        late = []
        if launch_rest:
            again = [b for b in self.buckets if b.launched and b.dirty]
            for li, lane in enumerate(self._lanes):
                for b in lane[self._cursor[li]:]:
                    if not b.launched:
                        self.start_grad_sync(b)
                        late.append(b)
                self._cursor[li] = len(lane)
            for b in again:
                self.start_grad_sync(b)
                late.append(b)
        while self._inflight:
            self._finish(self._inflight.popleft())
        return late

    def start_param_sync(self) -> None:
        for b in reversed(self.buckets):  # the forward's first params first
            b.start_param_sync(self.comm)

    def finish_param_sync(self) -> None:
        for b in reversed(self.buckets):
            b.finish_param_sync(self.comm)
