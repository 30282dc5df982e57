"""``zerofuse.checkpoint``: sharded ZeRO checkpoints that load at any world size, stage and TP size;
torch.distributed.checkpoint (DCP) and safetensors interop.

- ``save(path, model, optimizer=None, *, extra=None, format="zerofuse")``: collective. zerofuse's
  format (native.py) or ``format="dcp"`` (dcp.py: torch's DCP layout, readable by DCP's own
  ``load`` / ``dcp_to_torch_save``). ``extra`` holds tensors, numbers, strings, lists and dicts.
- ``load(path, model, optimizer=None)``: into a ZeRO model (any layout; either format, a DCP
  checkpoint written by plain torch too) or a plain model (and torch optimizer) via consolidate.
  Returns ``extra``.
- ``consolidate(path)``: one process, full tensors, torch.optim-format optimizer state.
- ``export_hf(path, out_dir)``: safetensors + config.json.

Safety: loading never runs code from a file (``weights_only=True``, JSON, a restricted unpickler for
DCP's metadata); tensors are read memory-mapped on the CPU and copied to the model's device; each
rank opens only the files holding its pieces. Durability: [Note: checkpoint commit protocol] in
files.py: files and directories fsynced, no moment without a complete checkpoint. The files must be
on a filesystem every rank sees.
"""
from __future__ import annotations

import os

import torch

from zerofuse.checkpoint import files, native, optim_checks, sources
from zerofuse.checkpoint.hf import export_hf

NAME = files.NAME
FORMATS = ("zerofuse", "dcp")


def _dcp():
    """dcp.py, imported at its first use: torch.distributed.checkpoint brings DTensor (measured
    2026-11-27: 1.05 s of ``import zerofuse``'s 3.3 s), which a zerofuse-format run never needs."""
    from zerofuse.checkpoint import dcp  # noqa: PLC0415

    return dcp


def _apply_pending(optimizer, who: str) -> None:
    """A zero.Optimizer's delayed update applied first ([Note: delayed parameter update]); refused
    while the last backward's offloaded host steps run (offload_overlap): they had moved the masters
    and moments to the next step already (a save wrote them under the old step count, a load was
    overwritten by them or counted a step it never took: a review's reproduction, 2026-12-06)."""
    if hasattr(optimizer, "apply_pending"):
        optimizer.apply_pending(who)


def save(path: str, model: torch.nn.Module, optimizer=None, *, extra=None, format: str = "zerofuse") -> None:
    """Collective: every rank of the model's group calls it (with tensor parallelism: every rank of
    the world, i.e. of the dp × tp mesh)."""
    if format not in FORMATS:
        raise ValueError(f"{NAME}.save: expected format to be one of {FORMATS}, got {format!r}")
    _apply_pending(optimizer, f"{NAME}.save")
    (native.save if format == "zerofuse" else _dcp().save)(path, model, optimizer, extra=extra)


def _is_dcp(path: str) -> bool:
    path = os.path.abspath(path)
    if files.is_dcp(path):
        return True
    try:
        return files.is_dcp(files.resolve(path))
    except FileNotFoundError:
        return False


def load(path: str, model: torch.nn.Module, optimizer=None):
    """Returns the ``extra`` given to save (None for a DCP checkpoint written by plain torch)."""
    with files.reading(path):  # (a save of the path meanwhile waits)
        return _load(path, model, optimizer)


