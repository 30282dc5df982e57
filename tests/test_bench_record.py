"""bench/conftest.py's --bench-jsonl: each benchmark's result is on disk the moment it ends, so a
suite killed at a GPU lease's deadline (before pytest-benchmark writes its JSON at the end of the
session) keeps its finished benchmarks; bench/summarize.py --merge reads them for such a suite."""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent


def _summarize():
    spec = importlib.util.spec_from_file_location("bench_summarize", ROOT / "bench" / "summarize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _suite(tmp_path, **popen):
    cmd = [sys.executable, "-m", "pytest", "bench/bench_flatten.py", "-q", "-p", "no:cacheprovider", "--bench-device",
           "cpu", "--benchmark-json", str(tmp_path / "bench_flatten.json"), "--bench-jsonl",
           str(tmp_path / "bench_flatten.jsonl")]
    # not an xdist worker's variables: pytest-benchmark takes them to mean xdist and times nothing
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["ZEROFUSE_BENCH_SMOKE"] = "1"
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **popen)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_each_benchmark_is_recorded_as_it_ends(tmp_path):
    assert _suite(tmp_path).wait(timeout=300) == 0
    whole = json.loads((tmp_path / "bench_flatten.json").read_text())["benchmarks"]
    lines = _lines(tmp_path / "bench_flatten.jsonl")
    assert len(lines) == len(whole) > 1
    for a, b in zip(lines, whole):
        assert (a["name"], a["stats"]["median"], a["extra_info"]) == (b["name"], b["stats"]["median"], b["extra_info"])
    out = tmp_path / "merged.json"  # a suite with its JSON: the lines are not read again
    _summarize().merge(str(out), [str(tmp_path / "bench_flatten.json"), str(tmp_path / "bench_flatten.jsonl")])
    merged = json.loads(out.read_text())
    assert len(merged["benchmarks"]) == len(whole) and "partial_suites" not in merged


def test_a_suite_killed_midway_keeps_its_finished_benchmarks(tmp_path):
    proc = _suite(tmp_path, start_new_session=True)
    path = tmp_path / "bench_flatten.jsonl"
    deadline = time.monotonic() + 240
    while len(_lines(path)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the suite ended before it could be cut"
    os.killpg(proc.pid, signal.SIGKILL)  # as `timeout --kill-after` does to a suite that ignores SIGINT
    proc.wait(timeout=60)
    assert not (tmp_path / "bench_flatten.json").exists()  # pytest-benchmark's file never came
    got = _lines(path)
    assert len(got) >= 2
    out = tmp_path / "merged.json"
    S = _summarize()
    S.merge(str(out), [str(tmp_path / "bench_flatten.json"), str(path)])
    merged = json.loads(out.read_text())
    assert [b["name"] for b in merged["benchmarks"]] == [b["name"] for b in got]
    assert merged["partial_suites"] == ["bench_flatten"]
    assert "Cut before their end" in S.render(merged, "t") and got[0]["name"] in S.render(merged, "t")
    # labelled with the date, commit and host where it was merged (they read "?": a review, 2026-12-06)
    head = S.render(merged, "t")
    assert "date: ?" not in head and "commit: ?" not in head and "machine: ?" not in head, head


def test_a_cut_suite_keeps_only_its_finished_benchmarks(tmp_path):
    """A suite cut mid-benchmark: pytest-benchmark's JSON (written at the interrupt) also holds the
    interrupted benchmark, partly timed; merge takes the finished ones from the lines instead (the
    cut row read as any other before 2026-12-07, a review's reproduction)."""
    done = {"name": "bench_done", "stats": {"median": 1.0}, "extra_info": {"time_ms": 1.0, "case": "c"}}
    cut = {"name": "bench_slow", "stats": {"median": 0.5}, "extra_info": {}}
    (tmp_path / "bench_x.json").write_text(json.dumps({"benchmarks": [done, cut], "datetime": "d"}))
    (tmp_path / "bench_x.jsonl").write_text(json.dumps(done) + "\n")
    (tmp_path / "bench_x.cut").write_text("")
    out = tmp_path / "merged.json"
    _summarize().merge(str(out), [str(tmp_path / n) for n in ("bench_x.json", "bench_x.jsonl", "bench_x.cut")])
    merged = json.loads(out.read_text())
    assert [b["name"] for b in merged["benchmarks"]] == ["bench_done"] and merged["partial_suites"] == ["bench_x"]
    assert merged["datetime"] == "d"  # (the JSON's header still labels it)
    # cut inside its first benchmark: no lines yet, and none of the JSON's rows is a result
    (tmp_path / "bench_x.jsonl").unlink()
    _summarize().merge(str(out), [str(tmp_path / n) for n in ("bench_x.json", "bench_x.jsonl", "bench_x.cut")])
    merged = json.loads(out.read_text())
    assert merged["benchmarks"] == [] and merged["partial_suites"] == ["bench_x"]


def test_a_benchmark_whose_test_failed_is_marked_and_not_shown_as_a_result(tmp_path):
    """A benchmark that timed, then failed its check: bench/conftest.py marks it failed (JSON and
    lines) and summarize shows no figure of it (its row, speedups included, read as any other)."""
    (tmp_path / "conftest.py").write_text(
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'bench')!r})\n"
        f"spec = importlib.util.spec_from_file_location('bench_conftest', {str(ROOT / 'bench' / 'conftest.py')!r})\n"
        "mod = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(mod)\n"
        "pytest_addoption, pytest_runtest_makereport = mod.pytest_addoption, mod.pytest_runtest_makereport\n")
    (tmp_path / "test_b.py").write_text(
        "def test_wrong(benchmark):\n    benchmark.extra_info['speedup_vs_peer'] = 7.0\n"
        "    benchmark(lambda: None)\n    assert False, 'the timed result is wrong'\n\n"
        "def test_right(benchmark):\n    benchmark(lambda: None)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_b.py",
                           "--benchmark-json", "b.json", "--bench-jsonl", "b.jsonl"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "1 failed, 1 passed" in proc.stdout, proc.stdout + proc.stderr
    for rows in (json.loads((tmp_path / "b.json").read_text())["benchmarks"], _lines(tmp_path / "b.jsonl")):
        assert {b["name"]: b["extra_info"].get("failed", False) for b in rows} == {"test_wrong": True,
                                                                                    "test_right": False}
    text = _summarize().render(json.loads((tmp_path / "b.json").read_text()), "t")
    wrong = next(line for line in text.splitlines() if "test_wrong" in line)
    assert "FAILED its test" in wrong and "7.00x" not in wrong and "Failed their test after timing" in text
