"""Tiny random-initialised Hugging Face causal LMs built from configs (never downloaded), for the
zerofuse.patch / zerofuse.shard tests and benchmarks. Odd sizes: vocab 131, 3 layers, GQA."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 131
ARCH_NAMES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gpt2")


def config(arch: str, **over):
    common = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, head_dim=24)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False)
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=64)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**{k: v for k, v in common.items() if k != "head_dim"}, tie_word_embeddings=True)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, tie_word_embeddings=False)
    elif arch == "gemma":
        cfg = transformers.GemmaConfig(**common, hidden_act="gelu_pytorch_tanh")
    elif arch == "gemma2":
        cfg = transformers.Gemma2Config(**common, hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=3.0,
                                        attn_logit_softcapping=20.0, sliding_window=8, query_pre_attn_scalar=24)
        cfg._attn_implementation = "eager"  # sdpa refuses a softcap
    elif arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=96, n_layer=3, n_head=4, n_positions=128,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    else:
        raise ValueError(arch)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def build(arch: str, dtype=torch.float32, seed: int = 0, **over):
    """The stock model of ``arch`` (causal LM), in train mode."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config(arch, **over))
    return model.to(dtype).train()


def batch(n: int = 2, t: int = 19, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, t), generator=g)
