"""zerofuse.pipeline: pipeline parallelism. Schedules as per-rank action lists and their dry-run
simulator (pure Python), stages split from a model with its parameter names kept, and the runtime
that executes a rank's actions over the Communicator's point-to-point transfers."""
from .schedules import Action, SCHEDULES, bubble_fraction, build_schedule, stage_to_rank
from .simulator import PipelineDeadlock, SimResult, p2p_order_mismatches, simulate, validate
from .stage import Stage, merge_stages, split_gpt
from .modules import split_modules
from .runtime import Pipeline

__all__ = ["Action", "SCHEDULES", "bubble_fraction", "build_schedule", "stage_to_rank",
           "PipelineDeadlock", "SimResult", "p2p_order_mismatches", "simulate", "validate",
           "Stage", "merge_stages", "split_gpt", "split_modules", "Pipeline"]
