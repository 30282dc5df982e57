"""The read side of zerofuse's checkpoint format (native.py): a saved ZeRO layout (Source), a
checkpoint's full tensors one param at a time across TP parts (Full) and across pipeline stages
(each stage saved its own params into ``pp{s}/``, with its own ZeRO/TP layout inside), and
``consolidate``: the whole checkpoint as plain state dicts, in one process."""
from __future__ import annotations

import math
import os

import torch

from zerofuse.checkpoint import files
from zerofuse.tp.spec import TPSpec

NAME = files.NAME
FORMAT = 2
VALUE = "value"  # the param's value: the fp32 master where saved, else the param shard


def same_save(where: str, got, want) -> None:
    """A file of a checkpoint is of its save: the save id it records is its meta.json's (files saved
    before 2026-12-07 record none: not checked). A rank file copied in from another save of the same
    model passed every size check and loaded silently (a review's reproduction, 2026-12-07)."""
    if want is not None and got != want:
        raise ValueError(f"{NAME}: {where} is of another save than the checkpoint's (save id {got}, expected {want} "
                         "as its meta.json says): a file copied in from another checkpoint?")


def _nat(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_meta(meta, file: str) -> None:
    """A layout's meta.json holds what save wrote, in its types (an edited or damaged one failed in
    Python's words midway: KeyError 'tables', IndexError, a str length added to an int, a negative
    offset in a copy's size error; a review's reproductions, 2026-12-07)."""
    def refuse(key: str, want: str, got) -> None:
        got = repr(got)
        raise ValueError(f"{NAME}: {file}: expected {key} {want}, got {got[:120] + ('...' if len(got) > 120 else '')} "
                         "(a damaged or edited meta.json)")

    if not isinstance(meta, dict):
        refuse("the file", "to hold an object", meta)
    names, shapes, tables = meta.get("names"), meta.get("shapes"), meta.get("tables")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        refuse("'names'", "a list of parameter names", names)
    if not isinstance(shapes, list) or len(shapes) != len(names) or not all(
            isinstance(sh, list) and all(map(_nat, sh)) for sh in shapes):
        refuse("'shapes'", f"a list of {len(names)} shapes (one per name, lists of sizes >= 0)", shapes)
    if not isinstance(tables, list) or not all(isinstance(t, list) for t in tables):
        refuse("'tables'", "a list of the ranks' tables", tables)
    known = set(names)
    if not isinstance(meta.get("precision"), str):
        refuse("'precision'", "a precision's name", meta.get("precision"))
    aliases = meta.get("aliases", {})
    if not isinstance(aliases, dict) or not all(isinstance(a, str) and n in known for a, n in aliases.items()):
        refuse("'aliases'", "an object of names to names of 'names'", aliases)
    for r, table in enumerate(tables):
        for row in table:
            if not (isinstance(row, list) and len(row) == 5 and row[0] in known and all(map(_nat, row[1:]))):
                refuse(f"each row of 'tables'[{r}]", "[a name of 'names', unit, shard offset, length, param offset] "
                       "with whole numbers >= 0", row)
    if "optimizer" not in meta:
        refuse("'optimizer'", "(null, or the optimizer's kind, state keys, param groups and steps)", None)
    opt = meta["optimizer"]
    if opt is None:
        return
    groups = opt.get("param_groups") if isinstance(opt, dict) else None
    if not isinstance(opt, dict) or not isinstance(opt.get("kind"), str) or not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        refuse("'optimizer'", "an object with 'kind' and 'param_groups' (each with its 'params')", opt)
    if stray := [n for g in groups for n in g["params"] if n not in known]:
        refuse("'optimizer'.'param_groups' to hold", "names of 'names'", stray)
    if not isinstance(opt.get("state_keys"), list) or not all(isinstance(k, str) for k in opt["state_keys"]):
        refuse("'optimizer'.'state_keys'", "a list of state names", opt.get("state_keys"))
    steps = opt.get("steps")
    if not isinstance(steps, list) or len(steps) != len(groups) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in steps):
        refuse("'optimizer'.'steps'", f"{len(groups)} step counts >= 0 (one per param group)", steps)
    for key in ("scale", "growth_tracker"):
        if not isinstance(opt.get(key), (int, float)) or isinstance(opt.get(key), bool):
            refuse(f"'optimizer'.'{key}'", "a number", opt.get(key))


