"""zerofuse's environment switches (ZEROFUSE_*), parsed in one place: a bad value raises ValueError
naming the variable, what it takes and what it got (ZEROFUSE_TRITON_ON_CPU=yes was taken as off
without a word, ZEROFUSE_ONE_LAUNCH_FLOATS=abc failed with int()'s message, ZEROFUSE_COMM_DELAY_MS=x
inside a collective's setup)."""
from __future__ import annotations

import math
import os


def choice(name: str, default: str, choices: dict[str, str]) -> str:
    """One of ``choices`` (value -> what it means); unset: ``default``."""
    value = os.environ.get(name, default)
    if value not in choices:
        said = " or ".join(f"{k!r} ({v})" for k, v in choices.items())
        raise ValueError(f"{name} must be {said}, got {value!r}")
    return value


def flag(name: str, default: bool, on: str, off: str) -> bool:
    """'1' (``on``) or '0' (``off``); unset: ``default``."""
    return choice(name, "1" if default else "0", {"0": off, "1": on}) == "1"


def number(name: str, default, kind=int, minimum=0):
    """An int (or float) >= ``minimum``; unset: ``default``."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or (isinstance(value, float) and not math.isfinite(value)) or value < minimum:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"{name} must be {what} >= {minimum}, got {raw!r}")
    return value
