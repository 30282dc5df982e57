"""Pure-PyTorch references of every zerofuse op: the same math, written for clarity.

Tests and benchmarks import these; nothing else copies them. They run on any device and dtype
(float64 included), in place where the op is in place.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def flatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets: Sequence[int]) -> None:
    """flat[offsets[i] : offsets[i] + tensors[i].numel()] = tensors[i] in row-major order, cast to flat.dtype."""
    for t, off in zip(tensors, offsets):
        flat[off : off + t.numel()].copy_(t.reshape(-1))


def unflatten_from(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """tensors[i][...] = flat[offsets[i] : offsets[i] + tensors[i].numel()].view(tensors[i].shape), cast."""
    for t, off in zip(tensors, offsets):
        t.copy_(flat[off : off + t.numel()].view(t.shape))
