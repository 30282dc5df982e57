"""Where the build finds its toolchain: sources, nvcc, CUDA headers, the NCCL that torch uses.

Shared by setup.py and tools/check_cuda.py so the compile-only check compiles exactly what a CUDA
build compiles, with the same include paths and defines.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import shlex
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")


def _sources(pattern: str) -> list[str]:
    """Paths relative to the repository root, as setup() requires."""
    return sorted(glob.glob(os.path.join("csrc", "**", pattern), recursive=True, root_dir=ROOT))


def cpp_sources() -> list[str]:
    """C++ built into every zerofuse._C (CPU kernels, registration, module)."""
    return _sources("*.cpp")


def cuda_sources() -> list[str]:
    """Everything that needs CUDA or NCCL headers is a .cu file: built only in CUDA builds."""
    return _sources("*.cu")


def cuda_guarded_sources() -> list[str]:
    """The .cpp files (built everywhere) with blocks only a CUDA build compiles (#ifdef
    ZEROFUSE_WITH_CUDA / ZEROFUSE_WITH_NCCL): the NCCL communicator's, the module's bindings."""
    out = []
    for rel in cpp_sources():
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            text = f.read()
        if "ZEROFUSE_WITH_CUDA" in text or "ZEROFUSE_WITH_NCCL" in text:
            out.append(rel)
    return out


def find_cuda_home() -> str | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var) and os.path.isdir(os.environ[var]):
            return os.environ[var]
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda"
    return None


def bad_cuda_home() -> str | None:
    """What is wrong with a CUDA_HOME (or CUDA_PATH) that torch's build would use, or None: torch
    compiles .cu files with $CUDA_HOME/bin/nvcc when the variable is set, whatever is on PATH (a
    CUDA_HOME without bin/nvcc made the build pick the nvcc on PATH and then fail inside torch's
    build with a missing-file error)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):  # torch reads the first that is set
        value = os.environ.get(var)
        if value:
            if not os.path.exists(os.path.join(value, "bin", "nvcc")):
                return (f"zerofuse: {var}={value} has no bin/nvcc, and torch builds CUDA sources with "
                        f"{var}/bin/nvcc: point {var} at the CUDA toolkit (the directory holding bin/nvcc), "
                        "unset it, or build CPU-only with ZEROFUSE_CUDA=0")
            return None
    return None


