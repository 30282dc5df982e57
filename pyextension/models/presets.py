"""The GPT's configuration (GPTConfig, checked on construction) and its named presets: GPT-2 as
released, Llama-style shapes, Mixture of Experts, and the CPU-sized ones of the tests and the job."""
from __future__ import annotations

import dataclasses
import math
import numbers

from zerofuse.models import moe as zmoe
from zerofuse.nn.rotary import check_rope_scaling


@dataclasses.dataclass
class GPTConfig:
    vocab_size: int = 65
    seq_len: int = 128  # the longest context (size of the position table)
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None  # None: n_head (multi-head); fewer: grouped-query attention
    dim: int = 128
    mlp_ratio: float = 4.0
    norm: str = "layernorm"  # or "rmsnorm"
    norm_eps: float | None = None  # None: the norm module's default (LayerNorm 1e-5, RMSNorm finfo eps)
    bias: bool = False
    tie_embeddings: bool = False
    attention: str = "zerofuse"  # or "torch": torch.nn.functional.scaled_dot_product_attention
    pos: str = "learned"  # or "rope": rotary embeddings of q and k (half-split pairs, as Llama)
    rope_base: float = 10000.0
    rope_scaling: dict | None = None  # Llama 3's frequency scaling (zerofuse.nn.rotary.check_rope_scaling)
    mlp: str = "gelu"  # or "swiglu": proj(silu(gate) * up), gate and up one fc of 2 x hidden
    mlp_hidden: int | None = None  # None: mlp_ratio * dim
    # the loss by zerofuse's fused output layer + cross-entropy (chunks of tokens: no (tokens, vocab)
    # logits; forward(idx, targets) then returns (None, loss)); False: the head, then F.cross_entropy
    fused_loss: bool = True
    # Mixture of Experts (zerofuse/models/moe.py): 0 experts = dense
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_every: int = 1
    moe_capacity: float = 0.0  # capacity factor; 0: dropless
    moe_router: str = "softmax"  # or "sigmoid"
    moe_aux_loss: float = 1e-2
    moe_aux_scope: str = "local"  # or "global": the load fractions over the DP group's batch
    moe_z_loss: float = 1e-3
    moe_bias_rate: float = 0.0  # aux-loss-free balancing's bias step; 0: off
    moe_shared_expert: bool = False
    moe_hidden: int | None = None  # None: the dense MLP's hidden size

    def __post_init__(self):
        name = "zerofuse.models.GPTConfig"
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        # types first (dim=128.0 failed in torch.empty at build, moe_every=1.5 made one block of four
        # MoE, bias="no" was True, a negative or NaN norm_eps failed at the first forward unnamed)
        for key in ("vocab_size", "seq_len", "n_layer", "n_head", "n_kv_head", "dim", "mlp_hidden", "moe_experts",
                    "moe_top_k", "moe_every", "moe_hidden"):
            v = getattr(self, key)
            if v is None and key in ("mlp_hidden", "moe_hidden"):
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"{name}: expected {key} to be an int, got {v!r}")
            setattr(self, key, int(v))  # (numpy's ints: plain ones, as torch's sizes want)
        for key in ("bias", "tie_embeddings", "fused_loss", "moe_shared_expert"):
            if not isinstance(getattr(self, key), bool):
                raise TypeError(f"{name}: expected {key} to be True or False, got {getattr(self, key)!r}")
        for key in ("mlp_ratio", "norm_eps"):
            v = getattr(self, key)
            if v is None and key == "norm_eps":
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 <= v < math.inf:
                raise ValueError(f"{name}: expected {key} to be a finite number >= 0"
                                 f"{' or None' if key == 'norm_eps' else ''}, got {v!r}")
            setattr(self, key, float(v))
        for key in ("vocab_size", "seq_len", "n_layer", "n_head", "n_kv_head", "dim"):
            if getattr(self, key) < 1:
                raise ValueError(f"{name}: expected {key} >= 1, got {getattr(self, key)}")
        if self.dim % self.n_head:
            raise ValueError(f"{name}: expected n_head ({self.n_head}) to divide dim ({self.dim})")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"{name}: expected n_kv_head ({self.n_kv_head}) to divide n_head ({self.n_head})")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"{name}: expected norm 'layernorm' or 'rmsnorm', got {self.norm!r}")
        for key, allowed in (("pos", ("learned", "rope")), ("mlp", ("gelu", "swiglu"))):
            if getattr(self, key) not in allowed:
                raise ValueError(f"{name}: expected {key} one of {allowed}, got {getattr(self, key)!r}")
        if self.pos == "rope" and (self.dim // self.n_head) % 2:
            raise ValueError(f"{name}: rope needs an even head_dim, got {self.dim // self.n_head}")
        if self.attention not in ("zerofuse", "torch"):
            raise ValueError(f"{name}: expected attention 'zerofuse' or 'torch', got {self.attention!r}")
        if self.mlp_hidden is not None and self.mlp_hidden < 1:
            raise ValueError(f"{name}: expected mlp_hidden >= 1 or None (mlp_ratio * dim), got {self.mlp_hidden}")
        if self.hidden < 1:
            raise ValueError(f"{name}: expected mlp_ratio * dim >= 1 (the MLP's hidden size), got mlp_ratio "
                             f"{self.mlp_ratio} x dim {self.dim} = {self.hidden}")
        if isinstance(self.rope_base, bool) or not isinstance(self.rope_base, numbers.Real) \
                or not 0 < self.rope_base < math.inf:  # (0 or less: NaN rope tables, which attention absorbs
            raise ValueError(f"{name}: expected a finite rope_base > 0, got {self.rope_base!r}")  # silently; '1e4' a
            # bare TypeError, True taken as 1: a review's reproduction, 2026-12-07)
        check_rope_scaling(self.rope_scaling, name)
        if self.rope_scaling is not None:  # its own copy: the presets' dict was shared by every config made from it
            self.rope_scaling = dict(self.rope_scaling)
            theta = self.rope_scaling.get("rope_theta")  # (a transformers 5 config's dict carries the base)
            if theta is not None and theta != self.rope_base:
                raise ValueError(f"{name}: rope_scaling's rope_theta {theta} differs from rope_base {self.rope_base}")
        if self.rope_scaling is not None and self.pos != "rope":
            raise ValueError(f"{name}: rope_scaling is for pos='rope', got pos={self.pos!r}")
        zmoe.check_config(self)

    @property
    def hidden(self) -> int:
        return self.mlp_hidden if self.mlp_hidden is not None else int(self.mlp_ratio * self.dim)


PRESETS = {
    # ~0.8M params: the CPU default of the training job and the tests (char-level vocab 65)
    "tiny": dict(n_layer=4, n_head=4, dim=128, seq_len=128),
    "small": dict(n_layer=6, n_head=6, dim=384, seq_len=256),
}
# GPT-2 (Radford et al. 2019) as released: learned positions, LayerNorm and Linear with biases, GELU
# (tanh), the output layer tied to the token embedding; the vocabulary 50257 padded to 50304
_GPT2 = dict(seq_len=1024, vocab_size=50304, bias=True, tie_embeddings=True, norm="layernorm")
PRESETS.update({
    "gpt2-124m": dict(n_layer=12, n_head=12, dim=768, **_GPT2),
    "gpt2-350m": dict(n_layer=24, n_head=16, dim=1024, **_GPT2),
    "gpt2-774m": dict(n_layer=36, n_head=20, dim=1280, **_GPT2),
})


# Llama-style (Touvron et al. 2023; Llama 3): RMSNorm, rotary positions, SwiGLU, no biases,
# grouped-query attention. llama-tiny runs on a CPU (char vocabulary); the llama3-* shapes are Llama
# 3.2 1B and Llama 3 8B's (vocab 128256, rope base 500000; the context here 2048 / 8192 positions),
# with their rotary frequencies: Llama 3.2's scaled (factor 32, as its config.json), Llama 3's not.
_LLAMA = dict(norm="rmsnorm", norm_eps=1e-5, pos="rope", mlp="swiglu", bias=False)
PRESETS.update({
    "llama-tiny": dict(n_layer=4, n_head=4, n_kv_head=2, dim=128, mlp_hidden=352, seq_len=128, **_LLAMA),
    "llama3-1b": dict(n_layer=16, n_head=32, n_kv_head=8, dim=2048, mlp_hidden=8192, seq_len=2048, vocab_size=128256,
                      rope_base=500000.0, tie_embeddings=True, **_LLAMA,
                      rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama3-8b": dict(n_layer=32, n_head=32, n_kv_head=8, dim=4096, mlp_hidden=14336, seq_len=8192,
                      vocab_size=128256, rope_base=500000.0, **_LLAMA),
})
# Mixture of Experts: moe-tiny (CPU) is llama-tiny with 8 SwiGLU experts, top-2, in every other
# block; moe-1b-8x (GPU) llama3-1b's shape with 8 experts of a quarter the dense hidden size in
# every block (a Mixtral-like layout at ~2.0B total / ~0.83B active parameters: num_params
# 2,041,382,912 / 833,423,360)
_MOE = dict(moe_experts=8, moe_top_k=2, moe_aux_loss=1e-2, moe_z_loss=1e-3)
PRESETS.update({
    "moe-tiny": dict(PRESETS["llama-tiny"], moe_every=2, mlp_hidden=256, **_MOE),
    "moe-1b-8x": dict(PRESETS["llama3-1b"], moe_every=1, moe_hidden=2048, **_MOE),
})


def config(name: str, **overrides) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"zerofuse.models.config: unknown model {name!r}; expected one of {sorted(PRESETS)}")
    return GPTConfig(**{**PRESETS[name], **overrides})
