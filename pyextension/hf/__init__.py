"""Per-instance patching and sharding of Hugging Face ``transformers`` causal LMs:
``zerofuse.patch(model, ...)`` (zerofuse's kernels in that model) and ``zerofuse.shard(model, dp=...,
tp=..., zero_stage=...)`` (its TP plan and ZeRO). transformers is imported only when they run."""
from zerofuse.hf.archs import ARCHS
from zerofuse.hf.attention import attention_calls, register as register_attention
from zerofuse.hf.patch import patch, patched
from zerofuse.hf.shard import shard

__all__ = ["patch", "patched", "shard", "attention_calls", "register_attention", "ARCHS"]
