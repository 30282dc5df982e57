"""``zerofuse.checkpoint``: sharded ZeRO checkpoints that load at any world size and stage.

Layout of a checkpoint directory:
    meta.json    world size, stage, precision, optimizer, param names/shapes, param groups, step
                 counts, loss scale (written last by rank 0)
    rank{r}.pt   rank r's shards: per unit the param shard (param dtype), the fp32 master and the
                 optimizer states, plus the table of which param pieces they hold
                 (name, unit, shard offset, length, offset in the flattened param); rank 0's file
                 also holds the buffers, frozen params and the caller's ``extra``.

With tensor parallelism each TP rank's ZeRO group writes the layout above into ``tp{t}/`` and
the top-level meta.json holds the TP size and every sharded param's TPSpec (how it slices the
full tensor). Loading at the same TP size reads the rank's own part; at another TP size (or
without TP) the parts are merged into full tensors and each rank slices its own.

Saving is atomic: every rank writes into ``<path>.tmp``, then (after a barrier) rank 0 writes
meta.json and renames the directory into place (an older checkpoint at ``path`` is moved to
``<path>.old`` first and removed after). A crash at any point leaves either the old checkpoint or
the new one loadable, never a partial one. Loading reads, for each piece of this rank's new
shards, the overlapping pieces of every saved rank's file (memory-mapped), so a checkpoint saved at
4 ranks stage 3 loads at 2 ranks stage 1, at 1 rank, or into a plain model. The files must be on
a filesystem every rank sees.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

from zerofuse.tp.spec import TPSpec, spec_of
from zerofuse.zero.engine import engine_of

NAME = "zerofuse.checkpoint"
FORMAT = 1


def _value_key(saved_unit: dict) -> str:
    return "master" if "master" in saved_unit else "param"


def save(path: str, model: torch.nn.Module, optimizer=None, *, extra=None) -> None:
    """Collective: every rank of the model's group calls it (with tensor parallelism: every rank of
    the world, i.e. of the dp × tp mesh). ``extra`` (anything torch.save takes, e.g. the data
    position) comes back from load()."""
    eng = engine_of(model, f"{NAME}.save")
    if optimizer is not None and optimizer.engine is not eng:
        raise ValueError(f"{NAME}.save: the optimizer belongs to a different model")
    if eng.stage != 3:
        eng.finish_param_sync()
    path = os.path.abspath(path)
    tmp = path + ".tmp"
    tp = eng.tp_comm is not None
    # who coordinates: the ZeRO group's rank 0, or with TP the world's (one ZeRO group per TP rank)
    group = None if tp else eng.comm.group
    leader = dist.get_rank() == 0 if tp else eng.rank == 0
    if leader:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier(group=group)
    sub = os.path.join(tmp, f"tp{eng.tp_rank}") if tp else tmp
    if tp and eng.rank == 0:
        os.makedirs(sub)
    dist.barrier(group=group)
    _write_shards(sub, eng, model, optimizer, extra)
    dist.barrier(group=group)
    if tp and eng.rank == 0:
        _write_json(os.path.join(sub, "meta.json"), _meta(eng, model, optimizer))
    if tp:
        dist.barrier(group=group)
    if leader:
        if tp:
            specs = {n: spec.to_json() for n, p in zip(eng.names, eng.params) if (spec := spec_of(p)) is not None}
            _write_json(os.path.join(tmp, "meta.json"), {"format": FORMAT, "tp": eng.tp_comm.world_size,
                                                          "specs": specs})
        else:
            _write_json(os.path.join(tmp, "meta.json"), _meta(eng, model, optimizer))
        old = path + ".old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group=group)


def _write_shards(directory: str, eng, model, optimizer, extra) -> None:
    units = []
    table = []
    replica = eng.stage == 0 and eng.rank != 0  # stage 0: rank 0's copy is the checkpoint
    for u in ([] if replica else eng.units):
        entry = {"param": u.shard.clone()}
        if optimizer is not None:
            entry.update({k: t for k, t in optimizer.unit_states[u.index].items()})
        units.append(entry)
        for s in u.segments:
            table.append((u.names[s.param], u.index, s.shard_offset, s.length, s.param_offset))
    blob = {"format": FORMAT, "units": units, "table": table}
    if eng.rank == 0:
        managed = {id(p) for p in eng.params}
        blob["rest"] = {n: t.detach().clone() for n, t in model.state_dict(keep_vars=True).items()
                        if id(t) not in managed}
        blob["extra"] = extra
    torch.save(blob, os.path.join(directory, f"rank{eng.rank}.pt"))


def _meta(eng, model, optimizer) -> dict:
    return {
        "format": FORMAT, "world_size": eng.world_size, "stage": eng.stage, "precision": eng.precision,
        "names": eng.names, "shapes": [list(p.shape) for p in eng.params],
        # state_dict names of params shared under another name (tied weights)
        "aliases": {n: eng.names[eng.param_index[id(t)]] for n, t in model.state_dict(keep_vars=True).items()
                    if id(t) in eng.param_index and n not in eng.names},
        "optimizer": None if optimizer is None else {
            "kind": optimizer.kind,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} | {
                "params": [eng.names[eng.param_index[id(p)]] for p in g["params"]]} for g in optimizer.param_groups],
            "steps": [float(s.item()) for s in optimizer._steps],
            "scale": float(optimizer.scale.item()),
            "growth_tracker": int(optimizer._growth_tracker.item()),
        },
    }


def _write_json(file: str, obj) -> None:
    with open(file, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _resolve(path: str) -> str:
    """path, or the older checkpoint a crash mid-rename left at path.old."""
    for p in (path, path + ".old"):
        if os.path.isfile(os.path.join(p, "meta.json")):
            return p
    raise FileNotFoundError(f"{NAME}: no complete checkpoint at {path!r} (no meta.json)")


def _read_meta(path: str) -> tuple[str, dict]:
    path = _resolve(os.path.abspath(path))
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{NAME}: checkpoint format {meta.get('format')} at {path!r}; this zerofuse reads {FORMAT}")
    return path, meta


def _read(path: str):
    """(meta, rank blobs) of a checkpoint without tensor parallelism, or of one TP rank's part."""
    path, meta = _read_meta(path)
    if "tp" in meta:
        raise ValueError(f"{NAME}: {path!r} is a tensor-parallel checkpoint; read its parts tp0, tp1, ...")
    blobs = [torch.load(os.path.join(path, f"rank{r}.pt"), mmap=True, weights_only=False)
             for r in range(meta["world_size"])]
    return meta, blobs


