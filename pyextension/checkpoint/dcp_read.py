"""Reading a DCP checkpoint without trusting it: DCP's ``.metadata`` goes through an unpickler that
admits DCP's metadata classes only, the storage files it names must be files of the checkpoint's
own directory, and non-tensor values (param groups) load with ``weights_only=True``."""
from __future__ import annotations

import io
import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from zerofuse.checkpoint import files

NAME = files.NAME
DCP_META = files.DCP_META
EXTRA = "zerofuse_extra.pt"  # (save writes it before meta.json; load reads the loss scale and extra from it)


# Everything DCP's .metadata pickles (torch 2.8-2.13): its metadata dataclasses and torch's own
# value types. Anything else is refused.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.storage", "_StorageInfo"),
    ("torch", "Size"), ("torch", "float32"), ("torch", "strided"), ("torch", "contiguous_format"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("builtins", "set"),
    ("pathlib", "PosixPath"), ("enum", "Enum"),
}


class _Refused(pickle.UnpicklingError):
    """A .metadata refused for what it would run (not for being damaged)."""


class _MetadataUnpickler(pickle._Unpickler):  # (the Python one: its BUILD can be checked)
    def find_class(self, module, name):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                           (torch.dtype, torch.layout,
                                                                            torch.memory_format))):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name} is not a DCP metadata type")

    def load_build(self):
        """BUILD sets the state of the object below it: aimed at an admitted class itself (not an
        instance) it set class attributes for the whole process (PosixPath.__truediv__ replaced:
        every later path join, the job's saves included, broken by a file that was refused)."""
        target = self.stack[-2]
        if isinstance(target, type):
            raise _Refused(f"a BUILD of the class {target.__qualname__} (setting its attributes) is not DCP "
                           "metadata")
        # only DCP's own metadata objects take a state: a PosixPath's set its cached string apart from
        # its parts, the name checked below other than the file DCP opened (a review's reproduction,
        # 2026-12-07: another checkpoint's file read into the model)
        if not type(target).__module__.startswith("torch.distributed.checkpoint."):
            raise _Refused(f"a BUILD of a {type(target).__qualname__} (setting its state) is not DCP metadata")
        super().load_build()

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = load_build


