"""zerofuse's own checkpoint format: every rank writes its shards, any layout reads them back.

Layout of a checkpoint directory (format 2):
    meta.json    world size, stage, precision, optimizer, param names/shapes, param groups, step
                 counts, loss scale, and the table of which param pieces each rank file holds
                 (name, unit, shard offset, length, offset in the flattened param); written last
    rank{r}.pt   rank r's shards: per unit the param shard (param dtype), the fp32 master and the
                 optimizer states
    common.pt    (rank 0) the buffers, frozen params and the caller's ``extra``
Tensors, numbers, strings, lists and dicts only (read with weights_only=True).

With tensor parallelism each TP rank's ZeRO group writes the layout above into ``tp{t}/`` and the
top-level meta.json holds the TP size and every sharded param's TPSpec.

Loading reads, for each piece of this rank's new shards, the overlapping pieces of the saved rank
files that hold them (found from meta.json; the other files are never opened), memory-mapped, on
the CPU, copied into the shards on their device. At another TP size one param at a time is
assembled from the TP parts and sliced: memory while loading stays within this rank's shards and
one full param (+ its TP parts). Saving follows [Note: checkpoint commit protocol] (files.py).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from zerofuse.checkpoint import files
from zerofuse.tp.spec import TPSpec, spec_of
from zerofuse.zero.engine import engine_of

NAME = files.NAME
FORMAT = 2
VALUE = "value"  # the param's value: the fp32 master where saved, else the param shard


def _saving_ranks(eng) -> int:
    return 1 if eng.stage == 0 else eng.world_size  # stage 0: rank 0's copy is the checkpoint


def _table(eng, rank: int) -> list[list]:
    """The pieces rank ``rank``'s shards hold (the bucket layout is the same on every rank)."""
    rows = []
    for u in eng.units:
        lo = rank * u.shard_numel
        for i, (p, o) in enumerate(zip(u.params, u.offsets)):
            a, b = max(o, lo), min(o + p.numel(), lo + u.shard_numel)
            if a < b:
                rows.append([u.names[i], u.index, a - lo, b - a, a - o])
    return rows


def save(path: str, model: torch.nn.Module, optimizer=None, *, extra=None) -> None:
    eng = engine_of(model, f"{NAME}.save")
    if optimizer is not None and optimizer.engine is not eng:
        raise ValueError(f"{NAME}.save: the optimizer belongs to a different model")
    files.check_plain(extra)
    if eng.stage != 3:
        eng.finish_param_sync()
    path = os.path.abspath(path)
    tp = eng.tp_comm is not None
    # who coordinates: the ZeRO group's rank 0, or with TP the world's (one ZeRO group per TP rank)
    group = None if tp else eng.comm.group
    leader = dist.get_rank() == 0 if tp else eng.rank == 0
    tmp = path + ".tmp"
    if leader:
        files.begin(path)
    dist.barrier(group=group)
    sub = os.path.join(tmp, f"tp{eng.tp_rank}") if tp else tmp
    if tp and eng.rank == 0:
        os.makedirs(sub)
        files.fsync_dir(tmp)
    dist.barrier(group=group)
    if eng.rank < _saving_ranks(eng):
        _write_shards(sub, eng, model, optimizer, extra)
    dist.barrier(group=group)
    if tp and eng.rank == 0:
        files.fsync_dir(sub)
        files.write_json(os.path.join(sub, files.META), _meta(eng, model, optimizer))
        files.fsync_dir(sub)
    if tp:
        dist.barrier(group=group)
    if leader:
        if tp:
            specs = {n: spec.to_json() for n, p in zip(eng.names, eng.params) if (spec := spec_of(p)) is not None}
            top = {"format": FORMAT, "tp": eng.tp_comm.world_size, "specs": specs}
        else:
            top = _meta(eng, model, optimizer)
        files.fsync_dir(tmp)
        files.write_json(os.path.join(tmp, files.META), top)
        files.commit(path)
    dist.barrier(group=group)


def _write_shards(directory: str, eng, model, optimizer, extra) -> None:
    units = []
    for u in eng.units:
        entry = {"param": u.shard}
        if optimizer is not None:
            entry.update(optimizer.unit_states[u.index])
        units.append(entry)
    files.write_tensors(os.path.join(directory, f"rank{eng.rank}.pt"), {"units": units})
    if eng.rank == 0:
        managed = {id(p) for p in eng.params}
        rest = {n: t.detach() for n, t in model.state_dict(keep_vars=True).items() if id(t) not in managed}
        files.write_tensors(os.path.join(directory, "common.pt"), {"rest": rest, "extra": extra})


