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
  the only clock of the suites that time by hand; ``device_ms``, ``setup_then_sync`` (and
  ``host_ms``, which suites import from timing).
- :func:`check_result`: every suite compares what it timed with a float64 reference by the
  project's rule (tests/tolerances.py), so that a wrong kernel's time is not recorded as a result
  (:func:`cached_reference` computes a case's reference once for all its providers).
"""
from __future__ import annotations

import os
import statistics
import sys

import pytest
import torch

from timing import device_ms, setup_then_sync, synchronize, timed  # noqa: F401  (bench/timing.py; suites import them here too)

# tests/tolerances.py, the project's one table of tolerances and its reference rule (appended, not
# put first: tests/ has a conftest.py too, which the ranks of the distributed suites, importing
# `conftest` by name, must not find before this one)
_TESTS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
if _TESTS not in map(os.path.normpath, sys.path):
    sys.path.append(_TESTS)

from tolerances import assert_within_peer_rule  # noqa: E402


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
        # nor a speedup of a later row over it (a wrong peer's time is no yardstick)
        registry = item.funcargs.get("registry")
        if registry is not None:
            registry.medians.pop((fixture.extra_info.get("case"), fixture.extra_info.get("provider")), None)
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


# ------------------------------------------------------------------ results checked against a reference
#
# [Note: checked results] Every benchmark that times an op or a step checks what it timed: the
# provider's output from its untimed warm-up call (or one extra untimed call) against a float64
# reference of the same inputs (zerofuse.reference, or torch on float64 copies) by the project's
# rule, tests/tolerances.py's assert_within_peer_rule: the error is at most twice that of the torch
# peer's result in the same dtype plus the dtype's atol (no tolerance chosen here, none from what a
# machine printed). Every provider, peers included (the torch peer itself is the rule's yardstick:
# its check holds by definition). The check runs after the timing, so a failing row is still
# recorded, marked failed (pytest_runtest_makereport above), and dropped from the speedups.
# Collectives of integer-valued floats are exact: check_equal.


def _tensors(x) -> list:
    return [x] if isinstance(x, torch.Tensor) else list(x)


def check_result(got, want64, peer, *, what: str = "result", scale: float = 1.0) -> None:
    """The reference rule on a benchmark's result: ``got`` (a tensor, or a sequence of them, e.g.
    a backward's grads, each checked alone) against ``want64`` (the float64 reference, any device)
    and ``peer`` (torch's computation in got's dtype); AssertionError naming ``what`` if not.
    ``scale``: all three multiplied by it first (in their dtypes: a power of two keeps them exact),
    for results of a mean over many terms (the grads of a mean over T tokens, scale T: the sum's),
    whose values would otherwise sit far under the
    dtype's atol, which then passed any result (a mean over 8192 tokens: grads of 1e-5 against
    bf16's atol of 1e-2)."""
    gots, wants, peers = _tensors(got), _tensors(want64), _tensors(peer)
    if not len(gots) == len(wants) == len(peers):
        raise AssertionError(f"{what}: {len(gots)} results, {len(wants)} references, {len(peers)} peer results")
    for i, (g, w, p) in enumerate(zip(gots, wants, peers)):
        name = what if len(gots) == 1 else f"{what} [{i}]"
        if not g.shape == w.shape == p.shape:
            raise AssertionError(f"{name}: shape {tuple(g.shape)}, reference {tuple(w.shape)}, peer {tuple(p.shape)}")
        g = g.detach()
        w, p = w.detach().to(g.device), p.detach().to(g.device)
        if scale != 1.0:
            g, w, p = g * scale, w * scale, p * scale
        assert_within_peer_rule(g, w, p, msg=name)


def check_pieces(pieces, *, what: str = "result") -> None:
    """check_result on one result given in pieces, (got, want64, peer) triples (a step too large to
    hold in float64 at once, computed a chunk at a time): the rule on the whole, applied to each
    piece's worst elements (the rule reads only the largest errors of got and of the peer)."""
    worst = []
    for g, w, p in pieces:
        dev = g.device
        g, w, p = (t.detach().reshape(-1).to(dev) for t in (g, w, p))
        for t in (g, p):
            i = int(torch.argmax(torch.nan_to_num((t.double() - w).abs(), nan=float("inf"))))
            worst.append((g[i], w[i], p[i]))
    if not worst:
        raise AssertionError(f"{what}: no pieces")
    check_result(*(torch.stack(t) for t in zip(*worst)), what=what)


def check_equal(got, want, *, what: str = "result") -> None:
    """Exact results (e.g. sums of integer-valued floats, whatever their order): every element
    equal; AssertionError naming ``what`` and the largest difference if not."""
    gots, wants = _tensors(got), _tensors(want)
    if len(gots) != len(wants):
        raise AssertionError(f"{what}: {len(gots)} results, {len(wants)} expected")
    for i, (g, w) in enumerate(zip(gots, wants)):
        name = what if len(gots) == 1 else f"{what} [{i}]"
        if g.shape != w.shape or not torch.equal(g.detach(), w.to(g.device, g.dtype)):
            diff = (g.double() - w.to(g.device).double()).abs().max().item() if g.shape == w.shape else None
            raise AssertionError(f"{name}: not equal to torch's result (shape {tuple(g.shape)} vs {tuple(w.shape)}, "
                                 f"max difference {diff})")


def gpt_losses(model_kw: dict, batches: list, steps: int = 2) -> list:
    """[float64, fp32] tensors of the losses on batches[0] of the first ``steps`` steps of
    zerofuse's GPT(GPTConfig(**model_kw), seed=0) trained data-parallel on ``batches`` (one per
    data-parallel rank, the grads averaged) with torch.optim.AdamW(lr=1e-3, weight_decay=0.01,
    foreach=False): torch's computation of the distributed suites' training steps (bench_zero, bench_tp)."""
    from zerofuse.models import GPT, GPTConfig

    out = []
    for dtype in (torch.float64, torch.float32):
        model = GPT(GPTConfig(**model_kw), seed=0).to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
        losses = []
        for _ in range(steps):
            for i, x in enumerate(batches):
                _, loss = model(x[:, :-1], x[:, 1:])
                (loss / len(batches)).backward()
                if i == 0:
                    losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        out.append(torch.stack(losses))
    return out


_REFERENCE: dict = {}


def cached_reference(key, make):
    """make()'s value (a case's float64 reference and torch peer's result) for ``key``, computed
    once for all the providers of a case (parametrised innermost: they run one after another) and
    kept until another key is asked for: one case's tensors held at a time."""
    if key not in _REFERENCE:
        _REFERENCE.clear()  # (the last case's freed before this one's are made)
        _REFERENCE[key] = make()
    return _REFERENCE[key]


def float64(*tensors, grad: bool = False):
    """float64 copies of tensors (detached; requiring grad with grad=True): a reference's inputs."""
    out = [t.detach().double().requires_grad_(grad) for t in tensors]
    return out[0] if len(out) == 1 else out


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
