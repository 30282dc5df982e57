"""bench/conftest.py times what the names say: the setup of a timed call (the forward before a timed
backward) finishes on the device before the timer starts."""
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).parent.parent / "bench"


def _bench_conftest():
    if str(BENCH) not in sys.path:  # (conftest imports bench/timing.py, as the suites do)
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_conftest", BENCH / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_setup_is_synchronized_before_the_timed_call(monkeypatch):
    conf = _bench_conftest()
    order = []
    monkeypatch.setattr(sys.modules["timing"], "synchronize", lambda device: order.append(("sync", device.type)))
    run = conf.setup_then_sync(lambda: order.append("setup") or ("y",), torch.device("cuda"))
    args, kwargs = run()
    assert order == ["setup", ("sync", "cuda")]
    assert args == ("y",) and kwargs == {}


def test_device_time_flushes_the_l2_and_times_only_the_call(monkeypatch):
    """device_ms (CUDA only, so here with CUDA's event and sleep calls recorded): per round the
    setup, a sync, the sleep that holds the stream, the L2 flush, then the events around the call
    alone; the median of the event times."""
    conf = _bench_conftest()
    order, times = [], iter([3.0, 1.0, 2.0])

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            order.append("record")

        def synchronize(self):
            order.append("wait")

        def elapsed_time(self, end):
            return next(times)

    class Flush:
        def zero_(self):
            order.append("flush")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: order.append("sleep"))
    monkeypatch.setattr(sys.modules["timing"], "synchronize", lambda device: order.append("sync"))
    monkeypatch.setattr(conf.torch, "empty", lambda *a, **k: Flush())
    setup = conf.setup_then_sync(lambda: order.append("setup") or ("x",), torch.device("cuda"))
    ms = conf.device_ms(lambda x: order.append(f"call {x}"), setup, torch.device("cuda"), rounds=3)
    one = ["setup", "sync", "sync", "sleep", "flush", "record", "call x", "record", "wait"]
    assert order == one * 3 and ms == 2.0


