"""The bad-input sweep's case tables and their runners (tests/test_bad_input_*.py).

A :class:`Case` is one row: the public callable, a factory of the bad arguments (fresh tensors per
run), the exception expected and a regex its message must match (naming the argument, what was
expected and what came). A :class:`Behaviour` is a row whose input is odd but legal (NaN, inf,
empty, aliasing): its function runs the callable and asserts the documented result on values.
Extending the sweep is adding a row to a table.

C++ op rows that could take the process down if a check were missing run in a child process
(:func:`run_isolated`): a crash there fails its row instead of the whole test session.

Every test module of the sweep keeps ``TABLES = {name: list of its parametrisations}``; the
count printed by each module's ``test_case_count`` is summed from those lists (:func:`census`).
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

MODULES = ("test_bad_input_ops", "test_bad_input_nn_optim", "test_bad_input_dist", "test_bad_input_comm",
           "test_bad_input_train")
TARGET = 150  # cases the sweep must hold (issue 22)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    fn: Callable[..., Any]
    args: Callable[[], tuple] = tuple  # the bad arguments, built at each run
    exc: type[BaseException] = ValueError
    match: str = ""
    kwargs: Callable[[], dict] | dict = dataclasses.field(default_factory=dict)

    def invoke(self):
        kwargs = self.kwargs() if callable(self.kwargs) else self.kwargs
        return self.fn(*self.args(), **kwargs)

    def check(self) -> None:
        with pytest.raises(self.exc) as info:
            self.invoke()
        assert re.search(self.match, str(info.value)), f"{self.id}: message {str(info.value)!r} !~ {self.match!r}"


@dataclasses.dataclass(frozen=True)
class Behaviour:
    id: str
    check: Callable[[], None]  # runs the callable on the odd input and asserts the documented values


def params(rows) -> list:
    """pytest params of a table, with the rows' ids."""
    return [pytest.param(r, id=r.id) for r in rows]


def census() -> dict[str, dict[str, int]]:
    """{module: {table: parametrisations}} of every module of the sweep, from their TABLES."""
    return {m: {name: len(rows) for name, rows in importlib.import_module(m).TABLES.items()} for m in MODULES}


def print_census(module: str, capsys) -> int:
    counts = census()
    total = sum(sum(t.values()) for t in counts.values())
    mine = counts[module]
    with capsys.disabled():
        print(f"\n{module}: {sum(mine.values())} bad-input cases ("
              + ", ".join(f"{name} {n}" for name, n in mine.items())
              + f"); the sweep: {total} cases in {len(counts)} modules")
    return total


# ---------------------------------------------------------------------------- isolated rows

_CHILD = r"""
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
rows = {r.id: r for r in getattr(importlib.import_module(sys.argv[2]), sys.argv[3])}
for rid in json.loads(sys.stdin.read()):
    print("START " + rid, flush=True)
    row = rows[rid]
    try:
        if hasattr(row, "invoke"):
            row.invoke()
        else:
            row.check()
        out = {"mro": [], "msg": ""}
    except BaseException as e:  # noqa: BLE001 - reported to the parent as it is
        out = {"mro": [c.__name__ for c in type(e).__mro__], "msg": str(e)}
    print("RESULT " + json.dumps({"id": rid, **out}), flush=True)
"""


def run_isolated(module: str, table: str, ids: list[str], env: dict[str, str], timeout: float = 120) -> dict:
    """Runs the rows ``ids`` of ``module.table`` in child processes, in order: {id: {"mro": exception
    class names (empty: returned normally), "msg": message}} or {id: {"crash": how the child died}}.
    A crash ends that child; the rows after the one that crashed run in a new one."""
    results: dict[str, dict] = {}
    here = os.path.dirname(os.path.abspath(__file__))
    todo = list(ids)
    while todo:
        p = subprocess.run([sys.executable, "-c", _CHILD, here, module, table], input=json.dumps(todo),
                           capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})
        started = None
        for line in p.stdout.splitlines():
            if line.startswith("START "):
                started = line[6:]
            elif line.startswith("RESULT "):
                r = json.loads(line[7:])
                results[r.pop("id")] = r
                started = None
        left = [i for i in todo if i not in results]
        if not left:  # (a child dying at exit, after its last row, fails no row)
            break
        if started is None:  # died between rows: the next row is charged with it
            started = left[0]
        tail = "\n".join(p.stderr.strip().splitlines()[-5:])
        results[started] = {"crash": f"exit code {p.returncode}: {tail}"}
        todo = todo[todo.index(started) + 1:]
    return results


def assert_isolated(row, result: dict) -> None:
    assert "crash" not in result, f"{row.id} crashed the process ({result['crash']})"
    if isinstance(row, Behaviour):
        assert not result["mro"], f"{row.id}: {result['mro'][0]}: {result['msg']}"
        return
    assert row.exc.__name__ in result["mro"], (f"{row.id}: expected {row.exc.__name__}, got "
                                               f"{(result['mro'] or ['no exception'])[0]}: {result['msg']}")
    assert re.search(row.match, result["msg"]), f"{row.id}: message {result['msg']!r} !~ {row.match!r}"
