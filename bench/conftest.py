"""pytest-benchmark setup shared by every suite in bench/.

- Device: CUDA when available, else CPU (``--bench-device`` overrides). GPU timings synchronise.
- ``--smoke`` (or ZEROFUSE_BENCH_SMOKE=1): tiny sizes, for CI with ``--benchmark-disable``, so the
  suites run (and check their results) without costing minutes.
- :func:`measure` times one provider with warm-up rounds and records in ``extra_info``: GB/s (or
  TFLOP/s), the ratio to the roofline measured in the same session (a plain large device copy for
  memory-bound ops), and for the zerofuse provider the speedup over each peer measured earlier in
  the same session on the same case (parametrise providers with zerofuse last); on a GPU all of
  them from the device time (CUDA events, L2 flushed), the wall time per call beside it, except
  for whole training steps, timed by wall (``timing="wall"``).
- bench/timing.py (re-exported here): ``timed``, one call's device time (GPU) or wall time (CPU),
  the only clock of the suites that time by hand; ``device_ms``, ``setup_then_sync``.
"""
from __future__ import annotations

import os
import statistics

import pytest
import torch

from timing import device_ms, setup_then_sync, synchronize, timed  # noqa: F401  (bench/timing.py; suites import them here too)


# torch.compile peers: a suite compiles the same functions for many shapes and dtypes, which
# passes Dynamo's default of 8 recompiles per function, after which it runs them eagerly without a
# word (bench_norms' compiled rows from its third shape on were torch's eager ones, 2026-11-26)
torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 512)
torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 4096)


