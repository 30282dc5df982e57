"""zerofuse.models.GPT as transformers' causal LMs and back, by config and parameter names.

- ``hf_config(cfg)``: the ``config.json`` of the transformers model that computes what GPT(cfg) does:
  GPT-2's shape (LayerNorm, learned positions, GELU(tanh) MLP, one head for every KV head) as
  ``GPT2LMHeadModel``; Llama's (RMSNorm, rotary positions, SwiGLU, any GQA, Llama 3 scaling) as
  ``LlamaForCausalLM``. Anything else (MoE, LayerNorm with rotary, ...) is refused with what
  does not map: ``representable(cfg)`` says it without raising.
- ``to_hf(cfg, state)``: a GPT state_dict under the transformers model's names (q/k/v and gate/up
  split from the fused projections, GPT-2's Conv1D weights transposed; GPT-2's biases written as
  zeros for a bias-free GPT, which computes the same). The token embedding comes before the output
  layer: a tied export writes it, and transformers ties the head to it.
- ``from_hf(model)``: a GPT with a transformers ``GPT2LMHeadModel`` / ``LlamaForCausalLM``'s
  weights (and ``GPTConfig`` from its config); what GPT cannot compute is refused by name.

zerofuse-train --export writes with these when the model maps (tests/test_hf_names.py: logits of
the exported files loaded by transformers against the GPT's, both architectures, tied and not).
"""
from __future__ import annotations

import torch

from zerofuse.models.presets import GPTConfig

NAME = "zerofuse.models.hf_names"
GPT2_EOT = 50256  # GPT-2's <|endoftext|>, its bos and eos

# per block (ours, GPT-2's): the LayerNorms, and the Linears that are Conv1D there ((in, out) weights)
_GPT2_NORMS = (("norm1", "ln_1"), ("norm2", "ln_2"))
_GPT2_CONV1D = (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                ("mlp.proj", "mlp.c_proj"))
# per block (ours, Llama's), as they are; qkv (q, k, v) and fc ([gate | up]) are split / joined
_LLAMA_NORMS = (("norm1", "input_layernorm"), ("norm2", "post_attention_layernorm"))
_LLAMA_LINEARS = (("attn.proj", "self_attn.o_proj"), ("mlp.proj", "mlp.down_proj"))


def _kind(cfg: GPTConfig) -> tuple[str | None, list[str]]:
    """("gpt2" | "llama" | None, what keeps cfg from the other architectures)."""
    gpt2 = [f"{k}={getattr(cfg, k)!r} (GPT-2: {v!r})" for k, v in
            (("norm", "layernorm"), ("pos", "learned"), ("mlp", "gelu")) if getattr(cfg, k) != v]
    if cfg.n_kv_head != cfg.n_head:
        gpt2.append(f"n_kv_head={cfg.n_kv_head} (GPT-2: n_head {cfg.n_head})")
    llama = [f"{k}={getattr(cfg, k)!r} (Llama: {v!r})" for k, v in
             (("norm", "rmsnorm"), ("pos", "rope"), ("mlp", "swiglu")) if getattr(cfg, k) != v]
    both = [f"moe_experts={cfg.moe_experts} (neither has experts)"] if cfg.moe_experts else []
    if not gpt2 and not both:
        return "gpt2", []
    if not llama and not both:
        return "llama", []
    return None, both + (gpt2 if len(gpt2) <= len(llama) else llama)


def representable(cfg: GPTConfig) -> str | None:
    """None when GPT(cfg) maps to a transformers model, else why not."""
    kind, why = _kind(cfg)
    return None if kind else ", ".join(why)


_UNSET = object()