def check_format(meta: dict, directory: str) -> None:
    """meta.json's format, and a top meta's layout (pipeline stages, TP parts) in its types."""
    file = os.path.join(directory, files.META)
    if not isinstance(meta, dict):
        check_meta(meta, file)  # (refuses it by name)
    for key in ("pp", "tp"):
        if key in meta and not (_nat(meta[key]) and meta[key] >= 1):
            raise ValueError(f"{NAME}: {file}: expected '{key}' a whole number >= 1, got {meta[key]!r} (a damaged or "
                             "edited meta.json)")
    if not isinstance(meta.get("specs", {}), dict):
        raise ValueError(f"{NAME}: {file}: expected 'specs' an object of names to TP specs, got {meta['specs']!r} (a "
                         "damaged or edited meta.json)")
    if meta.get("format") == "dcp":  # (".metadata" missing: "this zerofuse reads format 2" before: a review's
        # reproduction, 2026-12-07)
        raise ValueError(f"{NAME}: the DCP checkpoint at {directory!r} has no {files.DCP_META} (DCP writes it last: "
                         "an incomplete or damaged checkpoint)")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{NAME}: checkpoint format {meta.get('format')!r} at {directory!r}; this zerofuse reads "
                         f"format {FORMAT}")


class Source:
    """One saved ZeRO layout (a checkpoint without TP, or one TP part): which rank file holds
    which piece of which param; rank files are opened (memory-mapped) only when a piece is read.
    save_id: the enclosing meta.json's (TP parts, pipeline stages), which this one's must be."""

    def __init__(self, directory: str, save_id: int | None = None):
        self.dir = directory
        self.meta = files.read_json(os.path.join(directory, files.META))
        check_format(self.meta, directory)
        check_meta(self.meta, os.path.join(directory, files.META))
        same_save(os.path.join(directory, files.META), self.meta.get("save_id"), save_id)
        self.save_id = self.meta.get("save_id")
        self.shapes = {n: tuple(s) for n, s in zip(self.meta["names"], self.meta["shapes"])}
        self.pieces: dict[str, list] = {}
        for r, table in enumerate(self.meta["tables"]):
            for name, unit, so, length, po in table:
                self.pieces.setdefault(name, []).append((r, unit, so, length, po))
        self._blobs: dict[int, dict] = {}
        self._common = None

    def blob(self, r: int) -> dict:
        if r not in self._blobs:
            file = os.path.join(self.dir, f"rank{r}.pt")
            blob = files.read_tensors(file)
            same_save(file, blob.get("save_id") if isinstance(blob, dict) else None, self.save_id)
            self._blobs[r] = blob
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

    def check(self, wanted: dict, keys) -> None:
        """The pieces of ``wanted`` ({name: [(lo, hi), ...] element ranges of the flattened param, or
        None: all of it}) and ``keys`` are where the tables say, before a load writes anything (a
        rank file of another save, or a cut one, was found midway: a half-loaded model, and a size
        error on one rank that left its peers waiting). Opens only the rank files holding them."""
        for name, ranges in wanted.items():
            pieces = self.pieces.get(name, ())
            for lo, hi in ranges if ranges is not None else [(0, math.prod(self.shapes.get(name, ())))]:
                got = sum(max(0, min(hi, po + length) - max(lo, po)) for *_, length, po in pieces)
                if got != hi - lo:  # (found by fill, midway through the load, before: a half-loaded model)
                    raise ValueError(f"{NAME}: the checkpoint's shards cover {got} of {hi - lo} elements "
                                     f"[{lo}, {hi}) of {name!r} ({self.dir!r} {files.META}'s tables: a row missing, "
                                     "or a file of another save)")
            for r, unit, so, length, po in pieces:
                if ranges is not None and not any(lo < po + length and po < hi for lo, hi in ranges):
                    continue
                units = self.blob(r).get("units")
                if not isinstance(units, (list, tuple)) or not 0 <= unit < len(units):
                    raise ValueError(f"{NAME}: {self.dir!r} rank{r}.pt holds no unit {unit} (its table names one)")
                for key in keys:
                    t = self._saved(r, unit, key)
                    if not isinstance(t, torch.Tensor) or t.dim() != 1 or so + length > t.numel():
                        got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                        raise ValueError(f"{NAME}: {self.dir!r} rank{r}.pt: the {key!r} of unit {unit} is {got}; its "
                                         f"table puts {length} elements of {name!r} at offset {so} (a file of "
                                         "another save?)")

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
            file = os.path.join(self.dir, "common.pt")
            common = files.read_tensors(file)
            same_save(file, common.get("save_id") if isinstance(common, dict) else None, self.save_id)
            self._common = common
        return self._common


