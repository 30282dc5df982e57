"""python -m zerofuse.doctor: reports the build, self-tests every op, fails when one fails."""
import subprocess
import sys

import pytest
import torch

from zerofuse import doctor, ops


def test_doctor_exits_zero_and_lists_ops():
    r = subprocess.run([sys.executable, "-m", "zerofuse.doctor"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    for needle in ("zerofuse ", "torch ", "triton ", "NCCL ", "backends   CPU yes", "doctor: all self-tests passed"):
        assert needle in r.stdout
    for name in ("zerofuse::flatten_into", "zerofuse::unflatten_from"):
        assert f"ok    {name}" in r.stdout


def test_a_failing_selftest_fails_the_doctor(monkeypatch, capsys):
    def wrong(device):
        torch.testing.assert_close(torch.ones(2), torch.zeros(2))

    name = "zerofuse::flatten_into"
    monkeypatch.setitem(ops.OPS, name, ops.OpInfo(name, "C++", wrong))
    failures = doctor.selftest([torch.device("cpu")])
    assert len(failures) == 1 and failures[0].startswith(f"{name} on cpu")
    assert "FAIL" in capsys.readouterr().out


def test_an_op_without_selftest_fails_the_doctor(monkeypatch):
    monkeypatch.delitem(ops.OPS, "zerofuse::unflatten_from")
    failures = doctor.selftest([torch.device("cpu")])
    assert failures == ["zerofuse::unflatten_from: registered with torch but has no self-test"]


@pytest.mark.parametrize("flag", ["--no-selftest"])
def test_report_only(flag, capsys):
    assert doctor.main([flag]) == 0
    assert "ok    " not in capsys.readouterr().out