class SafeReader(dcp.FileSystemReader):
    """DCP's reader with a .metadata unpickler limited to DCP's own metadata types."""

    def read_metadata(self, *args, **kwargs):
        file = os.path.join(str(self.path), DCP_META)
        if not os.path.isfile(file):  # (meta.json said format 'dcp': the native reader's "reads format 2" before)
            raise ValueError(f"{NAME}: the DCP checkpoint at {str(self.path)!r} has no {DCP_META} (DCP writes it "
                             "last: an incomplete or damaged checkpoint)")
        try:
            with open(file, "rb") as f:
                md = _MetadataUnpickler(f).load()
        except _Refused as e:
            raise ValueError(f"{NAME}: refused to load {file!r}: {e} (loading it could run code)") from None
        except Exception as e:  # cut or damaged (a bare EOFError or struct.error, or "could run code" for a cut file)
            raise ValueError(f"{NAME}: {file!r} is damaged or cut short ({type(e).__name__}: {e})") from None
        if getattr(md, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        if md.planner_data is None:
            md.planner_data = {k: (k,) for k in md.state_dict_metadata}  # as DCP's own reader fills it
        _check_storage_paths(md, str(self.path), file)
        return md


def _check_storage_paths(md, root: str, file: str) -> None:
    """Every storage file the metadata names is a plain file name in the checkpoint's directory (DCP
    joins root / relative_path: '../x' or an absolute path read any torch-saved file on the machine
    into the model)."""
    real_root = os.path.realpath(root)
    for index, info in (getattr(md, "storage_data", None) or {}).items():
        rel = str(getattr(info, "relative_path", ""))
        target = os.path.realpath(os.path.join(root, rel))
        if not rel or os.path.isabs(rel) or "/" in rel or "\\" in rel or rel in (".", "..") \
                or os.path.dirname(target) != real_root:
            raise ValueError(f"{NAME}: refused to load {file!r}: it names the storage file {rel!r} for "
                             f"{getattr(index, 'fqn', index)!r}, expected a file of the checkpoint's directory")
        object.__setattr__(info, "relative_path", rel)  # the name checked is the one DCP joins


def storage_problem(md, root: str, meta: dict | None = None) -> str | None:
    """Why the storage files the metadata names cannot all be read (missing, or shorter than the
    metadata reads), None when they can: checked before a load writes anything (DCP raised its
    CheckpointException, a BaseException, midway: the model and the moments partly overwritten;
    a review's reproduction, 2026-12-07). A checkpoint zerofuse saved (``meta`` its meta.json)
    also needs the zerofuse_extra.pt written before that meta.json (without it the load kept the
    loss scale it had and returned no extra, silently)."""
    if (meta or {}).get("format") == "dcp" and not os.path.isfile(file := os.path.join(root, EXTRA)):
        return f"its file {file!r} (the loss scale and the caller's extra, which zerofuse's save writes) is missing"
    ends: dict[str, int] = {}
    for info in (getattr(md, "storage_data", None) or {}).values():
        rel = str(info.relative_path)
        ends[rel] = max(ends.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in sorted(ends.items()):
        file = os.path.join(root, rel)
        if not os.path.isfile(file):
            return f"its storage file {file!r} is missing"
        if (size := os.path.getsize(file)) < end:
            return f"its storage file {file!r} is cut short ({size} bytes; the metadata reads up to {end})"
    return None


def read_saved(root: str, md, keys: list[str]) -> dict:
    """The saved tensors ``keys`` (DCP's flat keys), whole, read by this process alone."""
    want = {k: torch.empty(md.state_dict_metadata[k].size, dtype=md.state_dict_metadata[k].properties.dtype)
            for k in keys}
    dcp.load(want, storage_reader=SafeReader(root), planner=SafeLoadPlanner(flatten_state_dict=False), no_dist=True)
    return want


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor values (param groups, step counts saved as numbers) load with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise ValueError(f"{NAME}: refused to load {read_item.dest_index.fqn!r} of a DCP checkpoint: it is not "
                             f"plain data (loading it could run code): {str(e).splitlines()[0]}") from None
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def check_tied(model, eng, md, saved, prefix: str, who: str, root: str, recorded: dict) -> None:
    """A model holding one matrix under two names (tied embeddings) loads a checkpoint holding two
    only if they are equal (an untied model's loaded silently, the second name's matrix dropped, where
    the native format refuses and torch keeps the other: a review's reproduction, 2026-12-07)."""
    names = set(eng.names)
    pairs = [(n, eng.names[eng.param_index[id(t)]]) for n, t in model.state_dict(keep_vars=True).items()
             if n not in names and id(t) in eng.param_index and n in saved]
    # (a tie zerofuse's save recorded in meta.json's aliases holds one matrix: not read twice to compare)
    pairs = [(a, b) for a, b in pairs if recorded.get(a) != b]
    if not pairs:
        return
    got = read_saved(root, md, sorted({prefix + n for pair in pairs for n in pair}))
    if differ := [f"{a} and {b}" for a, b in pairs if not torch.equal(got[prefix + a], got[prefix + b])]:
        raise ValueError(f"{who}: the model ties {', '.join(differ)} (one matrix); the DCP checkpoint at {root!r} "
                         "holds two different ones (an untied model's: load it into an untied model)")


def saved_steps(reader, md) -> dict[str, float]:
    """Each param's saved step count (``optim.state.<fqn>.step``: a tensor, or a number)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: PLC0415
    keys = {k: m for k, m in md.state_dict_metadata.items() if k.startswith("optim.state.") and k.endswith(".step")}
    if not keys:
        return {}
    want = {k: torch.empty(m.size, dtype=m.properties.dtype) if isinstance(m, TensorStorageMetadata) else None
            for k, m in keys.items()}
    planner = SafeLoadPlanner(flatten_state_dict=False)
    dcp.load(want, storage_reader=reader, planner=planner, no_dist=True)
    return {k.removeprefix("optim.state.").removesuffix(".step"): float(planner.state_dict[k]) for k in keys}


def param_groups(reader, md) -> list[dict]:
    """The optimizer's param groups of a DCP checkpoint (plain values, read with weights_only)."""
    keys = [k for k in md.state_dict_metadata if k.startswith("optim.param_groups")]
    planner = SafeLoadPlanner(flatten_state_dict=False)
    dcp.load({k: None for k in keys}, storage_reader=reader, planner=planner, no_dist=True)
    if keys == ["optim.param_groups"]:  # the list saved as one value
        return list(planner.state_dict["optim.param_groups"])
    by_group: dict[int, dict] = {}
    for k in keys:
        i, opt_key = k.removeprefix("optim.param_groups.").split(".", 1)
        by_group.setdefault(int(i), {})[opt_key] = planner.state_dict[k]
    return [by_group[i] for i in sorted(by_group)]
