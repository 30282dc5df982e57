"""``torch.distributed.checkpoint`` (DCP) interop: save a ZeRO model and optimizer as DCP, load a DCP
checkpoint (zerofuse's or one written by plain torch) into a ZeRO model.

The state dict has torch's shape (``torch.distributed.checkpoint.state_dict.get_state_dict``):
``{"model": {fqn: tensor}, "optim": {"state": {fqn: {"step", "exp_avg", ...}}, "param_groups":
[{..., "params": [fqn, ...]}]}}``, so a plain torch model reads it with get_state_dict / dcp.load /
set_state_dict and ``dcp_to_torch_save`` consolidates it. Each rank contributes its ZeRO shard of
every param as the rectangles its flat range covers (a ShardedTensor's local shards, views of the
shard: nothing is copied or gathered); a load fills the same views, from whatever chunks were
saved. Params hold the fp32 master where the run keeps one.

Reading never trusts the files: zerofuse/checkpoint/dcp_read.py.
"""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from zerofuse.checkpoint import files
from zerofuse.checkpoint.dcp_read import (EXTRA, SafeLoadPlanner, SafeReader, check_tied, param_groups, read_saved,
                                         saved_steps, storage_problem)
from zerofuse.checkpoint.collective import agree, begin_save, on_one
from zerofuse.checkpoint.native import _saving_ranks, _table, refuse_frozen_experts
from zerofuse.checkpoint.optim_checks import (check_kind, check_optimizer, check_owner, check_torch_options,
                                              plain_options, restore_scale, saved_kind)
from zerofuse.tp.spec import spec_of
from zerofuse.zero.engine import engine_of

NAME = files.NAME
DCP_META = files.DCP_META
is_dcp = files.is_dcp


def boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Elements [a, b) of a row-major tensor of ``shape`` as rectangles (offsets, sizes, flat start):
    at most 2 per dimension, each contiguous in memory."""
    if a >= b:
        return []
    if len(shape) == 0:
        return [((), (), 0)]
    if len(shape) == 1:
        return [((a,), (b - a,), a)]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    out = []
    row = a // inner
    if a % inner:  # a partial first row
        end = min(b, (row + 1) * inner)
        out += [((row,) + o, (1,) + s, row * inner + f) for o, s, f in boxes(shape[1:], a - row * inner, end - row * inner)]
        a, row = end, row + 1
    if a >= b:
        return out
    last = b // inner
    if last > row:  # whole rows
        out.append(((row,) + (0,) * (len(shape) - 1), (last - row,) + tuple(shape[1:]), row * inner))
    if b > last * inner:  # a partial last row
        out += [((last,) + o, (1,) + s, last * inner + f) for o, s, f in boxes(shape[1:], 0, b - last * inner)]
    return out


def _sharded(eng, name: str, shape, dtype, mine: list[tuple[torch.Tensor, int]], everyone) -> ShardedTensor:
    """A ShardedTensor of ``shape`` whose local shards view this rank's flat pieces ``mine``
    ((1-D tensor, offset in the flattened param)); ``everyone``: every rank's (rank, offset, length)."""
    group = eng.comm.group
    device = mine[0][0].device if mine else torch.device("cpu")
    shards_md, local = [], []
    for r, off, length in everyone:
        grank = dist.get_global_rank(group, r) if group is not None else r
        for offsets, sizes, _ in boxes(tuple(shape), off, off + length):
            shards_md.append(ShardMetadata(list(offsets), list(sizes), f"rank:{grank}/{device}"))
    for t, off in mine:
        for offsets, sizes, start in boxes(tuple(shape), off, off + t.numel()):
            view = t[start - off:start - off + math.prod(sizes)].view(sizes)
            local.append(Shard(view, ShardMetadata(list(offsets), list(sizes), f"rank:{dist.get_rank()}/{device}")))
    md = ShardedTensorMetadata(shards_md, torch.Size(shape), TensorProperties(dtype=dtype, requires_grad=False))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, md, process_group=group)


_TORCH_OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}


