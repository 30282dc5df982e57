"""torch.compiler.disable without importing torch._dynamo at zerofuse's import.

``torch.compiler.disable(fn)`` imports torch._dynamo (measured 2026-11-27: 1.35 s of
``import zerofuse``'s 3.3 s on an Intel Xeon, paid by every process of a job, every rank of a test
and every user's script, compiled or not). ``opaque_to_compile(fn)`` returns a wrapper that makes
the disabled function at its first call (dynamo is imported by then if anything compiles) and
calls it. Traced by dynamo, the wrapper is inlined and the disabled function breaks the graph as
the decorator's would (``fullgraph=True`` refuses it); a first call made while tracing breaks the
graph one call earlier, on the ``torch.compiler.disable`` call itself.
"""
from __future__ import annotations

import functools
import sys

import torch


def opaque_to_compile(fn):
    """torch.compiler.disable(fn), made at the first call (at once where dynamo is already imported)."""
    made = [torch.compiler.disable(fn)] if "torch._dynamo" in sys.modules else []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not made:
            made.append(torch.compiler.disable(fn))
        return made[0](*args, **kwargs)

    return call
