"""zerofuse's torch ops, and the registry that lists them.

Every op is a ``torch.ops.zerofuse.<name>``: C++ ops get their schema in csrc/registration.cpp and
their fake impl here; Triton ops are ``torch.library.custom_op``s. Each op module registers an
:class:`OpInfo` with a self-test (used by ``python -m zerofuse.doctor``) that checks the op against
``zerofuse.reference`` on a given device.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class OpInfo:
    name: str  # qualified, "zerofuse::flatten_into"
    kind: str  # "C++" or "Triton": where the device kernels come from
    selftest: Callable[[torch.device], None]  # raises AssertionError on a wrong result


OPS: dict[str, OpInfo] = {}


def register(name: str, kind: str, selftest: Callable[[torch.device], None]) -> None:
    OPS[name] = OpInfo(name, kind, selftest)


def eager_apply(cls: type[torch.autograd.Function]) -> Callable:
    """``cls.apply`` for the ops' eager autograd paths (EagerNorm, EagerSwiGLU, EagerQKVAttention)
    without torch.autograd.Function.apply's Python wrapper, whose per-call argument binding and
    functorch dead-wrapper unwrapping cost ~2.6 us of a ~13 us LayerNorm call on this project's CPU
    (a third of the autograd bookkeeping). Under functorch transforms (torch.func.grad, vmap) it
    goes through cls.apply, whose wrapper those need."""
    c_apply = super(torch.autograd.Function, cls).apply
    functorch_active = torch._C._are_functorch_transforms_active

    def apply(*args):
        return cls.apply(*args) if functorch_active() else c_apply(*args)

    return apply


def list_ops() -> list[str]:
    """Qualified names of zerofuse's registered ops."""
    return sorted(OPS)


def registered_in_torch() -> list[str]:
    """Every zerofuse:: op the dispatcher knows, to check nothing ships without a self-test."""
    return sorted(
        {n.split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("zerofuse::")}
    )


from zerofuse.ops.flatten import flatten_into, packed_offsets, unflatten_from  # noqa: E402
from zerofuse.ops import norms  # noqa: E402,F401
from zerofuse.ops import attention  # noqa: E402,F401
from zerofuse.ops import attention_qkv  # noqa: E402,F401
from zerofuse.ops import linear_cross_entropy  # noqa: E402,F401
from zerofuse.ops import swiglu  # noqa: E402,F401
from zerofuse.ops import bias_gelu  # noqa: E402,F401
from zerofuse.ops import rotary  # noqa: E402,F401
from zerofuse.ops import moe  # noqa: E402,F401
from zerofuse.ops.adam import adam_  # noqa: E402
from zerofuse.ops.l2norm import l2norm  # noqa: E402
from zerofuse.ops.lamb import lamb_, lamb_stage1_, lamb_stage2_  # noqa: E402
from zerofuse.ops.lars import lars_  # noqa: E402

__all__ = ["OPS", "OpInfo", "list_ops", "registered_in_torch", "flatten_into", "unflatten_from", "packed_offsets", "adam_", "l2norm",
           "lamb_", "lamb_stage1_", "lamb_stage2_", "lars_"]
