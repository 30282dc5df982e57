"""Turn a pytest-benchmark JSON file into a markdown table.

    python bench/summarize.py bench.json [--title "..."] > summary.md
    python bench/summarize.py --merge out.json a.json b.json ...   # one file of several suites' results
                                                                 # (a.jsonl: --bench-jsonl's lines,
                                                                 #  a.cut: the mark of a cut suite)

One row per benchmark: its time (on a GPU the device time, bench/conftest.py's measure), GB/s or
TFLOP/s, ratio to the measured roofline, the zerofuse provider's speedups over the peers measured
in the same run, and every other number the benchmark recorded (all from extra_info).
"""
from __future__ import annotations

import argparse
import json
import os


# extra_info keys shown in their own columns or in the header, not among a row's other results
_COLUMNS = {"GB/s", "TFLOP/s", "roofline_ratio", "peak_ratio", "roofline_GB/s", "matmul_peak_TFLOP/s", "time_ms"}


def render(data: dict, title: str) -> str:
    m = data.get("machine_info", {})
    c = data.get("commit_info", {})
    lines = [
        f"# {title}",
        "",
        f"- date: {data.get('datetime', '?')}",
        f"- commit: {c.get('id', '?')[:12]}{' (dirty)' if c.get('dirty') else ''}",
        f"- machine: {m.get('node', '?')}, {m.get('cpu', {}).get('brand_raw', '?')}, python {m.get('python_version', '?')}",
    ]
    extra = data["benchmarks"][0].get("extra_info", {}) if data.get("benchmarks") else {}
    for key in ("device", "device_name", "torch", "triton"):
        if key in extra:
            lines.append(f"- {key}: {extra[key]}")
    lines += ["", "| benchmark | time (ms) | GB/s | TFLOP/s | roofline ratio "
                  "| speedups (zerofuse vs peer); other results |",
              "|---|---:|---:|---:|---:|---|"]
    timings, failed = set(), []
    for b in data.get("benchmarks", []):
        e = b.get("extra_info", {})
        timings.add(e.get("timing", "wall"))
        if e.get("failed"):  # (its test failed after timing it: no figure of it is a result)
            failed.append(b["name"])
            lines.append(f"| {b['name']} | | | | | FAILED its test: not a result |")
            continue
        speedups = ", ".join(f"{k[len('speedup_vs_'):]} {v:.2f}x" for k, v in e.items() if k.startswith("speedup_vs_"))
        # every other number a benchmark recorded (memory peaks and their ratios, tokens/s, bubbles,
        # per-provider medians, ...): the columns' own keys and the run's constants left out
        others = ", ".join(f"{k} {v:.4g}" for k, v in e.items()
                           if k not in _COLUMNS and not k.startswith("speedup_vs_")
                           and isinstance(v, (int, float)) and not isinstance(v, bool))
        results = "; ".join(x for x in (speedups, others) if x)
        seconds = e["time_ms"] / 1e3 if isinstance(e.get("time_ms"), (int, float)) else b["stats"]["median"]
        # rounds of several providers in turn: no one provider's time (their medians are among the results);
        # untimed rows (a memory peak: pytest-benchmark timed a no-op) have none either
        shown = "" if e.get("timing") in ("rounds", "untimed") else f"{seconds * 1e3:.3f}"
        lines.append(
            f"| {b['name']} | {shown} | {e.get('GB/s', '')} | {e.get('TFLOP/s', '')} "
            f"| {e.get('roofline_ratio', e.get('peak_ratio', ''))} | {results} |"
        )
    if "device" in timings:
        lines += ["", "Time: the device time by CUDA events with the L2 flushed where the row's timing is device "
                      "(GB/s, TFLOP/s, ratios and speedups from it; wall_ms is the wall time per call, host "
                      "included); the wall median elsewhere (CPU rows, whole training steps)."]
    if "untimed" in timings:
        lines += ["", "Untimed rows (a memory peak, say: their figure is among the results) show no time."]
    if "rounds" in timings:
        lines += ["", "Rows without a time ran their providers in turn within each round: their speedups are the "
                      "median over rounds of the per-round ratios, each provider's median time among the results."]
    if failed:
        lines += ["", f"Failed their test after timing (not results): {', '.join(failed)}."]
    if data.get("partial_suites"):
        lines += ["", f"Cut before their end (the results of their finished benchmarks only): "
                      f"{', '.join(data['partial_suites'])}."]
    roof = next((b["extra_info"].get("roofline_GB/s") for b in data.get("benchmarks", []) if "roofline_GB/s" in b.get("extra_info", {})), None)
    if roof:
        lines += ["", f"Roofline: measured device bandwidth {roof} GB/s (bytes read + written; the better of a copy and an in-place scale)."]
    peak = next((b["extra_info"].get("matmul_peak_TFLOP/s") for b in data.get("benchmarks", [])
                 if "matmul_peak_TFLOP/s" in b.get("extra_info", {})), None)
    if peak:  # (the rows' ratio column is against this where they have no bandwidth roofline: attention)
        lines += ["", f"Peak: measured bf16 matmul {peak} TFLOP/s; rows with TFLOP/s and no GB/s show their ratio to it."]
    return "\n".join(lines) + "\n"


