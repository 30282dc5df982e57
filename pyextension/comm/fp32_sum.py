"""The Work of Communicator.reduce_scatter_fp32_sum (zerofuse/comm/communicator.py): an all-to-all
on the c10d group, summed in fp32, its all-gather launched in the order of the calls."""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from zerofuse.comm.waits import _waited, wait_timeout


class _SummedWork:
    """Work of Communicator.reduce_scatter_fp32_sum: the all-to-all finished and summed, and with
    all_gather its gather launched (``_advance``), at wait() or at the communicator's next
    collective, whichever comes first: the gather takes its place in the group's order where the
    call did, not where a rank waited (gloo and NCCL pair collectives by order: two ranks waiting in
    other orders swapped two calls' results, silently, or hung - a review's reproduction,
    2026-12-06). A failure is the communicator's, as for the C++ Works ([Note: communicator
    failure]): this wait and every later one raise it, and so does every later call of the
    communicator (a second wait returned with out_shard unwritten, and the next collective waited
    for a timeout again)."""

    __slots__ = ("_comm", "_w", "_recv", "_flat", "_out", "_gather", "_what", "_error", "_gw", "_cuda")

    def __init__(self, comm, work, recv, flat, out, gather, what):
        self._comm, self._w, self._recv, self._flat, self._out, self._gather = comm, work, recv, flat, out, gather
        self._what, self._error, self._gw = what, None, None
        self._cuda = recv.is_cuda

    def _wait_work(self, work, timeout: datetime.timedelta, host: bool) -> None:
        """c10d's NCCL wait with a timeout blocks the host until the GPU finished (WorkNCCL::wait:
        "blockingWait_ || timeout != kNoTimeout"): on CUDA the stream waits alone, the watchdog
        and the group's timeout catch a hang (a review's reading, 2026-12-06: every bucket's launch
        waited on the host for the last one's all-to-all, no overlap left); host: the caller gave
        wait() a timeout, which blocks the host as the C++ Works' does."""
        if self._cuda and not host:
            work.wait()
        else:
            work.wait(timeout)

    def _timeout(self, timeout=None) -> datetime.timedelta:
        limit = wait_timeout(timeout)
        return datetime.timedelta(seconds=min(self._comm.timeout, limit or self._comm.timeout))

    def _fail(self, e: Exception, timeout: datetime.timedelta) -> None:
        message = f"{self._what} failed (timeout {timeout.total_seconds():g} s): {e}"
        self._comm._c.fail(message)
        self._error = f"zerofuse.comm: {message}"
        raise dist.DistBackendError(self._error) from e

    def _advance(self, timeout: datetime.timedelta, host: bool = False) -> None:
        """The all-to-all waited for and summed in fp32, the all-gather (all_gather=True) launched."""
        if self._w is None:
            return
        try:
            self._wait_work(self._w, timeout, host)
            ws = self._comm.world_size
            total = torch.sum(self._recv.view(ws, -1), dim=0, dtype=torch.float32)
            if self._out is not None:
                self._out.copy_(total)
            if self._gather:
                # (into flat as 1-D: a 2-D flat was gloo's "invalid tensor size", on every rank)
                self._comm._c.wait_launched()
                self._gw = dist.all_gather_into_tensor(self._flat.view(-1), total.to(self._flat.dtype),
                                                       group=self._comm.group, async_op=True)
        except RuntimeError as e:  # c10d names neither the collective nor the group
            self._fail(e, timeout)
        finally:
            self._w = self._recv = self._out = None

    def wait(self, timeout=None) -> None:
        if self._error is not None:
            raise dist.DistBackendError(self._error)
        if self._w is None and self._gw is None:
            return
        t0 = time.perf_counter()
        limit = self._timeout(timeout)
        try:
            self._advance(limit, timeout is not None)
            if self._gw is not None:
                gw, self._gw = self._gw, None
                try:
                    self._wait_work(gw, limit, timeout is not None)
                except RuntimeError as e:
                    self._fail(e, limit)
        finally:
            self._flat = None
            _waited[0] += time.perf_counter() - t0

    def is_completed(self) -> bool:
        """Done: the all-to-all summed and, with all_gather, the gather done. A finished all-to-all is
        advanced here (its gather launched): no collective was called since, or _in_order would have
        (it stayed False until wait(): a polling loop never ended; 2026-12-07)."""
        if self._error is not None:
            return True  # (wait() raises)
        if self._w is not None:
            if not self._w.is_completed():
                return False
            try:
                self._advance(self._timeout())
            except dist.DistBackendError:  # recorded: wait() raises it
                return True
        return self._gw is None or self._gw.is_completed()
