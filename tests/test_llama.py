"""The Llama-style zerofuse model (GPTConfig(pos="rope", mlp="swiglu", norm="rmsnorm", bias=False)):
its forward and gradients against Llama written out from the reference ops (pre-norm blocks, RoPE on
q and k, grouped-query causal attention, SwiGLU, tied or untied head), the presets' parameter counts
(Llama 3.2 1B's and Llama 3 8B's), and the training job on llama-tiny. Parallel training (TP, SP,
ZeRO-2/3) vs one process: tests/test_tp.py (arch "llama")."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tolerances import assert_close
from zerofuse import reference
from zerofuse.models import GPT, GPTConfig, config
from zerofuse.nn import rope_tables

CFG = dict(vocab_size=67, seq_len=40, n_layer=2, n_head=4, n_kv_head=2, dim=48, mlp_hidden=72, norm="rmsnorm",
           norm_eps=1e-5, pos="rope", mlp="swiglu", bias=False, rope_base=500.0)


def _llama_reference(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """Llama's forward from model's weights, each step written out with the reference ops, fp64."""
    cfg = model.config
    p = {n: t.detach().double() for n, t in model.named_parameters()}
    hq, hkv, d = cfg.n_head, cfg.n_kv_head, cfg.dim // cfg.n_head
    cos, sin = rope_tables(cfg.seq_len, d, cfg.rope_base, scaling=cfg.rope_scaling)
    b, n = idx.shape
    x = p["wte.weight"][idx]
    for i in range(cfg.n_layer):
        pre = f"blocks.{i}."
        h, _ = reference.rms_norm(x, (cfg.dim,), p[pre + "norm1.weight"], cfg.norm_eps)
        qkv = h @ p[pre + "attn.qkv.weight"].T
        q = qkv[..., :hq * d].view(b, n, hq, d).transpose(1, 2)
        k = qkv[..., hq * d:(hq + hkv) * d].view(b, n, hkv, d).transpose(1, 2)
        v = qkv[..., (hq + hkv) * d:].view(b, n, hkv, d).transpose(1, 2)
        q = reference.rotary_embedding(q, cos.double(), sin.double())
        k = reference.rotary_embedding(k, cos.double(), sin.double())
        rep = hq // hkv
        att = reference.attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)[0]
        x = x + att.transpose(1, 2).reshape(b, n, cfg.dim) @ p[pre + "attn.proj.weight"].T
        h, _ = reference.rms_norm(x, (cfg.dim,), p[pre + "norm2.weight"], cfg.norm_eps)
        gate, up = (h @ p[pre + "mlp.fc.weight"].T).chunk(2, dim=-1)
        x = x + reference.swiglu(gate, up) @ p[pre + "mlp.proj.weight"].T
    h, _ = reference.rms_norm(x, (cfg.dim,), p["norm.weight"], cfg.norm_eps)
    return h @ p.get("head.weight", p["wte.weight"]).T  # tied: one param, named wte.weight


# Llama 3's frequency scaling at this size: head_dim 12, base 500 -> wavelengths 6.3 (kept: under
# 32 / 4), 17.7 (interpolated), 50 and more (divided by the factor: over 32 / 1)
SCALED = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


@pytest.mark.parametrize("tie,scaling", [(False, None), (True, None), (False, SCALED)])
def test_forward_and_loss_match_llama_written_out(tie, scaling):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG, tie_embeddings=tie, rope_scaling=scaling), seed=3)
    with torch.no_grad():  # non-trivial norm weights
        for name, prm in model.named_parameters():
            if "norm" in name:
                prm.add_(torch.randn(prm.shape) * 0.1)
    idx = torch.randint(0, 67, (2, 37))
    want = _llama_reference(model, idx)
    logits, _ = model(idx)
    assert_close(logits.double(), want, atol=2e-5, rtol=1e-4)
    targets = torch.randint(0, 67, (2, 37))
    _, loss = model(idx, targets)
    assert_close(loss.double(), F.cross_entropy(want.reshape(-1, 67), targets.reshape(-1)), atol=2e-6, rtol=1e-5)
    assert "wpe.weight" not in dict(model.named_parameters())


def test_gradients_match_the_unfused_model():
    """The fused loss and the fused blocks vs the same model with the head + F.cross_entropy and
    torch's attention: every parameter's gradient."""
    idx, targets = torch.randint(0, 67, (2, 33)), torch.randint(0, 67, (2, 33))
    grads = []
    for kw in (dict(), dict(fused_loss=False, attention="torch")):
        model = GPT(GPTConfig(**CFG, **kw), seed=1)
        model(idx, targets)[1].backward()
        grads.append({n: q.grad for n, q in model.named_parameters()})
    for name, g in grads[0].items():
        assert_close(g, grads[1][name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_preset_parameter_counts():
    counts = {}
    for name in ("llama-tiny", "llama3-1b", "llama3-8b"):
        with torch.device("meta"):
            counts[name] = GPT(config(name)).num_params()
    # Llama 3.2 1B (tied embeddings) and Llama 3 8B as released (Hugging Face's counts)
    assert counts["llama3-1b"] == 1_235_814_400
    assert counts["llama3-8b"] == 8_030_261_248
    assert counts["llama-tiny"] == 755_072


LLAMA32 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("head_dim,base,scaling", [(12, 500.0, SCALED), (64, 500000.0, LLAMA32),
                                                   (128, 500000.0, {**LLAMA32, "factor": 8.0})])  # (Llama 3.1's)
def test_llama3_rope_scaling_is_transformers(head_dim, base, scaling):
    """The frequencies against transformers' llama3 rope init (fp32 there, float64 here); the
    llama3-1b preset is Llama 3.2 1B's (its config.json's rope_scaling), llama3-8b Llama 3's (none)."""
    from zerofuse.nn.rotary import rope_frequencies

    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim, rope_theta=base,
                                  max_position_embeddings=131072, rope_scaling=dict(scaling))
    want, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    # the dict transformers 5 keeps (the base added as rope_theta) is taken as it is, checked against rope_base
    given = dict(hf.rope_scaling)
    assert given.get("rope_theta") == base
    assert GPTConfig(**{**CFG, "rope_base": base, "rope_scaling": given}).rope_scaling == given
    with pytest.raises(ValueError, match=f"rope_scaling's rope_theta {base} differs from rope_base 1.0"):
        GPTConfig(**{**CFG, "rope_base": 1.0, "rope_scaling": given})
    got, plain = rope_frequencies(head_dim, base, scaling), rope_frequencies(head_dim, base)
    assert attention_factor == 1.0 and (got != plain).any()
    torch.testing.assert_close(got.float(), want, rtol=2e-6, atol=0)
    assert config("llama3-1b").rope_scaling == LLAMA32
    mine = config("llama3-1b")  # each config its own dict: an edit reached the preset and every config made
    mine.rope_scaling["factor"] = 8.0
    assert config("llama3-1b").rope_scaling == LLAMA32 and config("llama3-1b").rope_scaling is not mine.rope_scaling
    assert config("llama3-8b").rope_scaling is None


