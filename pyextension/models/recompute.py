"""Activation checkpointing of zerofuse.models.GPT's blocks (``model.activation_checkpointing``):

- "none" (or False): every activation autograd saves is kept;
- "full" (or True): only each block's input is kept, the whole block recomputed in backward;
- "selective": the block is recomputed except the matmul outputs (aten mm / addmm / bmm and the
  MoE experts' grouped mm), which are kept: attention, the norms and the elementwise ops are
  recomputed (Megatron's selective recomputation keeps the linear layers' outputs and recomputes
  the attention core). torch's selective activation checkpointing (torch.utils.checkpoint
  ``create_selective_checkpoint_contexts``) applies the policy to the ops the block dispatches.

Recomputation runs the same ops on the same inputs, so grads are bitwise those of "none" on
deterministic kernels. Under expert parallelism the recomputed forward runs its all-to-alls again,
on every rank in the same order.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "full", "selective")
_aten = torch.ops.aten
SAVED = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default}
if hasattr(_aten, "_grouped_mm"):
    SAVED.add(_aten._grouped_mm.default)


def mode_of(value) -> str:
    """The mode of a ``model.activation_checkpointing`` value (True/False as "full"/"none")."""
    if value is True:
        return "full"
    if value is False or value is None:
        return "none"
    if value not in MODES:
        raise ValueError(f"zerofuse.models.GPT: expected activation_checkpointing one of {MODES} (or a bool), got "
                         f"{value!r}")
    return value


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def run(block, mode: str, *args):
    """block(*args) under the mode (no checkpointing without grad)."""
    if mode == "none" or not torch.is_grad_enabled():
        return block(*args)
    if mode == "full":
        return checkpoint(block, *args, use_reentrant=False)
    return checkpoint(block, *args, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, _policy))
