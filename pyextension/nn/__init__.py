"""Drop-in modules and functions: same signatures and state_dict keys as the torch ones they replace."""
from zerofuse.nn import functional
from zerofuse.nn.normalization import LayerNorm, RMSNorm, replace_norms

__all__ = ["functional", "LayerNorm", "RMSNorm", "replace_norms"]
