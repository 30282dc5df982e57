"""``python -m zerofuse.doctor``: what was built, what runs here, and a self-test of every op.

Prints the zerofuse, torch, triton and NCCL versions, the backends compiled into zerofuse._C, the
visible devices and how Triton runs (natively on a GPU or in the interpreter), then runs each
registered op's self-test on every available device against zerofuse.reference. Exits 1 if any
self-test fails, an op registered with torch has no self-test, the extension was built from
other sources than csrc/ holds (a stale build: pyextension/_stamp.py), or it is a CUDA build and no
CUDA device is visible (its CUDA and NCCL self-tests cannot run).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
import time
import traceback

import torch


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _nccl_str(code: int) -> str:
    # NCCL_VERSION_CODE is major*10000 + minor*100 + patch since 2.9.
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}" if code else "unknown"


def _devices() -> list[torch.device]:
    devs = [torch.device("cpu")]
    if torch.cuda.is_available():
        devs.append(torch.device("cuda", torch.cuda.current_device()))
    return devs


def report() -> list[str]:
    import zerofuse
    from zerofuse import kernels

    info = zerofuse.build_info()
    lines = [
        f"zerofuse   {zerofuse.__version__}  ({os.path.dirname(zerofuse.__file__)})",
        f"python     {platform.python_version()}  ({sys.executable})",
        f"torch      {torch.__version__}  (CUDA {torch.version.cuda or 'none'})",
        f"triton     {_version('triton')}",
    ]
    if info["nccl"]:
        lines.append(
            f"NCCL       compiled against {_nccl_str(info['nccl_compiled_version'])}, "
            f"loaded {_nccl_str(info['nccl_runtime_version'])}"
        )
    else:
        lines.append(f"NCCL       not compiled in (CPU build); nvidia-nccl-cu13 wheel: {_version('nvidia-nccl-cu13')}")
    lines.append(
        "backends   CPU yes, CUDA " + ("yes" if info["cuda"] else "no") + ", NCCL " + ("yes" if info["nccl"] else "no")
    )
    lines.append(f"devices    cpu ({torch.get_num_threads()} threads)")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"           cuda:{i} {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB")
    else:
        lines.append("           cuda: none visible")
    if kernels.interpreted():
        mode = "interpreter (TRITON_INTERPRET=1)"
    elif torch.cuda.is_available():
        from zerofuse.kernels import launch

        # [Note: launch handles]: which launch path the numbers of a run were measured with
        mode = f"native on CUDA, launches through {launch.MODE} (ZEROFUSE_TRITON_LAUNCH)"
    else:
        mode = "no GPU: Triton kernels do not run (ZEROFUSE_TRITON_ON_CPU=1 runs them in the interpreter)"
    lines.append(f"triton     {mode}; CPU tensors use " + ("Triton" if kernels.triton_on_cpu() else "the CPU kernels"))
    return lines


def selftest(devices: list[torch.device]) -> list[str]:
    """Runs every self-test; returns failure descriptions (empty when all pass)."""
    from zerofuse import ops

    failures = []
    known = set(ops.list_ops())
    in_torch = ops.registered_in_torch()
    print(f"ops        {len(in_torch)} registered: {', '.join(in_torch)}")
    for name in in_torch:
        if name not in known:
            failures.append(f"{name}: registered with torch but has no self-test")
            print(f"  FAIL  {name}: no self-test")
    # Each op must be called by its self-test (three passed on self-tests that never called them: a
    # review's reproduction, 2026-12-07): one profiler session over them all, each test a named range,
    # the dispatcher's op events attributed to the range they fall in (on any thread: the time says).
    # Checked on the cpu's native paths: on CUDA (and the CPU interpreter) an optimizer's face launches
    # its Triton kernel without the dispatcher, and the C++ CPU ops' tests run on the cpu only.
    ranges, called = {}, set()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for name in ops.list_ops():
            failures += _selftest_op(name, ops.OPS[name], devices, ranges)
    spans = sorted((e.time_range.start, e.time_range.end, ranges[e.name]) for e in prof.events() if e.name in ranges)
    for e in prof.events():
        if e.name.startswith("zerofuse::"):
            t = e.time_range.start
            called.update(op for a, b, op in spans if a <= t <= b and op == e.name)
    for name in sorted(set(ranges.values())):
        if name not in called and not any(f.startswith(f"{name} on ") for f in failures):
            failures.append(f"{name}: its self-test passed without calling it (the dispatcher saw no call)")
            print(f"  FAIL  {name:28s} its self-test never called it")
    return failures


def _selftest_op(name: str, info, devices, ranges: dict) -> list[str]:
    from zerofuse import kernels

    keys = [
        {"CompositeExplicitAutograd": "all devices"}.get(k, k)
        for k in ("CPU", "CUDA", "CompositeExplicitAutograd", "Meta")
        if torch._C._dispatch_has_kernel_for_dispatch_key(name, k)
    ]
    failures = []
    for dev in devices:
        label = f"zerofuse-selftest {name} {dev}"
        if dev.type == "cpu" and not kernels.TRITON_ON_CPU:
            ranges[label] = name
        t0 = time.perf_counter()
        try:
            with torch.profiler.record_function(label):
                info.selftest(dev)
        except Exception:
            failures.append(f"{name} on {dev}: {traceback.format_exc()}")
            print(f"  FAIL  {name:28s} {str(dev):7s} [{info.kind}]\n{traceback.format_exc()}")
            continue
        dt = (time.perf_counter() - t0) * 1e3
        print(f"  ok    {name:28s} {str(dev):7s} [{_ran(info.kind, dev)}; kernels: {', '.join(keys)}] {dt:.1f} ms")
    return failures


def _ran(kind: str, device: torch.device) -> str:
    """What an op's self-test ran on ``device``: its kind ("C++", "Triton", "C++ (CPU), Triton
    (CUDA)") where that is what runs there; an op with a Triton kernel takes it for CPU tensors
    in the interpreter with ZEROFUSE_TRITON_ON_CPU=1, its CPU path otherwise (the optimizers' lines
    said "C++ (CPU)" in the interpreter: a review's count of launches, 2026-12-06)."""
    from zerofuse import kernels

    if "Triton" not in kind or device.type != "cpu":
        return kind
    if kernels.triton_on_cpu():
        return "Triton (interpreter)"
    return "C++ (CPU)" if kind.startswith("C++") else "CPU path (C++ or torch); Triton on CUDA"


HANDLES_FAILED = "launch handles: FAILED"  # bench/run_gpu.sh looks for this line


def _handles_in_use(device: torch.device) -> bool:
    from zerofuse import kernels
    from zerofuse.kernels import launch

    return device.type == "cuda" and not kernels.interpreted() and launch.MODE == "handles"


def handles_selftest(devices: list[torch.device]) -> list[str]:
    """Every op's self-test again where Triton launches through handles ([Note: launch handles]):
    the first run (selftest) compiled each kernel and launched its first call through the JIT, so
    this one launches through the handles made then. A failure here after a pass there is the handles'
    own: the line HANDLES_FAILED says to run with ZEROFUSE_TRITON_LAUNCH=jit."""
    from zerofuse import ops
    from zerofuse.kernels import launch

    failures = []
    for dev in [d for d in devices if _handles_in_use(d)]:
        hits = sum(h.hits for h in launch.HANDLES.values())
        for name in ops.list_ops():
            try:
                ops.OPS[name].selftest(dev)
            except Exception:
                failures.append(f"{name} on {dev} through launch handles: {traceback.format_exc()}")
                print(f"  FAIL  {name:28s} {str(dev):7s} through launch handles\n{traceback.format_exc()}")
        hits = sum(h.hits for h in launch.HANDLES.values()) - hits
        if failures:
            print(f"{HANDLES_FAILED} on {dev}: the self-tests above failed only through them; "
                  "run with ZEROFUSE_TRITON_LAUNCH=jit")
        else:
            print(f"  ok    every op again on {dev} through launch handles ({hits} handle launches)")
    return failures


def _comm_case(transport: str, device: torch.device) -> None:
    from zerofuse.comm import Communicator

    comm = Communicator(transport=transport, timeout=60)
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(n, generator=g).to(device) for n in (1, 7, 1023, 4097)]
    flat = torch.cat(ts)
    out = torch.empty(comm.shard_numel(ts), device=device)
    comm.reduce_scatter_coalesced(ts, out, op="avg").wait()
    back = [torch.empty_like(t) for t in ts]
    comm.all_gather_coalesced(out * 2, back).wait()
    comm.all_reduce_coalesced(ts, op="sum", scale=3.0).wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    torch.testing.assert_close(out, flat)
    torch.testing.assert_close(torch.cat(back), flat * 2)
    torch.testing.assert_close(torch.cat(ts), flat * 3)