def _meta(eng, model, optimizer) -> dict:
    return {
        "format": FORMAT, "world_size": eng.world_size, "stage": eng.stage, "precision": eng.precision,
        "names": eng.names, "shapes": [list(p.shape) for p in eng.params],
        "tables": [_table(eng, r) for r in range(_saving_ranks(eng))],
        # state_dict names of params shared under another name (tied weights)
        "aliases": {n: eng.names[eng.param_index[id(t)]] for n, t in model.state_dict(keep_vars=True).items()
                    if id(t) in eng.param_index and n not in eng.names},
        "optimizer": None if optimizer is None else {
            "kind": optimizer.kind,
            "state_keys": sorted(k for k in optimizer.unit_states[0] if k != "master") if optimizer.unit_states else [],
            "param_groups": [{k: v for k, v in g.items() if k != "params"} | {
                "params": [eng.names[eng.param_index[id(p)]] for p in g["params"]]} for g in optimizer.param_groups],
            "steps": [float(s.item()) for s in optimizer._steps],
            "scale": float(optimizer.scale.item()),
            "growth_tracker": int(optimizer._growth_tracker.item()),
        },
    }


class Source:
    """One saved ZeRO layout (a checkpoint without TP, or one TP part): which rank file holds
    which piece of which param; rank files are opened (memory-mapped) only when a piece is read."""

    def __init__(self, directory: str):
        self.dir = directory
        self.meta = files.read_json(os.path.join(directory, files.META))
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{NAME}: checkpoint format {self.meta.get('format')!r} at {directory!r}; this zerofuse "
                             f"reads format {FORMAT}")
        self.shapes = {n: tuple(s) for n, s in zip(self.meta["names"], self.meta["shapes"])}
        self.pieces: dict[str, list] = {}
        for r, table in enumerate(self.meta["tables"]):
            for name, unit, so, length, po in table:
                self.pieces.setdefault(name, []).append((r, unit, so, length, po))
        self._blobs: dict[int, dict] = {}
        self._common = None

    def blob(self, r: int) -> dict:
        if r not in self._blobs:
            self._blobs[r] = files.read_tensors(os.path.join(self.dir, f"rank{r}.pt"))
        return self._blobs[r]

    def _saved(self, r: int, unit: int, key: str) -> torch.Tensor:
        entry = self.blob(r)["units"][unit]
        if key == VALUE:
            key = "master" if "master" in entry else "param"
        if key not in entry:
            raise ValueError(f"{NAME}: {self.dir!r} rank{r}.pt holds no {key!r} for unit {unit}")
        return entry[key]

    def fill(self, dst: torch.Tensor, name: str, param_off: int, key: str) -> None:
        """dst (1-D) <- elements [param_off, param_off + dst.numel()) of the flattened saved ``key``
        of param ``name``."""
        lo, hi = param_off, param_off + dst.numel()
        covered = 0
        for r, unit, so, length, po in self.pieces.get(name, ()):
            a, b = max(lo, po), min(hi, po + length)
            if a < b:
                dst[a - lo:b - lo].copy_(self._saved(r, unit, key)[so + a - po:so + b - po])
                covered += b - a
        if covered != hi - lo:
            raise ValueError(f"{NAME}: the checkpoint's shards cover {covered} of {hi - lo} elements of {name!r}")

    def dtype(self, name: str, key: str) -> torch.dtype:
        r, unit = self.pieces[name][0][:2]
        return self._saved(r, unit, key).dtype

    def full(self, name: str, key: str) -> torch.Tensor:
        shape = self.shapes[name]
        t = torch.empty(shape, dtype=self.dtype(name, key))
        self.fill(t.view(-1), name, 0, key)
        return t

    def common(self) -> dict:
        """{'rest': buffers and frozen params, 'extra': what save was given}"""
        if self._common is None:
            self._common = files.read_tensors(os.path.join(self.dir, "common.pt"))
        return self._common


def layout(path: str) -> tuple[str, dict, list[Source] | None]:
    """(the resolved directory, its top meta, the TP parts' Sources or None without TP)."""
    root = files.resolve(os.path.abspath(path))
    top = files.read_json(os.path.join(root, files.META))
    if top.get("format") != FORMAT:
        raise ValueError(f"{NAME}: checkpoint format {top.get('format')!r} at {root!r}; this zerofuse reads "
                         f"format {FORMAT}")
    if "tp" not in top:
        return root, top, None
    return root, top, [Source(os.path.join(root, f"tp{t}")) for t in range(top["tp"])]


class Full:
    """Full (un-TP-sharded) tensors of a checkpoint, one param at a time."""

    def __init__(self, path: str):
        self.root, top, parts = layout(path)
        self.parts = parts if parts is not None else [Source(self.root)]
        self.tp = len(self.parts)
        self.specs = {n: TPSpec.from_json(d, self.tp, 0) for n, d in top.get("specs", {}).items()}
        self.meta = self.parts[0].meta
        self.shapes = {n: tuple(self.specs[n].full_shape) if n in self.specs else s
                       for n, s in self.parts[0].shapes.items()}

    def get(self, name: str, key: str) -> torch.Tensor:
        spec = self.specs.get(name)
        if spec is None:  # not TP-sharded: every TP part holds it whole
            return self.parts[0].full(name, key)
        out = torch.empty(spec.full_shape, dtype=self.parts[0].dtype(name, key))
        for r, part in enumerate(self.parts):  # one TP part alive at a time beside the full tensor
            spec.place(out, part.full(name, key), r)
        return out


def check_model(saved: dict, names, shapes, who) -> None:
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


