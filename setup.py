"""Build zerofuse._C.

Always: a CppExtension from csrc/**/*.cpp (CPU kernels, op registration).
With a CUDA torch and nvcc: a CUDAExtension that also compiles csrc/**/*.cu and links the NCCL that
torch uses (the nvidia-nccl-cuXX wheel next to torch), with an rpath so the .so finds libnccl on a
fresh machine, in an editable install and after `pip install .`.

Environment: ZEROFUSE_CUDA=0/1 forces the CPU-only / CUDA build; MAX_JOBS caps ninja's jobs
(torch.utils.cpp_extension honours it); ZEROFUSE_DEBUG=1 builds with -g -O0 and asserts (release by
default: -O3 -g0); both take 0 or 1 only; TORCH_CUDA_ARCH_LIST picks the GPU architectures (default: the visible GPU).
"""
import os
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

from tools import buildenv  # noqa: E402


def _want_cuda() -> bool:
    forced = None
    if os.environ.get("ZEROFUSE_CUDA") is not None:
        forced = buildenv.env("ZEROFUSE_CUDA", "flag", False, "the CUDA build", "the CPU-only build")
    if forced is False:
        return False
    if torch.version.cuda is not None and (bad := buildenv.bad_cuda_home()):
        raise SystemExit(bad)
    have = torch.version.cuda is not None and buildenv.find_nvcc() is not None
    if forced and not have:
        raise SystemExit(
            f"ZEROFUSE_CUDA=1 needs a CUDA build of torch and nvcc; found torch {torch.__version__} "
            f"(torch.version.cuda={torch.version.cuda}) and nvcc={buildenv.find_nvcc()}"
        )
    return have


def _extension():
    note = buildenv.pick_host_compilers()
    if note:
        print(f"zerofuse: {note}", file=sys.stderr)
    debug = buildenv.env("ZEROFUSE_DEBUG", "flag", False, "-g -O0, asserts on", "release: -O3, no debug info")
    # after Python's own flags (-DNDEBUG -g -O2 or so, which come first): -g0 drops their -g (the
    # debug info was ~60% of the .so and a large part of the compile time), -UNDEBUG their NDEBUG
    opt = ["-g", "-O0", "-UNDEBUG"] if debug else ["-O3", "-g0"]
    # -fopenmp: at::parallel_for is OpenMP inline code; without the flag it silently runs on one
    # thread. libgomp.so.1 resolves to the copy torch has already loaded.
    # -fno-math-errno: otherwise sqrt in a loop cannot vectorise (errno) - the Adam kernel ran 2x slower.
    cxx = opt + ["-fvisibility=hidden", "-fopenmp", "-fno-math-errno"]
    link = ["-fopenmp"]
    if not _want_cuda():
        print("zerofuse: building the CPU-only extension", file=sys.stderr)
        return CppExtension(
            "zerofuse._C", buildenv.cpp_sources(), extra_compile_args={"cxx": cxx}, extra_link_args=link
        )

    nccl = buildenv.find_nccl()
    if nccl is None:
        raise SystemExit(
            "zerofuse: CUDA build needs NCCL (nccl.h and libnccl.so). Install the nvidia-nccl-cuXX "
            "wheel that torch uses, set NCCL_HOME, or build CPU-only with ZEROFUSE_CUDA=0."
        )
    inc, lib = nccl
    print(f"zerofuse: building with CUDA {torch.version.cuda} and NCCL from {lib}", file=sys.stderr)
    # nvcc takes the last -O: a debug build drops -O3 (-g: host debug info, -G: device's)
    nvcc = [f for f in buildenv.NVCC_FLAGS if f != "-O3"] + ["-G", "-g", "-O0"] if debug else buildenv.NVCC_FLAGS
    # $ORIGIN/../nvidia/nccl/lib finds the wheel's libnccl after a non-editable install into
    # site-packages; the absolute path covers editable installs and NCCL_HOME builds.
    rpath = ["-Wl,-rpath,$ORIGIN/../nvidia/nccl/lib", f"-Wl,-rpath,{lib}"]
    return CUDAExtension(
        "zerofuse._C",
        buildenv.cpp_sources() + buildenv.cuda_sources(),
        include_dirs=[inc],
        library_dirs=[lib],
        extra_link_args=link + rpath + [buildenv.nccl_link_name(lib)],
        define_macros=[("ZEROFUSE_WITH_CUDA", "1"), ("ZEROFUSE_WITH_NCCL", "1")],
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
    )


# zerofuse.data: the shipped corpus (no Python; listed so setuptools ships it as package data and
# not as an undeclared namespace package, which it warns it will stop including)
packages = ["zerofuse"] + ["zerofuse." + p for p in find_packages("pyextension")] + ["zerofuse.kernels", "zerofuse.data"]

def _load_stamp():
    """pyextension/_stamp.py, loaded by path (the zerofuse package cannot be imported mid-build)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_zerofuse_stamp", os.path.join(ROOT, "pyextension", "_stamp.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _BuildExt(BuildExtension.with_options(use_ninja=True)):
    """torch's BuildExtension, then the build stamp next to the extension (pyextension/_stamp.py):
    the sources' hashes taken before the build, written only once it succeeded."""

    def run(self):
        buildenv.check_compiler()  # (here, not at load: --version and sdist compile nothing)
        stamp = _load_stamp()
        cuda = any(src.endswith(".cu") for ext in self.extensions for src in ext.sources)
        suffixes = stamp.SUFFIXES if cuda else stamp.CPU_SUFFIXES
        hashes = stamp.source_hashes(os.path.join(ROOT, "csrc"), suffixes)
        build = stamp.build_hashes(ROOT)
        super().run()
        for ext in self.extensions:
            full = self.get_ext_fullpath(ext.name)
            path = stamp.write(os.path.dirname(full), hashes, suffixes, torch.__version__, os.path.basename(full), build)
            print(f"zerofuse: build stamp {path}", file=sys.stderr)


setup(
    packages=packages,
    package_dir={"zerofuse": "pyextension", "zerofuse.kernels": "kernels"},
    package_data={"zerofuse.data": ["*.txt", "*.bin"]},
    ext_modules=[_extension()],
    cmdclass={"build_ext": _BuildExt},
)
