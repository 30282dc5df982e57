"""Bucket copy-in / copy-out: ``zerofuse::flatten_into`` and ``zerofuse::unflatten_from`` (C++ ops).

The heart of the fused collectives: many tensors go into one flat (padded) buffer with one kernel,
one collective runs on the buffer, and the results come back out with one kernel. Schemas live in
csrc/registration.cpp, kernels in csrc/cpu/flatten.cpp and csrc/cuda/flatten.cu; this module adds
the fake impls (so both ops trace under torch.compile) and the Python faces.
"""
from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from zerofuse import reference
from zerofuse.ops import register


# c10's ScalarType names (what the C++ messages print) where they are not torch's name capitalised
_C10_NAMES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
              torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int", torch.int64: "Long",
              torch.complex32: "ComplexHalf", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
              torch.qint8: "QInt8", torch.quint8: "QUInt8", torch.qint32: "QInt32", torch.quint4x2: "QUInt4x2",
              torch.quint2x4: "QUInt2x4"}


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    return _C10_NAMES.get(dtype, name[:1].upper() + name[1:])


def _copyable(dtype: torch.dtype) -> bool:
    """csrc/flatten.h's is_copyable_dtype: real and not bool, float8, quantized or bits."""
    name = str(dtype).removeprefix("torch.")
    return not (dtype.is_complex or dtype == torch.bool or name.startswith(("float8", "q", "bits")))


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """First and last byte of a non-empty tensor's elements, counted from its storage's start."""
    first = t.storage_offset() * t.element_size()
    return first, first + (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size() - 1


def _check(tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets: Sequence[int], op: str) -> None:
    """The checks of csrc/flatten.h, for fake tensors (same messages, same exception types)."""
    pre = f"zerofuse::{op}: "
    if flat.dim() != 1 or not flat.is_contiguous():
        raise RuntimeError(
            f"{pre}expected flat to be a 1-D contiguous tensor, got shape {list(flat.shape)} with strides {list(flat.stride())}"
        )
    if not _copyable(flat.dtype):
        raise RuntimeError(f"{pre}expected flat to have a real, non-bool dtype, got {_dtype_name(flat.dtype)}")
    if len(tensors) != len(offsets):
        raise ValueError(
            f"{pre}expected len(offsets) == len(tensors) == {len(tensors)}, got len(offsets) == {len(offsets)}"
        )
    n_flat = flat.numel()
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        if t.device != flat.device:
            raise RuntimeError(f"{pre}expected tensors[{i}] on the device of flat ({flat.device}), got {t.device}")
        if not _copyable(t.dtype):
            raise RuntimeError(f"{pre}expected tensors[{i}] to have a real, non-bool dtype, got {_dtype_name(t.dtype)}")
        if off < 0 or off + t.numel() > n_flat:
            raise ValueError(
                f"{pre}offsets[{i}] = {off} with tensors[{i}].numel() = {t.numel()} runs outside flat of numel {n_flat}"
            )
    # by offset, then index: the C++ check's order (and so its message)
    ranges = sorted(((off, off + t.numel(), i) for i, (t, off) in enumerate(zip(tensors, offsets)) if t.numel()),
                    key=lambda r: (r[0], r[2]))
    for (b0, e0, i0), (b1, e1, i1) in zip(ranges, ranges[1:]):
        if b1 < e0:
            raise ValueError(f"{pre}ranges of tensors[{i0}] [{b0}, {e0}) and tensors[{i1}] [{b1}, {e1}) overlap in flat")
    if n_flat == 0:
        return
    flat_first, flat_last = _byte_span(flat)
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        if t.numel() == 0 or not torch._C._is_alias_of(t, flat):
            continue
        first, last = _byte_span(t)
        if last < flat_first or first > flat_last:
            continue
        if not (t.is_contiguous() and t.dtype == flat.dtype and first == flat_first + off * flat.element_size()):
            raise ValueError(
                f"{pre}expected tensors[{i}] not to share memory with flat, except as the view of its own range "
                f"flat[{off}:{off + t.numel()}], got a {_dtype_name(t.dtype)} tensor of shape {list(t.shape)} with "
                f"strides {list(t.stride())} at byte {first - flat_first} of flat"
            )


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
    the gaps between ranges (padding) are left untouched. A tensor may share memory with ``flat``
    only as the contiguous view of its own range (then it is already in place). One parallel pass on CPU, one kernel
    launch on CUDA for contiguous fp32/fp16/bf16/fp64 tensors.
    """
    torch.ops.zerofuse.flatten_into(list(tensors), flat, _offsets(offsets, "flatten_into"))


def unflatten_from(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """The reverse of :func:`flatten_into`: ``tensors[i].copy_(flat[offsets[i]:...].view(shape))``, in place.
    The tensors must not share memory with each other (each is written)."""
    torch.ops.zerofuse.unflatten_from(flat, list(tensors), _offsets(offsets, "unflatten_from"))


def _offsets(offsets: Sequence[int], who: str) -> list[int]:
    """Element offsets as ints; a float (3.9 was taken as 3) or a bool is refused, naming it."""
    out = []
    for i, o in enumerate(offsets):
        try:
            if isinstance(o, bool):
                raise TypeError
            out.append(operator.index(o))
        except TypeError:
            raise TypeError(f"zerofuse.ops.{who}: expected offsets[{i}] to be an int, got {o!r}") from None
    return out


def packed_offsets(numels: Sequence[int], align: int = 1) -> tuple[list[int], int]:
    """Offsets that pack tensors of ``numels`` back to back, each start a multiple of ``align``.

    Returns ``(offsets, total)`` with ``total`` itself rounded up to ``align``, the size of the flat
    buffer to allocate.
    """
    if align < 1:
        raise ValueError(f"packed_offsets: expected align >= 1, got {align}")
    offsets, pos = [], 0
    for i, n in enumerate(numels):
        try:
            if isinstance(n, (bool, torch.Tensor)):
                raise TypeError
            n = operator.index(n)
            if n < 0:
                raise TypeError
        except TypeError:
            got = f"a tensor of shape {list(n.shape)}" if isinstance(n, torch.Tensor) else repr(n)
            raise TypeError(f"packed_offsets: expected numels[{i}] to be an element count (an int >= 0: "
                            f"[t.numel() for t in tensors]), got {got}") from None
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
