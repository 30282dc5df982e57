"""The debug checker of ``zerofuse.comm.Communicator`` (``ZEROFUSE_CHECK_COLLECTIVES=1``): every rank
publishes each call's signature in the group's store before the collective and compares it with
every other rank's, so that a mismatch raises :class:`CollectiveMismatch` on every rank instead of
a hang or a mix of data. A mixin of Communicator (it reads the communicator's group, store,
uid, rank, world size and timeout). Messages name ranks globally, and a group's members where it
is not the world.

Calls are numbered by the checker itself, one count per communicator advanced at every published
call: the C++ sequence number (used before) does not advance when a call is refused by its
argument checks after publishing, so the next call reused the refused call's keys and compared
itself with the other ranks' stale signatures (a false mismatch on one rank, the others entering
the collective alone)."""
from __future__ import annotations

import datetime
import functools

import torch
import torch.distributed as dist


class CollectiveMismatch(RuntimeError):
    """Ranks issued different collectives at the same point of their sequence."""


def _tensor(t: torch.Tensor, layout: bool = False) -> str:
    """A tensor as a signature shows it: shape, dtype, and (``layout``: a shard, which the
    collective's own checks refuse unless contiguous) "strided": refused on one rank alone after
    publishing, its peers entered the collective and waited for the timeout."""
    strided = layout and not t.is_contiguous()
    return f"{tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}" + (":strided" if strided else "")


def _signature(name: str, **parts) -> str:
    items = []
    for key, value in parts.items():
        if isinstance(value, torch.Tensor):
            value = _tensor(value, layout=True)
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            value = "[" + ", ".join(map(_tensor, value)) + "]"
        items.append(f"{key}={value}")
    return f"{name}({', '.join(items)})"


def scale_of(scale) -> float | None:
    """A call's scale as the signature shows it: 1 and 1.0 are one scale, and so are None and 1 (the
    C++ call multiplies by neither: false mismatches)."""
    return None if scale is None or float(scale) == 1.0 else float(scale)


def one_dtype(tensors) -> torch.dtype | None:
    """The dtype a call reduces in by default, for the signature: the tensors' dtypes promoted, as
    the C++ call does (reduce_dtype=None and the same dtype given explicitly are one call; a
    mixed list showed None, a false mismatch)."""
    dtypes = [t.dtype for t in tensors]
    return functools.reduce(torch.promote_types, dtypes) if dtypes else None


def _forget(store, key: str) -> None:
    try:
        store.delete_key(key)
    except (RuntimeError, NotImplementedError):  # a store without deletion keeps it
        pass


def _other(op: str) -> str:
    """The peer's side of a transfer this rank posts as ``op``."""
    return "recv" if op == "send" else "send"


def _ints(part: str) -> list[int]:
    return [int(n) for n in part.split(",") if n]  # ("" is an empty list: its length is then reported)