def _load(path: str, model: torch.nn.Module, optimizer=None):
    if getattr(model, "_zerofuse_zero", None) is None:
        full = consolidate(path)
        if optimizer is not None:  # (checked before the model is loaded)
            if full["optimizer"] is None:
                raise ValueError(f"{NAME}.load: the checkpoint at {path!r} holds no optimizer state (saved without "
                                 "an optimizer); pass optimizer=None")
            # (a DCP checkpoint zerofuse wrote names its optimizer in meta.json: torch's option says
            # adam or adamw only, a LAMB/LARS one loaded silently into another rule)
            kind = (_dcp().saved_meta(path).get("optimizer") or optim_checks.saved_kind(full["optimizer"]["param_groups"])
                    if _is_dcp(path) else native.Full(path).meta["optimizer"]["kind"])
            optim_checks.check_kind(kind, optim_checks.kind_of(optimizer), f"{NAME}.load", type(optimizer).__name__)
        _check_plain_load(model, optimizer, full, path)  # before anything is written
        if optimizer is not None:
            full["optimizer"] = optim_checks.by_name(model, optimizer, full, f"{NAME}.load", path)
            _give_masters(model, optimizer, full)
        model.load_state_dict(full["model"])
        if optimizer is not None:
            optimizer.load_state_dict(full["optimizer"])
        return full["extra"]
    # a delayed host step must not write the states (or a live optimizer's masters, a weights-only
    # load) while they load
    eng = getattr(model, "_zerofuse_zero", None)
    _apply_pending(optimizer if optimizer is not None or eng is None else eng.live_optimizer(), f"{NAME}.load")
    return (_dcp().load if _is_dcp(path) else native.load)(path, model, optimizer)


def _check_plain_load(model, optimizer, full: dict, path: str) -> None:
    """A plain model's load, checked whole before anything is written (torch's load_state_dict
    wrote the matching tensors, then refused; the optimizer's refusal came after the model's load)."""
    who = f"{NAME}.load"
    mine = model.state_dict()
    native.check_model({n: tuple(t.shape) for n, t in full["model"].items()}, list(mine),
                       [t.shape for t in mine.values()], who)
    if optimizer is None:
        return
    groups = full["optimizer"]["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"{who}: the checkpoint at {path!r} has {len(groups)} param groups, the optimizer "
                         f"{len(optimizer.param_groups)}")
    for i, (g, s) in enumerate(zip(optimizer.param_groups, groups)):
        if len(g["params"]) != len(s["params"]):
            raise ValueError(f"{who}: param group {i} of the checkpoint at {path!r} holds {len(s['params'])} params, "
                             f"the optimizer's {len(g['params'])}")


def _give_masters(model, optimizer, full: dict) -> None:
    """A plain bf16/fp16 model whose optimizer keeps fp32 masters (zerofuse.optim, master_weights):
    the checkpoint's fp32 values (saved from the masters) become the masters; rounded into the
    model, they were all the optimizer had to rebuild them from."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    state = full["optimizer"]["state"]
    for g, s in zip(optimizer.param_groups, full["optimizer"]["param_groups"]):
        if not g.get("master_weights", False):
            continue
        for p, i in zip(g["params"], s["params"]):
            value = full["model"].get(names.get(id(p)))
            if (p.dtype in (torch.bfloat16, torch.float16) and isinstance(value, torch.Tensor)
                    and value.dtype == torch.float32 and isinstance(state.get(i), dict)):
                state[i] = {**state[i], "master": value}


def consolidate(path: str, *, optimizer: bool = True) -> dict:
    """{'model': a plain state_dict (full tensors; fp32 from the masters when the run kept them),
    'optimizer': torch.optim-format state (params numbered in the saved order) or None,
    'extra': what save() was given, 'optimizer_names': the name of each param number (None without
    an optimizer)}. One process, no process group needed. optimizer=False: the model only (the
    optimizer's states, twice the fp32 model for Adam, are not read: 'optimizer' None)."""
    if not isinstance(optimizer, bool):
        raise TypeError(f"{NAME}.consolidate: expected optimizer True or False, got {optimizer!r}")
    with files.reading(path):  # (a save of the path meanwhile waits)
        return _dcp().consolidate(path, optimizer) if _is_dcp(path) else sources.consolidate(path, optimizer)


__all__ = ["save", "load", "consolidate", "export_hf", "FORMATS"]
