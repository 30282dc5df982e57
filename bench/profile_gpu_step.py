"""Where a training step's time goes on a GPU: a torch.profiler trace of zerofuse-train's step.

Runs zerofuse-train's Trainer in this process (a world of one) on CUDA, warms up, times `--steps`
steps by wall clock (synchronized at both ends), then records `--profile-steps` steps with
torch.profiler (CPU + CUDA activities) and reads the Chrome trace. Per step it reports:
- wall ms and tokens/s (synchronized), host ms (until train_step returns, no sync: what Python
  costs; host < wall means the GPU, not the host, sets the pace);
- GPU busy %: the union of kernel and memcpy/memset intervals over the profiled wall window;
- kernels launched, runtime launch calls, synchronizing runtime calls (cudaStreamSynchronize,
  cudaDeviceSynchronize, blocking cudaMemcpy);
- the kernels taking the most GPU time.

    python bench/profile_gpu_step.py [--zero-stage 2] [--batch 16] [-- extra zerofuse-train flags]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import inprocess


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -1.0
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def read_trace(path: str, steps: int) -> dict:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    kernels = [e for e in gpu if e["cat"] == "kernel"]
    rt = [e for e in events if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver"]
    launches = [e for e in rt if "Launch" in e["name"]]
    syncing = [e for e in rt if e["name"] in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                              "cudaEventSynchronize", "cudaMemcpy")]
    marks = [e for e in events if e.get("name", "").startswith("zf_step") and "dur" in e]
    t0 = min(e["ts"] for e in marks)
    t1 = max(e["ts"] + e["dur"] for e in marks + gpu)
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + e["dur"]
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
    return {"window_ms": (t1 - t0) / 1e3, "gpu_busy_pct": 100.0 * busy / (t1 - t0),
            "kernels_per_step": len(kernels) / steps, "launch_calls_per_step": len(launches) / steps,
            "sync_calls_per_step": len(syncing) / steps,
            "sync_calls": sorted({e["name"] for e in syncing}),
            "top_kernels_ms_per_step": [(n[:90], round(d / 1e3 / steps, 3)) for n, d in top]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--zero-stage", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (no GPU figures)")
    ap.add_argument("extra", nargs="*", help="more zerofuse-train flags (after --)")
    a = ap.parse_args(argv)
    n = a.warmup + a.steps + a.profile_steps + 2
    if a.device == "cuda" and "--no-cuda-graphs" not in a.extra:
        # a graph captured before the profiler first starts (the warm-up captures it) is traced
        # only when CUPTI was set up for graphs first (pytorch#75504 hung without)
        from torch.profiler import _utils as prof_utils

        if hasattr(prof_utils, "_init_for_cuda_graphs"):
            prof_utils._init_for_cuda_graphs()
    t = inprocess.trainer(["--device", a.device, "--model", a.model, "--batch", str(a.batch), "--steps", str(n),
                           "--zero-stage", str(a.zero_stage), *a.extra])
    args, out = t.args, t.args.out
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    tokens = args.batch * args.grad_accum * t.cfg.seq_len
    for _ in range(a.warmup):
        t.train_step()
    t.metrics.flush()
    sync()
    host, w0 = [], time.perf_counter()
    for _ in range(a.steps):
        h0 = time.perf_counter()
        t.train_step()
        host.append(time.perf_counter() - h0)
    sync()
    wall = (time.perf_counter() - w0) / a.steps
    t.metrics.flush()
    from torch.profiler import ProfilerActivity, profile, record_function
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(a.profile_steps):
            with record_function(f"zf_step{i}"):
                t.train_step()
        sync()
    trace = os.path.join(out, "trace.json")
    prof.export_chrome_trace(trace)
    from zerofuse.train.report import graphs_state
    res = {"model": a.model, "params": sum(p.numel() for p in t.model.parameters()), "zero_stage": a.zero_stage,
           "batch": a.batch, "seq_len": t.cfg.seq_len, "precision": args.precision, "extra": a.extra,
           # what the step ran as (--cuda-graphs may fall back to eager: ZeRO-3, a failed capture)
           "cuda_graphs": graphs_state(t),
           "wall_ms_per_step": wall * 1e3, "tokens_per_s": tokens / wall,
           "host_ms_per_step_median": statistics.median(host) * 1e3, "host_ms_per_step_max": max(host) * 1e3,
           **read_trace(trace, a.profile_steps),
           "torch": torch.__version__}
    if a.device == "cuda":
        res.update(max_memory_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                   device=torch.cuda.get_device_name())
    # the headline figures last and one per line, so that a tail of the output keeps them
    for name, ms in res["top_kernels_ms_per_step"]:
        print(f"  {ms:8.3f} ms/step  {name}")
    print(json.dumps({k: v for k, v in res.items() if k != "top_kernels_ms_per_step"}, indent=1))
    return inprocess.finish(res, a.json)


if __name__ == "__main__":
    sys.exit(main())
