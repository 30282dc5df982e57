"""zerofuse's environment switches (kernels/env.py): each bad value is refused naming the variable,
what it takes and what it got (ZEROFUSE_TRITON_ON_CPU=yes was taken as off without a word,
ZEROFUSE_ONE_LAUNCH_FLOATS=abc failed with int()'s message, ZEROFUSE_COMM_DELAY_MS=x inside a
communicator's construction)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from zerofuse.kernels import env


def test_choice_flag_and_number(monkeypatch):
    monkeypatch.delenv("ZF_TEST_X", raising=False)
    assert env.choice("ZF_TEST_X", "a", {"a": "one", "b": "two"}) == "a"
    assert env.flag("ZF_TEST_X", True, "on", "off") is True and env.number("ZF_TEST_X", 7) == 7
    monkeypatch.setenv("ZF_TEST_X", "b")
    assert env.choice("ZF_TEST_X", "a", {"a": "one", "b": "two"}) == "b"
    with pytest.raises(ValueError, match=r"^ZF_TEST_X must be '0' \(off\) or '1' \(on\), got 'b'$"):
        env.flag("ZF_TEST_X", False, "on", "off")
    for bad, kind in (("abc", int), ("1.5", int), ("-1", int), ("nan", float), ("x", float)):
        monkeypatch.setenv("ZF_TEST_X", bad)
        what = "an integer" if kind is int else "a number"
        with pytest.raises(ValueError, match=rf"^ZF_TEST_X must be {what} >= 0, got '{bad}'$"):
            env.number("ZF_TEST_X", 0, kind=kind)
    monkeypatch.setenv("ZF_TEST_X", "2.5")
    assert env.number("ZF_TEST_X", 0.0, kind=float) == 2.5


@pytest.mark.parametrize("name,value", [("ZEROFUSE_TRITON_ON_CPU", "yes"), ("ZEROFUSE_ONE_LAUNCH_FLOATS", "abc"),
                                        ("ZEROFUSE_OPTIM_GRID", "wide"), ("ZEROFUSE_LAMB_ONE_LAUNCH", "true")])
def test_a_bad_switch_is_named_at_import(name, value):
    p = subprocess.run([sys.executable, "-c", "import zerofuse.optim"], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, name: value})
    assert p.returncode != 0 and f"ValueError: {name} must be " in p.stderr and repr(value) in p.stderr, p.stderr
