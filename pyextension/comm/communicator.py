"""``zerofuse.comm.Communicator``: fused, coalesced collectives over lists of tensors.

Python face of the C++ Communicator (csrc/comm/communicator.h). Every call copies its tensors into
one flat buffer (one kernel / one parallel pass), runs one collective, and returns a ``Work``; the
result (the output shard, or the tensors themselves for all-gather / all-reduce) is written when
``wait()`` returns. ``wait()`` blocks on CPU (bounded by ``timeout``) and, for CUDA tensors, only
orders the current stream after the collective.

Transports: ``"auto"`` (default: CPU tensors through the c10d ProcessGroup, e.g. gloo; CUDA
tensors through zerofuse's own NCCL communicator in CUDA builds), ``"process_group"``, ``"nccl"``.

Timeout (default: the group's own, as given to ``init_process_group`` / ``new_group``, else torch's
default): bounds every blocking wait and, on NCCL, every collective's run on the device (a watchdog
thread aborts the communicator when one does not complete in time). The first collective that
fails or times out makes the communicator unusable: that call and every later launch or wait raise
``torch.distributed.DistBackendError`` naming the failed collective, its sequence number, the group
and the timeout, on every rank, instead of hanging (csrc/comm/communicator.h, [Note: communicator
failure]).

Debug checker: with ``ZEROFUSE_CHECK_COLLECTIVES=1`` every rank publishes each call's signature
(op, shapes, dtypes, sequence number) in the group's store before the collective and compares it
with every other rank's; a mismatch raises :class:`CollectiveMismatch` on every rank naming the
ranks and their calls, and a rank that never arrives is named after ``timeout``, instead of a
hang.

Without the checker, ranks passing different sizes to one call are not detected: each rank knows
only its own, and comparing them would be a collective of its own before every call (on gloo as
long as a small all-reduce). On gloo such a call aborts the process of a rank that receives more
than it posted (gloo's enforce, in its transport thread: std::terminate, no Python exception), and
the ranks left raise ``DistBackendError``; the abort cannot tear a checkpoint (files.py writes
each one aside and renames it into place). But gloo also takes a message shorter than the receive:
a rank whose size is smaller than a peer's can return without an error holding a mix of data or its
own values unreduced (measured at 3 ranks sizes [2, 2, 4]: ranks 0 and 1 returned [6, 6] and [9, 9],
rank 2 timed out; at 2 ranks [4, 2]: rank 1 returned its own [1, 1]; a review's reproduction,
2026-12-07), besides the rare sizes of [Note: piece size] (process_group_transport.cpp). Ranks that differ only in dtype, with equal element sizes (bf16 and
fp16, fp32 and int32), are not detected by the transports either: the bytes are reduced as the
receiving rank's dtype and every rank returns garbage (as torch's own gloo collectives).
``all_gather_coalesced`` is a broadcast per rank on gloo, which takes a message shorter than the
receive: the rank with the largest shard can return with others' shorter shards in its slots. Run
with ``ZEROFUSE_CHECK_COLLECTIVES=1`` to find such a mismatch (tests/test_bad_input_comm.py).
"""
from __future__ import annotations

import contextlib
import itertools
import math
import numbers
import time
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from zerofuse import _C
from zerofuse.comm import local
from zerofuse.kernels import env
from zerofuse.comm.checker import CollectiveChecker, CollectiveMismatch  # noqa: F401  (re-exported)
from zerofuse.comm.checker import one_dtype as _one_dtype
from zerofuse.comm.checker import scale_of as _scale
from zerofuse.comm.fp32_sum import _SummedWork
from zerofuse.comm.lists import _bytes_of_bools, _checked_list, check_args, check_p2p
from zerofuse.comm.waits import MAX_TIMEOUT_S, _timeout, _waited, group_timeout, wait_seconds, wait_timeout  # noqa: F401  (re-exported)