def _state_dict(eng, model, optimizer, loading: bool = False, live=None) -> dict:
    """The torch-shaped state dict whose tensors view this rank's shards (what save writes and load
    fills). ``everyone``: every rank's pieces, for the ShardedTensors' global metadata (stage 0 saves
    rank 0's replica; loading at stage 0, each rank fills its own replica). live (a weights-only
    load, optimizer None): a zero.Optimizer whose fp32 masters take the values (as the native
    load's: read into the param dtype, a bf16 model's masters were the saved ones rounded)."""
    masters = optimizer if optimizer is not None else live
    # (per unit: with twin-flow offload only the host units keep fp32 masters)
    master_of = {u.index: masters.unit_states[u.index]["master"] for u in eng.units
                 if masters is not None and "master" in masters.unit_states[u.index]}
    ranks = _saving_ranks(eng)
    everyone: dict[str, list] = {}
    for r in ([eng.rank] if loading and eng.stage == 0 else range(ranks)):
        for name, _unit, _so, length, po in _table(eng, 0 if eng.stage == 0 else r):
            everyone.setdefault(name, []).append((r, po, length))
    mine: dict[str, dict[str, list]] = {}
    if loading or eng.rank < ranks:
        for u in eng.units:
            states = optimizer.unit_states[u.index] if optimizer is not None else {}
            value = master_of.get(u.index, u.shard)
            for s in u.segments:
                sl = slice(s.shard_offset, s.shard_offset + s.length)
                got = mine.setdefault(u.names[s.param], {})
                got.setdefault("value", []).append((value[sl], s.param_offset))
                for key, t in states.items():
                    if key != "master":
                        got.setdefault(key, []).append((t[sl], s.param_offset))
    model_sd = {}
    for name, p in zip(eng.names, eng.params):
        dtype = torch.float32 if master_of and p.dtype != torch.float32 else p.dtype
        model_sd[name] = _sharded(eng, name, p.shape, dtype, mine.get(name, {}).get("value", []), everyone[name])
    for n, t in model.state_dict(keep_vars=True).items():
        if id(t) not in eng.param_index:
            model_sd[n] = t.detach()
    for alias, first in _aliases(eng, model).items():  # (torch's get_state_dict writes both names)
        model_sd[alias] = model_sd[first]
    sd = {"model": model_sd}
    if optimizer is not None:
        state = {}
        for gi, g in enumerate(optimizer.param_groups):
            for p in g["params"]:
                name = eng.names[eng.param_index[id(p)]]
                entry = {"step": optimizer._steps[gi].view(())} if optimizer.kind != "lars" else {}
                for key in optimizer.unit_states[0]:
                    if key != "master":
                        entry[key] = _sharded(eng, name, p.shape, torch.float32, mine.get(name, {}).get(key, []),
                                              everyone[name])
                state[name] = entry
        torch_opt = _TORCH_OPTIMIZERS.get(optimizer.kind)
        # torch's own options first, so a torch optimizer's load finds every key it asks for
        defaults = torch_opt([torch.zeros(1)]).defaults if torch_opt is not None and not loading else {}
        groups = [defaults | plain_options(g)
                  | {"params": [eng.names[eng.param_index[id(p)]] for p in g["params"]]} for g in optimizer.param_groups]
        sd["optim"] = {"state": state, "param_groups": groups}
    return sd


def _refuse_tp(eng, model) -> None:
    refuse_frozen_experts(eng, model, NAME)
    if any(spec_of(p) is not None for p in model.state_dict(keep_vars=True).values()):  # (frozen ones too)
        raise NotImplementedError(f"{NAME}: format='dcp' does not take tensor-parallel models yet; save in zerofuse's "
                                  "format (it reshards across TP sizes) and export from a consolidated copy")
    if eng.edp_comm is not None:
        raise NotImplementedError(f"{NAME}: format='dcp' does not take expert-parallel models yet; save in zerofuse's "
                                  "format (it reshards across ep sizes) and export from a consolidated copy")
    if eng.pp_comm is not None:  # (every stage wrote the same directory: a crash, or stages lost)
        raise NotImplementedError(f"{NAME}: format='dcp' does not take pipeline-parallel models yet; save in "
                                  "zerofuse's format (a folder per stage) and export from a consolidated copy")


def _aliases(eng, model) -> dict[str, str]:
    """A tied weight's second names -> its first (consolidate gives them one tensor, as the native
    format's; export_hf then records the tie)."""
    return {n: eng.names[eng.param_index[id(t)]] for n, t in model.state_dict(keep_vars=True).items()
            if id(t) in eng.param_index and eng.names[eng.param_index[id(t)]] != n}