def pytest_addoption(parser):
    parser.addoption("--smoke", action="store_true", help="tiny sizes (CI smoke run)")
    parser.addoption("--bench-device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.addoption("--bench-jsonl", default=None, metavar="PATH",
                     help="append each benchmark's result to PATH (one JSON line) as soon as it ends")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """--bench-jsonl: each benchmark's result written when its test ends, not only in pytest-benchmark's
    JSON at the end of the session, which a suite cut at a GPU lease's deadline (SIGINT then KILL,
    bench/run_gpu.sh) never reaches: on 2026-11-26 an attention suite cut so lost every result.
    bench/summarize.py --merge reads these lines for a suite that has no JSON.
    A benchmark whose test failed after its timing (a correctness check on the timed results) is
    marked ``failed`` in its extra_info (JSON and lines): summarize.py shows it as such, not as a
    result (its row read as any other, speedups included, before 2026-12-07)."""
    outcome = yield
    fixture = getattr(item, "funcargs", {}).get("benchmark")
    if call.when != "call" or fixture is None or getattr(fixture, "stats", None) is None:
        return
    if outcome.get_result().failed:
        fixture.extra_info["failed"] = True
    path = item.config.getoption("--bench-jsonl")
    if not path:
        return
    import json

    with open(path, "a") as f:
        f.write(json.dumps(fixture.stats.as_dict(include_data=False), default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


@pytest.fixture(scope="session")
def smoke(request) -> bool:
    return request.config.getoption("--smoke") or os.environ.get("ZEROFUSE_BENCH_SMOKE") == "1"


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    name = request.config.getoption("--bench-device") or ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def import_peer(module: str):
    """A peer's module, or the test skipped with the reason it did not import: not only a missing
    package (a wheel carried to the GPU machine with --no-deps may fail on something else)."""
    import importlib

    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - whatever breaks the import, the peer is listed as absent
        pytest.skip(f"{module} does not import here ({type(e).__name__}: {str(e).splitlines()[0][:160]})",
                    allow_module_level=True)


@pytest.fixture
def sync(device):
    """synchronize() bound to the benchmark device, for suites that time by hand."""
    return lambda: synchronize(device)


def _median_seconds(fn, device, rounds: int, cold: bool = False) -> float:
    return statistics.median(timed(fn, device, cold=cold) for _ in range(rounds))


@pytest.fixture(scope="session")
def copy_roofline(device, smoke) -> float:
    """Measured device bandwidth in GB/s (bytes read + written), the memory-bound roofline: the
    better of a copy into another buffer and an in-place scale of one buffer. On a CPU the copy
    pays a read-for-ownership of every destination line (18 vs 30 GB/s on the 2-core VM), which
    in-place ops such as optimizer steps do not, so the copy alone put them above 'the roofline'."""
    n = (1 << 20) if smoke else (64 << 20)  # fp32 elements: 4 MiB / 256 MiB
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    rounds = 3 if smoke else 15
    # cold: timed as the ops it is the roofline of (device_ms: the stream held while the host queues,
    # the L2 flushed); warm, the launch gap counted understated it by a few % (a review, 2026-12-07)
    t = min(_median_seconds(lambda: dst.copy_(src), device, rounds, cold=True),
            _median_seconds(lambda: dst.mul_(1.0), device, rounds, cold=True))
    return 2 * src.numel() * src.element_size() / t / 1e9


def _versions(device: torch.device) -> dict:
    import triton

    out = {"torch": torch.__version__, "triton": triton.__version__}
    out["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return out


class _Registry:
    """Median seconds per (case, provider) measured this session, for same-run ratios."""

    def __init__(self):
        self.medians: dict[tuple[str, str], float] = {}


@pytest.fixture(scope="session")
def registry() -> _Registry:
    return _Registry()


def record(info: dict, registry: _Registry, *, case: str, provider: str, wall: float, dev: float | None,
           timing: str, bytes_moved: int | None, flops: float | None, roofline: float) -> float:
    """measure()'s results into extra_info from the wall median and the device time (None: not
    measured, a CPU); returns the seconds the rates and ratios use (see measure)."""
    seconds, basis = wall, "wall"
    if dev is not None:
        # (the wall median ran with a warm L2, the device time with a flushed one: for calls
        # whose data fits in L2 the share can read near zero or below)
        info.update(device_ms=round(dev * 1e3, 4), wall_ms=round(wall * 1e3, 4),
                    host_share_ms=round((wall - dev) * 1e3, 4))
        if timing == "device":
            seconds, basis = dev, "device"
    info.update(time_ms=round(seconds * 1e3, 4), timing=basis)
    registry.medians[(case, provider)] = seconds
    if bytes_moved is not None:
        gbps = bytes_moved / seconds / 1e9
        info.update(**{"GB/s": round(gbps, 2), "roofline_GB/s": round(roofline, 2),
                       "roofline_ratio": round(gbps / roofline, 3)})
    if flops is not None:
        info["TFLOP/s"] = round(flops / seconds / 1e12, 3)
    if provider == "zerofuse":
        for (c, peer), m in registry.medians.items():
            if c == case and peer != provider:
                info[f"speedup_vs_{peer}"] = round(m / seconds, 3)
    return seconds


@pytest.fixture
def measure(benchmark, device, smoke, copy_roofline, registry):
    def run(fn, *, case: str, provider: str, bytes_moved: int | None = None, flops: float | None = None, setup=None,
            timing: str = "device") -> float | None:
        """Times fn(); with ``setup``, fn(*setup()) where setup (untimed, before every round)
        makes fn's arguments (e.g. a fresh autograd graph for a backward). Returns the seconds per
        call that GB/s, TFLOP/s, the roofline ratio and the speedups are computed from (None under
        --benchmark-disable, which times nothing):

        - ``timing="device"`` (an op or a kernel): on a GPU the device time by CUDA events with
          the L2 flushed (:func:`device_ms`), the wall time per call (host included) recorded beside
          it as wall_ms; on a CPU the two are one.
        - ``timing="wall"`` (a whole training step, whose host time is part of what it costs):
          the wall time per call, the device time recorded beside it.

        extra_info's time_ms and timing say which one the row's numbers use (the wall median
        alone made them: 2026-11-27's attention rows read 0.84x cuDNN by wall, 1.01x by device)."""
        if timing not in ("device", "wall"):
            raise ValueError(f"measure: expected timing 'device' or 'wall', got {timing!r}")
        rounds = 1 if smoke else 20
        pedantic_setup = setup_then_sync(setup, device) if setup else None
        benchmark.pedantic(lambda *a: (fn(*a), synchronize(device)), setup=pedantic_setup, rounds=rounds,
                           warmup_rounds=1 if smoke else 3)
        info = benchmark.extra_info
        info.update(case=case, provider=provider, device=str(device), **_versions(device))
        if benchmark.stats is None:  # --benchmark-disable: ran once, nothing timed
            return None
        wall, dev = benchmark.stats.stats.median, None
        if device.type == "cuda" and not smoke:  # device time apart from the wall time per call
            dev = device_ms(fn, pedantic_setup, device, max(3, rounds // 2),
                            hold_ms=min(50.0, max(1.0, 2e3 * wall))) / 1e3
        return record(info, registry, case=case, provider=provider, wall=wall, dev=dev, timing=timing,
                      bytes_moved=bytes_moved, flops=flops, roofline=copy_roofline)

    return run
