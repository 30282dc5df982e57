"""Whether two tensors share memory, exactly: the one check the in-place ops and the Communicator's
written tensors use (views into one buffer may interleave without sharing an element: q, k and v
heads side by side in a fused projection's rows, x[::2] and x[1::2])."""
from __future__ import annotations

import torch
from torch import Tensor


def byte_span(t: Tensor) -> tuple[int, int]:
    """[first, end) of the bytes t's elements lie in (absolute addresses; t not empty)."""
    lo = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st < 0)
    hi = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st > 0)
    base, es = t.untyped_storage().data_ptr(), t.element_size()
    return base + lo * es, base + (hi + 1) * es


def shared(a: Tensor, b: Tensor) -> Tensor | None:
    """None where a and b cannot share a byte (another storage, an empty one, spans apart: no work);
    else a 0-d bool tensor on a's device, whether they do (each marks its bytes in a scratch mask of
    the spans' union, as bytes: tensors of other dtypes over one buffer too)."""
    if not a.numel() or not b.numel() or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return None
    (a0, a1), (b0, b1) = byte_span(a), byte_span(b)
    if a1 <= b0 or b1 <= a0:
        return None
    first = min(a0, b0)
    mask = torch.zeros(max(a1, b1) - first, dtype=torch.uint8, device=a.device)

    def view(t: Tensor) -> Tensor:
        es, start = t.element_size(), t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
        return mask.as_strided((*t.shape, es), (*(st * es for st in t.stride()), 1), start - first)

    view(a).fill_(1)
    return (view(b) != 0).any()


def shared_pair(tensors, counts=None) -> tuple[int, int] | None:
    """The first pair i < j of ``tensors`` (non-tensors and empty ones skipped) sharing a byte, among
    the pairs ``counts(i, j)`` admits (all without it), or None: spans swept in address order, only
    crossing ones compared by ``shared``."""
    spans = sorted((*byte_span(t), i) for i, t in enumerate(tensors) if isinstance(t, Tensor) and t.numel())
    for k, (_, hi, i) in enumerate(spans):
        for lo2, _hi2, j in spans[k + 1:]:
            if lo2 >= hi:
                break
            if counts is not None and not counts(i, j):
                continue
            both = shared(tensors[i], tensors[j])
            if both is not None and bool(both):
                return min(i, j), max(i, j)
    return None