def saved_meta(path: str) -> dict:
    """The meta.json of the DCP checkpoint at ``path`` (or its .tmp/.old: files.resolve)."""
    return _meta(os.path.abspath(path) if is_dcp(path) else files.resolve(os.path.abspath(path)))


def _meta(root: str) -> dict:
    """zerofuse's meta.json of a DCP checkpoint ({} for one written by torch)."""
    file = os.path.join(root, files.META)
    return files.read_json(file) if os.path.isfile(file) else {}


def _is_nested(md, meta: dict, names=None) -> bool:
    """Whether the checkpoint is torch's {"model": ..., "optim": ...} (keys "model.<fqn>") rather than a
    model's state dict saved flat. A Hugging Face model's flat keys also start with "model." (it was
    read as nested: everything else dropped); all of them starting so, the reading holding more of
    the model's ``names`` wins."""
    keys = list(md.state_dict_metadata)
    if meta.get("format") == "dcp" or any(k.startswith("optim.") for k in keys):
        return True
    if not keys or not all(k.startswith("model.") for k in keys):
        return False
    if names is None:
        return True
    return sum(f"model.{n}" in md.state_dict_metadata for n in names) >= sum(n in md.state_dict_metadata
                                                                               for n in names)


def save(path: str, model, optimizer=None, *, extra=None) -> None:
    """Collective, as zerofuse.checkpoint.save; the directory follows [Note: checkpoint commit
    protocol] (a meta.json naming the format is written after DCP's files)."""
    eng = engine_of(model, f"{NAME}.save")
    check_owner(optimizer, eng, f"{NAME}.save")
    _refuse_tp(eng, model)
    if eng.stage != 3:
        eng.finish_param_sync()
    eng.flush_full_params()  # (inside full_params: the block's writes so far are what is saved)
    path = os.path.abspath(path)
    files.check_target(path, f"{NAME}.save")
    group = eng.comm.group
    locked = False
    try:
        device = eng.units[0].device if eng.units else torch.device("cpu")
        locked, _ = begin_save(path, eng.rank == 0, group, device, extra)  # (DCP's own files hold no save id)
        tmp = path + ".tmp"
        dcp.save(_state_dict(eng, model, optimizer), storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                 process_group=group)

        def commit():
            scale = {} if optimizer is None else {"scale": float(optimizer.scale.item()),
                                                     "growth_tracker": int(optimizer._growth_tracker.item())}
            files.write_tensors(os.path.join(tmp, EXTRA), {"extra": extra} | scale)
            files.fsync_dir(tmp)
            files.write_json(os.path.join(tmp, files.META), {
                "format": "dcp", "world_size": eng.world_size, "stage": eng.stage, "precision": eng.precision,
                "optimizer": None if optimizer is None else optimizer.kind, "aliases": _aliases(eng, model)})
            files.commit(path)

        on_one(eng.rank == 0, commit, group, device, "could not commit the checkpoint")
    finally:  # (a save failed mid-way held the path's lock for the process's life)
        if locked:
            files.release(path)
    dist.barrier(group=group)


