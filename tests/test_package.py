"""Packaging facts: the layout users import, the shipped data, build info, interpreter mode."""
import os
import subprocess
import sys
import textwrap

import pytest

import zerofuse


def test_kernels_is_installed_inside_zerofuse_only(tmp_path):
    code = "import importlib.util, zerofuse.kernels; print(zerofuse.kernels.__name__, importlib.util.find_spec('kernels'))"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["zerofuse.kernels", "None"]


def test_corpus_is_shipped_with_the_package():
    path = os.path.join(os.path.dirname(zerofuse.__file__), "data", "tinyshakespeare.txt")
    assert os.path.getsize(path) == 1_115_394
    with open(path) as f:
        assert f.read(15) == "First Citizen:\n"


def test_build_info_matches_torch():
    import torch

    info = zerofuse.build_info()
    assert set(info) == {"cuda", "nccl", "nccl_compiled_version", "nccl_runtime_version"}
    if torch.version.cuda is None:
        assert info["cuda"] is False and info["nccl"] is False
    if info["nccl"]:
        assert info["nccl_runtime_version"] >= 22000


def test_ops_are_listed():
    assert zerofuse.ops.list_ops() == zerofuse.ops.registered_in_torch()
    assert {"zerofuse::flatten_into", "zerofuse::unflatten_from"} <= set(zerofuse.ops.list_ops())


def _clean_env(**env):
    """The environment without interpreter settings or the test path (a user's process)."""
    drop = ("TRITON_INTERPRET", "ZEROFUSE_TRITON_ON_CPU", "PYTHONPATH")
    return {k: v for k, v in os.environ.items() if k not in drop} | env


def _run(code, **env):
    full_env = _clean_env(**env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True, text=True, timeout=300)


TRITON_PROGRAM = """
    import zerofuse, torch, triton, triton.language as tl
    from zerofuse import kernels

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)

    print(kernels.interpreted(), kernels.triton_on_cpu())
    x = torch.arange(1000, dtype=torch.float32)
    add_one[(triton.cdiv(1000, 256),)](x, 1000, BLOCK=256)
    assert torch.equal(x, torch.arange(1, 1001, dtype=torch.float32)), x
    print("ran")
"""


