"""``export_hf``: a checkpoint's consolidated weights as safetensors files plus a config JSON, the
layout Hugging Face tooling reads (``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
with ``model.safetensors.index.json`` past ``max_shard_bytes``). Names stay zerofuse's (the
state_dict keys of the saved model); a tied weight is written once and the tie recorded in the config."""
from __future__ import annotations

import os
import re

import torch

from zerofuse.checkpoint import files

NAME = files.NAME


def _safetensors():
    try:
        from safetensors.torch import save_file  # noqa: PLC0415
    except ImportError:
        raise ImportError(f"{NAME}.export_hf needs the safetensors package: pip install safetensors "
                          "(or pip install 'zerofuse[export]')") from None
    return save_file


def export_hf(path: str, out_dir: str, *, config: dict | None = None, dtype: torch.dtype | None = None,
              max_shard_bytes: int = 5 << 30) -> list[str]:
    """Write ``path``'s model (zerofuse or DCP format, any layout) to ``out_dir``; returns the files
    written. ``config``: the model's config (default: ``extra["config"]`` when the run saved one,
    as zerofuse-train does); ``dtype``: cast floating tensors (default: as saved, fp32 from masters)."""
    from zerofuse.checkpoint import consolidate  # noqa: PLC0415 - the package imports this module

    save_file = _safetensors()
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"{NAME}.export_hf: expected dtype to be a floating torch.dtype or None, got {dtype!r}")
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"{NAME}.export_hf: expected max_shard_bytes to be a positive int, got {max_shard_bytes!r}")
    full = consolidate(path)
    tensors, ties, seen = {}, {}, {}
    for n, t in full["model"].items():
        key = (t.data_ptr(), t.shape, t.dtype) if t.numel() else None
        if key is not None and key in seen:  # safetensors stores no shared tensors: write a tie once
            ties[n] = seen[key]
            continue
        if key is not None:
            seen[key] = n
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[n] = t.contiguous()
    extra = full.get("extra")
    if config is None:
        config = dict(extra["config"]) if isinstance(extra, dict) and isinstance(extra.get("config"), dict) else {}
    config = dict(config)
    config["tie_word_embeddings"] = bool(ties)
    config["zerofuse_tied"] = ties
    written_dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.") if tensors else None
    if dtype is not None:  # the dtype the files hold, whatever the given config said (it kept its own)
        config["torch_dtype"] = written_dtype
    else:
        config.setdefault("torch_dtype", written_dtype)
    os.makedirs(out_dir, exist_ok=True)
    # an earlier export's weights would stay beside these (transformers opens model.safetensors
    # before an index: a one-file export under a sharded one was what it loaded)
    for old in os.listdir(out_dir):
        if old in ("model.safetensors", "model.safetensors.index.json") or re.fullmatch(
                r"model-\d{5}-of-\d{5}\.safetensors", old):
            os.remove(os.path.join(out_dir, old))
    shards, cur, size = [], {}, 0
    for n, t in tensors.items():
        b = t.numel() * t.element_size()
        if cur and size + b > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[n] = t
        size += b
    shards.append(cur)
    written = []
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
        written.append(name)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {n: name for name, shard in zip(names, shards) for n in shard}}
        files.write_json(os.path.join(out_dir, "model.safetensors.index.json"), index)
        written.append("model.safetensors.index.json")
    files.write_json(os.path.join(out_dir, "config.json"), config)
    written.append("config.json")
    return [os.path.join(out_dir, w) for w in written]
