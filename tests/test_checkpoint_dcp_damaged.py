"""A damaged or foreign DCP checkpoint is refused by name before anything is loaded (a review's
reproductions, 2026-12-07): a missing or cut-short storage file (DCP's CheckpointException, a
BaseException, came midway, the model and the moments partly overwritten), a missing or damaged
.metadata (read as "format 'dcp', this zerofuse reads format 2"; a bare EOFError), and an untied
model's checkpoint in a tied model (loaded silently, the head's matrix dropped)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import zerofuse

from dist_utils import error_text, run_distributed

pytestmark = pytest.mark.usefixtures("native_kernels")


def _gpt(tied: bool):
    from zerofuse.models import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=65, seq_len=16, n_layer=1, n_head=2, dim=32, tie_embeddings=tied), seed=1)


def _trained(rank):
    model = zerofuse.zero.parallelize(_gpt(True), stage=2)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-2)
    idx = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(idx, idx)[1].backward()
    opt.step()
    return model, opt


def _save_rank(rank, ws, path):
    model, opt = _trained(rank)
    zerofuse.checkpoint.save(path, model, opt, format="dcp")


def _load_rank(rank, ws, path, with_optimizer=True):
    model, opt = _trained(rank + 10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [st["exp_avg"].clone() for st in opt.unit_states]
    err = error_text(lambda: zerofuse.checkpoint.load(path, model, opt if with_optimizer else None))
    untouched = (all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
                 and all(torch.equal(st["exp_avg"], m) for st, m in zip(opt.unit_states, moments)))
    return err, untouched


@pytest.mark.parametrize("damage", ["missing", "cut", "extra"])
def test_a_missing_or_cut_storage_file_is_refused_before_anything_loads(tmp_path, damage):
    """"extra": zerofuse's zerofuse_extra.pt (the loss scale, the caller's extra) gone: the load kept
    the loss scale it had and returned None for the extra, silently."""
    path = str(tmp_path / "ck")
    run_distributed(_save_rank, 2, path, timeout=240)
    shard = os.path.join(path, "zerofuse_extra.pt" if damage == "extra" else "__1_0.distcp")
    if damage == "cut":
        os.truncate(shard, os.path.getsize(shard) // 2)
    else:
        os.remove(shard)
    want = "is cut short" if damage == "cut" else "is missing"
    for err, untouched in run_distributed(_load_rank, 2, path, timeout=240):
        assert "cannot be loaded: its" in err and os.path.basename(shard) in err and want in err, err
        assert untouched
    with pytest.raises(ValueError, match=want):
        zerofuse.checkpoint.consolidate(path)


@pytest.mark.parametrize("damage", ["missing", "cut"])
def test_a_missing_or_damaged_metadata_is_named(tmp_path, damage):
    path = str(tmp_path / "ck")
    run_distributed(_save_rank, 2, path, timeout=240)
    meta = os.path.join(path, ".metadata")
    with open(meta, "rb") as src, open(os.path.join(str(tmp_path), "whole.metadata"), "wb") as dst:
        dst.write(src.read())
    if damage == "missing":
        os.remove(meta)
    else:
        os.truncate(meta, 20)
    want = "has no .metadata" if damage == "missing" else "is damaged or cut short"
    with pytest.raises(ValueError, match=want):
        zerofuse.checkpoint.consolidate(path)
    for err, _ in run_distributed(_load_rank, 2, path, timeout=240):
        assert want in err, err
    if damage == "cut":  # (cuts inside a number's bytes raised a bare struct.error)
        whole = open(os.path.join(str(tmp_path), "whole.metadata"), "rb").read()
        for cut in (5, 9, len(whole) // 2, len(whole) - 3):
            with open(meta, "wb") as f:
                f.write(whole[:cut])
            with pytest.raises(ValueError, match=want):
                zerofuse.checkpoint.consolidate(path)


def test_an_untied_models_checkpoint_is_refused_by_a_tied_model(tmp_path):
    path = str(tmp_path / "torch")
    untied = _gpt(False)
    with torch.no_grad():
        untied.head.weight.add_(1.0)  # (a head apart from the embedding)
    dcp.save({"model": untied.state_dict()}, checkpoint_id=path, no_dist=True)
    for err, untouched in run_distributed(_load_rank, 2, path, False, timeout=240):
        assert "the model ties head.weight and wte.weight (one matrix)" in err and "two different ones" in err, err
        assert untouched
