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
