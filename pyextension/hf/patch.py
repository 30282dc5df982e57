"""``zerofuse.patch(model, ...)``: zerofuse's kernels inside one loaded Hugging Face causal LM.

Per instance: forwards are bound on the model's own modules (and lm_head swapped for a zerofuse
head sharing its weight); the classes, the modeling modules and every other instance stay stock,
parameters and state_dict keys are unchanged, and patching twice changes nothing more.
"""
from __future__ import annotations

from zerofuse.hf import archs
from zerofuse.hf.attention import register
from zerofuse.hf.bound import Bound, forward_slot
from zerofuse.hf.causal_lm import check_fusable_head, patch_lm
from zerofuse.hf.rebind import patch_attention
from zerofuse.nn import functional as zF

WHO = "zerofuse.patch"


def _rms_forward(self, x):
    if x.dtype != self.weight.dtype:  # fp32 norms in a bf16 model (PEFT's k-bit preparation,
        # _keep_in_fp32_modules): HF's weight * x.to(input_dtype) promotes to the weight's dtype, the
        # kernel returned x's (bf16, one more rounding; a review's reproduction, 2026-12-06): stock
        return type(self).forward(self, x)
    return zF.rms_norm(x, self.weight.shape, self.weight, self._zerofuse_eps)


def _rms_offset_forward(self, x):  # Gemma: (1 + weight) * x / rms(x), the weight term in fp32
    return zF.rms_norm(x, self.weight.shape, 1.0 + self.weight.float(), self._zerofuse_eps)


def _layer_forward(self, x):
    return zF.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


_NORMS = {"rms": _rms_forward, "rms_offset": _rms_offset_forward, "layer": _layer_forward}


def _glu_forward(self, x):
    glu = zF.swiglu if self._zerofuse_glu == "silu" else zF.geglu
    return self.down_proj(glu(self.gate_proj(x), self.up_proj(x)))


def _patched(mod) -> bool:
    slot = forward_slot(mod)
    own = vars(mod).get(slot)
    # (another instance forward than accelerate's: left alone, as its owner made it)
    return isinstance(own, Bound) if slot == "_old_forward" else own is not None


def _attach_norm(mod, kind) -> None:
    mod._zerofuse_norm, mod._zerofuse_eps = kind, archs.norm_eps(mod)
    setattr(mod, forward_slot(mod), Bound(mod, _NORMS[kind]))


def _attach_glu(mod, act) -> None:
    mod._zerofuse_glu = act
    setattr(mod, forward_slot(mod), Bound(mod, _glu_forward))


def _patch_modules(model, detect, attach) -> int:
    """attach(mod, detect(mod)) on every not yet patched module that detect recognises; the count."""
    n = 0
    for mod in model.modules():
        found = None if _patched(mod) else detect(mod)
        if found is not None:
            attach(mod, found)
            n += 1
    return n


def _flag(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{WHO}: expected {name} to be True or False, got {value!r}")
    return value


def patch(model, rms_norm: bool = True, attention: bool = True, rope: bool = True, swiglu: bool = True,
          linear_cross_entropy: bool = True):
    """Run zerofuse's kernels in this ``transformers`` causal LM (Llama, Mistral, Qwen2, Qwen3,
    Gemma, Gemma 2, GPT-2), in place; returns the model. Each flag turns one replacement on where
    the architecture has it (``zerofuse.hf.patched(model)`` counts what was applied):
    rms_norm: its RMSNorm (GPT-2: LayerNorm) modules; attention: zerofuse's fused causal attention
    through the attention interface (unpadded causal batches; the rest runs the model's own);
    rope: the rotary embedding; swiglu: the gated MLP's act(gate) * up (SwiGLU, Gemma's GeGLU);
    linear_cross_entropy: the output layer + loss fused and chunked when labels are given.
    An unknown architecture is refused with the list of what can be patched; a refusal changes nothing.
    The patched model pickles whole (``torch.save(model)``, ``copy.deepcopy``) with its patches
    (zerofuse.hf.bound); ``save_pretrained`` saves the stock layout (patch again after loading)."""
    flags = {k: _flag(k, v) for k, v in (("rms_norm", rms_norm), ("attention", attention), ("rope", rope),
                                         ("swiglu", swiglu), ("linear_cross_entropy", linear_cross_entropy))}
    outer, model = model, getattr(model, "_orig_mod", model)  # torch.compile's wrapper: patch what it wraps
    _, arch = archs.arch_of(model, WHO)
    archs.decoder_of(model, arch, WHO)
    if getattr(model, "_zerofuse_zero", None) is not None:
        raise ValueError(f"{WHO}: this model is sharded already (its ZeRO shards cannot be probed or swapped): "
                         "call zerofuse.patch before zerofuse.shard / zerofuse.zero.parallelize")
    counts = dict(getattr(model, "_zerofuse_patched", None) or dict.fromkeys(archs.OPS, 0))
    on = {k for k, v in flags.items() if v and k in arch.ops}
    if "linear_cross_entropy" in on:
        check_fusable_head(model)  # before anything is swapped: a refusal leaves the model as it was
    if "rms_norm" in on:
        counts["rms_norm"] += _patch_modules(model, archs.norm_kind, _attach_norm)
    if "swiglu" in on:
        counts["swiglu"] += _patch_modules(model, archs.glu_activation, _attach_glu)
    if on & {"rope", "attention"}:
        register()
        for mod in model.modules():
            for what in patch_attention(mod, "rope" in on, "attention" in on):
                counts[what] += 1
    if "linear_cross_entropy" in on and patch_lm(model, arch):
        counts["linear_cross_entropy"] += 1
    model._zerofuse_patched = counts
    return outer


def patched(model) -> dict:
    """{op: number of modules patched} for a model given to zerofuse.patch ({} otherwise)."""
    model = getattr(model, "_orig_mod", model)
    return dict(getattr(model, "_zerofuse_patched", None) or {})