# per group name: ranks of a group number their communicators alike whatever other groups they
# belong to (the store keys of the NCCL id and the checker derive from it). The count restarts
# when the name belongs to a new group object (destroy_process_group + init reuses names), so
# ranks that made different numbers of communicators before a re-init agree again after it; the
# new object also starts a new generation, counted per rank in the store, so that a store that
# outlives the re-init (torchrun's) cannot hand out a key, such as an NCCL id, of the last one.
_instances: dict[str, tuple[weakref.ref, str, itertools.count]] = {}


def _next_uid(name: str, group: dist.ProcessGroup, store, rank: int) -> str:
    entry = _instances.get(name)
    if entry is None or entry[0]() is not group:
        generation = store.add(f"zerofuse/{name}/generation/rank{rank}", 1)
        entry = _instances[name] = (weakref.ref(group), f"g{generation}", itertools.count())
    return f"zerofuse/{name}/{entry[1]}/{next(entry[2])}"


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _whole(n) -> bool:
    """A whole row count: an int, or a float or a one-element tensor holding one (not a bool)."""
    n = n.item() if isinstance(n, torch.Tensor) and n.numel() == 1 else n
    return not isinstance(n, bool) and isinstance(n, numbers.Real) and math.isfinite(n) and n == int(n)


def _group_label(group: dist.ProcessGroup) -> str:
    """As the C++ side names a group in messages (csrc/comm/communicator.cpp, group_label)."""
    desc = getattr(group, "group_desc", "")
    return f"group {group.group_name}" + (f" ({desc})" if desc and desc != "undefined" else "")


class Work:
    """Handle of one collective: ``wait(timeout=None)`` (CPU: blocks, bounded by the communicator's
    timeout; CUDA: the current stream waits) and ``is_completed()``. A ``timeout`` (seconds or a
    timedelta, as torch's Work.wait) blocks the host until the collective is done, on CUDA too,
    for at most that long; past it the collective is the communicator's failure, as when the
    communicator's own timeout passes ([Note: communicator failure]: a collective in flight cannot
    be withdrawn from its peers)."""

    __slots__ = ("_w", "_comm", "_cuda", "_checks")

    def __init__(self, work, comm: "Communicator", cuda: bool = False, checks: list | None = None):
        self._w, self._comm, self._cuda, self._checks = work, comm, cuda, checks

    def wait(self, timeout=None) -> None:
        limit = wait_timeout(timeout)
        if self._cuda and self._comm._coalescing:  # a usage error, not the communicator's failure (the
            # C++ wait's refusal failed it for good: every collective of the open group refused at its end)
            raise RuntimeError(f"zerofuse.comm: wait() on {self._w.what}, a collective of a group that is still "
                               "open: end the coalesce() block first (NCCL launches its collectives there)")
        t0 = time.perf_counter()
        try:
            if self._checks:  # ZEROFUSE_CHECK_COLLECTIVES' comparisons of a batch_p2p left to the wait
                checks, self._checks = self._checks, None
                self._comm.finish_p2p_checks(checks, limit)
            if limit is not None and not self._cuda:  # the ProcessGroup transport: a timed C++ wait (polling
                # is_completed() never saw a gloo send/recv done: every timed p2p wait failed; 2026-12-07)
                self._w.wait_within(limit)
                return
            if limit is not None and not self._done_within(limit):  # (NCCL: its events' completion)
                message = f"{self._w.what} did not finish within the wait's timeout of {limit:g} s"
                self._comm._c.fail(message)
                raise dist.DistBackendError(f"zerofuse.comm: {message}")
            self._w.wait()
        finally:
            _waited[0] += time.perf_counter() - t0

    def _done_within(self, limit: float) -> bool:
        deadline, nap = time.monotonic() + limit, 50e-6
        while not self._w.is_completed():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(nap, left))
            nap = min(2 * nap, 1e-3)
        return True

    def is_completed(self) -> bool:
        """True once wait() would not block (done, or failed: then wait() raises). A point-to-point
        Work on gloo stays False until wait(): gloo's send/recv report completion only in their wait
        (poll with ``wait(timeout=)`` there instead of looping on this)."""
        return self._w.is_completed()


