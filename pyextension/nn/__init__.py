"""Drop-in modules and functions: same signatures and state_dict keys as the torch ones they replace."""
from zerofuse.nn import functional
from zerofuse.nn.attention import Attention
from zerofuse.nn.mlp import GatedMLP, LinearGELU
from zerofuse.nn.loss import LinearCrossEntropyHead, LinearCrossEntropyLoss
from zerofuse.nn.rotary import RotaryEmbedding, rope_tables
from zerofuse.nn.normalization import LayerNorm, RMSNorm, replace_norms

__all__ = ["functional", "Attention", "GatedMLP", "LinearGELU", "LinearCrossEntropyLoss", "LinearCrossEntropyHead", "LayerNorm", "RMSNorm", "replace_norms", "RotaryEmbedding",
           "rope_tables"]
