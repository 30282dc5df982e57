"""The checkpoint's collective steps where one rank's failure must fail every rank at once (a
rank reads or writes only its own files, so one bad file or full disk fails one rank; the others
must not go on into a collective it never joins): ``agree``, ``on_one`` and the save's ``begin_save``."""
from __future__ import annotations

import secrets

import torch
import torch.distributed as dist

from zerofuse.checkpoint import files

NAME = files.NAME


def agree(group, error, who, device, what: str = "could not read their part of the checkpoint",
          value: int = 0) -> int:
    """Collective: raise on every rank if reading (or writing: ``what``) failed on any (a rank
    reads only its own files, so one bad file fails one rank; the others must not go on into a
    collective it never joins). The failed rank raises its own error after. Returns the group's
    rank 0's ``value`` (begin_save's save id)."""
    flag = torch.tensor([0 if error is None else 1, value], dtype=torch.int64, device=device)
    failed = [torch.zeros_like(flag) for _ in range(dist.get_world_size(group))]
    dist.all_gather(failed, flag, group=group)
    ranks = [r for r, f in enumerate(failed) if f[0].item()]
    if ranks and error is None:
        raise ValueError(f"{who}: rank(s) {ranks} of the group {what} (their errors say why)")
    return int(failed[0][1].item())


def on_one(cond: bool, fn, group, device, what: str) -> None:
    """Collective: ``fn()`` on the ranks where ``cond`` holds (the leader's meta.json, the commit), its
    failure raised on every rank (the peers waited for it in a barrier until the process group's
    timeout, or for good beside a caller that caught the error and went on: a review's
    reproduction, 2026-12-07)."""
    error = None
    if cond:
        try:
            fn()
        except Exception as e:
            error = e
    agree(group, error, f"{NAME}.save", device, what)
    if error is not None:
        raise error


def begin_save(path: str, leader: bool, group, device, extra=None) -> tuple[bool, int]:
    """Collective: the caller's ``extra`` checked (files.check_plain; every rank's, though only
    the leader's is written) and the leader's files.begin (the save's lock and fresh .tmp), a
    failure on any rank raised on every rank (the peers waited for it in a barrier until the
    timeout: a review's reproduction, 2026-12-07). Returns whether this rank holds the lock, and
    the save's id (the leader's random draw): every file of the save records it, and a load
    refuses a file of another save (a rank file copied from an earlier save of the same model
    loaded silently: a review's reproduction, 2026-12-07)."""
    error = None
    try:
        files.check_plain(extra)
        if leader:
            files.begin(path)
    except Exception as e:
        error = e
    try:
        save_id = agree(group, error, f"{NAME}.save", device, "could not begin the save",
                        secrets.randbits(62) if leader else 0)
    except BaseException:
        if leader and error is None:  # (a failed collective: the lock held for the process's life)
            files.release(path)
        raise
    if error is not None:
        raise error
    return leader, save_id
