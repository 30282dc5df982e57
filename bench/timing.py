"""The clocks of the benchmarks (bench/conftest.py re-exports them): every timed region of a suite
goes through ``measure`` (conftest), pytest-benchmark's own timer, or ``timed`` here, never a
clock read in the suite itself (tests/test_bench_timing.py holds the suites to that), so that what
is timed is the call alone: its setup (a barrier, zero_grad, the forward before a timed backward)
ran and finished on the device before the clock starts. A plain module, not conftest: the ranks
of the distributed suites (spawned, importing their suite by name) import it too."""
from __future__ import annotations

import statistics
import time

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def setup_then_sync(setup, device):
    """pytest-benchmark's pedantic setup: setup() (e.g. the forward whose backward is timed), then a
    device synchronize, so the setup's queued kernels finish before the timer starts (without it,
    each "bwd" time on a GPU included the forward: bench/results/h100-2026-11-23's bwd rows)."""
    def run():
        args = setup()
        synchronize(device)
        return args, {}

    return run


def device_ms(fn, setup, device: torch.device, rounds: int, flush_bytes: int = 256 << 20,
              hold_ms: float = 1.0) -> float:
    """CUDA: the median device time of fn(*setup()) in ms, by CUDA events, the L2 flushed (a write of
    flush_bytes, more than an H100's 50 MB or an H200's 60 MB of L2) before each round and the
    stream held by a sleep kernel (about hold_ms) while the host queues the flush, the start event,
    fn's launches and the end event, so host time between launches is not counted (the wall time
    the benchmark records counts it: the difference is the host's share per call). The hold must
    outlast the queueing: measure() passes twice the call's wall time (at most 50 ms). A call that
    synchronizes inside (a host read) is timed with its host time whatever the hold. setup runs
    untimed."""
    flush = torch.empty(flush_bytes, dtype=torch.int8, device=device)
    times = []
    for _ in range(rounds):
        args = setup()[0] if setup else ()
        synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(hold_ms * 2_000_000))  # cycles: ~hold_ms at 2 GHz
        flush.zero_()
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_ms(fn, device: torch.device, rounds: int = 3) -> float:
    """The median wall time in ms of a call of fn, its device work not waited for (each call starts
    on an empty queue): the host's time to queue it, which device_ms's hold must outlast. On a CPU
    the call's whole time."""
    times = []
    for _ in range(rounds):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    synchronize(device)
    return statistics.median(times)


def timed(fn, device: torch.device, cold: bool = False, hold_ms: float = 1.0) -> float:
    """Seconds of one call of fn, for suites that time by hand (interleaved pairs): on a GPU its
    device time, by CUDA events around it once the queue is empty (cold=True: as device_ms times,
    the L2 flushed and the stream held while the host queues fn, so neither a warm L2 nor the host's
    gaps between launches count; hold_ms: device_ms's, which must outlast the host's queueing of fn:
    pass twice host_ms(fn), at most 50, as measure() does); on a CPU its wall time."""
    synchronize(device)
    if device.type == "cuda" and cold:
        return device_ms(fn, None, device, rounds=1, hold_ms=hold_ms) / 1e3
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