def layout(path: str, save_id: int | None = None) -> tuple[str, dict, list[Source] | None]:
    """(the resolved directory, its top meta, the TP parts' Sources or None without TP); save_id:
    as Source's."""
    root = files.resolve(os.path.abspath(path))
    top = files.read_json(os.path.join(root, files.META))
    check_format(top, root)
    if top.get("format") != FORMAT:
        raise ValueError(f"{NAME}: checkpoint format {top.get('format')!r} at {root!r}; this zerofuse reads "
                         f"format {FORMAT}")
    same_save(os.path.join(root, files.META), top.get("save_id"), save_id)
    if "tp" not in top:
        return root, top, None
    return root, top, [Source(os.path.join(root, f"tp{t}"), top.get("save_id")) for t in range(top["tp"])]


class _StageFull:
    """Full (un-TP-sharded) tensors of one saved layout (a whole checkpoint, or a pipeline stage's)."""

    def __init__(self, path: str, save_id: int | None = None):
        self.root, top, parts = layout(path, save_id)
        self.parts = parts if parts is not None else [Source(self.root, save_id)]
        self.tp = len(self.parts)
        self.specs = {n: TPSpec.from_json(d, self.tp, 0) for n, d in top.get("specs", {}).items()}
        self.meta = self.parts[0].meta
        self.shapes = {n: tuple(self.specs[n].full_shape) if n in self.specs else s
                       for n, s in self.parts[0].shapes.items()}

    def rest(self) -> dict:
        """The buffers and frozen params, TP-sharded frozen params whole (from every TP part: the
        first part's was taken as the whole tensor)."""
        out = dict(self.parts[0].common().get("rest", {}))
        for n, t in out.items():
            spec = self.specs.get(n)
            if spec is not None and tuple(t.shape) != tuple(spec.full_shape):
                whole = torch.empty(spec.full_shape, dtype=t.dtype)
                for r, part in enumerate(self.parts):
                    spec.place(whole, part.common()["rest"][n], r)
                out[n] = whole
        return out

    def get(self, name: str, key: str) -> torch.Tensor:
        spec = self.specs.get(name)
        if spec is None:  # not TP-sharded: every TP part holds it whole
            return self.parts[0].full(name, key)
        out = torch.empty(spec.full_shape, dtype=self.parts[0].dtype(name, key))
        for r, part in enumerate(self.parts):  # one TP part alive at a time beside the full tensor
            spec.place(out, part.full(name, key), r)
        return out


class Full:
    """Full (un-TP-sharded) tensors of a checkpoint, one param at a time, whatever the pipeline
    layout it was saved at: ``stages`` one _StageFull per saved pipeline stage; ``parts`` (the TP
    parts' Sources) only for a checkpoint saved without pipeline stages."""

    def __init__(self, path: str):
        root = files.resolve(os.path.abspath(path))
        top = files.read_json(os.path.join(root, files.META))
        check_format(top, root)
        self.pp = top.get("pp", 1)
        self.stages = [_StageFull(os.path.join(root, f"pp{k}"), top.get("save_id")) for k in range(self.pp)] \
            if "pp" in top else [_StageFull(root)]
        first = self.stages[0]
        self.parts = first.parts if self.pp == 1 else None
        self.tp = first.tp
        self.specs = {n: sp for st in self.stages for n, sp in st.specs.items()}
        self.shapes = {n: sh for st in self.stages for n, sh in st.shapes.items()}
        self._where = {n: st for st in self.stages for n in st.shapes}
        self.meta = _merged_meta([st.meta for st in self.stages])

    def get(self, name: str, key: str) -> torch.Tensor:
        return self._where[name].get(name, key)

    def check(self, names, keys) -> None:
        """Source.check of ``names`` whole, over every TP part of the stages holding them."""
        for st in self.stages:
            mine = {n: None for n in names if self._where.get(n) is st}
            for part in st.parts if mine else ():
                part.check(mine, keys)

    def common(self) -> dict:
        """The first stage's extra, and every stage's buffers and frozen params (whole)."""
        out = dict(self.stages[0].parts[0].common())
        out["rest"] = {n: t for st in self.stages for n, t in st.rest().items()}
        return out