class P2POp(NamedTuple):
    """One transfer of :meth:`Communicator.batch_p2p`: ``op`` "send" or "recv", a contiguous
    ``tensor`` (written at ``wait()`` for a receive), ``peer`` a rank of the communicator's group,
    ``tag`` told apart by c10d transports (NCCL matches a pair's transfers by order)."""

    op: str
    tensor: torch.Tensor
    peer: int
    tag: int = 0


class Communicator(CollectiveChecker):
    """Coalesced collectives on ``group`` (None: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, transport: str = "auto",
                 timeout: float | None = None, debug_delay_ms: float | None = None):
        if not dist.is_initialized():
            raise RuntimeError("zerofuse.comm.Communicator: torch.distributed is not initialized "
                               "(call torch.distributed.init_process_group first)")
        self.group = group if group is not None else dist.distributed_c10d._get_default_group()
        if self.group is dist.GroupMember.NON_GROUP_MEMBER or not isinstance(self.group, dist.ProcessGroup):
            raise ValueError(f"zerofuse.comm.Communicator: expected a process group this rank ({dist.get_rank()}) "
                             f"belongs to, got {self.group!r} (new_group returns that on the ranks outside the group)")
        name = dist.distributed_c10d._get_process_group_name(self.group)
        self.store = dist.distributed_c10d._get_default_store()
        self._uid = _next_uid(name, self.group, self.store, dist.get_rank(self.group))
        if debug_delay_ms is None:
            debug_delay_ms = env.number("ZEROFUSE_COMM_DELAY_MS", 0.0, kind=float)
        self.timeout = _timeout(group_timeout(self.group) if timeout is None else timeout)
        self._fp32_sums = itertools.count()  # numbers reduce_scatter_fp32_sum calls (c10d: not in the C++ sequence)
        self._c = _C._Communicator(self.group, self.store, transport, f"{self._uid}/nccl_id", self.timeout,
                                   float(debug_delay_ms))
        self.check = env.flag("ZEROFUSE_CHECK_COLLECTIVES", False, "calls compared across ranks", "off")
        self._p2p_counts: dict[tuple, int] = {}  # (src, dst[, tag]) -> transfers checked (_checked_p2p)
        self._one = self._c.world_size == 1  # collectives done in place on the current stream (comm/local.py)
        self._coalescing = 0  # depth of coalesce() blocks (a Work of an open NCCL group is not launched yet)
        self._gathers: list[_SummedWork] = []  # reduce_scatter_fp32_sum(all_gather=True) not advanced yet

    @property
    def rank(self) -> int:
        return self._c.rank

    @property
    def world_size(self) -> int:
        return self._c.world_size

    @property
    def transport(self) -> str:
        return self._c.transport

    def shard_numel(self, tensors: Sequence[torch.Tensor]) -> int:
        """ceil(total numel / world_size): the numel of a coalesced reduce-scatter's output shard."""
        return self._c.shard_numel(list(tensors))

    # ------------------------------------------------------------------ collectives

    def _in_order(self) -> None:
        """Before a collective: the all-gathers of earlier reduce_scatter_fp32_sum calls launched
        first (_SummedWork), so the group pairs every collective in the order it was called."""
        t0 = time.perf_counter() if self._gathers else None
        while self._gathers:
            w = self._gathers.pop(0)
            w._advance(w._timeout())
        if t0 is not None:  # (time blocked on an all-to-all here is communication the step waited for)
            _waited[0] += time.perf_counter() - t0

    def reduce_scatter_coalesced(self, tensors: Sequence[torch.Tensor], out_shard: torch.Tensor, op: str = "avg",
                                 scale: float | None = None, reduce_dtype: torch.dtype | None = None,
                                 tag: str | None = None):
        """Reduce the concatenation of ``tensors`` (padded with zeros to world_size * shard) over
        the ranks and write this rank's shard, times ``scale``, into ``out_shard``. Reduced in
        ``reduce_dtype`` (default out_shard's dtype), e.g. bf16 grads in fp32. A single contiguous
        tensor of exactly world_size * shard elements in the reduce dtype is used as the flat
        buffer instead of a copy: leave it alone until ``wait()``, and treat its contents as
        scratch after (on gloo it is all-reduced in place). ``tag``: a name ZEROFUSE_CHECK_COLLECTIVES
        compares too (ZeRO's bucket: two buckets of one size launched in different orders on two ranks
        were reduced together, silently)."""
        check_args("reduce_scatter_coalesced", tensors, scale=scale, reduce_dtype=reduce_dtype, op=op,
                   out_shard=out_shard)
        *tensors, out_shard = _bytes_of_bools("reduce_scatter_coalesced", [*tensors, out_shard], op, scale)
        tensors = _checked_list("reduce_scatter_coalesced", "tensors", tensors, written=False)
        if isinstance(out_shard, torch.Tensor):  # written, not differentiated (a leaf requiring grad: every
            out_shard = out_shard.detach()       # wait() raised after the collective ran; one rank wrote it)
        reduce_dtype = torch.uint8 if reduce_dtype is torch.bool else reduce_dtype
        if self._one:
            return local.reduce_scatter_coalesced(tensors, out_shard, op, scale, reduce_dtype)
        self._in_order()
        self._checked("reduce_scatter_coalesced", tensors=tensors, out_shard=out_shard, op=op, scale=_scale(scale),
                      reduce_dtype=reduce_dtype or out_shard.dtype, **({"tag": tag} if tag else {}))
        return Work(self._c.reduce_scatter_coalesced(tensors, out_shard, op, scale, reduce_dtype), self,
                    out_shard.is_cuda)

    def all_gather_coalesced(self, shard: torch.Tensor, tensors: Sequence[torch.Tensor]):
        """Gather every rank's ``shard`` into the concatenation of ``tensors`` (the inverse of
        reduce_scatter_coalesced's layout); the tensors are written at ``wait()`` (a single
        contiguous tensor of exactly world_size * shard elements is gathered into directly)."""
        check_args("all_gather_coalesced", tensors, shard=shard)
        shard, *tensors = _bytes_of_bools("all_gather_coalesced", [shard, *tensors])
        tensors = _checked_list("all_gather_coalesced", "tensors", tensors, written=True)
        if self._one:
            return local.all_gather_coalesced(shard, tensors)
        self._in_order()
        self._checked("all_gather_coalesced", shard=shard, tensors=tensors)
        return Work(self._c.all_gather_coalesced(shard, tensors), self, shard.is_cuda)

    def all_reduce_coalesced(self, tensors: Sequence[torch.Tensor], op: str = "sum", scale: float | None = None,
                             reduce_dtype: torch.dtype | None = None, tag: str | None = None):
        """Reduce every tensor over the ranks, in place (at ``wait()``), through one flat buffer.
        A single contiguous tensor in the reduce dtype is reduced in place with no copy: its
        contents are undefined until ``wait()``. ``tag``: as reduce_scatter_coalesced's."""
        check_args("all_reduce_coalesced", tensors, scale=scale, reduce_dtype=reduce_dtype, op=op)
        tensors = _bytes_of_bools("all_reduce_coalesced", list(tensors), op, scale)
        tensors = _checked_list("all_reduce_coalesced", "tensors", tensors, written=True, promoted=reduce_dtype is None)
        reduce_dtype = torch.uint8 if reduce_dtype is torch.bool else reduce_dtype
        if self._one:
            return local.all_reduce_coalesced(tensors, op, scale, reduce_dtype)
        self._in_order()
        self._checked("all_reduce_coalesced", tensors=tensors, op=op, scale=_scale(scale),
                      reduce_dtype=reduce_dtype or _one_dtype(tensors), **({"tag": tag} if tag else {}))
        return Work(self._c.all_reduce_coalesced(tensors, op, scale, reduce_dtype), self,
                    any(t.is_cuda for t in tensors))

    def reduce_scatter_fp32_sum(self, flat: torch.Tensor, out_shard: torch.Tensor | None = None, *,
                                all_gather: bool = False) -> "_SummedWork":
        """Reduce-scatter of a low-precision (bf16/fp16) ``flat`` of world_size * shard elements
        without rounding at every hop: one all-to-all hands each rank every rank's piece of its
        shard (on the wire in flat's dtype), and ``wait()`` sums them in fp32, rounding once, into
        ``out_shard``. ``all_gather=True``: an all-reduce, the summed shards gathered back into
        flat. Runs on the c10d group (not checked by ZEROFUSE_CHECK_COLLECTIVES)."""
        ws = self.world_size
        if not isinstance(flat, torch.Tensor):
            raise ValueError(f"zerofuse.comm.reduce_scatter_fp32_sum: expected flat to be a tensor, got "
                             f"{type(flat).__name__}")
        if flat.dtype not in (torch.bfloat16, torch.float16, torch.float32):  # (int64 and float64 were summed
            raise ValueError(f"zerofuse.comm.reduce_scatter_fp32_sum: expected flat bf16, fp16 or fp32 (summed in "  # in
                             f"fp32), got {flat.dtype}; reduce_scatter_coalesced sums it in its own dtype")  # fp32)
        if not flat.is_contiguous() or flat.numel() % ws:
            raise ValueError(f"zerofuse.comm.reduce_scatter_fp32_sum: expected a contiguous flat tensor of a "
                             f"multiple of world_size ({ws}) elements, got {list(flat.shape)} "
                             f"(contiguous={flat.is_contiguous()})")
        shard = flat.numel() // ws
        if out_shard is not None:
            check_args("reduce_scatter_fp32_sum", out_shard=out_shard)
        if out_shard is not None and (out_shard.dim() != 1 or not out_shard.is_contiguous()
                                      or not out_shard.is_floating_point() or out_shard.device != flat.device):
            raise ValueError(f"zerofuse.comm.reduce_scatter_fp32_sum: expected out_shard as a 1-D contiguous "
                             f"floating tensor on {flat.device}, got {out_shard.dtype} {list(out_shard.shape)} "
                             f"(contiguous={out_shard.is_contiguous()}) on {out_shard.device}")
        if out_shard is not None and out_shard.numel() != shard:
            raise ValueError(f"zerofuse.comm.reduce_scatter_fp32_sum: expected out_shard of {shard} elements, got "
                             f"{out_shard.numel()}")
        flat, out_shard = flat.detach(), None if out_shard is None else out_shard.detach()  # (written: as above)
        if self._one:  # the sum over one rank in fp32 is the input; the gather writes it back unchanged
            if out_shard is not None:
                out_shard.copy_(flat.float())
            return local.DONE
        what = (f"reduce_scatter_fp32_sum #{next(self._fp32_sums)} on rank {self.rank} of {ws} in "
                f"{_group_label(self.group)}")
        self._c.check_usable(what)  # [Note: communicator failure]
        self._in_order()
        recv = torch.empty_like(flat)
        self._c.wait_launched()  # (the c10d group's order is the calls' order)
        work = dist.all_to_all_single(recv, flat, group=self.group, async_op=True)
        summed = _SummedWork(self, work, recv, flat if all_gather else None, out_shard, all_gather, what)
        if all_gather:
            self._gathers.append(summed)
        return summed

    # ------------------------------------------------------------------ point-to-point

    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Work:
        """Send ``tensor`` to rank ``peer`` of the group; wait() before changing it."""
        return self.batch_p2p([P2POp("send", tensor, peer, tag)])

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Work:
        """Receive into ``tensor`` from rank ``peer``; it holds the data once wait() returns."""
        return self.batch_p2p([P2POp("recv", tensor, peer, tag)])

    def batch_p2p(self, ops: Sequence[P2POp]) -> Work:
        """Post every send and receive of ``ops`` together and return one Work (NCCL: one
        ncclGroupStart/End on the p2p stream; c10d: isend/irecv). Shapes and dtypes are not sent:
        both ranks must post the same shape and dtype for a transfer (a pipeline agrees them once
        per schedule); ZEROFUSE_CHECK_COLLECTIVES=1 compares them through the store and raises
        CollectiveMismatch on both ranks of a pair that differ. wait() for the Work before dropping
        it: on gloo a send or receive destroyed before it completed breaks the pair's connection (as
        torch's own isend/irecv do), and the group's next collectives time out (measured 2026-12-07)."""
        ops = list(ops)
        for i, o in enumerate(ops):
            if not isinstance(o, P2POp) or o.op not in ("send", "recv") or not isinstance(o.tensor, torch.Tensor) \
                    or not _is_int(o.peer) or not _is_int(o.tag):  # (a float peer was truncated to a rank)
                raise ValueError(f"zerofuse.comm.batch_p2p: expected ops[{i}] to be a P2POp('send'|'recv', tensor, "
                                 f"peer: int, tag: int), got {o!r}")
        check_p2p(ops, self.world_size, self.rank)
        checks = self._checked_p2p(ops) if self.check else None
        cuda = any(o.tensor.is_cuda for o in ops)
        return Work(self._c.batch_p2p([(o.op == "send", o.tensor, int(o.peer), int(o.tag)) for o in ops]), self,
                    cuda, checks)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
                   input_splits: Sequence[int]) -> Work:
        """Rows of ``input`` to every rank (``input_splits[r]`` rows to rank r, in rank order) and
        ``output_splits[r]`` rows from each rank r into ``output`` (written at ``wait()``); both
        contiguous, of one row shape and dtype. A collective: every rank calls it in the same order.
        ZEROFUSE_CHECK_COLLECTIVES=1 also checks that each rank receives what the others send."""
        check_args("all_to_all", output=output, input=input)
        for name, given in (("input_splits", input_splits), ("output_splits", output_splits)):
            if isinstance(given, torch.Tensor) or not isinstance(given, Sequence):
                raise ValueError(f"zerofuse::comm.all_to_all: expected {name} to be a list of row counts, got "
                                 f"{type(given).__name__}")
        for name, given in (("input_splits", input_splits), ("output_splits", output_splits)):
            # (1.7 rows were taken as 1; "a" or None failed in int() naming no argument)
            if not all(map(_whole, given)):
                raise ValueError(f"zerofuse::comm.all_to_all: expected {name} to be whole row counts, got "
                                 f"{list(given)}")
        in_s, out_s = [int(n) for n in input_splits], [int(n) for n in output_splits]  # (0-d tensors too)
        if self._one:
            return local.all_to_all(output, input, out_s, in_s)
        local.check_all_to_all(output, input, out_s, in_s, self.world_size, lengths=False)
        self._in_order()
        if self.check:
            seq = self._checked("all_to_all", dtype=str(input.dtype), row_shape=tuple(input.shape[1:]))
            self._check_splits(seq, in_s, out_s)
        return Work(self._c.all_to_all(output, input, out_s, in_s), self, input.is_cuda)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the CPU staging buffers kept for reuse (the flat copies of tensor lists; at
        most 4 buffers, each as large as the largest collective that used it)."""
        return self._c.staging_bytes

    def free_buffers(self) -> None:
        """Drop the kept CPU staging buffers (those in flight are freed when their collective is)."""
        self._c.free_staging()

    @contextlib.contextmanager
    def coalesce(self):
        """Collectives issued inside the block are launched together where the transport can:
        NCCL runs them in one ncclGroupStart/End with one done event (e.g. every bucket's
        reduce-scatter); the ProcessGroup transport launches each at once. Wait for their Works
        after the block."""
        self._c.group_start()
        self._coalescing += 1
        try:
            yield self
        finally:
            self._coalescing -= 1
            self._c.group_end()