def _check_model(meta, names, shapes, who) -> None:
    saved = dict(zip(meta["names"], (tuple(s) for s in meta["shapes"])))
    mine = dict(zip(names, (tuple(s) for s in shapes)))
    missing = [n for n in mine if n not in saved]
    unexpected = [n for n in saved if n not in mine]
    wrong = [f"{n}: saved {list(saved[n])}, model {list(mine[n])}" for n in mine if n in saved and saved[n] != mine[n]]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing in the checkpoint: {missing}")
        if unexpected:
            parts.append(f"not in the model: {unexpected}")
        if wrong:
            parts.append(f"shape mismatch: {wrong}")
        raise ValueError(f"{who}: the checkpoint is for a different model; " + "; ".join(parts))


def _pieces(blobs):
    """name -> [(blob, unit, shard_offset, length, param_offset)]"""
    out: dict[str, list] = {}
    for blob in blobs:
        for name, unit, so, length, po in blob["table"]:
            out.setdefault(name, []).append((blob, unit, so, length, po))
    return out


def _fill(dst: torch.Tensor, name: str, dst_param_off: int, pieces, key_of) -> None:
    """dst (a slice of a new shard) <- the saved pieces of param ``name`` covering
    [dst_param_off, dst_param_off + dst.numel()) of the flattened param."""
    lo, hi = dst_param_off, dst_param_off + dst.numel()
    covered = 0
    for blob, unit, so, length, po in pieces[name]:
        a, b = max(lo, po), min(hi, po + length)
        if a >= b:
            continue
        saved_unit = blob["units"][unit]
        src = saved_unit[key_of(saved_unit)]
        dst[a - lo:b - lo].copy_(src[so + a - po:so + b - po])
        covered += b - a
    if covered != hi - lo:
        raise ValueError(f"{NAME}: the checkpoint's shards cover {covered} of {hi - lo} elements of {name!r}")


