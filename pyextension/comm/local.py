"""A Communicator's collectives over a group of one rank: done at once, in place where they can be,
with ordinary tensor ops on the current stream (no transport, no communication stream, no event).

Over one rank a reduction is its input times the call's scale (avg divides by 1), a gather or an
all-to-all is a copy, so nothing needs the transport. Done here, a world of one runs no NCCL call,
creates no CUDA event and waits for nothing, so its steps can be captured in a CUDA graph
(zerofuse.train's --cuda-graphs) and cost no launches beyond the copies. The results equal the
C++ transports' at world size 1 bit for bit (the same casts, in the same order: the input in the
reduce dtype, times the factor in that dtype, then into the output's dtype; tests/test_comm_local.py)
and the argument checks raise the same messages.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

_OPS = ("sum", "avg", "max", "min")


class DoneWork:
    """The Work of a collective that completed when it was called."""

    __slots__ = ()

    def wait(self, timeout=None) -> None:
        if timeout is not None:  # (the same arguments refused as on the transports; none: the hot path)
            from zerofuse.comm.communicator import wait_timeout

            wait_timeout(timeout)

    def is_completed(self) -> bool:
        return True


DONE = DoneWork()


def _check_op(op: str, fn: str) -> None:
    if op not in _OPS:
        raise ValueError(f"zerofuse::comm{fn}: expected op 'sum', 'avg', 'max' or 'min', got '{op}'")


def _check_reduce_dtype(op: str, scale: float | None, dtype: torch.dtype, fn: str) -> None:
    """As the C++ transports (communicator.cpp, check_reduce_dtype): avg or a scale on integers is
    refused on any world size (over one rank avg divides by 1: it was accepted here only); a scale of
    1.0 is none."""
    if not (dtype.is_floating_point or (op != "avg" and (scale is None or float(scale) == 1.0))):  # (1.0: none,
        # as the collective checker's signature takes it: one rank refused, the other entered alone)
        name = torch.empty(0, dtype=dtype).type().removeprefix("torch.").removesuffix("Tensor")  # c10's: Long, Int
        how = " with op 'avg'" if op == "avg" else " with a scale"
        raise ValueError(f"zerofuse::comm{fn}: expected a floating dtype with op 'avg' or a scale (the result is "
                         f"multiplied by a fraction), got {name}{how}")


def _check_one_device(tensors: Sequence[torch.Tensor], fn: str, other: torch.Tensor | None, other_name: str) -> None:
    want = other.device if other is not None else (tensors[0].device if tensors else None)
    for i, t in enumerate(tensors):
        if t.device != want:
            like = f" like {other_name}" if other is not None else " like tensors[0]"
            raise RuntimeError(f"zerofuse::comm{fn}: expected tensors[{i}] on {want}{like}, got {t.device}")


def _check_flat(t: torch.Tensor, numel: int, fn: str, name: str) -> None:
    if t.dim() != 1 or not t.is_contiguous():
        raise RuntimeError(f"zerofuse::comm{fn}: expected {name} to be a 1-D contiguous tensor, got shape "
                           f"{list(t.shape)} with strides {list(t.stride())}")
    if t.numel() != numel:
        raise ValueError(f"zerofuse::comm{fn}: expected {name} to have {numel} elements (ceil(total numel / "
                         f"world_size)), got {t.numel()}")


def _flat(tensors: Sequence[torch.Tensor], total: int, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """The tensors in one buffer of dtype: the tensor itself when it already is one (no copy)."""
    if len(tensors) == 1 and tensors[0].is_contiguous() and tensors[0].dtype == dtype:
        return tensors[0].detach().view(-1)
    flat = torch.empty(total, dtype=dtype, device=like.device)
    torch.ops.zerofuse.flatten_into(list(tensors), flat, _offsets(tensors))
    return flat


def _offsets(tensors: Sequence[torch.Tensor]) -> list[int]:
    out, off = [], 0
    for t in tensors:
        out.append(off)
        off += t.numel()
    return out


def _factor(scale: float | None) -> float:
    return 1.0 if scale is None else float(scale)  # avg over one rank: / 1


def reduce_scatter_coalesced(tensors: Sequence[torch.Tensor], out_shard: torch.Tensor, op: str, scale: float | None,
                             reduce_dtype: torch.dtype | None) -> DoneWork:
    fn = ".reduce_scatter_coalesced"
    _check_op(op, fn)
    _check_one_device(tensors, fn, out_shard, "out_shard")
    total = sum(t.numel() for t in tensors)
    _check_flat(out_shard, total, fn, "out_shard")
    if total == 0:
        return DONE
    dtype = reduce_dtype or out_shard.dtype
    _check_reduce_dtype(op, scale, dtype, fn)
    factor = _factor(scale)
    with torch.no_grad():
        flat = _flat(tensors, total, dtype, out_shard)
        if flat.data_ptr() == out_shard.data_ptr() and flat.dtype == out_shard.dtype:  # in place
            if factor != 1.0:
                out_shard.mul_(factor)
            return DONE
        if factor != 1.0:
            flat = flat * factor
        out_shard.copy_(flat)
    return DONE


def all_gather_coalesced(shard: torch.Tensor, tensors: Sequence[torch.Tensor]) -> DoneWork:
    fn = ".all_gather_coalesced"
    _check_one_device(tensors, fn, shard, "shard")
    total = sum(t.numel() for t in tensors)
    _check_flat(shard, total, fn, "shard")
    if total == 0:
        return DONE
    with torch.no_grad():
        if len(tensors) == 1 and tensors[0].is_contiguous() and tensors[0].data_ptr() == shard.data_ptr():
            return DONE  # the shard is the whole buffer (ZeRO stage 1/2 over one rank)
        torch.ops.zerofuse.unflatten_from(shard, list(tensors), _offsets(tensors))
    return DONE


def all_reduce_coalesced(tensors: Sequence[torch.Tensor], op: str, scale: float | None,
                         reduce_dtype: torch.dtype | None) -> DoneWork:
    fn = ".all_reduce_coalesced"
    _check_op(op, fn)
    _check_one_device(tensors, fn, None, "")
    total = sum(t.numel() for t in tensors)
    factor = _factor(scale)
    dtype = tensors[0].dtype if tensors else None
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    dtype = reduce_dtype or dtype
    if total:
        _check_reduce_dtype(op, scale, dtype, fn)
    if total == 0 or (factor == 1.0 and all(t.dtype == dtype for t in tensors)):
        return DONE  # nothing changes (C++ casts to the reduce dtype and back: exact when it is theirs)
    with torch.no_grad():
        flat = _flat(tensors, total, dtype, tensors[0])
        if factor != 1.0:
            flat.mul_(factor)
        if not (len(tensors) == 1 and flat.data_ptr() == tensors[0].data_ptr() and flat.dtype == tensors[0].dtype):
            torch.ops.zerofuse.unflatten_from(flat, list(tensors), _offsets(tensors))
    return DONE


def check_all_to_all(output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
                     input_splits: Sequence[int], world_size: int, lengths: bool = True) -> None:
    """The transport's checks (csrc/comm/all_to_all.cpp, its messages), in Python before the call
    publishes anything to ZEROFUSE_CHECK_COLLECTIVES' store (a rank refused by the C++ checks after
    publishing left the others waiting out the timeout with no word of why; a review's
    reproduction, 2026-12-07), and an out that shares memory with input, refused on every world
    size (over several ranks the rows arrived while others were still being sent from the same
    memory: wrong rows, silently). lengths=False: split lists of another length than the world size
    are left to the checker, which names the ranks that differ, and to the C++ checks."""
    fn = "zerofuse::comm.all_to_all"
    for name, splits in (("out_splits", output_splits), ("in_splits", input_splits)) if lengths else ():
        if len(splits) != world_size:
            raise ValueError(f"{fn}: expected {name} to hold {world_size} row counts (one per rank), got {len(splits)}")
        if any(n < 0 for n in splits):
            raise ValueError(f"{fn}: expected {name} >= 0, got {list(splits)}")
    if not (input.is_contiguous() and output.is_contiguous()):
        raise RuntimeError(f"{fn}: expected contiguous input and out")
    if input.device != output.device or input.dtype != output.dtype:
        raise RuntimeError(f"{fn}: expected out on input's device with its dtype ({input.device}, {input.dtype}), "
                           f"got {output.device}, {output.dtype}")
    if input.dim() < 1 or output.dim() != input.dim() or input.shape[1:] != output.shape[1:]:
        raise RuntimeError(f"{fn}: expected input and out of one row shape, got {list(input.shape)} and "
                           f"{list(output.shape)}")
    if len(input_splits) == len(output_splits) == world_size:
        if sum(input_splits) != input.shape[0]:
            raise ValueError(f"{fn}: expected in_splits to sum to input's {input.shape[0]} rows, got "
                             f"{list(input_splits)}")
        if sum(output_splits) != output.shape[0]:
            raise ValueError(f"{fn}: expected out_splits to sum to out's {output.shape[0]} rows, got "
                             f"{list(output_splits)}")
    if input.numel() and output.numel():
        size = input.element_size()
        if input.data_ptr() < output.data_ptr() + output.numel() * size and \
                output.data_ptr() < input.data_ptr() + input.numel() * size:
            raise ValueError(f"{fn}: expected out not to share memory with input (the rows arrive while others are "
                             "still sent from it), got tensors that overlap; receive into another tensor")


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
               input_splits: Sequence[int]) -> DoneWork:
    fn = "zerofuse::comm.all_to_all"
    check_all_to_all(output, input, output_splits, input_splits, 1)
    if output_splits[0] != input_splits[0]:
        raise ValueError(f"{fn}: over one rank the input goes to the output whole: expected equal splits, got "
                         f"in_splits {list(input_splits)}, out_splits {list(output_splits)}")
    with torch.no_grad():
        output.copy_(input)
    return DONE
