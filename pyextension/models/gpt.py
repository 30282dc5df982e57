"""A GPT (decoder-only transformer) built from zerofuse's ops: fused attention (zerofuse.nn.Attention,
grouped-query heads), fused LayerNorm/RMSNorm, and trained with zerofuse's fused optimizers.

Pre-norm blocks (x + attn(norm(x)), x + mlp(norm(x))), learned position embeddings, GELU MLP, an
optional tied output head. Initialisation is GPT-2's (normal(0, 0.02); the residual projections
scaled by 1/sqrt(2 * n_layer)) drawn from a generator seeded by ``seed``: the same seed gives the
same weights on every rank and machine, whatever the global RNG state.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as TF
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from zerofuse import nn as znn


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
    bias: bool = False
    tie_embeddings: bool = False
    attention: str = "zerofuse"  # or "torch": torch.nn.functional.scaled_dot_product_attention

    def __post_init__(self):
        name = "zerofuse.models.GPTConfig"
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        for key in ("vocab_size", "seq_len", "n_layer", "n_head", "n_kv_head", "dim"):
            if getattr(self, key) < 1:
                raise ValueError(f"{name}: expected {key} >= 1, got {getattr(self, key)}")
        if self.dim % self.n_head:
            raise ValueError(f"{name}: expected n_head ({self.n_head}) to divide dim ({self.dim})")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"{name}: expected n_kv_head ({self.n_kv_head}) to divide n_head ({self.n_head})")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"{name}: expected norm 'layernorm' or 'rmsnorm', got {self.norm!r}")
        if self.attention not in ("zerofuse", "torch"):
            raise ValueError(f"{name}: expected attention 'zerofuse' or 'torch', got {self.attention!r}")

    @property
    def hidden(self) -> int:
        return int(self.mlp_ratio * self.dim)


PRESETS = {
    # ~0.8M params: the CPU default of the training job and the tests (char-level vocab 65)
    "tiny": dict(n_layer=4, n_head=4, dim=128, seq_len=128),
    "small": dict(n_layer=6, n_head=6, dim=384, seq_len=256),
    "gpt2-124m": dict(n_layer=12, n_head=12, dim=768, seq_len=1024, vocab_size=50304),
    "gpt2-350m": dict(n_layer=24, n_head=16, dim=1024, seq_len=1024, vocab_size=50304),
}


def config(name: str, **overrides) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"zerofuse.models.config: unknown model {name!r}; expected one of {sorted(PRESETS)}")
    return GPTConfig(**{**PRESETS[name], **overrides})


def _norm(cfg: GPTConfig) -> torch.nn.Module:
    if cfg.norm == "rmsnorm":
        return znn.RMSNorm(cfg.dim)
    return znn.LayerNorm(cfg.dim, bias=cfg.bias)


class MLP(torch.nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = torch.nn.Linear(cfg.dim, cfg.hidden, bias=cfg.bias)
        self.proj = torch.nn.Linear(cfg.hidden, cfg.dim, bias=cfg.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(TF.gelu(self.fc(x), approximate="tanh"))


class Block(torch.nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        sdpa = TF.scaled_dot_product_attention if cfg.attention == "torch" else None
        self.norm1 = _norm(cfg)
        self.attn = znn.Attention(cfg.dim, cfg.n_head, cfg.n_kv_head, bias=cfg.bias, causal=True, sdpa=sdpa)
        self.norm2 = _norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(torch.nn.Module):
    """forward(idx (B, N) int64, targets (B, N) or None) -> (logits (B, N, vocab), loss or None);
    the loss is the mean cross-entropy in fp32 whatever the model's dtype."""

    def __init__(self, cfg: GPTConfig, *, seed: int = 0, device=None):
        super().__init__()
        self.config = cfg
        self.wte = torch.nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = torch.nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = torch.nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = _norm(cfg)
        self.head = torch.nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.wte.weight
        # recompute each block's forward in backward instead of keeping its activations
        self.activation_checkpointing = False
        self.reset_parameters(seed)
        if device is not None:
            self.to(device)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():  # shared params appear once
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "norm.weight":
                value = torch.ones(p.shape)
            elif name.endswith(".bias"):
                value = torch.zeros(p.shape)
            else:
                std = resid_std if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight") else 0.02
                value = torch.randn(p.shape, generator=gen) * std
            p.copy_(value)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        b, n = idx.shape
        if n > self.config.seq_len:
            raise ValueError(f"zerofuse.models.GPT: sequence length {n} exceeds the model's seq_len "
                             f"{self.config.seq_len}")
        pos = torch.arange(n, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.norm(x))
        loss = None
        if targets is not None:
            loss = TF.cross_entropy(logits.float().reshape(b * n, -1), targets.reshape(b * n))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> Tensor:
        """Sample max_new_tokens tokens after idx (B, N); returns (B, N + max_new_tokens)."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.seq_len:])
            logits = logits[:, -1, :].float() / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