@torch.no_grad()
def load(path: str, model: torch.nn.Module, optimizer=None):
    """Load into a ZeRO model (any world size and stage) and its zero.Optimizer, or into a plain
    model (and a torch-style optimizer via consolidate()). Returns the ``extra`` given to save."""
    eng = getattr(model, "_zerofuse_zero", None)
    if eng is None:
        full = consolidate(path)
        model.load_state_dict(full["model"])
        if optimizer is not None:
            optimizer.load_state_dict(full["optimizer"])
        return full["extra"]
    root, top = _read_meta(path)
    saved_tp = top.get("tp", 1)
    model_tp = eng.tp_comm.world_size if eng.tp_comm is not None else 1
    if saved_tp != model_tp:  # another TP layout: slice this rank's part out of the full tensors
        return _load_full(_consolidated(path), eng, model, optimizer)
    meta, blobs = _read(os.path.join(root, f"tp{eng.tp_rank}") if saved_tp > 1 else root)
    who = f"{NAME}.load"
    _check_model(meta, eng.names, [p.shape for p in eng.params], who)
    pieces = _pieces(blobs)
    opt_meta = meta["optimizer"]
    _check_optimizer(optimizer, opt_meta, eng, who)
    for u in eng.units:
        states = optimizer.unit_states[u.index] if optimizer is not None else {}
        for s in u.segments:
            name = u.names[s.param]
            sl = slice(s.shard_offset, s.shard_offset + s.length)
            _fill(u.shard[sl], name, s.param_offset, pieces, _value_key)
            if "master" in states:
                _fill(states["master"][sl], name, s.param_offset, pieces, _value_key)
            for key, t in states.items():
                if key != "master":
                    _fill(t[sl], name, s.param_offset, pieces, lambda _u, k=key: k)
    _finish_load(eng, model, optimizer, opt_meta, blobs[0].get("rest", {}))
    return blobs[0].get("extra")


def _check_optimizer(optimizer, opt_meta, eng, who) -> None:
    if optimizer is not None:
        if opt_meta is None:
            raise ValueError(f"{who}: the checkpoint holds no optimizer state (saved without an optimizer)")
        if optimizer.kind != opt_meta["kind"]:
            raise ValueError(f"{who}: the checkpoint's optimizer is {opt_meta['kind']!r}, this one is {optimizer.kind!r}")
        by_name = {n: i for i, n in enumerate(eng.names)}
        saved_groups = opt_meta["param_groups"]
        if len(saved_groups) != len(optimizer.param_groups) or any(
                sorted(by_name[n] for n in saved["params"]) != sorted(eng.param_index[id(p)] for p in g["params"])
                for g, saved in zip(optimizer.param_groups, saved_groups)):
            raise ValueError(f"{who}: the checkpoint's param groups hold different params than the optimizer's")


def _load_full(full: dict, eng, model, optimizer):
    """Load from consolidated tensors: each param (and its optimizer states) sliced to this rank's
    TP part (TPSpec) and ZeRO shard."""
    who = f"{NAME}.load"
    full_shape = [tuple(spec.full_shape) if (spec := spec_of(p)) is not None else tuple(p.shape) for p in eng.params]
    _check_model({"names": list(full["names"]), "shapes": [list(full["model"][n].shape) for n in full["names"]]},
                 eng.names, full_shape, who)
    opt_meta = full["optimizer_meta"]
    _check_optimizer(optimizer, opt_meta, eng, who)
    index = {n: i for i, n in enumerate(full["names"])}
    states_full = full["optimizer"]["state"] if full["optimizer"] is not None else {}
    for u in eng.units:
        states = optimizer.unit_states[u.index] if optimizer is not None else {}
        for s in u.segments:
            name, p = u.names[s.param], u.params[s.param]
            spec = spec_of(p)

            def part(t, spec=spec, s=s):
                mine = spec.slice(t) if spec is not None else t
                return mine.reshape(-1)[s.param_offset:s.param_offset + s.length]

            sl = slice(s.shard_offset, s.shard_offset + s.length)
            value = part(full["model"][name])
            u.shard[sl].copy_(value)
            for key, t in states.items():
                t[sl].copy_(value if key == "master" else part(states_full[index[name]][key]))
    _finish_load(eng, model, optimizer, opt_meta, full["rest"])
    return full["extra"]


