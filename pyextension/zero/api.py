"""``zerofuse.zero.parallelize`` and the context managers over a parallelized model (the engine
itself: zerofuse/zero/engine.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from zerofuse.zero.engine import ZeroEngine, engine_of


def _spans_world(engine) -> bool:
    """Whether the engine's data-parallel ranks with its tensor- and pipeline-parallel peers are the
    whole default group (zerofuse.shard's mesh), the group transformers' synced_gpus syncs over."""
    size = engine.world_size
    for comm in (engine.tp_comm, engine.pp_comm):
        size *= comm.world_size if comm is not None else 1
    return size == dist.get_world_size()


def _hf_generation(model) -> bool:
    """A transformers model with generate (GenerationMixin), told without importing transformers."""
    return any(c.__name__ == "GenerationMixin" and c.__module__.startswith("transformers.") for c in type(model).__mro__)


def parallelize(model: torch.nn.Module, *, stage: int, group=None, precision: str = "fp32",
                reduce_dtype: torch.dtype | None = None, bucket_mb: float = 25.0, overlap: bool = True,
                prefetch: int = 1, wrap=None, reshard_after_forward: bool = True,
                tp_group=None, max_inflight: int = 2, device=None, param_init_fn=None,
                pp_group=None, expert_group=None, offload=None, offload_ratio: float | str = 1.0,
                param_gather: str = "step", find_unused_parameters: bool = False,
                gradient_as_bucket_view: bool = False) -> torch.nn.Module:
    """Make ``model`` ZeRO data-parallel over ``group`` (None: the default group), in place, and
    return it. stage 0 is plain data parallelism (grads all-reduced in buckets during backward,
    every rank keeps and steps everything); 1/2/3 shard optimizer states / + grads / + params.
    tp_group (default: ``model.tp_group``, set by tensor-parallel zerofuse models): the
    tensor-parallel group, so that grad norms (clipping, LAMB/LARS trust ratios, fp16 overflow)
    cover the whole model; pp_group: the pipeline-parallel group when ``model`` is one pipeline
    stage (zerofuse.pipeline), for the same reason and for per-stage checkpoints; expert_group
    (default ``model.edp_group``): with expert-parallel MoE layers, the ranks holding the same
    experts, over which expert params reduce and shard (ZeroEngine._init_experts); offload="optimizer":
    the optimizer's fp32 masters and states of this rank's shards in host memory, stepped there by
    the C++ CPU kernel as each unit's grads arrive ([Note: offloaded steps] in zero/offload.py);
    offload_ratio < 1 (twin flow): only the units first ready in backward, that fraction of the
    shard, are stepped on the host, the rest on the device ("auto": the fraction whose host and
    device steps take equal time, measured once, zero/offload.py auto_ratio). precision: the dtype params and grads are kept in (fp32 masters live
    in the optimizer); reduce_dtype: the dtype grads are accumulated and reduced in (default fp32;
    bf16/fp16 put half the bytes on the wire and are summed in fp32 after an all-to-all, rounding
    once); averages are pre-divided by the world size before the reduction. max_inflight: gradient
    reductions in flight at once during backward (the next launch waits for the oldest), which
    bounds backward's gradient memory to about grad shard + (max_inflight + 1) buckets/units.
    param_gather (stages 1/2): "step" (default) - step() returns with every param whole again (the
    updated shards all-gathered, as DeepSpeed's); "module" - the all-gathers run on while the next
    forward starts, each module's forward waiting for those of its own params (they overlap the
    forward; state_dict() waits for all): every param must then be read only in the forward of a
    module that holds it (``F.linear(h, self.wte.weight)`` from another module, an EMA update or a
    norm logged right after step() read other ranks' old values, silently); zerofuse's own models
    and zerofuse-train keep that rule. find_unused_parameters=True (as DDP's): each forward's output
    graph is walked, and the params it does not reach are marked ready when the next backward
    starts, so a param with no grad on some ranks does not hold that rank's reductions back to its
    end of backward (needed where the model runs collectives during backward: MoE's all-to-all,
    tensor parallelism; [Note: unused params] in zero/unused.py). gradient_as_bucket_view=True (as
    DDP's): over one rank (stages 0-2, where no hooks run) each param's ``.grad`` is a view of its
    bucket's buffer, which autograd accumulates into, so backward holds the grads once, not in
    .grad and the buffer ([Note: a world of one]); zero_grad then fills them with zeros (they
    stay views: ``.grad`` is never None), and a ``.grad`` replaced by another tensor is copied in
    (or, set to None, zeroed) at the next sync point. It needs grads in the params' dtype
    (reduce_dtype equal to precision's: a ValueError otherwise); over several ranks, at stage 3
    and with offload the hooks already move each grad into its bucket as it arrives: no effect.

    A model built under ``torch.device("meta")`` is materialized bucket by bucket on ``device``
    (default: the current CUDA device, else the CPU): each bucket (stage 3: each unit) is allocated
    whole once, initialised by ``param_init_fn(module)`` (default: the model's ``param_init_fn``
    method, else each module's ``reset_parameters()``) and, at stage 3, cut to this rank's shard,
    so the full model never exists on one rank. stage 3: ``wrap`` picks the units (None: each child of the main ModuleList; a list
    of module classes; a list of submodules; a callable(module) -> bool) and ``prefetch`` how many
    units are gathered ahead, ``reshard_after_forward=False`` keeps each unit gathered from its
    forward to the end of its backward (FSDP2's option: less communication, more memory).
    ``model.no_sync()`` then skips communication in backward, for
    gradient accumulation. Build ``zerofuse.zero.Optimizer(model, ...)`` to train."""
    engine = ZeroEngine(model, stage=stage, group=group, precision=precision, reduce_dtype=reduce_dtype,
                        bucket_mb=bucket_mb, overlap=overlap, prefetch=prefetch, wrap=wrap,
                        reshard_after_forward=reshard_after_forward, tp_group=tp_group,
                        max_inflight=max_inflight, device=device, param_init_fn=param_init_fn, pp_group=pp_group,
                        expert_group=expert_group, offload=offload, offload_ratio=offload_ratio,
                        param_gather=param_gather, find_unused_parameters=find_unused_parameters,
                        gradient_as_bucket_view=gradient_as_bucket_view)
    model._zerofuse_zero = engine
    if stage == 3 and engine.world_size > 1 and _hf_generation(model) and _spans_world(engine):
        # (as DeepSpeed's ZeRO-3 gets from transformers, whose synced steps all-reduce over the whole world:
        # ZeRO-3 over a subgroup whose ranks alone generate left it off, the others never joining it)
        from zerofuse.hf.bound import Bound, generate_synced  # noqa: PLC0415 - transformers' models only
        model.generate = Bound(model, generate_synced)
    model.no_sync = engine.no_sync
    model.zero_grad = engine.model_zero_grad
    model.register_load_state_dict_pre_hook(_refuse_assign)
    if stage != 3:  # loaded params reach the Optimizer's fp32 masters (stage 3 loads inside full_params),
        # after a pending delayed update (its host step wrote over the loaded masters or not, by timing)
        model.register_load_state_dict_pre_hook(lambda *_a: engine.apply_pending_update())
        # (of the elements the load changed: a master whose rounding is the loaded value keeps its fp32
        # bits, so an optimizer state loaded first - its masters - survives the model's load; every
        # master was reset to its bf16 rounding before: the resumed run drifted; a review's reproduction)
        model.register_load_state_dict_post_hook(lambda _module, _keys: engine.params_loaded(written_only=True))
    return model


def _refuse_assign(module, state_dict, prefix, local_metadata, *args) -> None:
    """load_state_dict(assign=True) put new Parameters in place of the bucket views ZeRO reduces,
    shards and steps (nothing trained after it, or a KeyError in backward): refused."""
    if local_metadata.get("assign_to_params_buffers", False):
        raise ValueError("zerofuse.zero: expected load_state_dict(assign=False) on a model made data-parallel by "
                         "zerofuse.zero.parallelize (its params are views of zerofuse's buffers, which the load "
                         "copies into), got assign=True; assign before parallelize (e.g. a model built on meta)")


def full_params(model: torch.nn.Module):
    """Context manager: the model's params hold their full values inside (e.g. to export, evaluate,
    initialise or load outside the hooks; stage 3 writes what was written back to the shards on
    exit); see ZeroEngine.full_params."""
    return engine_of(model, "zerofuse.zero.full_params").full_params()


def full_grads(model: torch.nn.Module):
    """Context manager: every param of a ZeRO model holds its full gradient as ``.grad`` inside
    (for inspection, logging or a user's own clipping, written back on exit); outside it the grads
    live in zerofuse's shards (clip with ``zerofuse.zero.Optimizer.clip_grad_norm_``), and ``.grad``
    is None, or over one rank autograd's until the next step takes it, or with
    gradient_as_bucket_view a view of the buffer ([Note: a world of one])."""
    return engine_of(model, "zerofuse.zero.full_grads").full_grads()
