"""Test setup. Without a GPU, interpreter mode is on for the whole session (ZEROFUSE_TRITON_ON_CPU=1,
set before zerofuse is imported so TRITON_INTERPRET is in place before any kernel is defined): CPU
tensors go through the real Triton kernels. Tests of the native CPU path use the ``cpu_kernels`` fixture.
Tests marked ``gpu`` (or parametrised with common.DEVICES' ``cuda``) skip without CUDA.
"""
import getpass
import os
import sys
import tempfile

# torch.compile's on-disk kernel cache is keyed without ATEN_CPU_CAPABILITY: on an AVX-512 machine a
# run under ATEN_CPU_CAPABILITY=avx2 (CI's AVX2 step) loaded the kernels the main run had compiled
# for AVX-512 and computed garbage (measured 2026-11-25 on an Intel Xeon: the compile tests of norms
# and flatten failed with nan / 1e34; a fresh cache directory gave the right results). One cache
# per capability, unless the user chose one.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ.get('ATEN_CPU_CAPABILITY', 'default')}"))

# pytest-xdist runs a worker per core (pytest_xdist_auto_num_workers below): each worker, and what
# it starts (rank processes, training jobs), gets its share of the cores. With torch's default of
# one intra-op thread per core in every worker, two workers on 2 cores ran a pipeline test 3.5x
# slower than alone (29 s against 8 s; 10 s with a share each; measured 2026-11-27).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _workers)))

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Only without a GPU: interpreter mode is process-wide, and on a GPU machine the CUDA tests
    # must run the compiled kernels.
    os.environ.setdefault("ZEROFUSE_TRITON_ON_CPU", "1")

import zerofuse  # noqa: E402,F401
from common import HAS_CUDA  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_plans_from_other_tests():
    """The faces' plans ([Note: call signatures]) hold what module settings a test may patch (the
    wide-row kernels' thresholds): each test starts with none."""
    signatures = sys.modules.get("zerofuse.ops.signatures")
    if signatures is not None:
        signatures.clear_plans()


@pytest.fixture
def cpu_kernels(monkeypatch):
    """Route CPU tensors through the C++/torch CPU kernels instead of the Triton interpreter."""
    from zerofuse import kernels

    monkeypatch.setattr(kernels, "TRITON_ON_CPU", False)


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo process group of one rank in this process, destroyed after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def native_kernels(monkeypatch, cpu_kernels):
    """Distributed training tests: this process and the spawned ranks (through the environment)
    run the C++ CPU kernels, and no collective checker is on. The Triton kernels have their own
    interpreter tests; training steps in the interpreter would take minutes."""
    monkeypatch.setenv("ZEROFUSE_TRITON_ON_CPU", "0")
    monkeypatch.delenv("ZEROFUSE_CHECK_COLLECTIVES", raising=False)


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (README's test command): a worker per core, at most 4. Distributed tests start up
    to 4 rank processes each, so more workers would only oversubscribe the cores."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


@pytest.fixture(params=["triton", "torch"])
def kernel_path(request):
    """Both paths of an op on the cpu: its Triton kernel (in the interpreter without a GPU) and
    its torch/C++ cpu path (the cpu_kernels fixture)."""
    if request.param == "torch":
        request.getfixturevalue("cpu_kernels")
    return request.param
