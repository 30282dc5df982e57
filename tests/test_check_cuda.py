"""The CUDA compile-only check fails on a broken .cu file (the whole tree is checked by .ci/run)."""
import os

import pytest

from tools import buildenv, check_cuda

needs_nvcc = pytest.mark.skipif(
    buildenv.find_nvcc() is None or buildenv.find_nccl() is None, reason="needs nvcc and the NCCL headers"
)


@needs_nvcc
def test_broken_cuda_file_fails(tmp_path, capsys):
    bad = tmp_path / "broken.cu"
    bad.write_text('#include "checks.h"\n__global__ void k(float* x) { x[threadIdx.x] = undefined_name; }\n')
    assert check_cuda.main([str(bad), "--arch", "80"]) == 1
    err = capsys.readouterr().err
    assert "FAIL" in err and "undefined_name" in err


@needs_nvcc
def test_valid_cuda_file_passes(tmp_path):
    good = tmp_path / "good.cu"
    good.write_text("__global__ void k(float* x) { x[threadIdx.x] += 1.f; }\n")
    assert check_cuda.main([str(good), "--arch", "80", "--arch", "90a"]) == 0


def test_cuda_sources_are_the_cu_files():
    srcs = buildenv.cuda_sources()
    assert "csrc/cuda/flatten.cu" in srcs and all(s.endswith(".cu") for s in srcs)
    assert all(os.path.exists(os.path.join(buildenv.ROOT, s)) for s in srcs)


def test_the_cpp_blocks_only_a_cuda_build_compiles_are_checked_too():
    """communicator.cpp's NCCL blocks and module.cpp's bindings of them compile only in a CUDA build:
    the check compiles them too (it compiled the .cu files only before 2026-12-07)."""
    guarded = buildenv.cuda_guarded_sources()
    assert {"csrc/comm/communicator.cpp", "csrc/module.cpp"} <= set(guarded)
    assert all(s.endswith(".cpp") for s in guarded) and len(guarded) < len(buildenv.cpp_sources())


@needs_nvcc
def test_a_broken_nccl_block_of_a_cpp_file_fails(tmp_path, capsys):
    bad = tmp_path / "broken.cpp"
    bad.write_text("#ifdef ZEROFUSE_WITH_NCCL\n#include <nccl.h>\nint f() { return ncclNoSuchCall(); }\n#endif\n")
    assert check_cuda.main([str(bad), "--arch", "80"]) == 1
    assert "ncclNoSuchCall" in capsys.readouterr().err