@torch.no_grad()
def load(path: str, model, optimizer=None):
    """Load a DCP checkpoint (``{"model": ..., "optim": ...}`` as torch's get_state_dict gives, or
    just the model's tensors at the top level) into a ZeRO model and its zero.Optimizer."""
    who = f"{NAME}.load"
    eng = engine_of(model, who)
    _refuse_tp(eng, model)
    root = files.resolve(os.path.abspath(path)) if not is_dcp(path) else os.path.abspath(path)
    reader = SafeReader(root)
    md = reader.read_metadata()
    meta = _meta(root)
    nested = _is_nested(md, meta, eng.names)
    problem = storage_problem(md, root, meta)  # (every rank, agreed: a node's missing file fails them all at once)
    agree(eng.comm.group, problem, who, eng.device, "cannot read the checkpoint's storage files")
    if problem:
        raise ValueError(f"{who}: the DCP checkpoint at {root!r} cannot be loaded: {problem}")
    opt_meta = None
    check_owner(optimizer, eng, who)
    if optimizer is not None:
        kinds = {k.split(".")[-1] for k in md.state_dict_metadata if k.startswith("optim.state.")}
        have = set(optimizer.unit_states[0]) - {"master"} if optimizer.unit_states else set()
        if not have <= kinds:
            raise ValueError(f"{who}: the DCP checkpoint at {root!r} holds optimizer states {sorted(kinds)}, "
                             f"the {optimizer.kind!r} optimizer needs {sorted(have)}")
        opt_meta = {"kind": optimizer.kind, "param_groups": [{"params": [eng.names[eng.param_index[id(p)]]
                                                                          for p in g["params"]]}
                                                               for g in optimizer.param_groups]}
    check_optimizer(optimizer, opt_meta, eng, who)
    live = eng.live_optimizer() if optimizer is None else None
    sd = _state_dict(eng, model, optimizer, loading=True, live=live)
    if optimizer is not None:  # loaded on their own below, by their flat keys
        del sd["optim"]["param_groups"]
    want = sd if nested else sd["model"]
    saved = {k.split(".", 1)[1] if nested else k for k in md.state_dict_metadata if not nested or k.startswith("model.")}
    missing = [n for n in eng.names if n not in saved]
    def size(n):
        return tuple(getattr(md.state_dict_metadata[("model." if nested else "") + n], "size", ()))

    wrong = [f"{n}: saved {list(size(n))}, model {list(p.shape)}" for n, p in zip(eng.names, eng.params)
             if n in saved and size(n) != tuple(p.shape)]
    if wrong:
        raise ValueError(f"{who}: the DCP checkpoint at {root!r} is for a different model; shape mismatch: {wrong}")
    if missing:
        raise ValueError(f"{who}: the DCP checkpoint at {root!r} is for a different model; missing: {missing}")
    if unexpected := sorted(set(saved) - set(model.state_dict(keep_vars=True))):  # (a bigger model's: loaded before)
        raise ValueError(f"{who}: the DCP checkpoint at {root!r} is for a different model; not in the model: "
                         f"{unexpected}")
    check_tied(model, eng, md, saved, "model." if nested else "", who, root, meta.get("aliases", {}))
    rest = {n: t for n, t in model.state_dict(keep_vars=True).items() if id(t) not in eng.param_index}
    if absent := [n for n in rest if n not in saved]:  # (kept their values, silently: a frozen param its init)
        raise ValueError(f"{who}: the DCP checkpoint at {root!r} is for a different model; buffers or frozen params "
                         f"missing: {absent}")
    if wrong := [f"{n}: saved {list(size(n))}, model {list(t.shape)}" for n, t in rest.items()
                 if size(n) != tuple(t.shape)]:
        raise ValueError(f"{who}: the DCP checkpoint at {root!r} is for a different model; shape mismatch: {wrong}")
    if optimizer is not None and not nested:
        raise ValueError(f"{who}: the DCP checkpoint at {root!r} holds no optimizer state ('optim')")
    if optimizer is not None:  # checked before anything is loaded
        saved_groups = param_groups(reader, md)
        _check_groups(optimizer, eng, saved_groups, who, root)
        check_kind(meta.get("optimizer") or saved_kind(saved_groups), optimizer.kind, who, "zerofuse.zero.Optimizer")
        check_torch_options(saved_groups, who, root)
        steps = _group_steps(optimizer, eng, saved_steps(reader, md), who, root)
        for entry in want["optim"]["state"].values():
            entry.pop("step", None)  # one count per group, set below (each param's was written into it)
        absent = sorted(n for n, entry in want["optim"]["state"].items()
                        if any(f"optim.state.{n}.{k}" not in md.state_dict_metadata for k in entry))
        if absent:  # (DCP's planner raised a CheckpointException, a BaseException, midway through the load)
            raise ValueError(f"{who}: the DCP checkpoint at {root!r} holds no optimizer state for {absent} (frozen or "
                             "never stepped in the run that saved it); load the model alone (optimizer=None) and "
                             "start the optimizer afresh")
    dcp.load(want, storage_reader=reader, planner=SafeLoadPlanner(), process_group=eng.comm.group)
    if optimizer is not None:
        for g, saved_g in zip(optimizer.param_groups, saved_groups):
            g.update({k: v for k, v in saved_g.items() if k != "params" and k in g})
        for s, step in zip(optimizer._steps, steps):
            s.fill_(step)
        if optimizer.host is not None:  # offload keeps host copies of the step counters (left at 0 before)
            optimizer.host.load_steps()
        optimizer.write_params()
    elif live is not None and any("master" in st for st in live.unit_states):
        live.write_params()  # weights only into a live optimizer's fp32 masters: the params from them
    else:
        eng.params_loaded()  # weights only: a live zero.Optimizer's fp32 masters follow them (else its step wrote the old back)
        eng.params_written()  # (stage 3 inside full_params: the gathered units too)
    extra_file = os.path.join(root, EXTRA)
    ours = files.read_tensors(extra_file) if os.path.isfile(extra_file) else {}
    if optimizer is not None:  # fp16's loss scale (not saved before: the load restarted it from initial_scale)
        saved_precision = files.read_json(os.path.join(root, files.META)).get("precision") \
            if os.path.isfile(os.path.join(root, files.META)) else None
        restore_scale(optimizer, saved_precision, ours.get("scale"), ours.get("growth_tracker"))
    return ours.get("extra")


