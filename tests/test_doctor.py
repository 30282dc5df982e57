"""python -m zerofuse.doctor: reports the build, self-tests every op, fails when one fails."""
import re
import subprocess
import sys

import pytest
import torch

from zerofuse import doctor, ops


@pytest.mark.parametrize("triton_on_cpu", ["0", "1"])
def test_doctor_exits_zero_and_lists_ops(triton_on_cpu):
    """Both CPU paths: the ops' torch/C++ kernels (what a user's doctor runs, CI's doctor step) and
    the Triton kernels in the interpreter (what this test session runs)."""
    import os

    env = dict(os.environ, ZEROFUSE_TRITON_ON_CPU=triton_on_cpu)
    r = subprocess.run([sys.executable, "-m", "zerofuse.doctor"], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    for needle in ("zerofuse ", "torch ", "triton ", "NCCL ", "backends   CPU yes", "doctor: all self-tests passed"):
        assert needle in r.stdout
    for name in ("zerofuse::flatten_into", "zerofuse::unflatten_from"):
        assert f"ok    {name}" in r.stdout
    # what ran on the cpu is named: a Triton op's CPU path unless the interpreter was asked for
    # (its line said "Triton" either way)
    ran = "Triton (interpreter)" if triton_on_cpu == "1" else "CPU path (C++ or torch); Triton on CUDA"
    assert re.search(r"ok    zerofuse::layer_norm +cpu +\[" + re.escape(ran) + ";", r.stdout), r.stdout
    # the optimizers' kernels: C++ on the cpu, Triton in the interpreter when asked for (the line
    # said "C++ (CPU), Triton (CUDA)" in both)
    ran = "Triton (interpreter)" if triton_on_cpu == "1" else "C++ (CPU)"
    for name in ("adam_", "l2norm", "lamb_", "lars_"):
        assert re.search(rf"ok    zerofuse::{name} +cpu +\[" + re.escape(ran) + ";", r.stdout), r.stdout


@pytest.fixture
def stubbed(monkeypatch):
    """Every op's self-test replaced by one that passes: the tests below check the doctor's own logic
    (the real self-tests run in test_doctor_exits_zero_and_lists_ops, both CPU paths; here they
    took ~40-80 s per test in the interpreter)."""
    for name, info in list(ops.OPS.items()):
        monkeypatch.setitem(ops.OPS, name, ops.OpInfo(name, info.kind, lambda device, n=name: _seen_as(n)))


def _seen_as(name):
    """A range named as the op: what the doctor's profiler takes for a call of it."""
    with torch.profiler.record_function(name):
        pass


def test_a_selftest_that_never_calls_its_op_fails_the_doctor(monkeypatch, capsys, stubbed):
    """rotary_embedding_ and the MoE backward ops passed on self-tests that never called them (a
    review's reproduction, 2026-12-07)."""
    from zerofuse import kernels

    monkeypatch.setattr(kernels, "TRITON_ON_CPU", False)  # (checked where the cpu runs the native paths)
    name = "zerofuse::rotary_embedding_"
    monkeypatch.setitem(ops.OPS, name, ops.OpInfo(name, "Triton", lambda device: _seen_as("zerofuse::rotary_embedding")))
    failures = doctor.selftest([torch.device("cpu")])
    assert failures == [f"{name}: its self-test passed without calling it (the dispatcher saw no call)"]
    assert f"FAIL  {name}" in capsys.readouterr().out


def test_a_failing_selftest_fails_the_doctor(monkeypatch, capsys, stubbed):
    def wrong(device):
        torch.testing.assert_close(torch.ones(2), torch.zeros(2))

    name = "zerofuse::flatten_into"
    monkeypatch.setitem(ops.OPS, name, ops.OpInfo(name, "C++", wrong))
    failures = doctor.selftest([torch.device("cpu")])
    assert len(failures) == 1 and failures[0].startswith(f"{name} on cpu")
    assert "FAIL" in capsys.readouterr().out


def test_an_op_without_selftest_fails_the_doctor(monkeypatch, stubbed):
    monkeypatch.delitem(ops.OPS, "zerofuse::unflatten_from")
    failures = doctor.selftest([torch.device("cpu")])
    assert failures == ["zerofuse::unflatten_from: registered with torch but has no self-test"]


@pytest.mark.parametrize("flag", ["--no-selftest"])
def test_report_only(flag, capsys):
    assert doctor.main([flag]) == 0
    assert "ok    " not in capsys.readouterr().out


def test_a_selftest_failing_only_through_launch_handles_says_so(monkeypatch, capsys, stubbed):
    """The doctor runs the self-tests again where Triton launches through handles (faked here on
    the CPU device) and, when they fail only then, prints the line run_gpu.sh switches to the JIT on."""
    calls = []

    def fails_the_second_time(device):
        _seen_as(name)
        calls.append(device)
        if len(calls) > 1:
            torch.testing.assert_close(torch.ones(2), torch.zeros(2))

    name = "zerofuse::flatten_into"
    monkeypatch.setattr(doctor, "_handles_in_use", lambda d: True)
    monkeypatch.setitem(ops.OPS, name, ops.OpInfo(name, "C++", fails_the_second_time))
    assert doctor.selftest([torch.device("cpu")]) == []  # the first run passes
    failures = doctor.handles_selftest([torch.device("cpu")])
    assert len(failures) == 1 and failures[0].startswith(f"{name} on cpu through launch handles")
    assert doctor.HANDLES_FAILED in capsys.readouterr().out


def test_the_handles_selftest_passes_and_runs_nothing_without_handles(monkeypatch, capsys, stubbed):
    runs = []
    name = "zerofuse::flatten_into"
    monkeypatch.setitem(ops.OPS, name, ops.OpInfo(name, "C++", runs.append))
    assert doctor.handles_selftest([torch.device("cpu")]) == [] and runs == []  # no CUDA: no handles
    monkeypatch.setattr(doctor, "_handles_in_use", lambda d: True)
    assert doctor.handles_selftest([torch.device("cpu")]) == [] and runs == [torch.device("cpu")]
    out = capsys.readouterr().out
    assert "through launch handles" in out and doctor.HANDLES_FAILED not in out


def test_without_a_build_stamp_the_doctor_cannot_tell(monkeypatch, capsys):
    """No stamp beside a checkout's csrc/: it said "the extension matches the sources" (a review's
    reproduction, 2026-12-07)."""
    from zerofuse import _stamp

    monkeypatch.setattr(_stamp, "STAMP", "no-such-stamp.json")
    assert doctor.main(["--no-selftest"]) == 0
    out = capsys.readouterr().out
    assert "cannot tell whether the extension matches csrc/: no build stamp" in out and "matches the sources" not in out
