"""zerofuse: fused kernels, fused bucketed collectives and ZeRO/TP wrappers for PyTorch training.

Import order matters: zerofuse.kernels decides interpreter mode (ZEROFUSE_TRITON_ON_CPU) before any
Triton kernel is defined (and switches triton's own library functions if triton was imported
first), then the C++ extension registers its ops, then the Python ops register their fake impls
on top.
"""
import torch  # noqa: F401  (libtorch must be loaded before zerofuse._C)

from zerofuse import kernels  # noqa: F401
from zerofuse._loader import load_extension

_C = load_extension()

try:
    from zerofuse import ops  # noqa: E402
    from zerofuse import nn  # noqa: E402
    from zerofuse import optim  # noqa: E402
    from zerofuse import comm  # noqa: E402
    from zerofuse import zero  # noqa: E402
    from zerofuse import tp  # noqa: E402
    from zerofuse import parallel  # noqa: E402
    from zerofuse import models  # noqa: E402
    from zerofuse import checkpoint  # noqa: E402
    from zerofuse import hf  # noqa: E402
    from zerofuse.hf import patch, shard  # noqa: E402
    from zerofuse.ops import flatten_into, packed_offsets, unflatten_from  # noqa: E402
except ImportError as _e:  # a name the sources import from zerofuse._C that the built one lacks
    if "zerofuse._C" not in str(_e):
        raise
    raise ImportError(f"zerofuse: {_e}: the compiled extension is older than the Python sources (a git pull or "
                      "checkout without a rebuild?); rebuild it with `pip install --no-build-isolation -e .` "
                      "(see README.md)") from _e

__version__ = "0.1.0"

__all__ = ["ops", "nn", "optim", "comm", "zero", "tp", "parallel", "models", "moe", "pipeline", "checkpoint", "hf",
           "train", "patch", "shard", "flatten_into", "unflatten_from", "packed_offsets", "build_info", "__version__"]

_LAZY = ("pipeline", "train")  # imported on first use (zerofuse.pipeline.Pipeline raised AttributeError)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"zerofuse.{name}")
    raise AttributeError(f"module 'zerofuse' has no attribute {name!r}")


def build_info() -> dict:
    """What this build contains: {'cuda': bool, 'nccl': bool, 'nccl_compiled_version': int, ...}."""
    return _C.build_info()
