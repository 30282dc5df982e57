"""The figures zerofuse-train reports about itself (summary.json): each a mean over the same steady
steps, peaks read at the end of the job, MFU against the device's own peak. Each test failed before
its fix (a review's reproductions, 2026-12-06)."""
from __future__ import annotations

import json
import types

import pytest
import torch

from common import tiny_job_args, tiny_job_argv

pytestmark = pytest.mark.usefixtures("native_kernels")


def test_compute_and_communication_are_split_over_the_same_steps(tmp_path, monkeypatch):
    """The communication mean included the launch-counting step (step 2), the step time's did not:
    compute = step - comm mixed two sets of steps (ZeRO-3: 8.9 ms reported, 16.0 on the same steps).
    Also: the process's peaks are read at the end of the job, not at its first step."""
    import resource

    from zerofuse.train.loop import Trainer

    real, calls = resource.getrusage, []

    def growing(who):  # every read a higher peak: the summary must hold the last one
        calls.append(real(who).ru_maxrss + 1000 * (len(calls) + 1))
        return types.SimpleNamespace(ru_maxrss=calls[-1])

    monkeypatch.setattr(resource, "getrusage", growing)
    assert Trainer(tiny_job_args(tmp_path, "--steps", "5", "--log-every", "1"), None).run() == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    recs = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert recs[2].get("instrumented") and recs[2]["comm_time"] is not None
    steady = [recs[s] for s in (3, 4, 5)]
    assert summary["step_time_s"] == pytest.approx(sum(r["step_time"] for r in steady) / 3)
    assert summary["comm_time_s"] == pytest.approx(sum(r["comm_time"] for r in steady) / 3)
    assert len(calls) >= 2 and summary["memory_per_rank"][0]["max_rss"] == calls[-1] * 1024


def test_the_pipeline_bubble_leaves_out_the_launch_counting_step(world_of_one):
    from zerofuse.train.pipeline import PipelineJob

    job = types.SimpleNamespace(idle=[0.9, None, 0.2, 0.4],
                                pipe=types.SimpleNamespace(schedule="1f1b", p=2, m=4, v=1))
    rep = PipelineJob.report(job, 1)
    assert rep["bubble_measured_per_rank"] == [pytest.approx(0.3)] and rep["bubble_formula"] == pytest.approx(0.2)


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                        ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200", 989e12), ("Some GPU", None)])
def test_mfu_takes_the_devices_own_peak(monkeypatch, name, peak):
    """An H100 PCIe (756 TFLOP/s) was taken for an SXM one (989): MFU 1.31x too low."""
    import importlib.util
    import os

    from zerofuse.train import report

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    cfg = types.SimpleNamespace(n_layer=2, dim=8, seq_len=4)
    t = types.SimpleNamespace(device=torch.device("cuda", 0), cfg=cfg, n_flop_params=100, world=2)
    flops = 6 * 100 + 12 * 2 * 8 * 4
    got = report._mfu(t, 1e9)
    assert got == (None if peak is None else pytest.approx(flops * 1e9 / (peak * 2)))
    path = os.path.join(os.path.dirname(__file__), "..", "bench", "peer_step.py")  # the peer's own table
    spec = importlib.util.spec_from_file_location("peer_step", path)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    assert peer.PEAK_BF16 == report.PEAK_FLOPS


def test_wall_time_counts_from_the_process_start_and_the_launch_row_names_its_step(tmp_path):
    """wall_s started when zerofuse.train was imported, after torch and the extension: ~2 s of a
    7 s job left out; the table's launch row said "(step 2)" after a resume that counted step 5
    (a review's reproductions, 2026-12-06)."""
    import subprocess
    import sys
    import time

    from zerofuse.train.table import _table

    out = tmp_path / "job"
    cmd = [sys.executable, "-m", "zerofuse.train", *tiny_job_argv(out), "--steps", "2"]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    summary = json.loads((out / "summary.json").read_text())
    started = (out / "summary.json").stat().st_mtime - summary["wall_s"]  # the job's idea of its start
    assert t0 - 0.1 < started < t0 + 0.5, started - t0  # (from the package's import: ~1.5 s late here)
    summary["launches"]["step"] = 5
    assert "Python hooks (step 5)" in _table(summary)