def _merged_meta(metas: list[dict]) -> dict:
    """One meta over the pipeline stages' metas: their names in stage order, the optimizer's param
    groups with every stage's params (the groups' options and step counts are the same on all)."""
    if len(metas) == 1:
        return metas[0]
    out = dict(metas[0])
    out["names"] = [n for m in metas for n in m["names"]]
    out["shapes"] = [s for m in metas for s in m["shapes"]]
    out["aliases"] = {a: n for m in metas for a, n in m.get("aliases", {}).items()}
    opts = [m["optimizer"] for m in metas]
    if opts[0] is not None:
        groups, steps = [], []
        for opt in opts:  # a stage's group joins the one of equal options (a stage may lack a group: a
            used = set()  # first stage of embeddings only has no no-decay group; zipped by position, the
            for k, (g, step) in enumerate(zip(opt["param_groups"], opt["steps"])):  # others' second was lost)
                options = {key: v for key, v in g.items() if key != "params"}
                same = [j for j, m in enumerate(groups) if j not in used
                        and {key: v for key, v in m.items() if key != "params"} == options]
                if same:
                    j = k if k in same else same[0]
                    groups[j]["params"] = groups[j]["params"] + list(g["params"])
                else:
                    j = len(groups)
                    groups.append(dict(g, params=list(g["params"])))
                    steps.append(step)
                used.add(j)
        out["optimizer"] = {**opts[0], "param_groups": groups, "steps": steps}
    return out


@torch.no_grad()
def consolidate(path: str, optimizer: bool = True) -> dict:
    """{'model': a plain state_dict (full tensors; fp32 from the masters when the run kept them),
    'optimizer': torch.optim-format state (params numbered in the saved order) or None,
    'extra': what save() was given}. Runs in one process, no process group needed; tensor-parallel
    checkpoints are merged into the unsharded model's tensors."""
    full = Full(path)
    meta = full.meta
    opt_meta = meta["optimizer"] if optimizer else None
    model, opt_state = {}, {}
    for i, name in enumerate(meta["names"]):
        model[name] = full.get(name, VALUE)
        if opt_meta is not None:
            st = {key: full.get(name, key) for key in opt_meta["state_keys"]}
            gi = next((j for j, g in enumerate(opt_meta["param_groups"]) if name in g["params"]), None)
            if gi is None:
                raise ValueError(f"zerofuse.checkpoint.consolidate: the checkpoint at {path!r} has optimizer state "
                                 f"for {name!r} but no param group holding it (a damaged meta.json)")
            if opt_meta["kind"] in ("adam", "adamw", "lamb"):
                st["step"] = torch.tensor(opt_meta["steps"][gi])
            opt_state[i] = st
    first = full.common()
    model.update(first.get("rest", {}))
    for alias, name in meta.get("aliases", {}).items():
        model[alias] = model[name]
    optim = None
    if opt_meta is not None:
        index = {n: i for i, n in enumerate(meta["names"])}
        groups = [{k: (tuple(v) if isinstance(v, list) else v) for k, v in g.items() if k != "params"}
                  | {"params": [index[n] for n in g["params"]]} for g in opt_meta["param_groups"]]
        optim = {"state": opt_state, "param_groups": groups}
    return {"model": model, "optimizer": optim, "extra": first.get("extra"),
            "optimizer_names": list(meta["names"]) if optim is not None else None}
