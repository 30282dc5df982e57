"""Fused optimizers: torch.optim subclasses whose step runs zerofuse's fused kernels."""
from zerofuse.optim.adam import FusedAdam, FusedAdamW

__all__ = ["FusedAdam", "FusedAdamW"]
