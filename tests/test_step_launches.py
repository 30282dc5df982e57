"""Kernel launches of a training step, counted on the CPU (bench/profile_step.py: the CUDA path's
Python with every Triton launch stubbed and counted, aten ops and zerofuse's C++ copies counted by
a dispatch mode): a regression bound on the launches per transformer layer, and where they went.
Also: a ZeRO bucket's grads go into its flat buffer in one multi-tensor copy, not one per param."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(300)
def test_gpt2_step_launches_per_layer(tmp_path):
    out = tmp_path / "step.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "profile_step.py"), "--steps", "1", "--json",
                    str(out)], check=True, capture_output=True, timeout=280)
    res = json.loads(out.read_text())
    ops = res["aten"]
    # 2026-11-26: 57.4 per layer before attention read q/k/v from the fused projection in place
    # (no clone, slice_backward, add of the qkv grads) and the bucket copies were fused; 35.1 after;
    # 27.2 with the norms' backward in one launch, bias + GELU fused, the fused clip and the
    # attention backward's delta formed in its dq kernel; 26.3 with no zero-filled gradients, the
    # cross-entropy's grads scaled in one launch and no division by grad_accum 1; 25.0 with the
    # attention bias's gradient from norm2's kernel, a persistent unit gradient and metrics stacked
    # per log window (issue target: <= 25)
    assert res["launches_per_layer"] <= 25.0, res
    assert res["syncs_per_step"] == 0
    for gone in ("slice_backward", "clone", "copy_", "gelu", "gelu_backward", "clamp", "isfinite", "zeros", "mul_",
                 "div", "ones_like", "stack"):
        assert gone not in ops, (gone, ops)
    triton, layers = res["triton"], res["n_layer"]
    assert triton["norms._norm_bwd_kernel"] == 2 * layers + 1  # every norm's backward: one launch
    assert triton["bias_gelu._bias_gelu_bwd_kernel"] == layers
    assert triton["attention_bwd._attn_bwd_dq_kernel"] == triton["attention_bwd._attn_bwd_dkdv_kernel"] == layers
    assert not [k for k in triton if "sum_partials" in k or "delta" in k or "segment_sum" in k], triton
    assert ops["sum"] == 2 * layers + 1, ops  # qkv and MLP-out bias grads, wpe over the batch; no attention-out one


@pytest.mark.timeout(300)
def test_llama_step_launches_per_layer(tmp_path):
    """The Llama-style structure (RoPE, SwiGLU, GQA; bench/profile_step.py --model llama3-1b): 25.0
    launches per layer (41.0 before RoPE rotated the packed qkv in one kernel pass and SwiGLU read
    its fused gate/up output in place, 2026-11-26): no split heads' copies, slice gradients, sums
    of them or concatenation; one RoPE launch forward and one backward per layer."""
    out = tmp_path / "step.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "profile_step.py"), "--model", "llama3-1b", "--dim",
                    "128", "--steps", "1", "--json", str(out)], check=True, capture_output=True, timeout=280)
    res = json.loads(out.read_text())
    assert res["launches_per_layer"] <= 25.0, res
    for gone in ("slice_backward", "clone", "copy_", "cat", "silu", "silu_backward", "mul"):
        assert gone not in res["aten"], (gone, res["aten"])
    triton, layers = res["triton"], res["n_layer"]
    assert triton["rotary._rope_kernel"] == 2 * layers
    assert triton["swiglu._swiglu_fwd_kernel"] == triton["swiglu._swiglu_bwd_kernel"] == layers


@pytest.mark.timeout(300)
def test_hf_llama_patched_step_launches(tmp_path):
    """bench/profile_hf.py (Hugging Face Llama-3.2-1B's structure, stock vs zerofuse.patch): the
    script runs (it had rotted unnoticed) and the patched step launches under half of stock's
    kernels (43.4 vs 108.1 per decoder layer, 2026-11-26: no copies around attention and RoPE;
    43.7 vs 104.6 on 2026-11-27, both steps with use_cache=False, the patched loss's NaN for a batch
    without targets (stock's) costing ~5 launches a step)."""
    pytest.importorskip("transformers")
    out = tmp_path / "hf.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "profile_hf.py"), "--steps", "1", "--json", str(out)],
                   check=True, capture_output=True, timeout=280)
    res = json.loads(out.read_text())
    assert res["zerofuse"]["launches_per_layer"] <= 43.7 and res["launch_ratio"] < 0.5, res


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("stage", [0, 2])
def test_bucket_grads_arrive_in_one_copy(stage, world_of_one):
    """Over one rank ([Note: a world of one] in zerofuse/zero/world_of_one.py) the backward runs no grad
    hook and no copy: the grads are taken at the next sync point (here full_grads) in one
    zerofuse::flatten_into per bucket and no per-param copy, at stage 0 as at stage 2. The grads
    equal plain autograd's."""
    from zerofuse import zero

    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(4)]
    model = torch.nn.Sequential(*layers)
    ref = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    ref.load_state_dict(model.state_dict())
    zm = zero.parallelize(model, stage=stage, bucket_mb=2 * 8 * 9 * 4 / 2**20)  # two layers per bucket
    eng = zm._zerofuse_zero
    x = torch.randn(5, 8)
    assert eng.hookless and not any(p._post_accumulate_grad_hooks for p in zm.parameters())
    with _Count() as c:
        zm(x).square().sum().backward()
    assert "flatten_into" not in c.names and "copy_" not in c.names, c.names
    ref(x).square().sum().backward()
    with _Count() as c, zero.full_grads(zm):
        for p, r in zip(zm.parameters(), ref.parameters()):
            assert torch.equal(p.grad, r.grad)
    assert c.names.get("flatten_into") == len(eng.units) == 2 and "copy_" not in c.names, c.names


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_job_counts_its_step_and_restores_its_hooks(tmp_path, capsys, precision):
    """zerofuse-train counts the second step's launches and hooks (train/launches.py) and reports
    them; the counters leave every hook as it was. Over one rank ZeRO puts no hook on the model: the
    one counted is a user's grad hook, added here (bf16: the job removes the forward take hook of
    [Note: a world of one], its loop ending every backward at a sync point)."""
    from zerofuse.train.loop import Trainer

    from common import tiny_job_args

    t = Trainer(tiny_job_args(tmp_path, "--layers", "3", "--steps", "3", "--precision", precision), None)
    before = {}
    real_setup = t._setup

    def setup():
        real_setup()
        list(t.model.parameters())[-1].register_post_accumulate_grad_hook(lambda p: None)
        before.update({id(p): dict(p._post_accumulate_grad_hooks or {}) for p in t.model.parameters()})

    t._setup = setup
    assert t.run() == 0
    lc = json.loads((tmp_path / "summary.json").read_text())["launches"]
    n_params = len(before)
    assert n_params > 1 and lc["hooks"] == 1  # the user's; a world of one: no ZeRO grad hooks or callback
    assert lc["triton"] > 0 and lc["launches"] == lc["triton"] + lc["aten"]
    assert lc["per_layer"] == pytest.approx(lc["launches"] / 3)
    assert f"{lc['launches']} kernel launches per step" in capsys.readouterr().out
    assert {id(p): dict(p._post_accumulate_grad_hooks or {}) for p in t.model.parameters()} == before
    assert "_end_of_backward" not in vars(t.model._zerofuse_zero)
