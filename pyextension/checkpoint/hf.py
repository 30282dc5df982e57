"""``export_hf``: a checkpoint's consolidated weights as safetensors files plus a config JSON, the
layout Hugging Face tooling reads (``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
with ``model.safetensors.index.json`` past ``max_shard_bytes``). Names are the saved model's
state_dict keys, or what ``rename`` makes of them (zerofuse.models.hf_names: a zerofuse GPT as
transformers' GPT-2 / Llama); a tied weight is written once and the tie recorded in the config."""
from __future__ import annotations

import json
import os
import re
import warnings

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
              max_shard_bytes: int = 5 << 30, rename=None) -> list[str]:
    """Write ``path``'s model (zerofuse or DCP format, any layout) to ``out_dir``; returns the files
    written. ``config``: the model's config (default: ``extra["config"]`` when the run saved one,
    as zerofuse-train does); ``dtype``: cast floating tensors (default: as saved, fp32 from masters);
    ``rename``: the consolidated state_dict -> the one written (e.g. a zerofuse GPT's under
    transformers' names: ``functools.partial(zerofuse.models.hf_names.to_hf, cfg)`` with
    ``config=hf_names.hf_config(cfg)``; a tied weight: the same tensor under both names)."""
    from zerofuse.checkpoint import consolidate  # noqa: PLC0415 - the package imports this module

    save_file = _safetensors()
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"{NAME}.export_hf: expected dtype to be a floating torch.dtype or None, got {dtype!r}")
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"{NAME}.export_hf: expected max_shard_bytes to be a positive int, got {max_shard_bytes!r}")
    files.check_directory_path(out_dir, f"{NAME}.export_hf", "out_dir", out_dir)  # (before the consolidation)
    full = consolidate(path, optimizer=False)  # (Adam's states: twice the fp32 model, never written here)
    model = full["model"] if rename is None else rename(full["model"])
    tensors, ties, seen = {}, {}, {}
    for n, t in model.items():
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
    if "model_type" not in config:  # (the files loaded nowhere, silently: a review's reproduction, 2026-12-07)
        warnings.warn(f"{NAME}.export_hf: the config written to {out_dir}/config.json has no 'model_type': "
                      "transformers' from_pretrained refuses it; pass config=model.config.to_dict() (a transformers "
                      "model's; a zerofuse GPT's: config=zerofuse.models.hf_names.hf_config(cfg) with rename="
                      "functools.partial(hf_names.to_hf, cfg)), or save the checkpoint with extra={'config': ...}",
                      stacklevel=2)
    config["tie_word_embeddings"] = bool(ties)
    config["zerofuse_tied"] = ties
    written_dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.") if tensors else None
    # the dtype the files hold under both keys (transformers 5 reads "dtype" before the legacy
    # "torch_dtype": a config of a bf16 model exported in fp32 loaded back in bf16; a review's
    # reproduction, 2026-12-06), whatever the given config said, when dtype= is given
    if dtype is not None:
        config["torch_dtype"] = config["dtype"] = written_dtype
    else:
        given = config.get("dtype") or config.get("torch_dtype") or written_dtype
        config["torch_dtype"] = config["dtype"] = given
    os.makedirs(out_dir, exist_ok=True)
    shards, cur, size = [], {}, 0
    for n, t in tensors.items():
        b = t.numel() * t.element_size()
        if cur and size + b > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[n] = t
        size += b
    shards.append(cur)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for old in os.listdir(out_dir):  # a killed export's leftovers
        if old.endswith(".part") and _ours(old.removesuffix(".part")):
            os.remove(os.path.join(out_dir, old))
    # every new file is written whole under a temporary name before an earlier export's file is
    # touched (a failure midway - disk full, a kill - leaves that export as it was); then renamed in:
    # the weights, the index, and only then an earlier export's other files removed (transformers opens
    # model.safetensors before an index: one left under a sharded export was what it loaded)
    written = list(names)
    try:
        for name, shard in zip(names, shards):
            save_file(shard, os.path.join(out_dir, name + ".part"), metadata={"format": "pt"})
            files.seal(os.path.join(out_dir, name + ".part"))
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                     "weight_map": {n: name for name, shard in zip(names, shards) for n in shard}}
            files.write_part(os.path.join(out_dir, "model.safetensors.index.json"), "w", lambda f: json.dump(index, f))
            written.append("model.safetensors.index.json")
        files.write_part(os.path.join(out_dir, "config.json"), "w", lambda f: json.dump(config, f))
        written.append("config.json")
    except BaseException:
        for name in written + ["model.safetensors.index.json", "config.json"]:
            if os.path.exists(os.path.join(out_dir, name + ".part")):
                os.remove(os.path.join(out_dir, name + ".part"))
        raise
    for name in written[:-1]:
        os.replace(os.path.join(out_dir, name + ".part"), os.path.join(out_dir, name))
    for old in os.listdir(out_dir):
        if _ours(old) and old not in written:
            os.remove(os.path.join(out_dir, old))
    os.replace(os.path.join(out_dir, "config.json.part"), os.path.join(out_dir, "config.json"))
    files.fsync_dir(out_dir)
    return [os.path.join(out_dir, w) for w in written]


def _ours(name: str) -> bool:
    """A weights file of an export (not the config: every export writes one)."""
    return name in ("model.safetensors", "model.safetensors.index.json") or bool(
        re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name))