def test_triton_on_cpu_sets_interpreter_before_kernels_are_defined():
    r = _run(TRITON_PROGRAM, ZEROFUSE_TRITON_ON_CPU="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "ran"]


TRITON_FIRST_PROGRAM = """
    import triton, triton.language as tl  # before zerofuse: tl.sum, tl.max, ... decorated for a GPU
    import torch, zerofuse
    import zerofuse.nn.functional as ZF
    from zerofuse import kernels, reference

    @triton.jit
    def row_max(x_ptr, out_ptr, BLOCK: tl.constexpr):
        x = tl.load(x_ptr + tl.arange(0, BLOCK))
        tl.store(out_ptr, x.max(axis=0) + tl.cdiv(BLOCK, 2))  # a tensor method and a tl.standard function

    print(kernels.interpreted(), kernels.triton_on_cpu())
    x, w = torch.randn(3, 7, 123, dtype=torch.float64), torch.randn(123, dtype=torch.float64)
    y = ZF.layer_norm(x.float(), (123,), w.float())
    err = (y.double() - reference.layer_norm(x.float().double(), (123,), w.float().double())[0]).abs().max().item()
    assert err < 1e-5, err
    out = torch.zeros(1)
    row_max[(1,)](torch.arange(64.0), out, BLOCK=64)
    assert out.item() == 63 + 32, out
    print("ran")
"""


def test_triton_imported_before_zerofuse_still_runs_kernels_in_the_interpreter():
    """triton decorates its own library functions when imported: imported before zerofuse set
    TRITON_INTERPRET, they were compiled-mode functions and the first norm kernel died with
    "Cannot call @triton.jit'd outside of the scope of a kernel"."""
    r = _run(TRITON_FIRST_PROGRAM, ZEROFUSE_TRITON_ON_CPU="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "ran"]


def test_triton_imported_first_fails_at_import_with_what_to_set_when_it_cannot_be_switched():
    """Should a triton release change the internals the switch uses, `import zerofuse` says what to
    set instead of the first kernel failing."""
    code = """
        import triton.runtime.interpreter as interpreter

        class Changed:
            def __init__(self, *args, **kwargs):
                raise TypeError("unexpected arguments")

        interpreter.InterpretedFunction = Changed
        import zerofuse
    """
    r = _run(code, ZEROFUSE_TRITON_ON_CPU="1")
    assert r.returncode != 0
    assert ("ImportError: ZEROFUSE_TRITON_ON_CPU=1: triton was imported before zerofuse without TRITON_INTERPRET=1, "
            "and its library functions could not be switched to the interpreter (TypeError: unexpected arguments); "
            "set TRITON_INTERPRET=1 in the environment as well, or import zerofuse before triton") in r.stderr


def test_without_the_flag_triton_stays_native():
    r = _run("import zerofuse; from zerofuse import kernels; print(kernels.interpreted(), kernels.triton_on_cpu())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


def test_triton_interpret_is_read_as_triton_reads_it():
    """TRITON_INTERPRET=true makes triton interpret the kernels; zerofuse counted only "1", so it
    took them for compiled ones (no interpreter rounding fix: half of a bf16 SwiGLU's outputs one
    ulp off the round-to-nearest reference)."""
    code = """
        import torch, zerofuse
        from zerofuse import kernels
        from zerofuse.kernels.swiglu import swiglu_fwd
        g, u = (torch.randn(8, 64, generator=torch.Generator().manual_seed(i)).bfloat16() for i in (0, 1))
        ref = (torch.nn.functional.silu(g.float()) * u.float()).bfloat16()
        print(kernels.interpreted(), int((swiglu_fwd(g, u, "silu") != ref).sum()))
    """
    for value in ("true", "1"):
        r = _run(code, TRITON_INTERPRET=value)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["True", "0"], (value, r.stdout)


def _fake_gcc(path, libstdcxx_so):
    """A gcc-like driver script whose -print-file-name=libstdc++.so answers like a toolchain with
    (an absolute path) or without (the bare name) a shared libstdc++."""
    answer = libstdcxx_so if libstdcxx_so else "libstdc++.so"
    path.write_text(f"#!/bin/sh\necho {answer}\n")
    path.chmod(0o755)
    return str(path)


def test_build_replaces_a_compiler_that_links_libstdcxx_statically(tmp_path, monkeypatch):
    """The GPU image sets CXX to a gcc with only libstdc++.a, whose extensions segfault beside torch:
    the build moves to a g++ with a shared libstdc++, and refuses with a clear message when none is found."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        from tools import buildenv
    finally:
        sys.path.pop(0)
    so = tmp_path / "libstdc++.so"
    so.write_text("")
    (tmp_path / "bin").mkdir()
    good_cxx = _fake_gcc(tmp_path / "bin" / "g++", str(so))
    good_cc = _fake_gcc(tmp_path / "bin" / "gcc", str(so))
    static = _fake_gcc(tmp_path / "static-g++", None)

    monkeypatch.setenv("CXX", good_cxx)
    assert buildenv.pick_host_compilers() is None  # a fine compiler is left alone

    monkeypatch.setenv("CXX", static)
    monkeypatch.setenv("CC", "static-gcc")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    note = buildenv.pick_host_compilers()
    assert "links libstdc++ statically" in note
    assert (os.environ["CXX"], os.environ["CC"]) == (good_cxx, good_cc)

    monkeypatch.setenv("CXX", static)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    monkeypatch.setattr(buildenv, "_shared_libstdcxx", lambda c: c == good_cxx)  # /usr/bin/g++ "static" too
    with pytest.raises(SystemExit, match="links libstdc\\+\\+ statically"):
        buildenv.pick_host_compilers()


def test_a_missing_compiler_is_named_before_the_build(monkeypatch):
    """With no compiler the build printed torch's 16 failed compile lines and "Error compiling
    objects" (a review's reproduction, 2026-12-07)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        from tools import buildenv
    finally:
        sys.path.pop(0)
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(SystemExit, match=r"no working C\+\+ compiler \(CXX='/nonexistent/g\+\+'.*g\+\+ 10"):
        buildenv.check_compiler()
    monkeypatch.delenv("CXX")
    buildenv.check_compiler()  # this machine's c++


def _vector_isa(capability: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    out = subprocess.run([sys.executable, "-c", "from zerofuse import _C; print(_C.cpu_vector_isa())"], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.split()[-1])


def test_cpu_loops_follow_torchs_cpu_capability():
    """zerofuse's CPU loops (csrc/cpu/vector_isa.h) take the version torch's capability allows:
    ATEN_CPU_CAPABILITY=default runs the baseline loops and avx2 the AVX2 ones (at most), as torch
    does its own, so a suite run with it checks what a CPU without AVX-512 (or AVX2) runs. With
    GCC's target_clones the variable changed nothing."""
    machine = _vector_isa(None)
    assert _vector_isa("default") == 0
    assert _vector_isa("avx2") == min(1, machine)


IMPORT_WEIGHT_PROGRAM = """
    import sys
    import zerofuse, zerofuse.nn, zerofuse.hf, zerofuse.checkpoint, zerofuse.tp, zerofuse.zero
    print(" ".join(m for m in ("torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.tensor")
                   if m in sys.modules) or "none")
"""


def test_import_loads_neither_dynamo_nor_dcp():
    """``import zerofuse`` is the ops, not torch.compile's or DCP's machinery: torch._dynamo (a
    torch.compiler.disable decorator imported it: 1.35 s) and torch.distributed.checkpoint (with
    DTensor: 1.05 s) load at their first use (zerofuse._compile, checkpoint._dcp). Measured
    2026-11-27 on an Intel Xeon: import zerofuse 3.3-4.6 s -> 2.3-2.5 s, torch's own 1.6-2.1 s."""
    r = _run(IMPORT_WEIGHT_PROGRAM)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["none"], r.stdout


def _buildenv():
    sys.path.insert(0, ROOT)
    try:
        from tools import buildenv
    finally:
        sys.path.pop(0)
    return buildenv


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_cuda_home_without_nvcc_is_named(tmp_path, monkeypatch):
    """torch builds .cu files with $CUDA_HOME/bin/nvcc whenever CUDA_HOME is set: one without it
    (the build picked the nvcc on PATH, then failed inside torch's build) is named with what to do."""
    buildenv = _buildenv()
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    said = buildenv.bad_cuda_home()
    assert said.startswith(f"zerofuse: CUDA_HOME={tmp_path} has no bin/nvcc") and "ZEROFUSE_CUDA=0" in said
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    assert buildenv.bad_cuda_home() is None
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.setenv("CUDA_PATH", "/nonexistent/cuda")
    assert buildenv.bad_cuda_home().startswith("zerofuse: CUDA_PATH=/nonexistent/cuda has no bin/nvcc")


def test_an_nccl_home_is_used_or_refused(tmp_path, monkeypatch):
    """NCCL_HOME names the NCCL to build with: one holding none was passed over for the wheel's
    without a word."""
    buildenv = _buildenv()
    monkeypatch.delenv("NCCL_ROOT", raising=False)
    monkeypatch.setenv("NCCL_HOME", str(tmp_path))
    with pytest.raises(SystemExit, match=f"NCCL_HOME={tmp_path} holds no NCCL: expected NCCL_HOME/include/nccl.h"):
        buildenv.find_nccl()
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "nccl.h").write_text("")
    (tmp_path / "lib64").mkdir()
    (tmp_path / "lib64" / "libnccl.so.2").write_text("")
    assert buildenv.find_nccl() == (str(tmp_path / "include"), str(tmp_path / "lib64"))


@pytest.mark.parametrize("var,value", [("ZEROFUSE_CUDA", "true"), ("ZEROFUSE_DEBUG", "yes"), ("ZEROFUSE_DEBUG", "")])
def test_setup_refuses_build_switches_it_would_not_act_on(var, value):
    """setup.py acted on exactly "0"/"1": ZEROFUSE_CUDA=true meant auto-detect and ZEROFUSE_DEBUG=yes
    a release build, without a word."""
    r = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=_clean_env(**{var: value}),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert f"zerofuse: {var} must be '0' (" in r.stderr and f"got {value!r}" in r.stderr, r.stderr


def _elf_sections(path) -> set[str]:
    """The section names of an ELF64 little-endian shared object."""
    import struct

    data = open(path, "rb").read()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    def header(i):
        name, = struct.unpack_from("<I", data, shoff + i * shentsize)
        offset, size = struct.unpack_from("<QQ", data, shoff + i * shentsize + 0x18)
        return name, offset, size
    _, str_off, _ = header(shstrndx)
    return {data[str_off + n:data.index(b"\0", str_off + n)].decode() for n, _, _ in map(header, range(shnum))}


@pytest.mark.skipif(os.environ.get("ZEROFUSE_DEBUG") == "1", reason="a debug build keeps its debug info")
def test_the_release_extension_carries_no_debug_info():
    """Python's compile flags (-DNDEBUG -g -O2 ...) come before setup.py's: a release build took
    their -g (36 MB of a 37 MB .so was debug info, and most of the compile time)."""
    import zerofuse._C as ext

    sections = _elf_sections(ext.__file__)
    assert ".text" in sections and ".dynsym" in sections  # (the parser reads the real table)
    assert not {s for s in sections if s.startswith(".debug")}, sorted(sections)


def test_opaque_to_compile_breaks_the_graph_as_torch_compiler_disable():
    """zerofuse._compile.opaque_to_compile: eager calls run the function; under torch.compile it is
    not traced (a graph break, counted as torch.compiler.disable's; fullgraph refuses), whether its
    first call is eager or traced; its result is the eager one."""
    import torch
    from torch._dynamo.utils import counters

    from zerofuse._compile import opaque_to_compile

    for first_eager in (True, False):
        seen = []

        def inner(x):
            seen.append(torch.compiler.is_compiling())
            return x * 2

        opaque = opaque_to_compile(inner)
        x = torch.arange(3.0)
        if first_eager:
            assert torch.equal(opaque(x), x * 2)

        def f(x):
            return opaque(x + 1) - 1

        torch._dynamo.reset()
        counters.clear()
        for _ in range(2):
            assert torch.equal(torch.compile(f, backend="eager")(x), f(x))
        assert seen and not any(seen)  # never traced
        assert sum(counters["graph_break"].values()) >= 1
        with pytest.raises(Exception, match="torch.compiler.disable|skipped"):
            torch._dynamo.reset()
            torch.compile(f, backend="eager", fullgraph=True)(x)


def test_every_name_in_all_resolves_after_import_zerofuse_alone():
    """zerofuse.pipeline after `import zerofuse` raised AttributeError (nothing imported it), and
    __all__ left out tp, parallel, moe and pipeline."""
    code = ("import zerofuse; missing = [n for n in zerofuse.__all__ if getattr(zerofuse, n, None) is None]; "
            "print(missing, zerofuse.pipeline.Pipeline.__name__, zerofuse.train.main.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["[]", "Pipeline", "main"], out.stderr[-2000:]


def test_an_extension_older_than_the_sources_is_named_at_import():
    """After a git pull without a rebuild the old zerofuse._C loaded and the first name it lacked
    failed deep in an ops module ("cannot import name 'signature' from 'zerofuse._C'"), no hint to
    rebuild (a review, 2026-12-06). Simulated: the built extension with one name removed."""
    code = textwrap.dedent(f"""
        import importlib.util, sys
        import torch
        spec = importlib.util.spec_from_file_location("zerofuse._C", {zerofuse._C.__file__!r})
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        del m.signature
        sys.modules["zerofuse._C"] = m
        import zerofuse
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode != 0 and "cannot import name 'signature' from 'zerofuse._C'" in last, r.stderr
    assert "the compiled extension is older than the Python sources" in last and "pip install" in last, last