def _finish_load(eng, model, optimizer, opt_meta, rest) -> None:
    if optimizer is not None:
        for g, saved in zip(optimizer.param_groups, opt_meta["param_groups"]):
            g.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items() if k != "params"})
        for s, step in zip(optimizer._steps, opt_meta["steps"]):
            s.fill_(step)
        optimizer.scale.fill_(opt_meta["scale"])
        optimizer._growth_tracker.fill_(opt_meta["growth_tracker"])
    if rest:
        sd = model.state_dict(keep_vars=True)
        for n, t in rest.items():
            if n in sd:
                sd[n].data.copy_(t)
    if eng.stage != 3:
        eng.start_param_sync()
        eng.finish_param_sync()


@torch.no_grad()
def consolidate(path: str) -> dict:
    """{'model': a plain state_dict (full tensors; fp32 from the masters when the run kept them),
    'optimizer': torch.optim-format state (params numbered in the saved order) or None,
    'extra': what save() was given}. Runs in one process, no process group needed; tensor-parallel
    checkpoints are merged into the unsharded model's tensors."""
    full = _consolidated(path)
    return {k: full[k] for k in ("model", "optimizer", "extra")}


def _consolidated(path: str) -> dict:
    """consolidate()'s dict plus what loading needs: param names, aliases, optimizer meta, buffers."""
    root, top = _read_meta(path)
    if "tp" not in top:
        return _consolidate_part(root)
    parts = [_consolidate_part(os.path.join(root, f"tp{t}")) for t in range(top["tp"])]
    out = parts[0]
    for name, d in top["specs"].items():
        spec = TPSpec.from_json(d, top["tp"], 0)
        out["model"][name] = spec.merge([p["model"][name] for p in parts])
        if out["optimizer"] is not None:
            i = out["names"].index(name)
            for key in out["optimizer"]["state"][i]:
                if key != "step":
                    out["optimizer"]["state"][i][key] = spec.merge([p["optimizer"]["state"][i][key] for p in parts])
    for alias, name in out["aliases"].items():
        out["model"][alias] = out["model"][name]
    return out


def _consolidate_part(path: str) -> dict:
    meta, blobs = _read(path)
    pieces = _pieces(blobs)
    model = {}
    opt_meta = meta["optimizer"]
    state_keys = []
    if opt_meta is not None:
        first = next((u for b in blobs for u in b["units"]), {})
        state_keys = [k for k in first if k not in ("param", "master")]
    opt_state = {}
    for i, (name, shape) in enumerate(zip(meta["names"], meta["shapes"])):
        numel = 1
        for d in shape:
            numel *= d
        blob0, unit0 = pieces[name][0][0], pieces[name][0][1]
        src0 = blob0["units"][unit0][_value_key(blob0["units"][unit0])]
        t = torch.empty(numel, dtype=src0.dtype)
        _fill(t, name, 0, pieces, _value_key)
        model[name] = t.view(shape)
        if opt_meta is not None:
            st = {}
            for key in state_keys:
                s = torch.empty(numel, dtype=torch.float32)
                _fill(s, name, 0, pieces, lambda _u, k=key: k)
                st[key] = s.view(shape)
            gi = next(j for j, g in enumerate(opt_meta["param_groups"]) if name in g["params"])
            if opt_meta["kind"] in ("adam", "adamw", "lamb"):
                st["step"] = torch.tensor(opt_meta["steps"][gi])
            opt_state[i] = st
    model.update(blobs[0].get("rest", {}))
    for alias, name in meta.get("aliases", {}).items():
        model[alias] = model[name]
    optim = None
    if opt_meta is not None:
        index = {n: i for i, n in enumerate(meta["names"])}
        groups = [{k: (tuple(v) if isinstance(v, list) else v) for k, v in g.items() if k != "params"}
                  | {"params": [index[n] for n in g["params"]]} for g in opt_meta["param_groups"]]
        optim = {"state": opt_state, "param_groups": groups}
    return {"model": model, "optimizer": optim, "extra": blobs[0].get("extra"), "names": meta["names"],
            "aliases": meta.get("aliases", {}), "optimizer_meta": opt_meta, "rest": blobs[0].get("rest", {})}