def test_a_peer_that_fails_to_import_is_skipped_with_its_reason(tmp_path, monkeypatch):
    """import_peer: a missing package and one whose import raises something else (a wheel carried
    with --no-deps) both skip the benchmark with the reason, instead of erroring it."""
    import pytest

    conf = _bench_conftest()
    (tmp_path / "broken_peer_zf.py").write_text("raise RuntimeError('needs transformers<5')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(pytest.skip.Exception, match="no_such_peer_zf does not import here"):
        conf.import_peer("no_such_peer_zf")
    with pytest.raises(pytest.skip.Exception, match=r"broken_peer_zf does not import here \(RuntimeError: needs"):
        conf.import_peer("broken_peer_zf")
    assert conf.import_peer("json").dumps([1]) == "[1]"


def test_compiled_peers_may_recompile_for_every_shape():
    """Dynamo's default of 8 recompiles per function turned a suite's later torch.compile rows into
    eager ones silently; the bench conftest raises the limits."""
    import torch._dynamo.config as dyn

    _bench_conftest()
    assert dyn.recompile_limit >= 512 and dyn.accumulated_recompile_limit >= 4096


def _record(conf, registry, provider, *, wall, dev, timing="device"):
    info = {}
    seconds = conf.record(info, registry, case="c", provider=provider, wall=wall, dev=dev, timing=timing,
                          bytes_moved=4e9, flops=2e9, roofline=2000.0)
    return seconds, info


def test_rates_and_speedups_use_the_device_time_on_a_gpu():
    """On a GPU an op's GB/s, TFLOP/s and speedups come from its device time (CUDA events, L2
    flushed), the wall time per call beside it; they came from the wall median, host time and warm
    L2 included (the 2026-11-27 attention rows: 0.84x cuDNN by wall, 1.01x by device)."""
    conf = _bench_conftest()
    reg = conf._Registry()
    assert _record(conf, reg, "peer", wall=4e-3, dev=3e-3)[0] == 3e-3
    seconds, info = _record(conf, reg, "zerofuse", wall=5e-3, dev=2e-3)
    assert seconds == 2e-3 and info["timing"] == "device" and info["time_ms"] == 2.0
    assert info["speedup_vs_peer"] == 1.5  # 3 ms / 2 ms, not 4 ms / 5 ms
    assert info["GB/s"] == 2000.0 and info["roofline_ratio"] == 1.0 and info["TFLOP/s"] == 1.0
    assert info["wall_ms"] == 5.0 and info["device_ms"] == 2.0 and info["host_share_ms"] == 3.0


def test_whole_steps_and_cpu_rows_use_the_wall_time():
    conf = _bench_conftest()
    reg = conf._Registry()
    _record(conf, reg, "peer", wall=4e-3, dev=1e-3, timing="wall")
    seconds, info = _record(conf, reg, "zerofuse", wall=2e-3, dev=1e-3, timing="wall")
    assert seconds == 2e-3 and info["timing"] == "wall" and info["speedup_vs_peer"] == 2.0
    assert info["device_ms"] == 1.0  # still recorded beside
    seconds, info = _record(conf, conf._Registry(), "zerofuse", wall=3e-3, dev=None)  # a CPU: no device time
    assert seconds == 3e-3 and info["timing"] == "wall" and "device_ms" not in info


def test_compiled_peers_compile_for_static_shapes():
    """A peer's torch.compile reused across a suite's shapes (one function, or one lambda's code)
    went dynamic from the second shape on (Dynamo's automatic dynamic): every compiled row after the
    first timed a symbolic-shape kernel. Each bench suite's torch.compile names dynamic=False."""
    import ast

    bench = Path(__file__).parent.parent / "bench"
    calls = []
    for path in sorted(bench.glob("bench_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.compile":
                dynamic = [ast.unparse(k.value) for k in node.keywords if k.arg == "dynamic"]
                calls.append((path.name, node.lineno, dynamic[0] if dynamic else None))
    assert len(calls) >= 6
    assert all(d == "False" for _, _, d in calls), [c for c in calls if c[2] != "False"]


def test_the_summary_shows_every_result_and_what_its_time_is():
    """bench/summarize.py: a row's time is the time its rates use (the device time on a GPU), and
    every number a benchmark recorded is shown (the memory benchmarks' peaks and ratios were
    dropped: their rows showed only a no-op's time)."""
    from test_bench_record import _summarize

    S = _summarize()
    rows = [{"name": "bench_op[zerofuse]", "stats": {"median": 0.005},
             "extra_info": {"time_ms": 2.0, "timing": "device", "wall_ms": 5.0, "GB/s": 10.0, "speedup_vs_torch": 1.5,
                            "provider": "zerofuse"}},
            {"name": "bench_memory[zerofuse]", "stats": {"median": 1e-6},
             "extra_info": {"peak_MiB": 12.5, "ratio_vs_torch": 0.172,
                            "timing": "wall"}}]
    text = S.render({"benchmarks": rows}, "t")
    op = next(line for line in text.splitlines() if "bench_op" in line)
    assert "| 2.000 |" in op and "torch 1.50x" in op and "wall_ms 5" in op
    mem = next(line for line in text.splitlines() if "bench_memory" in line)
    assert "peak_MiB 12.5" in mem and "ratio_vs_torch 0.172" in mem
    assert "device time by CUDA events" in text


def test_rows_of_rounds_show_no_single_time_and_the_matmul_peak_is_named():
    """Interleaved rows time a round of every provider (no one provider's time: their column is
    blank, a footer says why); attention's ratio is to the measured matmul peak, which the summary
    now prints (it printed only the bandwidth roofline: a review, 2026-12-07)."""
    from test_bench_record import _summarize

    rows = [{"name": "bench_pair[1M]", "stats": {"median": 0.0023},
             "extra_info": {"timing": "rounds", "speedup_vs_torch": 1.2, "zerofuse_median_ms": 0.1}},
            {"name": "bench_attn[zerofuse]", "stats": {"median": 1.0},
             "extra_info": {"time_ms": 1.0, "timing": "device", "TFLOP/s": 400.0, "peak_ratio": 0.6,
                            "matmul_peak_TFLOP/s": 667.0}}]
    text = _summarize().render({"benchmarks": rows}, "t")
    pair = next(line for line in text.splitlines() if "bench_pair" in line)
    assert pair.startswith("| bench_pair[1M] |  |") and "torch 1.20x" in pair and "zerofuse_median_ms 0.1" in pair
    assert "in turn within each round" in text and "measured bf16 matmul 667.0 TFLOP/s" in text


def test_a_suite_cut_after_writing_its_json_is_listed_as_cut(tmp_path):
    """A suite cut by the deadline's SIGINT still gets its .json from pytest-benchmark, which read as
    the whole suite; run_gpu.sh marks it (NAME.cut) and merge lists it. Without its lines (cut in its
    first benchmark) none of its JSON's rows is a finished one: left out (2026-12-07)."""
    import json

    from test_bench_record import _summarize

    S = _summarize()
    row = {"name": "bench_a", "stats": {"median": 1.0}, "extra_info": {}}
    (tmp_path / "bench_x.json").write_text(json.dumps({"benchmarks": [row]}))
    (tmp_path / "bench_y.json").write_text(json.dumps({"benchmarks": [row]}))
    (tmp_path / "bench_x.cut").write_text("")
    out = tmp_path / "merged.json"
    S.merge(str(out), [str(tmp_path / n) for n in ("bench_x.json", "bench_y.json", "bench_x.cut", "bench_z.cut")])
    merged = json.loads(out.read_text())
    assert len(merged["benchmarks"]) == 1 and merged["partial_suites"] == ["bench_x"]


def test_timed_starts_its_clock_after_the_setup_finished(monkeypatch):
    """timed (the suites that time by hand: interleaved pairs, the ranks of the distributed suites):
    on a GPU a sync before the start event, so work the setup queued is not counted, the events
    around the call alone; on a CPU the wall time of the call alone (a setup that sleeps before it
    does not show)."""
    import time

    _bench_conftest()
    timing = sys.modules["timing"]
    order = []

    class Event:
        def __init__(self, enable_timing):
            pass

        def record(self):
            order.append("record")

        def synchronize(self):
            order.append("wait")

        def elapsed_time(self, end):
            return 5.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(timing, "synchronize", lambda device: order.append("sync"))
    assert timing.timed(lambda: order.append("call"), torch.device("cuda")) == 5e-3
    assert order == ["sync", "record", "call", "record", "wait"]
    monkeypatch.undo()
    time.sleep(0.05)  # a setup
    assert timing.timed(lambda: None, torch.device("cpu")) < 0.01


# the one clock a suite may read itself, and why: bench_pipeline's _Clock adds up the compute time
# spent inside the torch runner's methods during a step (the bubble's numerator), not a timed region
CLOCK_READS_ALLOWED = {"bench_pipeline.py": 2}


@pytest.mark.parametrize("suite", sorted(p.name for p in BENCH.glob("bench_*.py")))
def test_no_suite_reads_a_clock_itself(suite):
    """Every timed region goes through measure (conftest), pytest-benchmark's timer or timing.timed,
    whose setups are untimed and synchronized (the tests above): a suite that read time.perf_counter
    around its own loop timed whatever it put between the reads (issue: benchmarks that time what
    they say)."""
    text = (BENCH / suite).read_text()
    reads = re.findall(r"\btime\.(?:perf_counter|perf_counter_ns|time|monotonic|process_time)\(", text)
    assert len(reads) == CLOCK_READS_ALLOWED.get(suite, 0), (suite, reads)
