"""ZeRO's ``BucketGroup``: every bucket's gradient and parameter collectives, with at most
``max_inflight`` gradient reductions in flight ([Note: bucket buffers] in zerofuse/zero/buckets.py,
which holds the ``Bucket`` itself)."""
from __future__ import annotations

import collections


class BucketGroup:
    """Every bucket's collectives: ``start_grad_sync(bucket)`` launches one bucket's reduction,
    first waiting for the oldest in flight when ``max_inflight`` are ([Note: bucket buffers]);
    ``finish_grad_sync()`` launches what is left and waits for all; ``start_param_sync()`` /
    ``finish_param_sync()`` all-gather every bucket's shard into its params (stage 1/2, after a
    step; stage 3 gathers unit by unit through the buckets)."""

    def __init__(self, buckets: list[Bucket], comm, max_inflight: int):
        self.buckets, self.comm, self.max_inflight = buckets, comm, max_inflight
        self._inflight: collections.deque[Bucket] = collections.deque()
        self.on_reduced = None  # callable(bucket) once a bucket's reduction completed (offload: [Note: offloaded steps])

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

    def finish_grad_sync(self, launch_rest: bool = False) -> list[Bucket]:
        """Wait for every reduction in flight; with launch_rest, first launch buckets holding
        unreduced grads (unused params, overlap off, grads that arrived after their bucket's
        reduction). Returns the buckets launched here."""
        late = []
        if launch_rest:
            for b in self.buckets:
                if b.dirty:
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
