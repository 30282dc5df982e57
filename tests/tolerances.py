"""Per-dtype tolerances, in one table (DESIGN.md §5). Tests call :func:`assert_close`.

Defaults hold for elementwise results compared against an fp64 reference cast to the dtype;
ops with longer reductions add an entry keyed by (op name, dtype) instead of loosening defaults.
"""
from __future__ import annotations

import torch

TOLERANCES: dict = {
    torch.float64: dict(atol=1e-12, rtol=1e-10),
    torch.float32: dict(atol=1e-5, rtol=1.3e-6),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
    # weight/bias gradients sum over every row: fp32 accumulation error grows with the row count
    ("norm_param_grad", torch.float32): dict(atol=1e-4, rtol=1e-4),
    ("norm_param_grad", torch.float16): dict(atol=1e-2, rtol=2e-3),
    ("norm_param_grad", torch.bfloat16): dict(atol=5e-2, rtol=1.6e-2),
}


def tol(dtype: torch.dtype, op: str | None = None) -> dict:
    if op is not None and (op, dtype) in TOLERANCES:
        return TOLERANCES[(op, dtype)]
    if dtype not in TOLERANCES:
        return dict(atol=0, rtol=0)  # integer and bool results are exact
    return TOLERANCES[dtype]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, op: str | None = None, **override) -> None:
    """torch.testing.assert_close with the table's tolerance for actual's dtype."""
    kw = tol(actual.dtype, op) | override
    torch.testing.assert_close(actual, expected.to(actual.dtype), **kw)
