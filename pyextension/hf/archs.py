"""The Hugging Face architectures zerofuse.patch / zerofuse.shard know, and how their modules are found.

Modules are recognised by what they compute, not by class name, so a renamed class in a later
transformers release is still patched or is left alone, never patched wrongly:
- an RMSNorm is a module with a 1-D ``weight`` and an eps attribute whose output on a probe input
  equals ``weight * rmsnorm(x)`` (Llama, Mistral, Qwen) or ``(1 + weight) * rmsnorm(x)`` (Gemma);
- a gated MLP has ``gate_proj``/``up_proj``/``down_proj`` Linears and an ``act_fn`` that equals silu
  (SwiGLU) or tanh-GELU (GeGLU) on a probe;
- an attention module's forward refers to ``apply_rotary_pos_emb`` (RoPE) and/or
  ``ALL_ATTENTION_FUNCTIONS`` (the attention interface) by name.
"""
from __future__ import annotations

import copy
import dataclasses
import math

import torch
import torch.nn.functional as F

OPS = ("rms_norm", "attention", "rope", "swiglu", "linear_cross_entropy")
_LLAMA_TP = {"q_proj": "column", "k_proj": "column", "v_proj": "column", "o_proj": "row",
             "gate_proj": "column", "up_proj": "column", "down_proj": "row"}


@dataclasses.dataclass(frozen=True)
class Arch:
    ops: tuple[str, ...]  # what patch() can apply on this architecture
    decoder: str  # attribute of the *ForCausalLM model holding the decoder ("model", "transformer")
    embed: str  # the input embedding inside the decoder
    tp: dict | None = None  # Linear name -> "column" | "row" (None: no TP plan)
    final_softcap: str | None = None  # config attribute of a final-logit softcap (Gemma 2)


ARCHS = {
    "llama": Arch(OPS, "model", "embed_tokens", _LLAMA_TP),
    "mistral": Arch(OPS, "model", "embed_tokens", _LLAMA_TP),
    "qwen2": Arch(OPS, "model", "embed_tokens", _LLAMA_TP),
    "qwen3": Arch(OPS, "model", "embed_tokens", _LLAMA_TP),
    "gemma": Arch(OPS, "model", "embed_tokens", _LLAMA_TP),
    "gemma2": Arch(OPS, "model", "embed_tokens", _LLAMA_TP, "final_logit_softcapping"),
    # GPT-2: LayerNorm (patched as rms_norm's sibling, zerofuse's LayerNorm), no RoPE, a plain GELU
    # MLP (nothing for swiglu), Conv1D projections (no TP plan)
    "gpt2": Arch(("rms_norm", "attention", "linear_cross_entropy"), "transformer", "wte"),
}


def arch_of(model, who: str) -> tuple[str, Arch]:
    config = getattr(model, "config", None)
    name = getattr(config, "model_type", None)
    if name not in ARCHS:
        known = "; ".join(f"{k}: {', '.join(a.ops)}" for k, a in ARCHS.items())
        raise ValueError(f"{who}: expected a Hugging Face causal LM of a known architecture, got "
                         f"{type(model).__name__} (model_type {name!r}). What zerofuse can patch, by model_type: {known}")
    return name, ARCHS[name]


def decoder_of(model, arch: Arch, who: str):
    dec = getattr(model, arch.decoder, None)
    if dec is None or not hasattr(model, "lm_head"):
        raise ValueError(f"{who}: expected a *ForCausalLM model with .{arch.decoder} and .lm_head (the causal-LM "
                         f"class of its architecture), got {type(model).__name__}")
    return dec


def _probe(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, n, generator=g, dtype=torch.float64) * 3


def norm_kind(mod) -> str | None:
    """'rms' (weight * x / rms), 'rms_offset' ((1 + weight) * x / rms) or 'layer' (torch LayerNorm
    with an affine weight) for the norms zerofuse runs; None for anything else."""
    if type(mod) is torch.nn.LayerNorm:
        return "layer" if mod.elementwise_affine else None
    w = getattr(mod, "weight", None)
    eps = norm_eps(mod)
    if not isinstance(w, torch.nn.Parameter) or w.dim() != 1 or eps is None:
        return None
    if w.device.type == "meta":  # (a model built on meta: probed on a CPU copy; it was left unpatched, silently)
        try:
            return norm_kind(copy.deepcopy(mod).to_empty(device="cpu"))
        except Exception:  # noqa: BLE001 - as below: a module that cannot be probed is not a norm we know
            return None
    n = w.shape[0]
    x = _probe(n)
    w64 = torch.linspace(-0.5, 0.5, n, dtype=torch.float64)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    try:  # the weight set to a known ramp for the probe (ones or zeros would not tell the kinds apart)
        with torch.no_grad():
            saved = w.detach().clone()
            w.copy_(w64.to(w.dtype))
            try:  # on the weight's device (a model already on a GPU is probed there)
                y = mod(x.to(w.device, w.dtype)).double().cpu()
            finally:
                w.copy_(saved)
    except Exception:  # noqa: BLE001 - a module that cannot run the probe is not a norm we know
        return None
    wq, tol = w64.to(w.dtype).double(), 8 * torch.finfo(w.dtype).eps
    for kind, ref in (("rms", normed * wq), ("rms_offset", normed * (1 + wq))):
        if y.shape == ref.shape and torch.allclose(y, ref, rtol=tol, atol=tol):
            return kind
    return None


def norm_eps(mod) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(mod, name, None)
        if isinstance(v, float) and math.isfinite(v) and v >= 0:
            return v
    return None


def glu_activation(mlp) -> str | None:
    """'silu' or 'gelu_tanh' for a gated MLP (gate_proj, up_proj, down_proj, act_fn) whose act_fn
    is one of them; None otherwise."""
    if not all(isinstance(getattr(mlp, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
        return None
    act = getattr(mlp, "act_fn", None)
    if not callable(act):
        return None
    x = torch.linspace(-8, 8, 161, dtype=torch.float64)
    try:
        y = act(x).double()
    except Exception:  # noqa: BLE001
        return None
    for name, ref in (("silu", F.silu(x)), ("gelu_tanh", F.gelu(x, approximate="tanh"))):
        if torch.allclose(y, ref, rtol=1e-6, atol=1e-6):
            return name
    return None