def comm_selftest(devices: list[torch.device]) -> list[str]:
    """The Communicator in a world of one (gloo group in this process): the ProcessGroup transport
    on CPU, the NCCL transport on CUDA in NCCL builds."""
    import tempfile

    import torch.distributed as dist

    import zerofuse

    if dist.is_initialized():
        print("comm       skipped: a process group is already initialized")
        return []
    cases = [("process_group", torch.device("cpu"))]
    cases += [("nccl", d) for d in devices if d.type == "cuda" and zerofuse.build_info()["nccl"]]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
        try:
            for transport, dev in cases:
                t0 = time.perf_counter()
                try:
                    _comm_case(transport, dev)
                except Exception:
                    failures.append(f"comm {transport} on {dev}: {traceback.format_exc()}")
                    print(f"  FAIL  comm ({transport}, world of one) {dev}\n{traceback.format_exc()}")
                    continue
                print(f"  ok    comm ({transport}, world of one) {str(dev):7s} {(time.perf_counter() - t0) * 1e3:.1f} ms")
        finally:
            dist.destroy_process_group()
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zerofuse.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--no-selftest", action="store_true", help="only print what was built and what runs here")
    args = parser.parse_args(argv)
    for line in report():
        print(line)
    import zerofuse
    from zerofuse import _stamp

    pkg = os.path.dirname(os.path.abspath(zerofuse.__file__))
    stale = _stamp.stale(pkg, getattr(zerofuse._C, "__file__", None))
    if stale:
        print(f"build      STALE: {stale}")
    elif not os.path.isdir(os.path.join(os.path.dirname(pkg), "csrc")):
        print("build      no csrc/ here (an installed copy): nothing to compare the extension with")
    elif not os.path.isfile(os.path.join(pkg, _stamp.STAMP)):  # (said "matches" before: a review's reproduction)
        print(f"build      cannot tell whether the extension matches csrc/: no build stamp ({_stamp.STAMP}; built "
              "before stamps or by other means); rebuild to check")
    else:
        print("build      the extension matches the sources")
    built = _stamp.built_torch(os.path.dirname(os.path.abspath(zerofuse.__file__)))
    print(f"built for  torch {built or 'unknown (no stamp)'}")
    if args.no_selftest:  # (a stale build exited 0 here; the docstring and README say it fails)
        if stale:
            print(f"doctor: stale build: {stale}", file=sys.stderr)
        return 1 if stale else 0
    if zerofuse.build_info()["cuda"] and not torch.cuda.is_available():  # (it passed on the CPU checks alone)
        print("doctor: a CUDA build, but no CUDA device is visible here (driver, CUDA_VISIBLE_DEVICES?): its CUDA "
              "and NCCL self-tests cannot run", file=sys.stderr)
        return 1
    from zerofuse.kernels.attention import pinned_config
    with pinned_config():  # results are checked, not speed: no autotuning (44-78 s of an H200's time)
        failures = selftest(_devices())
        if not failures:  # a failure through the JIT would fail again here: not the handles'
            failures += handles_selftest(_devices())
    failures += comm_selftest(_devices())
    if stale:  # the self-tests ran the old kernels
        failures.append(f"stale build: {stale}")
    if failures:
        named = "; ".join(f.splitlines()[0] for f in failures)  # (a count alone named none of them)
        print(f"doctor: {len(failures)} check(s) failed: {named}", file=sys.stderr)
        return 1
    print("doctor: all self-tests passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