class CollectiveChecker:
    _check_seq = -1  # the number of the last call published (per instance once set)
    _members: list[int] | None = None  # the group's global ranks (per instance once read)

    def _g(self, r: int) -> int:
        """Group rank r's global rank: messages name ranks globally (a mesh's TP group named its
        members 0 and 1, which were other ranks, busy with other work: a review, 2026-12-07)."""
        if self._members is None:
            self._members = dist.get_process_group_ranks(self.group)
        return self._members[r]

    def _where(self) -> str:
        """What a message adds on a group other than the world: its members."""
        self._g(0)
        return "" if self._members == list(range(dist.get_world_size())) else f" (a group of ranks {self._members})"

    def _check_splits(self, seq: int, in_s: list[int], out_s: list[int]) -> None:
        """Rank r's out_splits[s] must be rank s's in_splits[r], for every pair: every rank checks
        the whole matrix, so all of them raise on a mismatch (none is left waiting in the call).
        ``seq``: the number _checked gave the call."""
        prefix = f"{self._uid}/a2a/{seq}/"
        self.store.set(prefix + str(self.rank), ",".join(map(str, in_s)) + ";" + ",".join(map(str, out_s)))
        keys = [prefix + str(r) for r in range(self.world_size)]
        self.store.wait(keys, datetime.timedelta(seconds=self.timeout))
        ins, outs = zip(*([_ints(part) for part in self.store.get(k).decode().split(";")] for k in keys))
        bad = [(s, r) for r in range(self.world_size) for s in range(self.world_size)
               if len(ins[s]) != self.world_size or len(outs[r]) != self.world_size or ins[s][r] != outs[r][s]]
        if bad:
            s, r = bad[0]
            raise CollectiveMismatch(
                f"zerofuse.comm: all_to_all #{seq} differs across ranks: rank {self._g(s)} sends "
                f"{ins[s][r] if len(ins[s]) > r else None} rows to rank {self._g(r)}, which expects "
                f"{outs[r][s] if len(outs[r]) > s else None} (rank pairs (sender, receiver) that differ: "
                f"{[(self._g(a), self._g(b)) for a, b in bad]}){self._where()}")

    def _checked_p2p(self, ops) -> list:
        """Publish each transfer's signature under its pair's own count and compare it with the
        peer's where that is published already; returns the comparisons left, which the batch's
        Work.wait() makes (``finish_p2p_checks``) before waiting for the transfers. Nothing here
        waits for the peer: a send that waited for its receive to be posted deadlocked valid
        programs (two ranks each sending, then receiving; a receiver taking a batch's transfers one
        by one - every pipeline schedule)."""
        counts = self._p2p_counts
        mine = []
        # c10d (gloo) pairs a pair's transfers by tag, NCCL by order: counted per (pair, tag) there (by
        # pair only, two tagged transfers posted in other orders on the two ranks were a false
        # mismatch that failed the communicator; a review's reproduction, 2026-12-07)
        by_tag = not (ops and ops[0].tensor.is_cuda and self.transport != "process_group")
        for o in ops:
            src, dst = (self.rank, o.peer) if o.op == "send" else (o.peer, self.rank)
            pair = (src, dst, o.tag) if by_tag else (src, dst)
            n = counts[pair] = counts.get(pair, -1) + 1
            key = f"{self._uid}/p2p/{src}-{dst}/" + (f"t{o.tag}/" if by_tag else "") + f"{n}/"
            sig = f"{tuple(o.tensor.shape)}:{str(o.tensor.dtype).removeprefix('torch.')} tag {o.tag}"
            self.store.set(key + o.op, sig)
            mine.append((o.op, o.peer, key, sig, n, src, dst))
        left = []
        for check in mine:  # a mismatch seen now is raised before anything is posted
            op, key = check[0], check[2]
            if not self.store.check([key + _other(op)]):
                left.append(check)
                continue
            self._compare_p2p(check)
        return left

    def finish_p2p_checks(self, checks: list, limit: float | None) -> None:
        """The comparisons _checked_p2p left, at the batch's wait(): the peer publishes before it
        posts its transfer, so waiting for its key waits no longer than the transfer would; a peer
        that never posts it is named after the timeout. The transfers are in flight then: a
        mismatch is the communicator's failure ([Note: communicator failure])."""
        timeout = min(self.timeout, limit) if limit else self.timeout
        for check in checks:
            op, peer, key, sig, n = check[:5]
            other = _other(op)
            try:
                self.store.wait([key + other], datetime.timedelta(seconds=timeout))
                self._compare_p2p(check)
            except CollectiveMismatch as e:
                self._c.fail(str(e))
                raise
            except Exception as e:  # noqa: BLE001 - backend-specific timeout types
                message = (f"zerofuse.comm: rank {self._g(peer)} did not post the {other} matching rank "
                           f"{self._g(self.rank)}'s {op} #{n} ({sig}) within {timeout:.0f} s{self._where()}")
                self._c.fail(message)
                raise CollectiveMismatch(message) from e

    def _compare_p2p(self, check) -> None:
        op, peer, key, sig, n, src, dst = check
        other = _other(op)
        theirs = self.store.get(key + other).decode()
        _forget(self.store, key + other)  # (this rank is its only reader)
        if theirs != sig:
            raise CollectiveMismatch(
                f"zerofuse.comm: transfer #{n} from rank {self._g(src)} to rank {self._g(dst)} differs: rank "
                f"{self._g(self.rank)} posted {op} {sig}, rank {self._g(peer)} posted {other} {theirs}{self._where()}")

    def _checked(self, name: str, **parts) -> int | None:
        """Publishes and compares this call's signature; returns its number (None: no checker)."""
        if not self.check:
            return None
        seq = self._check_seq = self._check_seq + 1
        mine = _signature(name, **parts)
        prefix = f"{self._uid}/check/{seq}/"
        self.store.set(prefix + str(self.rank), mine)
        keys = [prefix + str(r) for r in range(self.world_size)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout))
        except Exception as e:  # noqa: BLE001 - the store reports a timeout in backend-specific types
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            raise CollectiveMismatch(
                f"zerofuse.comm: rank(s) {[self._g(r) for r in missing]} did not reach collective #{seq} within "
                f"{self.timeout:.0f} s; rank {self._g(self.rank)} issued {mine}{self._where()}") from e
        calls = {r: self.store.get(k).decode() for r, k in enumerate(keys)}
        if len(set(calls.values())) > 1:
            by_call: dict[str, list[int]] = {}
            for r, c in calls.items():
                by_call.setdefault(c, []).append(self._g(r))
            detail = "; ".join(f"rank(s) {ranks}: {c}" for c, ranks in by_call.items())
            raise CollectiveMismatch(f"zerofuse.comm: collective #{seq} differs across ranks{self._where()}: {detail}")
        # every rank has published this call, so every rank is done reading the previous one's keys
        # (its signature and its all-to-all splits): this rank's go (the store grew by a key per
        # rank and call over a whole run)
        if seq > 0:
            _forget(self.store, f"{self._uid}/check/{seq - 1}/{self.rank}")
            _forget(self.store, f"{self._uid}/a2a/{seq - 1}/{self.rank}")
        return seq