def check_optimizer(optimizer, opt_meta, eng, who) -> None:
    if optimizer is None:
        return
    if opt_meta is None:
        raise ValueError(f"{who}: the checkpoint holds no optimizer state (saved without an optimizer)")
    if optimizer.kind != opt_meta["kind"]:
        raise ValueError(f"{who}: the checkpoint's optimizer is {opt_meta['kind']!r}, this one is {optimizer.kind!r}")
    by_name = {n: i for i, n in enumerate(eng.names)}
    saved_groups = opt_meta["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups) or any(
            sorted(by_name.get(n, -1) for n in saved["params"]) != sorted(eng.param_index[id(p)] for p in g["params"])
            for g, saved in zip(optimizer.param_groups, saved_groups)):
        raise ValueError(f"{who}: the checkpoint's param groups hold different params than the optimizer's")


@torch.no_grad()
def load(path: str, model: torch.nn.Module, optimizer=None):
    """Load into a ZeRO model (any world size, stage and TP size) and its zero.Optimizer."""
    who = f"{NAME}.load"
    eng = engine_of(model, who)
    full = Full(path)
    model_tp = eng.tp_comm.world_size if eng.tp_comm is not None else 1
    same_tp = full.tp == model_tp
    src = full.parts[eng.tp_rank] if same_tp else None
    shapes = [p.shape if same_tp or (spec := spec_of(p)) is None else spec.full_shape for p in eng.params]
    check_model(src.shapes if same_tp else full.shapes, eng.names, shapes, who)
    opt_meta = full.meta["optimizer"]
    check_optimizer(optimizer, opt_meta, eng, who)
    group = None if eng.tp_comm is not None else eng.comm.group
    try:
        _fill_shards(eng, optimizer, opt_meta, full, src)
        first = full.parts[0].common()
    except (ValueError, OSError) as e:
        agree(group, e, who, eng.units[0].device)
        raise
    agree(group, None, who, eng.units[0].device)
    _finish_load(eng, model, optimizer, opt_meta, first.get("rest", {}))
    return first.get("extra")


def _fill_shards(eng, optimizer, opt_meta, full, src) -> None:
    """This rank's shards (params, masters, optimizer states) from the checkpoint; ``src``: this
    rank's TP part when the TP size is the same, else None (assembled from ``full``)."""
    keys = [VALUE] + ([k for k in opt_meta["state_keys"]] if optimizer is not None else [])
    for u in eng.units:
        states = optimizer.unit_states[u.index] if optimizer is not None else {}
        for s in u.segments:
            name, p = u.names[s.param], u.params[s.param]
            sl = slice(s.shard_offset, s.shard_offset + s.length)
            for key in keys:
                dsts = [u.shard[sl]] + ([states["master"][sl]] if "master" in states else []) if key == VALUE \
                    else [states[key][sl]]
                if src is not None:
                    for dst in dsts:
                        src.fill(dst, name, s.param_offset, key)
                    continue
                # another TP layout: this param's full tensor, sliced to this rank's TP part
                spec = spec_of(p)
                t = full.get(name, key)
                mine = (spec.slice(t) if spec is not None else t).reshape(-1)[s.param_offset:s.param_offset + s.length]
                for dst in dsts:
                    dst.copy_(mine)
                del t, mine  # before the next one is assembled: one full tensor at a time


def agree(group, error, who, device) -> None:
    """Collective: raise on every rank if reading failed on any (a rank reads only its own files,
    so one bad file fails one rank; the others must not go on into a collective it never joins)."""
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
    failed = [torch.zeros_like(flag) for _ in range(dist.get_world_size(group))]
    dist.all_gather(failed, flag, group=group)
    ranks = [r for r, f in enumerate(failed) if f.item()]
    if ranks and error is None:
        raise ValueError(f"{who}: rank(s) {ranks} of the group could not read their part of the checkpoint "
                         "(their errors say why)")


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
    full = Full(path)
    meta = full.meta
    opt_meta = meta["optimizer"]
    model, opt_state = {}, {}
    for i, name in enumerate(meta["names"]):
        model[name] = full.get(name, VALUE)
        if opt_meta is not None:
            st = {key: full.get(name, key) for key in opt_meta["state_keys"]}
            gi = next(j for j, g in enumerate(opt_meta["param_groups"]) if name in g["params"])
            if opt_meta["kind"] in ("adam", "adamw", "lamb"):
                st["step"] = torch.tensor(opt_meta["steps"][gi])
            opt_state[i] = st
    first = full.parts[0].common()
    model.update(first.get("rest", {}))
    for alias, name in meta.get("aliases", {}).items():
        model[alias] = model[name]
    optim = None
    if opt_meta is not None:
        index = {n: i for i, n in enumerate(meta["names"])}
        groups = [{k: (tuple(v) if isinstance(v, list) else v) for k, v in g.items() if k != "params"}
                  | {"params": [index[n] for n in g["params"]]} for g in opt_meta["param_groups"]]
        optim = {"state": opt_state, "param_groups": groups}
    return {"model": model, "optimizer": optim, "extra": first.get("extra")}
