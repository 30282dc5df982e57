"""The tensor lists of the Communicator's collectives (zerofuse/comm/communicator.py), checked and
adapted before the C++ call: bools as bytes, refusals the C++ side made only after the collective."""
from __future__ import annotations

import math
import numbers

import torch

from zerofuse._overlap import shared_pair


def _checked_list(where: str, name: str, tensors: list, *, written: bool, promoted: bool = False) -> list:
    """Refusals at the call that the C++ side made at wait(), after the collective (or in its own
    op's terms): complex tensors, integer and floating tensors reduced in one promoted dtype (an int64
    count past 2**24 or an int32 counter beside bf16 grads came back rounded), written tensors that
    share memory (exactly: a transpose or a strided view too; the flat copy-back refused some of them
    after the collective, took others). Returns
    the tensors detached (a param that requires grad taken as the flat buffer: the in-place scaling
    raised after the collective, in autograd's words)."""
    kinds = set()
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor) and t.is_complex() and (len(tensors) > 1 or not t.is_contiguous()):
            raise ValueError(f"zerofuse.comm.{where}: expected {name}[{i}] of a real dtype (a complex tensor is "
                             f"taken alone and contiguous only, as the flat buffer), got {t.dtype} (pass "
                             "torch.view_as_real of it)")
        if isinstance(t, torch.Tensor):
            kinds.add(t.is_floating_point())
    if promoted and len(kinds) == 2:
        got = sorted({str(t.dtype) for t in tensors})
        raise ValueError(f"zerofuse.comm.{where}: expected {name} all integer or all floating without a reduce_dtype "
                         f"(they reduce in one promoted dtype: integers beside floats come back rounded), got {got}; "
                         "reduce them in two calls")
    for i, t in enumerate(tensors if written else ()):  # (an expanded tensor: torch's copy-back refused it at
        # wait(), after the collective had run; 2026-12-07)
        if isinstance(t, torch.Tensor) and any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
            raise ValueError(f"zerofuse.comm.{where}: expected {name}[{i}] to hold each element once (it is "
                             f"written), got a tensor whose elements share memory (strides {list(t.stride())}, "
                             f"shape {list(t.shape)}: expanded); pass a tensor of its own, e.g. .clone()")
    # (exact: interleaved views sharing no element pass; a strided view over another tensor's elements
    # was compared by neither check: gathered into both, silently)
    if written and len(tensors) > 1 and (pair := shared_pair(tensors)) is not None:
        raise ValueError(f"zerofuse.comm.{where}: expected {name}[{pair[0]}] and {name}[{pair[1]}] not to share "
                         "memory (both are written), got tensors that overlap")
    return [t.detach() if isinstance(t, torch.Tensor) and t.requires_grad else t for t in tensors]


OPS = ("sum", "avg", "max", "min")


def check_args(where: str, tensors=None, name: str = "tensors", *, scale=None, reduce_dtype=None, op="sum",
               **single) -> None:
    """The argument types of a collective, by name (None, a float or a dtype given as a string failed
    inside the call with AttributeError, or pybind's list of overloads; a NaN scale made every
    result NaN; torch's ReduceOp.SUM as op: pybind's overloads over ranks, 'RedOpType.SUM' over
    one: reviews' reproductions, 2026-12-07)."""
    if not isinstance(op, str) or op not in OPS:
        raise ValueError(f"zerofuse.comm.{where}: expected op 'sum', 'avg', 'max' or 'min', got {op!r}")
    if tensors is not None:
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
            raise ValueError(f"zerofuse.comm.{where}: expected {name} to be a list of tensors, got "
                             f"{type(tensors).__name__}")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"zerofuse.comm.{where}: expected {name}[{i}] to be a tensor, got {type(t).__name__}")
    for key, t in single.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"zerofuse.comm.{where}: expected {key} to be a tensor, got {type(t).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or not math.isfinite(scale)):
        raise ValueError(f"zerofuse.comm.{where}: expected scale to be a finite number or None, got {scale!r}")
    if reduce_dtype is not None and not isinstance(reduce_dtype, torch.dtype):
        raise ValueError(f"zerofuse.comm.{where}: expected reduce_dtype to be a torch.dtype or None, got "
                         f"{reduce_dtype!r}")


def _bytes_of_bools(where: str, tensors: list, op: str | None = None, scale=None) -> list:
    """Bool tensors as uint8 views of themselves (the flat buffers hold no bool; the C++ copy refused
    them naming its own internals, an all-gather only at wait(), after the collective): exact for a
    gather and for max / min (any / all). A sum, an average or a scale of bools is no bool: refused."""
    if not any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tensors):
        return tensors
    scaled = scale is not None and float(scale) != 1.0  # (1.0 is none, as the collective checker's signature)
    if op is not None and (op not in ("max", "min") or scaled):
        how = f"op {op!r}" + (" with a scale" if scaled else "")
        raise ValueError(f"zerofuse.comm.{where}: expected no bool tensors for {how} (a bool sum is no bool: cast "
                         f"them to an integer dtype, or reduce with op 'max' (any) or 'min' (all)), got bool")
    return [t.view(torch.uint8) if isinstance(t, torch.Tensor) and t.dtype == torch.bool else t for t in tensors]


def check_p2p(ops, ws: int, rank: int) -> None:
    """batch_p2p's ops (their types checked), then refuse_shared_p2p."""
    for i, o in enumerate(ops):  # the C++ call's checks (csrc/comm/p2p.cpp, in its words) before the checker
        # publishes (a call refused after it counted the pair's transfer: the next one was compared
        # with the peer's previous, a false mismatch that failed the communicator); and a tag or peer
        # past int32 (pybind's "incompatible function arguments" before)
        name, t = f"zerofuse.comm.batch_p2p: expected ops[{i}]", o.tensor
        if not 0 <= o.peer < ws:
            raise ValueError(f"{name}.peer to be a rank of the group (0 <= peer < {ws}), got {o.peer}")
        if o.peer == rank:
            raise ValueError(f"{name}.peer to be another rank than this one ({rank}), got {o.peer}")
        if not t.is_contiguous():
            raise ValueError(f"{name}.tensor to be contiguous, got strides {list(t.stride())} for shape "
                             f"{list(t.shape)}")
        if t.device != ops[0].tensor.device:
            raise ValueError(f"{name}.tensor on {ops[0].tensor.device} like ops[0].tensor, got {t.device}")
        if o.tag < 0:
            raise ValueError(f"{name}.tag >= 0, got {o.tag}")
        if o.tag >= 2 ** 31:
            raise ValueError(f"{name}.tag < 2**31 (an int32), got {o.tag}")
    refuse_shared_p2p(ops)


def refuse_shared_p2p(ops) -> None:
    """A received-into tensor sharing memory with another op's (a send of the same buffer, as
    all_to_all refuses its in place): the receive landed while the send read, every element wrong on
    gloo, silently (a review's reproduction, 2026-12-07)."""
    pair = shared_pair([o.tensor for o in ops], lambda i, j: "recv" in (ops[i].op, ops[j].op))
    if pair is not None:
        a, b = pair
        raise ValueError(f"zerofuse.comm.batch_p2p: expected ops[{a}].tensor and ops[{b}].tensor ({ops[a].op}, "
                         f"{ops[b].op}) not to share memory (a receive writes it), got tensors that overlap")