def _check_groups(optimizer, eng, saved_groups: list[dict], who: str, root: str) -> None:
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"{who}: the DCP checkpoint at {root!r} has {len(saved_groups)} param groups, the "
                         f"optimizer {len(optimizer.param_groups)}")
    for i, (g, saved_g) in enumerate(zip(optimizer.param_groups, saved_groups)):
        names = {eng.names[eng.param_index[id(p)]] for p in g["params"]}
        if "params" in saved_g and set(saved_g["params"]) != names:  # (applied by position before)
            raise ValueError(f"{who}: the DCP checkpoint at {root!r} has param group {i} over other params "
                             f"than the optimizer's: saved {sorted(saved_g['params'])}, optimizer {sorted(names)}")


def _group_steps(optimizer, eng, saved: dict[str, float], who: str, root: str) -> list[float]:
    """The step count of each param group: torch counts per param (a param without a grad at a step
    is not counted), zerofuse per group, so the counts of a group's params must agree."""
    out = []
    for gi, g in enumerate(optimizer.param_groups):
        got = {n: saved[n] for n in (eng.names[eng.param_index[id(p)]] for p in g["params"]) if n in saved}
        if len(set(got.values())) > 1:
            some = dict(sorted(got.items(), key=lambda kv: kv[1])[:3])
            raise ValueError(f"{who}: the DCP checkpoint at {root!r} counts Adam's steps per param and param group "
                             f"{gi} has several step counts: {some} ... and {max(got.values()):g}; zerofuse's "
                             "optimizer keeps one count per group: put the params of each count in a group of "
                             "their own, or load with optimizer=None")
        if not got and optimizer.kind != "lars":
            raise ValueError(f"{who}: the DCP checkpoint at {root!r} holds no step count for param group {gi} "
                             f"(the {optimizer.kind!r} optimizer's bias correction needs it)")
        out.append(next(iter(got.values()), 0.0))
    return out


@torch.no_grad()
def consolidate(path: str, optimizer: bool = True) -> dict:
    """A DCP checkpoint as zerofuse.checkpoint.consolidate gives it: full tensors in one process."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: PLC0415
    root = os.path.abspath(path) if is_dcp(path) else files.resolve(os.path.abspath(path))
    reader = SafeReader(root)
    md = reader.read_metadata()
    meta = _meta(root)
    nested = _is_nested(md, meta)
    if problem := storage_problem(md, root, meta):
        raise ValueError(f"zerofuse.checkpoint.consolidate: the DCP checkpoint at {root!r} cannot be read: {problem}")
    want = read_saved(root, md, [k for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)
                                 and (not nested or k.startswith(("model.", "optim.state.") if optimizer
                                                                 else "model."))])  # (DCP's flat keys)
    model = {k.removeprefix("model.") if nested else k: t for k, t in want.items() if not nested or k.startswith("model.")}
    for alias, first in meta.get("aliases", {}).items():
        if first in model:
            model[alias] = model[first]
    optim = None
    if optimizer and nested and any(k.startswith("optim.param_groups") for k in md.state_dict_metadata):
        index = {n: i for i, n in enumerate(model)}
        state: dict[int, dict] = {}
        for k, t in want.items():
            if k.startswith("optim.state."):
                fqn, key = k.removeprefix("optim.state.").rsplit(".", 1)
                state.setdefault(index[fqn], {})[key] = t
        groups = [g | {"params": [index[n] for n in g.get("params", [])]} for g in param_groups(reader, md)]
        optim = {"state": state, "param_groups": groups}
    extra_file = os.path.join(root, EXTRA)
    extra = files.read_tensors(extra_file)["extra"] if os.path.isfile(extra_file) else None
    return {"model": model, "optimizer": optim, "extra": extra,
            "optimizer_names": list(model) if optim is not None else None}  # (index's order)
