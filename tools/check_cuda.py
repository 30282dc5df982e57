"""Compile-only check of the CUDA sources on a machine without a GPU or a CUDA torch.

    python -m tools.check_cuda [FILE.cu ...] [--arch 80 --arch 90a] [-j N]

Compiles every csrc/**/*.cu, and every .cpp with blocks only a CUDA build compiles (#ifdef
ZEROFUSE_WITH_CUDA / ZEROFUSE_WITH_NCCL: the NCCL communicator, the bindings; the CPU build never
saw those blocks, so only a GPU machine's build found their errors before 2026-12-07), or the files
given, with nvcc for sm_80 and sm_90a against the installed torch's headers and the NCCL headers of
the nvidia-nccl wheel, with the defines that make c10's CUDA headers usable without a CUDA torch
(DESIGN.md §4). Nothing is linked or run. Exits non-zero if any file fails, printing nvcc's errors.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import sysconfig
import tempfile
import time

import torch
from torch.utils.cpp_extension import include_paths

from tools import buildenv


def _std_flag() -> str:
    # torch >= 2.10 headers need C++20 (its cpp_extension passes -std=c++20); older ones C++17.
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return "-std=c++20" if (major, minor) >= (2, 10) else "-std=c++17"


def nvcc_command(nvcc: str, src: str, obj: str, archs: list[str], nccl_include: str) -> list[str]:
    cuda_home = buildenv.find_cuda_home() or os.path.dirname(os.path.dirname(nvcc))
    includes = include_paths() + [
        os.path.join(cuda_home, "include"),
        nccl_include,
        sysconfig.get_paths()["include"],
        buildenv.CSRC,
    ]
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return (
        [nvcc, "-c", src, "-o", obj, _std_flag(), "-Xcompiler", "-fPIC", *gencode, *buildenv.NVCC_FLAGS]
        + buildenv.CPU_TORCH_CUDA_DEFINES
        + [
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            "-DZEROFUSE_WITH_CUDA=1",
            "-DZEROFUSE_WITH_NCCL=1",
            "-DTORCH_EXTENSION_NAME=_C",
            "-DTORCH_API_INCLUDE_EXTENSION_H",
        ]
        + [f"-I{p}" for p in includes]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", help="CUDA sources to check (default: csrc/**/*.cu)")
    p.add_argument("--arch", action="append", help="compute capability, repeatable (default: 80 and 90a)")
    p.add_argument("-j", "--jobs", type=int, help="parallel nvcc runs (default: MAX_JOBS, else the CPU count)")
    args = p.parse_args(argv)
    if args.jobs is None:
        args.jobs = buildenv.env("MAX_JOBS", "number", os.cpu_count() or 1, minimum=1)

    nvcc = buildenv.find_nvcc()
    if nvcc is None:
        print("check_cuda: nvcc not found (set CUDA_HOME or put nvcc on PATH)", file=sys.stderr)
        return 2
    nccl = buildenv.find_nccl()
    if nccl is None:
        print("check_cuda: NCCL headers not found; install the nvidia-nccl-cu13 wheel "
              "(pip install -c constraints-cpu.txt nvidia-nccl-cu13) or set NCCL_HOME", file=sys.stderr)
        return 2
    files = [os.path.abspath(f) for f in args.files] or [
        os.path.join(buildenv.ROOT, f) for f in buildenv.cuda_sources() + buildenv.cuda_guarded_sources()]
    archs = args.arch or ["80", "90a"]
    print(f"check_cuda: {len(files)} file(s), sm_{' sm_'.join(archs)}, {nvcc}, NCCL headers {nccl[0]}")

    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        def compile_one(src: str):
            obj = os.path.join(tmp, os.path.basename(src) + ".o")
            t0 = time.perf_counter()
            r = subprocess.run(nvcc_command(nvcc, src, obj, archs, nccl[0]), capture_output=True, text=True)
            return src, r, time.perf_counter() - t0

        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for src, r, dt in pool.map(compile_one, files):
                rel = os.path.relpath(src, buildenv.ROOT)
                if r.returncode == 0:
                    print(f"  ok    {rel} ({dt:.1f} s)")
                else:
                    failed.append(rel)
                    print(f"  FAIL  {rel} ({dt:.1f} s)\n{r.stdout}{r.stderr}", file=sys.stderr)
    if failed:
        print(f"check_cuda: {len(failed)} of {len(files)} file(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"check_cuda: all {len(files)} file(s) compiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
