"""Loads zerofuse._C, the compiled extension (importing it runs the C++ op registrations).

CUDA builds link libnccl from the nvidia-nccl wheel with an rpath; if the loader still cannot find
it (a relocated environment, say), the wheel's libnccl is preloaded and the import retried.
In a source checkout, an extension built from other C++ sources than csrc/ holds now warns
(StaleBuildWarning, pyextension/_stamp.py).
"""
from __future__ import annotations

import ctypes
import glob
import importlib
import importlib.util
import os
import sys
import sysconfig
import warnings

from zerofuse import _stamp


class StaleBuildWarning(UserWarning):
    """zerofuse._C was built from other C++ sources than the checkout holds ([_stamp])."""


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


def _rebuild_advice() -> str:
    """How to rebuild: in a source checkout (csrc/ beside the package) the editable build; an
    installed wheel has no sources to build from (the advice named the checkout's command)."""
    pkg = os.path.dirname(os.path.abspath(__file__))
    if os.path.isdir(os.path.join(os.path.dirname(pkg), "csrc")):
        return "rebuild it with `pip install --no-build-isolation -e .` in the checkout (see README.md)"
    return ("reinstall zerofuse from its source for this torch (`pip install --no-build-isolation --force-reinstall "
            "<zerofuse source or sdist>`; see README.md)")


def load_extension():
    import torch

    pkg = os.path.dirname(os.path.abspath(__file__))
    built = _stamp.built_torch(pkg)
    ours = "_C" + (sysconfig.get_config_var("EXT_SUFFIX") or "")
    # (a stamp of another Python's build speaks for its own .so, not ours: the stale check names it)
    if _stamp.stamped_extension(pkg) in (None, ours) and _stamp.torch_mismatch(built, torch.__version__):  # (it imported, then every collective failed on
        # pybind's "incompatible constructor arguments": a review's reproduction, 2026-12-07)
        raise ImportError(f"zerofuse: the compiled extension zerofuse._C was built against torch {built}, this is "
                          f"torch {torch.__version__}; {_rebuild_advice()}")
    try:
        ext = importlib.import_module("zerofuse._C")
    except ImportError as e:
        nccl = "libnccl" in str(e)
        advice = ("install the NCCL wheel matching this torch (`pip install nvidia-nccl-cu12` or -cu13, as torch's "
                  "own requirements name it) or put libnccl.so.2 on LD_LIBRARY_PATH / NCCL_HOME" if nccl
                  else _rebuild_advice())
        if not (nccl and _preload_nccl()):
            raise ImportError(f"zerofuse: the compiled extension zerofuse._C did not load ({e}); {advice}") from e
        try:
            ext = importlib.import_module("zerofuse._C")
        except ImportError as again:  # (the preloaded library did not serve: said, not a bare linker error)
            raise ImportError(f"zerofuse: the compiled extension zerofuse._C did not load ({again}); {advice}") \
                from again
    warn_if_stale(getattr(ext, "__file__", None))
    return ext


def warn_if_stale(extension: str | None = None) -> str | None:
    """Warns (StaleBuildWarning) when the extension's build stamp does not match csrc/ and the build
    files (or names another extension file than ``extension``, the one loaded); returns why."""
    if extension is None:
        ext = sys.modules.get("zerofuse._C")
        extension = getattr(ext, "__file__", None)
    why = _stamp.stale(os.path.dirname(os.path.abspath(__file__)), extension)
    if why:
        warnings.warn(f"zerofuse: the compiled extension zerofuse._C is stale: {why}. Its kernels are the old "
                      "ones; rebuild it with `pip install --no-build-isolation -e .` (see README.md).",
                      StaleBuildWarning, stacklevel=2)
    return why