def hf_config(cfg: GPTConfig, eos_token_id=_UNSET) -> dict:
    """The transformers config (as config.json holds it) of the model GPT(cfg) is. eos_token_id (also
    the bos): the tokenizer's, None for none; unset, GPT-2's config names <|endoftext|> (50256) where
    the vocabulary holds it and none in a smaller one, Llama's leaves transformers' defaults (1, 2)
    where they exist (transformers' 50256 named an id a character vocabulary has not: from_pretrained
    warned, generate stopped on no token; a review's reproduction, 2026-12-07)."""
    kind, why = _kind(cfg)
    if kind is None:
        raise ValueError(f"{NAME}: no transformers model computes this GPT: {', '.join(why)}")
    if eos_token_id is _UNSET and kind == "gpt2":
        end = GPT2_EOT if cfg.vocab_size > GPT2_EOT else None
    elif eos_token_id is _UNSET:  # Llama's 1 and 2 where the vocabulary holds them
        end = _UNSET if cfg.vocab_size > 2 else None
    elif eos_token_id is None or (isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool)
                                  and 0 <= eos_token_id < cfg.vocab_size):
        end = eos_token_id
    else:
        raise ValueError(f"{NAME}: expected eos_token_id an id below the vocabulary size {cfg.vocab_size} or None, "
                         f"got {eos_token_id!r}")
    ids = {} if end is _UNSET else {"bos_token_id": end, "eos_token_id": end}
    if kind == "gpt2":
        return ids | {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": cfg.vocab_size,
                       "n_positions": cfg.seq_len, "n_embd": cfg.dim, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
                       "n_inner": cfg.hidden, "activation_function": "gelu_new",
                       "layer_norm_epsilon": 1e-5 if cfg.norm_eps is None else cfg.norm_eps,
                       "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                       "tie_word_embeddings": cfg.tie_embeddings}
    eps = cfg.norm_eps if cfg.norm_eps is not None else torch.finfo(torch.float32).eps  # (RMSNorm's default)
    out = ids | {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size,
                 "hidden_size": cfg.dim, "intermediate_size": cfg.hidden, "num_hidden_layers": cfg.n_layer,
                 "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
                 "head_dim": cfg.dim // cfg.n_head, "max_position_embeddings": cfg.seq_len, "rms_norm_eps": eps,
                 "hidden_act": "silu", "rope_theta": cfg.rope_base, "attention_bias": cfg.bias, "mlp_bias": cfg.bias,
                 "tie_word_embeddings": cfg.tie_embeddings}
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = {k: v for k, v in cfg.rope_scaling.items() if k != "type"} | {"rope_type": "llama3"}
    return out


def to_hf(cfg: GPTConfig, state: dict) -> dict:
    """``state`` (GPT(cfg).state_dict()'s names) under the names of hf_config(cfg)'s model."""
    kind = hf_config(cfg)["model_type"]
    hd = cfg.dim // cfg.n_head
    hq, hkv = cfg.n_head * hd, cfg.n_kv_head * hd
    out = {}
    if kind == "gpt2":
        def bias(key, n):  # (a bias-free GPT: GPT-2's biases at zero compute the same)
            return state[key] if key in state else torch.zeros(n, dtype=state["wte.weight"].dtype)

        out["transformer.wte.weight"] = state["wte.weight"]
        out["transformer.wpe.weight"] = state["wpe.weight"]
        for i in range(cfg.n_layer):
            p, q = f"blocks.{i}.", f"transformer.h.{i}."
            for ours, theirs in _GPT2_NORMS:
                out[q + theirs + ".weight"] = state[p + ours + ".weight"]
                out[q + theirs + ".bias"] = bias(p + ours + ".bias", cfg.dim)
            for ours, theirs in _GPT2_CONV1D:
                w = state[p + ours + ".weight"]
                out[q + theirs + ".weight"] = w.t().contiguous()  # (Conv1D: (in, out))
                out[q + theirs + ".bias"] = bias(p + ours + ".bias", w.shape[0])
        out["transformer.ln_f.weight"] = state["norm.weight"]
        out["transformer.ln_f.bias"] = bias("norm.bias", cfg.dim)
        out["lm_head.weight"] = state["head.weight"]
        return out
    out["model.embed_tokens.weight"] = state["wte.weight"]
    for i in range(cfg.n_layer):
        p, q = f"blocks.{i}.", f"model.layers.{i}."
        for ours, theirs in _LLAMA_NORMS:
            out[q + theirs + ".weight"] = state[p + ours + ".weight"]
        for suffix in (".weight", ".bias") if cfg.bias else (".weight",):
            qkv = state[p + "attn.qkv" + suffix]
            for name, part in zip(("q_proj", "k_proj", "v_proj"), (qkv[:hq], qkv[hq:hq + hkv], qkv[hq + hkv:])):
                out[q + "self_attn." + name + suffix] = part
            fc = state[p + "mlp.fc" + suffix]  # [gate | up]
            out[q + "mlp.gate_proj" + suffix], out[q + "mlp.up_proj" + suffix] = fc[:cfg.hidden], fc[cfg.hidden:]
            for ours, theirs in _LLAMA_LINEARS:
                out[q + theirs + suffix] = state[p + ours + suffix]
    out["model.norm.weight"] = state["norm.weight"]
    out["lm_head.weight"] = state["head.weight"]
    return out


def _get(c, *names, default=None):
    for n in names:
        v = getattr(c, n, None)
        if v is not None:
            return v
    return default


def config_from_hf(hf_cfg) -> GPTConfig:
    """The GPTConfig of a transformers GPT2Config / LlamaConfig (what GPT cannot compute refused)."""
    kind = getattr(hf_cfg, "model_type", None)
    who = f"{NAME}.from_hf"
    if kind == "gpt2":
        if _get(hf_cfg, "activation_function") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"{who}: expected GPT-2's activation_function 'gelu_new' (GELU, tanh), got "
                             f"{hf_cfg.activation_function!r}")
        if getattr(hf_cfg, "scale_attn_by_inverse_layer_idx", False) or not getattr(hf_cfg, "scale_attn_weights", True):
            raise ValueError(f"{who}: expected GPT-2's attention scaled by 1/sqrt(head_dim) (scale_attn_weights=True, "
                             "scale_attn_by_inverse_layer_idx=False)")
        dim = hf_cfg.n_embd
        return GPTConfig(vocab_size=hf_cfg.vocab_size, seq_len=hf_cfg.n_positions, n_layer=hf_cfg.n_layer,
                         n_head=hf_cfg.n_head, dim=dim, mlp_hidden=hf_cfg.n_inner or 4 * dim, norm="layernorm",
                         norm_eps=float(hf_cfg.layer_norm_epsilon), bias=True,
                         tie_embeddings=bool(getattr(hf_cfg, "tie_word_embeddings", True)), pos="learned", mlp="gelu")
    if kind != "llama":
        raise ValueError(f"{who}: expected a GPT-2 or Llama model (model_type 'gpt2' or 'llama'), got model_type "
                         f"{kind!r}")
    dim, heads = hf_cfg.hidden_size, hf_cfg.num_attention_heads
    if _get(hf_cfg, "hidden_act") != "silu":
        raise ValueError(f"{who}: expected Llama's hidden_act 'silu', got {hf_cfg.hidden_act!r}")
    if _get(hf_cfg, "head_dim", default=dim // heads) != dim // heads:
        raise ValueError(f"{who}: expected head_dim = hidden_size / num_attention_heads ({dim // heads}), got "
                         f"{hf_cfg.head_dim}")
    attn_bias, mlp_bias = bool(getattr(hf_cfg, "attention_bias", False)), bool(getattr(hf_cfg, "mlp_bias", False))
    if attn_bias != mlp_bias:
        raise ValueError(f"{who}: GPT's bias is one switch: expected attention_bias == mlp_bias, got "
                         f"{attn_bias} and {mlp_bias}")
    rope = dict(getattr(hf_cfg, "rope_parameters", None) or {})  # (transformers 5: theta and scaling in one dict)
    theta = _get(hf_cfg, "rope_theta", default=rope.get("rope_theta", 10000.0))
    scaling = getattr(hf_cfg, "rope_scaling", None) or rope
    kind_of_rope = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind_of_rope not in ("default", "llama3"):
        raise ValueError(f"{who}: expected rope default or 'llama3' scaling, got rope_type {kind_of_rope!r}")
    scaling = ({k: scaling[k] for k in ("rope_type", "factor", "low_freq_factor", "high_freq_factor",
                                        "original_max_position_embeddings")} if kind_of_rope == "llama3" else None)
    return GPTConfig(vocab_size=hf_cfg.vocab_size, seq_len=hf_cfg.max_position_embeddings,
                     n_layer=hf_cfg.num_hidden_layers, n_head=heads,
                     n_kv_head=_get(hf_cfg, "num_key_value_heads", default=heads), dim=dim,
                     mlp_hidden=hf_cfg.intermediate_size, norm="rmsnorm", norm_eps=float(hf_cfg.rms_norm_eps),
                     pos="rope", rope_base=float(theta), rope_scaling=scaling, mlp="swiglu", bias=attn_bias,
                     tie_embeddings=bool(getattr(hf_cfg, "tie_word_embeddings", False)))


def from_hf(model: torch.nn.Module, **gpt_kwargs):
    """A zerofuse GPT with the weights of a transformers GPT2LMHeadModel / LlamaForCausalLM (a copy,
    in the model's dtype). gpt_kwargs: GPTConfig fields of zerofuse's own (attention, fused_loss)."""
    from zerofuse.models.gpt import GPT  # noqa: PLC0415 - gpt imports presets; this module is imported by gpt users

    other = sorted(set(gpt_kwargs) - {"attention", "fused_loss"})
    if other:  # (any field was taken: tie_embeddings=True dropped the model's own lm_head silently, 2026-12-07)
        raise ValueError(f"{NAME}.from_hf: expected gpt_kwargs among zerofuse's own fields 'attention' and "
                         f"'fused_loss' (the rest is the model's config), got {other}")
    cfg = config_from_hf(model.config)
    if gpt_kwargs:
        cfg = GPTConfig(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, **gpt_kwargs})
    theirs = model.state_dict()
    with torch.device("meta"):
        gpt = GPT(cfg)
    want = to_hf(cfg, {k: torch.empty(v.shape, device="meta") for k, v in gpt.state_dict().items()})
    extra = sorted(k for k in theirs if k not in want and not k.endswith((".attn.bias", ".attn.masked_bias",
                                                                           "rotary_emb.inv_freq")))
    missing = sorted(k for k in want if k not in theirs and not (k == "lm_head.weight" and cfg.tie_embeddings))
    if extra or missing:
        raise ValueError(f"{NAME}.from_hf: the model's weights are not those of {cfg.__class__.__name__}'s "
                         f"architecture: unexpected {extra[:5]}, missing {missing[:5]}")
    ours = _from_hf_state(cfg, theirs)
    dtype = next(iter(theirs.values())).dtype
    gpt = GPT(cfg).to(dtype)
    gpt.load_state_dict(ours, strict=True)
    return gpt


