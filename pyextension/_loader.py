"""Loads zerofuse._C, the compiled extension (importing it runs the C++ op registrations).

CUDA builds link libnccl from the nvidia-nccl wheel with an rpath; if the loader still cannot find
it (a relocated environment, say), the wheel's libnccl is preloaded and the import retried.
"""
from __future__ import annotations

import ctypes
import glob
import importlib
import importlib.util
import os


def _preload_nccl() -> bool:
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except ModuleNotFoundError:
        return False
    for loc in (spec.submodule_search_locations or []) if spec else []:
        for lib in sorted(glob.glob(os.path.join(loc, "lib", "libnccl.so*"))):
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            return True
    return False


def load_extension():
    try:
        return importlib.import_module("zerofuse._C")
    except ImportError as e:
        if "libnccl" in str(e) and _preload_nccl():
            return importlib.import_module("zerofuse._C")
        raise ImportError(
            f"zerofuse: the compiled extension zerofuse._C did not load ({e}). Build it with "
            "`pip install --no-build-isolation -e .` (see README.md)."
        ) from e
