"""Fused optimizers: torch.optim.Optimizer subclasses whose step runs zerofuse's fused kernels, and
functional steps on flat ZeRO shards (zerofuse.optim.functional)."""
from zerofuse.optim import functional
from zerofuse.optim.adam import FusedAdam, FusedAdamW
from zerofuse.optim.lamb import FusedLAMB
from zerofuse.optim.lars import FusedLARS

__all__ = ["FusedAdam", "FusedAdamW", "FusedLAMB", "FusedLARS", "functional"]
