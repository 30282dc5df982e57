"""Triton kernels of zerofuse (installed as ``zerofuse.kernels``): @triton.jit functions and launchers.

Interpreter mode: ``ZEROFUSE_TRITON_ON_CPU=1`` sets ``TRITON_INTERPRET=1`` here, before any kernel
module is imported (triton reads it when a function is decorated), and makes the ops route CPU
tensors through these kernels, so CPU-only CI runs the real kernels. This package is imported by
``zerofuse/__init__.py`` before anything that defines a kernel.
"""
import os

TRITON_ON_CPU = os.environ.get("ZEROFUSE_TRITON_ON_CPU", "0") == "1"
if TRITON_ON_CPU:
    os.environ["TRITON_INTERPRET"] = "1"


def triton_on_cpu() -> bool:
    """Whether ops send CPU tensors through the Triton kernels (in the interpreter)."""
    return TRITON_ON_CPU


# Read once: triton reads TRITON_INTERPRET when a function is decorated, which is at import.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreted() -> bool:
    """Whether @triton.jit functions run in the interpreter in this process."""
    return _INTERPRETED
