"""ZeRO stage 1/2/3 (Rajbhandari et al., 2020) on zerofuse's Communicator and flat-buffer optimizer
kernels: ``parallelize(model, stage=...)`` shards, ``Optimizer(model, ...)`` steps this rank's
shard, ``memory_report`` measures what each rank holds, ``peak_memory`` the peak during a region.
Gradients live in the shards: ``.grad`` is None after backward; ``full_grads(model)`` hands out full
``.grad`` tensors inside a block."""
from zerofuse.zero.api import full_grads, full_params, parallelize
from zerofuse.zero.memory import memory_report, peak_memory
from zerofuse.zero.optimizer import Optimizer

__all__ = ["parallelize", "full_params", "full_grads", "Optimizer", "memory_report", "peak_memory"]
