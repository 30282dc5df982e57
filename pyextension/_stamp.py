"""The build stamp: which C++/CUDA sources (and build-flag files, setup.py and tools/buildenv.py)
zerofuse._C was built from, against which torch, into which extension file.

setup.py's build_ext writes ``_C.stamp.json`` next to the extension it built, after the build
succeeded (a failed build leaves the old extension and its old stamp). In a source checkout
(``csrc/`` next to the package: an editable install) the loader compares the stamp with what
``csrc/`` holds now and warns, naming the files, when they differ: an edited or pulled ``csrc/``
without a rebuild otherwise runs the old kernels without a word (a missing symbol was the only
sign, and only when the Python side imported one). An installed wheel has no ``csrc/``: no check.

This file imports nothing from zerofuse: setup.py loads it by path before the package exists.
"""
from __future__ import annotations

import hashlib
import json
import os

SUFFIXES = (".cpp", ".cu", ".h", ".cuh")  # a CUDA build's; a CPU-only build compiles CPU_SUFFIXES only
CPU_SUFFIXES = (".cpp", ".h")
STAMP = "_C.stamp.json"
# the files that set the build's flags (-fopenmp, -O3), relative to the checkout: an edit there changed the
# compiled code with no source changed (a review's reproduction, 2026-12-07). Not recorded: the environment's
# (ZEROFUSE_DEBUG's -O0, TORCH_CUDA_ARCH_LIST)
BUILD_FILES = ("setup.py", "tools/buildenv.py")


def build_hashes(root: str) -> dict[str, str]:
    """sha256 of each of BUILD_FILES under the checkout ``root`` that exists."""
    out = {}
    for rel in BUILD_FILES:
        path = os.path.join(root, rel)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


def source_hashes(csrc: str, suffixes: tuple[str, ...] = SUFFIXES) -> dict[str, str]:
    """sha256 of every source under ``csrc`` with one of ``suffixes``, by path relative to it."""
    out = {}
    for root, dirs, files in os.walk(csrc):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(tuple(suffixes)):
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    out[os.path.relpath(path, csrc).replace(os.sep, "/")] = hashlib.sha256(f.read()).hexdigest()
    return out


def write(ext_dir: str, hashes: dict[str, str], suffixes: tuple[str, ...] = SUFFIXES,
          torch_version: str | None = None, extension: str | None = None, build: dict | None = None) -> str:
    """Writes the stamp (``hashes``: source_hashes of ``suffixes``, the kinds of file the build
    compiled, taken before it began, so an edit made during it counts as a change; the torch it was
    built against; ``extension``: the file name of the extension built, e.g.
    _C.cpython-311-x86_64-linux-gnu.so; ``build``: build_hashes) into ``ext_dir``, atomically;
    returns its path."""
    path = os.path.join(ext_dir, STAMP)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"sources": hashes, "suffixes": list(suffixes), "torch": torch_version, "extension": extension,
                   "build": build}, f, indent=0, sort_keys=True)
    os.replace(tmp, path)
    return path


def stale(pkg_dir: str, extension: str | None = None) -> str | None:
    """Why the extension in ``pkg_dir`` (``extension``: the file loaded, when known) does not match
    the checkout's ``csrc/`` and build files; None when it does, or when there is nothing to compare
    (no stamp: built before stamps or by other means; no csrc/)."""
    stamp = os.path.join(pkg_dir, STAMP)
    root = os.path.dirname(os.path.abspath(pkg_dir))
    csrc = os.path.join(root, "csrc")
    if not (os.path.isfile(stamp) and os.path.isdir(csrc)):
        return None
    try:
        with open(stamp) as f:
            saved = json.load(f)
        built, suffixes = saved["sources"], tuple(saved.get("suffixes", SUFFIXES))
        if not isinstance(built, dict):
            raise TypeError(type(built).__name__)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its build stamp {stamp} is unreadable ({type(e).__name__}: {e})"
    # one stamp a folder, an extension per Python: another's stamp vouched for ours (or for another folder's)
    stamped = saved.get("extension")
    here = extension is None or (os.path.basename(extension) == stamped
                                 and os.path.dirname(os.path.abspath(extension)) == os.path.abspath(pkg_dir))
    if isinstance(stamped, str) and not here:
        return (f"its build stamp describes {stamped} in {pkg_dir}, not the {extension} loaded (built by another "
                "Python, or elsewhere, from sources the stamp does not record)")
    build = saved.get("build")
    if isinstance(build, dict):  # (stamps before 2026-12-07 hold none)
        flags = sorted(k for k, v in build_hashes(root).items() if build.get(k) not in (None, v))
        if flags:
            return f"its build files changed since it was built: {', '.join(flags)} (the compiler flags)"
    now = source_hashes(csrc, suffixes)  # (a CPU-only build: a .cu edit changes nothing it holds)
    changed = sorted(k for k in now.keys() | built.keys() if now.get(k) != built.get(k))
    if not changed:
        return None
    how = {k: "new" if k not in built else "removed" if k not in now else "changed" for k in changed}
    listed = ", ".join(f"csrc/{k} ({how[k]})" for k in changed[:6])
    more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
    return f"it was built from other sources than {csrc} holds now: {listed}{more}"


def _recorded(pkg_dir: str, key: str) -> str | None:
    """The stamp's ``key`` in ``pkg_dir`` (None: no stamp, or one written before it was recorded)."""
    try:
        with open(os.path.join(pkg_dir, STAMP)) as f:
            value = json.load(f).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def stamped_extension(pkg_dir: str) -> str | None:
    """The extension file name the stamp in ``pkg_dir`` was written for (None: none recorded)."""
    return _recorded(pkg_dir, "extension")


def built_torch(pkg_dir: str) -> str | None:
    """The torch version the extension in ``pkg_dir`` was built against (None: no stamp, or one
    written before it was recorded)."""
    return _recorded(pkg_dir, "torch")


def torch_mismatch(built: str | None, running: str) -> bool:
    """Whether an extension built against torch ``built`` cannot run under ``running``: another
    major.minor or another build variant (the +cpu / +cu130 tag); a patch release is the same ABI."""
    if built is None:
        return False

    def key(v: str) -> tuple:
        base, _, local = v.partition("+")
        return tuple(base.split(".")[:2]), local
    return key(built) != key(running)
