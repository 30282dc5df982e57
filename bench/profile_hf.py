"""Offline proxy of a Hugging Face Llama training step on a GPU: stock vs zerofuse.patch.

The model has Llama-3.2-1B's structure (16 layers, 32 query / 8 kv heads, untied head) at small
dims so compute is negligible; zerofuse runs its CUDA path's Python (ZEROFUSE_TRITON_ON_CPU=1) with
every Triton launch replaced by a counting no-op (bench/profile_step.py's stubs and counter). Per
step (forward with labels and use_cache=False + backward + torch AdamW foreach step) it reports the launches (Triton
launches + aten ops that launch a kernel on CUDA; not the optimizer's step-counter reads, cpu
tensors on a GPU too), their count per layer, and the host ms (an upper bound: the aten ops still
run on tiny CPU tensors).

    python bench/profile_hf.py [--steps 10] [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

os.environ["ZEROFUSE_TRITON_ON_CPU"] = "1"  # before zerofuse is imported: the CUDA path's Python
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from profile_step import CountLaunches, _Stub, _stub_kernels  # noqa: E402


def _profile(model, ids, steps: int) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

    def step():
        model(ids, labels=ids, use_cache=False).loss.backward()  # a training step: no KV cache (both models)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    s0 = _Stub.count
    with CountLaunches() as c:
        step()
    # torch AdamW's per-param step counters live on the cpu on a GPU too (not capturable): their
    # .item() (aten::_local_scalar_dense, one per param) launches nothing there
    cpu_reads = c.names.pop("_local_scalar_dense", 0)
    triton = _Stub.count - s0
    launches = triton + c.count - cpu_reads
    layers = model.config.num_hidden_layers
    return {"host_ms_per_step": round(statistics.median(times) * 1e3, 2), "launches_per_step": launches,
            "triton_launches_per_step": triton, "launches_per_layer": round(launches / layers, 1),
            "top_aten": sorted(c.names.items(), key=lambda kv: -kv[1])[:10]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import transformers

    import zerofuse

    _stub_kernels()
    torch.set_num_threads(1)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=16, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=4, vocab_size=512, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    res = {"model": "Llama-3.2-1B structure (16 layers, 32/8 heads), small dims", "batch": list(ids.shape),
           "torch": torch.__version__, "transformers": transformers.__version__}
    for name in ("stock", "zerofuse"):
        model = copy.deepcopy(base)
        if name == "zerofuse":
            zerofuse.patch(model)
        res[name] = _profile(model, ids, a.steps)
    res["launch_ratio"] = round(res["zerofuse"]["launches_per_step"] / res["stock"]["launches_per_step"], 3)
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
