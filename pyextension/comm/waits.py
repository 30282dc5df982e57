"""The Communicator's clocks: its timeouts (a group's, a Work.wait's) and the seconds this process
spent blocked in Work.wait() (zerofuse/comm/communicator.py and its fp32-sum Work share them)."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


_waited = [0.0]  # seconds this process has spent blocked in Work.wait(), every communicator


def wait_seconds() -> float:
    """Seconds this process has spent blocked in ``Work.wait()`` of any Communicator: on CPU the
    communication that was not hidden behind compute (exposed communication). CUDA waits only
    order streams, so on GPU this stays near 0 and exposed time must be measured with events."""
    return _waited[0]


def group_timeout(group: dist.ProcessGroup) -> float:
    """Seconds: the timeout ``group`` was created with (``init_process_group`` / ``new_group``'s
    ``timeout``, torch's default for its backend otherwise)."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout.total_seconds()
        except (RuntimeError, AttributeError):  # no backend for that device, or one without options
            continue
    return dist.default_pg_timeout.total_seconds()


MAX_TIMEOUT_S = 1e8  # (~3 years) as csrc/comm/communicator.cpp: longer ones overflowed into 1 ms


def _float_or_nan(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _timeout(value) -> float:
    """Seconds or a datetime.timedelta, > 0 (NaN and <= 0 refused by name), at most MAX_TIMEOUT_S
    (inf: that)."""
    t = value.total_seconds() if isinstance(value, datetime.timedelta) else _float_or_nan(value)
    if not t > 0:
        raise ValueError(f"zerofuse.comm.Communicator: expected timeout > 0 seconds, got {value!r}")
    return min(t, MAX_TIMEOUT_S)


def wait_timeout(value) -> float | None:
    """Work.wait's ``timeout``: seconds, or a datetime.timedelta; None or 0 (torch's default,
    timedelta(0)): no bound but the communicator's. Negative or NaN values are refused by name."""
    if value is None:
        return None
    t = value.total_seconds() if isinstance(value, datetime.timedelta) else _float_or_nan(value)
    if not t >= 0:
        raise ValueError(f"zerofuse.comm.Work.wait: expected timeout >= 0 seconds or a timedelta (0: the "
                         f"communicator's), got {value!r}")
    return None if t == 0 else min(t, MAX_TIMEOUT_S)
