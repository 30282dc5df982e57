"""Host cost of one training step, offline: what the GPU would wait for.

Runs zerofuse-train's Trainer in this process (a world of one) with gpt2-124m's structure (12
layers, 12 heads, tied embeddings, biases) at small dims so that compute is negligible, with the
CUDA path's Python (Triton kernels; ZEROFUSE_TRITON_ON_CPU=1) and every Triton launch replaced by
a counting no-op. Per step it reports:
- host ms: the median wall time of a step (the aten ops still run, on tiny CPU tensors: an upper
  bound of the host time, the Triton launchers' own cost excluded);
- launches: Triton launches + aten ops that would launch a kernel on CUDA (TorchDispatchMode,
  views and allocations not counted), and that total per transformer layer;
- hooks: module/param hooks and autograd callbacks zerofuse registered, as they run;
- syncs: host reads of tensors from Python (tests/sync_counter.py) outside the host-side data path.

    python bench/profile_step.py [--stage 2] [--steps 12] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ["ZEROFUSE_TRITON_ON_CPU"] = "1"  # before zerofuse is imported: the CUDA path's Python

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from sync_counter import CountSyncs  # noqa: E402

import inprocess  # noqa: E402

from zerofuse.train.launches import CountLaunches, count_hooks  # noqa: E402  (the job's counters)


class _Stub:
    """A Triton kernel (or autotuner) whose launches are counted, by name, and do nothing."""
    count = 0
    names: dict[str, int] = {}

    def __init__(self, name: str):
        self.name = name

    def _count(self):
        _Stub.count += 1
        _Stub.names[self.name] = _Stub.names.get(self.name, 0) + 1

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self._count()
        return launch

    def run(self, *args, **kwargs):
        self._count()


def _stub_kernels() -> None:
    import importlib

    import zerofuse.kernels as K
    for name in ("attention", "attention_bwd", "cross_entropy", "norms", "optim"):  # (their kernels, to stub)
        importlib.import_module(f"zerofuse.kernels.{name}")
    for mod in [m for m in vars(K).values() if type(m).__name__ == "module" and m.__name__.startswith(K.__name__ + ".")]:
        for name in dir(mod):
            if name.endswith("_kernel") or name.endswith("_tuned"):
                setattr(mod, name, _Stub(f"{mod.__name__.rsplit('.', 1)[-1]}.{name}"))


def _host_side(obj, name: str, counting: list, extra: int = 0) -> None:
    """obj.name runs uncounted by the active CountLaunches (counting[0]), which then adds ``extra``
    launches (as "h2d_copy")."""
    real = getattr(obj, name)

    def run(*args, **kwargs):
        c = counting[0] if counting else None
        if c is None:
            return real(*args, **kwargs)
        c.paused = True
        try:
            return real(*args, **kwargs)
        finally:
            c.paused = False
            if extra:
                c.count += extra
                c.names["h2d_copy"] = c.names.get("h2d_copy", 0) + extra

    setattr(obj, name, run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dim", type=int, default=96)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--model", default="gpt2-124m", help="a preset's structure (e.g. llama3-1b) at the small dims")
    a = ap.parse_args(argv)
    from zerofuse.models import gpt
    # GPT-2's structure also where the preset lacked it (the comparison with 836555f's tree)
    gpt.PRESETS["gpt2-124m"].update(bias=True, tie_embeddings=True)
    _stub_kernels()
    t = inprocess.trainer(["--device", "cpu", "--model", a.model, "--tokenizer", "char", "--dim", str(a.dim),
                           "--seq-len", str(a.seq_len), "--batch", str(a.batch), "--steps", str(a.steps + 3),
                           "--zero-stage", str(a.stage)])
    torch.set_num_threads(1)
    for _ in range(3):  # warm-up: step plans, caches
        t.train_step()
    times, launches, aten, nhooks, syncs = [], [], [], [], []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        t.train_step()
        times.append(time.perf_counter() - t0)
    # What a CUDA job does in host memory, not launches there: the batch (sampled and stacked on the
    # host, then one host-to-device copy: counted as one launch) and the stop vote (CPU flags).
    counting: list = []
    _host_side(t, "_batch", counting, extra=1)
    _host_side(t.vote, "vote", counting)
    for _ in range(3):
        s0, hooks = _Stub.count, {}
        _Stub.names = {}
        with CountLaunches() as c, CountSyncs() as s, count_hooks(t.model, hooks):
            counting[:] = [c]
            t.train_step()
        counting.clear()
        launches.append(_Stub.count - s0 + c.count)
        aten.append(c.count)
        nhooks.append(hooks.get("hooks", 0))
        syncs.append(len(s.calls))
    layers = t.cfg.n_layer
    res = {"model": f"{a.model} structure", "n_layer": layers, "dim": a.dim, "seq_len": a.seq_len, "batch": a.batch,
           "zero_stage": a.stage, "host_ms_per_step": statistics.median(times) * 1e3,
           "launches_per_step": launches[-1], "aten_launches_per_step": aten[-1],
           "triton_launches_per_step": launches[-1] - aten[-1], "launches_per_layer": launches[-1] / layers,
           "hooks_per_step": nhooks[-1], "syncs_per_step": syncs[-1], "sync_calls": s.calls[:10],
           "top_aten": sorted(c.names.items(), key=lambda kv: -kv[1])[:12], "aten": c.names,
           "triton": dict(sorted(_Stub.names.items(), key=lambda kv: -kv[1]))}
    print(json.dumps(res, indent=1))
    return inprocess.finish(res, a.json)


if __name__ == "__main__":
    sys.exit(main())