def env(name: str, kind: str, *args, **kwargs):
    """kernels/env.py's parser of an environment variable (``flag`` or ``number``: a bad value is an
    error naming the variable), loaded from its file: setup.py runs before zerofuse is installed."""
    spec = importlib.util.spec_from_file_location("_zerofuse_build_env", os.path.join(ROOT, "kernels", "env.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        return getattr(module, kind)(name, *args, **kwargs)
    except ValueError as e:
        raise SystemExit(f"zerofuse: {e}") from None


def find_nvcc() -> str | None:
    home = find_cuda_home()
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def find_nccl() -> tuple[str, str] | None:
    """(include_dir, lib_dir) of NCCL, or None.

    Order: NCCL_HOME / NCCL_ROOT when set (refused when it holds none); the nvidia-nccl-cuXX wheel (the NCCL torch itself is linked
    against, installed next to torch); a system install under CUDA_HOME or /usr.
    """
    candidates = []
    for var in ("NCCL_HOME", "NCCL_ROOT"):
        if os.environ.get(var):  # asked for: used, or refused (it fell through to the wheel without a word)
            home = os.environ[var]
            found = [(os.path.join(home, "include"), os.path.join(home, d)) for d in ("lib", "lib64")]
            found = [c for c in found if _has_nccl(*c)]
            if not found:
                raise SystemExit(f"zerofuse: {var}={home} holds no NCCL: expected {var}/include/nccl.h and "
                                 f"{var}/lib/libnccl.so* (or lib64); point it at an NCCL install or unset it")
            return found[0]
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except ModuleNotFoundError:
        spec = None
    if spec is not None:
        for loc in spec.submodule_search_locations or []:
            candidates.append((os.path.join(loc, "include"), os.path.join(loc, "lib")))
    cuda = find_cuda_home()
    if cuda:
        candidates.append((os.path.join(cuda, "include"), os.path.join(cuda, "lib64")))
    candidates.append(("/usr/include", "/usr/lib/x86_64-linux-gnu"))
    for inc, lib in candidates:
        if _has_nccl(inc, lib):
            return inc, lib
    return None


def _has_nccl(inc: str, lib: str) -> bool:
    return os.path.exists(os.path.join(inc, "nccl.h")) and bool(glob.glob(os.path.join(lib, "libnccl.so*")))


def nccl_link_name(lib_dir: str) -> str:
    """Linker argument for libnccl: wheels ship only libnccl.so.2 (no unversioned symlink)."""
    if os.path.exists(os.path.join(lib_dir, "libnccl.so")):
        return "-lnccl"
    return "-l:" + os.path.basename(sorted(glob.glob(os.path.join(lib_dir, "libnccl.so*")))[0])


# Defines that let .cu files compile against a CPU-only torch's headers (DESIGN.md §4): the c10
# CUDA headers otherwise include a cmake-generated file that only CUDA torch builds ship.
CPU_TORCH_CUDA_DEFINES = ["-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE"]

NVCC_FLAGS = [
    "-O3",
    "--expt-relaxed-constexpr",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
]


def _shared_libstdcxx(compiler: str) -> bool:
    """True when `compiler` links C++ shared objects against a shared libstdc++ (it finds a
    libstdc++.so of its own); False for a toolchain that has only libstdc++.a."""
    try:
        out = subprocess.run([*shlex.split(compiler), "-print-file-name=libstdc++.so"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return True  # cannot tell (not a gcc-like driver): leave the choice alone
    return os.path.isabs(out) and os.path.exists(out)


def check_compiler() -> None:
    """Refuses the build, by name, when the C++ compiler torch will use (CXX, else c++) does not run:
    torch's build printed 16 failed compile lines and "Error compiling objects" (a review's
    reproduction, 2026-12-07)."""
    cxx = os.environ.get("CXX") or "c++"
    try:
        argv = shlex.split(cxx)
        ok = bool(argv) and shutil.which(argv[0]) is not None and subprocess.run(
            [*argv, "--version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, ValueError, subprocess.SubprocessError):
        ok = False
    if not ok:
        raise SystemExit(f"zerofuse: no working C++ compiler (CXX={os.environ.get('CXX')!r}, else `c++` on PATH): "
                         "zerofuse._C is a C++20 extension; install g++ 10 or newer (e.g. `apt install g++`) or "
                         "set CXX to one")


def pick_host_compilers() -> str | None:
    """Makes CC/CXX name a toolchain that links libstdc++ dynamically; returns a note when it changed them.

    A C++ extension that carries its own static copy of libstdc++ crashes beside torch's shared one:
    its locale and stream state get mixed with the process's (measured on the GPU image, whose CC/CXX
    point at /opt/gcc, a gcc 13 with only libstdc++.a: `std::ostringstream << long` in such a .so
    segfaults once torch is imported; the same source linked by /usr/bin/g++ runs). torch's build
    reads CXX for compiling and linking and CC for nvcc's -ccbin, so both are replaced by the first
    gcc/g++ pair on PATH (or in /usr/bin) that has a shared libstdc++.
    """
    cxx = os.environ.get("CXX")
    if not cxx or _shared_libstdcxx(cxx):
        return None
    bad = os.path.realpath(shlex.split(cxx)[0])
    for cand_cxx, cand_cc in ((shutil.which("g++"), shutil.which("gcc")), ("/usr/bin/g++", "/usr/bin/gcc"),
                              (shutil.which("c++"), shutil.which("cc"))):
        if not cand_cxx or not cand_cc or not os.path.exists(cand_cxx) or os.path.realpath(cand_cxx) == bad:
            continue
        if _shared_libstdcxx(cand_cxx):
            os.environ["CXX"], os.environ["CC"] = cand_cxx, cand_cc
            return (f"CXX={cxx} links libstdc++ statically (no shared libstdc++ of its own), which crashes beside "
                    f"torch: building with CXX={cand_cxx} CC={cand_cc} instead")
    raise SystemExit(
        f"zerofuse: CXX={cxx} links libstdc++ statically (it has no libstdc++.so), and an extension built so "
        "crashes beside torch's shared libstdc++; no other g++ with a shared libstdc++ was found. Set CXX and "
        "CC to such a compiler (e.g. the distribution's g++).")