def _from_hf_state(cfg: GPTConfig, theirs: dict) -> dict:
    """to_hf's inverse: transformers' names and layouts -> GPT(cfg).state_dict()'s."""
    kind = hf_config(cfg)["model_type"]
    out = {}
    if kind == "gpt2":
        out["wte.weight"], out["wpe.weight"] = theirs["transformer.wte.weight"], theirs["transformer.wpe.weight"]
        for i in range(cfg.n_layer):
            p, q = f"blocks.{i}.", f"transformer.h.{i}."
            for ours, t in _GPT2_NORMS:
                out[p + ours + ".weight"], out[p + ours + ".bias"] = theirs[q + t + ".weight"], theirs[q + t + ".bias"]
            for ours, t in _GPT2_CONV1D:
                out[p + ours + ".weight"] = theirs[q + t + ".weight"].t().contiguous()
                out[p + ours + ".bias"] = theirs[q + t + ".bias"]
        out["norm.weight"], out["norm.bias"] = theirs["transformer.ln_f.weight"], theirs["transformer.ln_f.bias"]
    else:
        out["wte.weight"] = theirs["model.embed_tokens.weight"]
        for i in range(cfg.n_layer):
            p, q = f"blocks.{i}.", f"model.layers.{i}."
            for ours, t in _LLAMA_NORMS:
                out[p + ours + ".weight"] = theirs[q + t + ".weight"]
            for suffix in (".weight", ".bias") if cfg.bias else (".weight",):
                out[p + "attn.qkv" + suffix] = torch.cat([theirs[q + f"self_attn.{n}_proj" + suffix] for n in "qkv"])
                out[p + "mlp.fc" + suffix] = torch.cat([theirs[q + "mlp.gate_proj" + suffix],
                                                        theirs[q + "mlp.up_proj" + suffix]])
                for ours, t in _LLAMA_LINEARS:
                    out[p + ours + suffix] = theirs[q + t + suffix]
        out["norm.weight"] = theirs["model.norm.weight"]
    out["head.weight"] = theirs.get("lm_head.weight", out["wte.weight"]) if not cfg.tie_embeddings else out["wte.weight"]
    return out