@pytest.mark.parametrize("bad,msg", [(dict(pos="alibi"), "expected pos one of"), (dict(mlp="relu"), "expected mlp one of"),
                                     (dict(pos="rope", dim=36, n_head=4, n_kv_head=4), "rope needs an even head_dim"),
                                     (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "no other kind is implemented"),
                                     (dict(rope_scaling={**SCALED, "factor": 0}), "expected rope_scaling"),
                                     (dict(rope_scaling={**SCALED, "high_freq_factor": 1.0}), "low_freq_factor < high"),
                                     (dict(rope_scaling=SCALED, pos="learned"), "rope_scaling is for pos='rope'")])
def test_bad_config(bad, msg):
    with pytest.raises(ValueError, match=msg):
        GPTConfig(**{**CFG, **bad})


def test_training_job_on_llama_tiny(tmp_path):
    """zerofuse-train --model llama-tiny, 2 ranks, ZeRO-3: the loss falls; the export loads back."""
    env = {"ZEROFUSE_TRITON_ON_CPU": "0", "PATH": "/usr/bin:/bin"}
    args = [sys.executable, "-m", "zerofuse.train", "--model", "llama-tiny", "--nproc", "2", "--zero-stage", "3",
            "--layers", "2", "--dim", "64", "--seq-len", "32", "--batch", "8", "--steps", "30", "--lr", "1e-2",
            "--warmup", "3", "--eval-every", "30", "--eval-batches", "2", "--sample-tokens", "8", "--log-every", "10",
            "--out", str(tmp_path)]
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [json.loads(line) for line in (Path(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < losses[0] - 0.5, losses
