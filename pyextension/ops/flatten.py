"""Bucket copy-in / copy-out: ``zerofuse::flatten_into`` and ``zerofuse::unflatten_from`` (C++ ops).

The heart of the fused collectives: many tensors go into one flat (padded) buffer with one kernel,
one collective runs on the buffer, and the results come back out with one kernel. Schemas live in
csrc/registration.cpp, kernels in csrc/cpu/flatten.cpp and csrc/cuda/flatten.cu; this module adds
the fake impls (so both ops trace under torch.compile) and the Python faces.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from zerofuse import reference
from zerofuse.ops import register


def _check(tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets: Sequence[int], op: str) -> None:
    """The checks of csrc/flatten.h, for fake tensors (same messages, same exception types)."""
    pre = f"zerofuse::{op}: "
    if flat.dim() != 1 or not flat.is_contiguous():
        raise RuntimeError(
            f"{pre}expected flat to be a 1-D contiguous tensor, got shape {list(flat.shape)} with strides {list(flat.stride())}"
        )
    if len(tensors) != len(offsets):
        raise ValueError(
            f"{pre}expected len(offsets) == len(tensors) == {len(tensors)}, got len(offsets) == {len(offsets)}"
        )
    n_flat = flat.numel()
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        if t.device != flat.device:
            raise RuntimeError(f"{pre}expected tensors[{i}] on the device of flat ({flat.device}), got {t.device}")
        if off < 0 or off + t.numel() > n_flat:
            raise ValueError(
                f"{pre}offsets[{i}] = {off} with tensors[{i}].numel() = {t.numel()} runs outside flat of numel {n_flat}"
            )
    ranges = sorted((off, off + t.numel(), i) for i, (t, off) in enumerate(zip(tensors, offsets)) if t.numel())
    for (b0, e0, i0), (b1, e1, i1) in zip(ranges, ranges[1:]):
        if b1 < e0:
            raise ValueError(f"{pre}ranges of tensors[{i0}] [{b0}, {e0}) and tensors[{i1}] [{b1}, {e1}) overlap in flat")


@torch.library.register_fake("zerofuse::flatten_into")
def _flatten_into_fake(tensors, flat, offsets):
    _check(tensors, flat, offsets, "flatten_into")


@torch.library.register_fake("zerofuse::unflatten_from")
def _unflatten_from_fake(flat, tensors, offsets):
    _check(tensors, flat, offsets, "unflatten_from")


def flatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets: Sequence[int]) -> None:
    """Copy each ``tensors[i]`` (any shape and strides) into ``flat[offsets[i] : offsets[i] + numel]``.

    Values are cast to ``flat.dtype`` (e.g. bf16 gradients into an fp32 bucket). ``flat`` must be
    1-D and contiguous, every tensor on its device, and the ranges inside ``flat`` and disjoint;
    the gaps between ranges (padding) are left untouched. One parallel pass on CPU, one kernel
    launch on CUDA for contiguous fp32/fp16/bf16/fp64 tensors.
    """
    torch.ops.zerofuse.flatten_into(list(tensors), flat, [int(o) for o in offsets])


def unflatten_from(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """The reverse of :func:`flatten_into`: ``tensors[i].copy_(flat[offsets[i]:...].view(shape))``, in place."""
    torch.ops.zerofuse.unflatten_from(flat, list(tensors), [int(o) for o in offsets])


def packed_offsets(numels: Sequence[int], align: int = 1) -> tuple[list[int], int]:
    """Offsets that pack tensors of ``numels`` back to back, each start a multiple of ``align``.

    Returns ``(offsets, total)`` with ``total`` itself rounded up to ``align``, the size of the flat
    buffer to allocate.
    """
    if align < 1:
        raise ValueError(f"packed_offsets: expected align >= 1, got {align}")
    offsets, pos = [], 0
    for n in numels:
        offsets.append(pos)
        pos += -(-int(n) // align) * align
    return offsets, pos


def _selftest_inputs(device: torch.device):
    """Mixed shapes and dtypes, a 0-dim, an empty and a non-contiguous tensor, odd sizes, padding."""
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (7,), (), (2, 3, 4), (0, 4), (1025,)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float32, torch.float32]
    tensors = [torch.randn(s, generator=g).to(device=device, dtype=d) for s, d in zip(shapes, dtypes)]
    tensors[3] = tensors[3].transpose(0, 2)
    offsets, total = packed_offsets([t.numel() for t in tensors], align=8)
    return g, tensors, offsets, total


def _selftest_flatten_into(device: torch.device) -> None:
    _, tensors, offsets, total = _selftest_inputs(device)
    flat = torch.zeros(total, device=device)
    expected = torch.zeros(total, device=device)
    flatten_into(tensors, flat, offsets)
    reference.flatten_into(tensors, expected, offsets)
    torch.testing.assert_close(flat, expected, rtol=0, atol=0)


def _selftest_unflatten_from(device: torch.device) -> None:
    g, tensors, offsets, total = _selftest_inputs(device)
    flat = torch.randn(total, generator=g).to(device)
    outs = [torch.zeros_like(t) for t in tensors]
    expected = [torch.zeros_like(t) for t in tensors]
    unflatten_from(flat, outs, offsets)
    reference.unflatten_from(flat, expected, offsets)
    for o, e in zip(outs, expected):
        torch.testing.assert_close(o, e, rtol=0, atol=0)


register("zerofuse::flatten_into", "C++", _selftest_flatten_into)
register("zerofuse::unflatten_from", "C++", _selftest_unflatten_from)