def merge(out: str, parts: list[str]) -> None:
    """The benchmarks of several pytest-benchmark JSON files in one (the first readable file's
    machine and commit info); files that are missing or unreadable (a suite cut before it wrote
    its file) are left out. A part ending in .jsonl holds one benchmark a line (conftest.py's
    --bench-jsonl, written as each ends): read when the .json of the same name is not readable
    or its suite was cut (a .cut beside it: pytest-benchmark's JSON then also holds the benchmark
    the cut interrupted, partly timed, which looked like any other row before 2026-12-07), its
    suite listed under "partial_suites" (cut before its end)."""
    merged, lines = None, []
    readable = set()
    # PART.cut: run_gpu.sh's mark of a suite cut at the deadline, whatever it managed to write
    cut = [p[: -len(".cut")] for p in parts if p.endswith(".cut") and os.path.exists(p)]
    partial = [os.path.basename(p) for p in cut]
    lines_instead = set(cut)  # (finished benchmarks only: none where it was cut in its first, no lines yet)
    for path in parts:
        if path.endswith((".jsonl", ".cut")):
            continue
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if path.endswith(".json") and path[: -len(".json")] in lines_instead:
            data["benchmarks"] = []  # (its header only)
        else:
            readable.add(path)
        if merged is None:
            merged = data
        else:
            merged["benchmarks"] += data.get("benchmarks", [])
    for path in parts:
        if not path.endswith(".jsonl") or path[: -len("l")] in readable:
            continue
        try:
            with open(path) as f:
                got = [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError):
            continue
        if got:
            lines += got
            partial.append(os.path.basename(path)[: -len(".jsonl")])
    if merged is None and lines:  # (only cut suites: labelled here, on the machine and tree that ran them;
        merged = _labels()  # left empty, the summary read "date: ?, commit: ?": a review, 2026-12-06)
    if merged is None:
        raise SystemExit("summarize --merge: no readable results")
    merged["benchmarks"] += lines
    if partial:
        merged["partial_suites"] = sorted(set(merged.get("partial_suites", [])) | set(partial))
    with open(out, "w") as f:
        json.dump(merged, f)


def _labels() -> dict:
    """pytest-benchmark's header fields for results that came without its JSON: now, this host, the
    git commit of the working tree (dirty or not)."""
    import datetime
    import platform
    import subprocess

    def git(*args) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"datetime": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "machine_info": {"node": platform.node(), "python_version": platform.python_version(),
                             "cpu": {"brand_raw": platform.processor() or platform.machine()}},
            "commit_info": {"id": git("rev-parse", "HEAD") or "?", "dirty": bool(git("status", "--porcelain"))},
            "benchmarks": []}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json")
    p.add_argument("--title", default="zerofuse benchmarks")
    p.add_argument("--merge", nargs="+", metavar="PART", help="write the benchmarks of the PART files to JSON")
    args = p.parse_args()
    if args.merge:
        merge(args.json, args.merge)
        return
    with open(args.json) as f:
        print(render(json.load(f), args.title), end="")


if __name__ == "__main__":
    main()
