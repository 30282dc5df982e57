"""ZeRO stage 1/2/3 (Rajbhandari et al., 2020) on zerofuse's Communicator and flat-buffer optimizer
kernels: ``parallelize(model, stage=...)`` shards, ``Optimizer(model, ...)`` steps this rank's
shard, ``memory_report`` measures what each rank holds."""
from zerofuse.zero.engine import full_params, parallelize
from zerofuse.zero.memory import memory_report
from zerofuse.zero.optimizer import Optimizer

__all__ = ["parallelize", "full_params", "Optimizer", "memory_report"]
