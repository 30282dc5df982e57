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


class _MetadataUnpickler(pickle._Unpickler):  # (the Python one: its BUILD can be checked)
    def find_class(self, module, name):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                           (torch.dtype, torch.layout,
                                                                            torch.memory_format))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata type")

    def load_build(self):
        """BUILD sets the state of the object below it: aimed at an admitted class itself (not an
        instance) it set class attributes for the whole process (PosixPath.__truediv__ replaced:
        every later path join, the job's saves included, broken by a file that was refused)."""
        target = self.stack[-2]
        if isinstance(target, type):
            raise pickle.UnpicklingError(f"a BUILD of the class {target.__qualname__} (setting its "
                                         "attributes) is not DCP metadata")
        # only DCP's own metadata objects take a state: a PosixPath's set its cached string apart from
        # its parts, the name checked below other than the file DCP opened (a review's reproduction,
        # 2026-12-07: another checkpoint's file read into the model)
        if not type(target).__module__.startswith("torch.distributed.checkpoint."):
            raise pickle.UnpicklingError(f"a BUILD of a {type(target).__qualname__} (setting its state) is not "
                                         "DCP metadata")
        super().load_build()

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = load_build


class SafeReader(dcp.FileSystemReader):
    """DCP's reader with a .metadata unpickler limited to DCP's own metadata types."""

    def read_metadata(self, *args, **kwargs):
        file = os.path.join(str(self.path), DCP_META)
        try:
            with open(file, "rb") as f:
                md = _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as e:
            raise ValueError(f"{NAME}: refused to load {file!r}: {e} (loading it could run code)") from None
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
