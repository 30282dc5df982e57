"""zerofuse.checkpoint with the ecosystem's formats, checked with their own functions: DCP written by
zerofuse read by torch (dcp_to_torch_save, get/set_state_dict), DCP written by plain torch loaded into
a ZeRO model, safetensors export read by safetensors.torch.load_file; and which files a rank opens."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import zerofuse
from zerofuse.checkpoint import files

from dist_utils import run_distributed
from test_checkpoint import STEPS_AFTER, STEPS_BEFORE, _steps
from zero_common import GLOBAL_BATCH, LR, WD, batches, make_model

pytestmark = pytest.mark.usefixtures("native_kernels")
STEPS = STEPS_BEFORE + STEPS_AFTER


def _plain_steps(model, opt, data):
    losses = []
    for b in data:
        _, loss = model(b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _zero_dcp_save(rank, ws, path, native, stage):
    model = make_model()
    zerofuse.zero.parallelize(model, stage=stage, bucket_mb=0.25)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD)
    data = batches(STEPS)
    _steps(rank, ws, model, opt, data[:STEPS_BEFORE])
    zerofuse.checkpoint.save(path, model, opt, extra={"step": STEPS_BEFORE}, format="dcp")
    zerofuse.checkpoint.save(native, model, opt, extra={"step": STEPS_BEFORE})
    return _steps(rank, ws, model, opt, data[STEPS_BEFORE:])


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_saves_dcp_that_torch_reads(tmp_path, stage):
    path, native = str(tmp_path / "dcp"), str(tmp_path / "native")
    cont = run_distributed(_zero_dcp_save, 2, path, native, stage, timeout=300)[0]
    assert os.path.isfile(os.path.join(path, ".metadata"))
    ref = zerofuse.checkpoint.consolidate(native)
    # torch's own consolidation of the DCP directory
    out = str(tmp_path / "full.pt")
    dcp_to_torch_save(path, out)
    full = torch.load(out, weights_only=False)
    for n, t in ref["model"].items():
        assert torch.equal(full["model"][n], t), n
    names = list(dict(make_model().named_parameters()))
    for i, n in enumerate(names):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(full["optim"]["state"][n][k], ref["optimizer"]["state"][i][k]), (n, k)
    # a plain model and torch.optim.AdamW resume from it through torch's DCP API
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    losses = _plain_steps(model, opt, batches(STEPS)[STEPS_BEFORE:])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cont), rtol=1e-5, atol=1e-6)
    # and zerofuse's own consolidate reads the DCP directory as well
    mine = zerofuse.checkpoint.consolidate(path)
    assert mine["extra"] == {"step": STEPS_BEFORE}
    for n, t in ref["model"].items():
        assert torch.equal(mine["model"][n], t), n


def _zero_dcp_load(rank, ws, path, stage):
    model = make_model()
    zerofuse.zero.parallelize(model, stage=stage, bucket_mb=0.1)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=123.0, weight_decay=0.5)  # the load restores lr and wd
    zerofuse.checkpoint.load(path, model, opt)
    assert opt.param_groups[0]["lr"] == LR and opt.param_groups[0]["weight_decay"] == WD
    return _steps(rank, ws, model, opt, batches(STEPS)[STEPS_BEFORE:])


@pytest.mark.parametrize("ws,stage", [(2, 3), (3, 1)])
def test_a_dcp_checkpoint_of_a_plain_torch_model_loads_into_zero(tmp_path, ws, stage):
    path = str(tmp_path / "torch_dcp")
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    data = batches(STEPS)
    _plain_steps(model, opt, data[:STEPS_BEFORE])
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    cont = _plain_steps(model, opt, data[STEPS_BEFORE:])
    resumed = run_distributed(_zero_dcp_load, ws, path, stage, timeout=300)[0]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(cont), rtol=1e-5, atol=1e-6)


def test_export_hf_writes_safetensors_that_load_file_reads(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    native = str(tmp_path / "native")
    run_distributed(_zero_dcp_save, 2, str(tmp_path / "dcp"), native, 3, timeout=300)
    ref = zerofuse.checkpoint.consolidate(native)
    out = str(tmp_path / "hf")
    written = zerofuse.checkpoint.export_hf(native, out, config={"model_type": "zerofuse-gpt", "n_layer": 2})
    assert [os.path.basename(w) for w in written] == ["model.safetensors", "config.json"]
    got = safetensors_torch.load_file(os.path.join(out, "model.safetensors"))
    cfg = json.load(open(os.path.join(out, "config.json")))
    for n, t in ref["model"].items():
        name = cfg["zerofuse_tied"].get(n, n)
        assert torch.equal(got[name], t), n
    assert cfg["n_layer"] == 2 and cfg["tie_word_embeddings"] == bool(cfg["zerofuse_tied"])
    # bf16 and several files: the index maps every tensor to its file
    out2 = str(tmp_path / "hf2")
    written = zerofuse.checkpoint.export_hf(native, out2, dtype=torch.bfloat16, max_shard_bytes=20_000)
    index = json.load(open(os.path.join(out2, "model.safetensors.index.json")))
    assert len(written) > 3
    mask = os.umask(0o022)
    os.umask(mask)
    for w in written:  # readable as any new file (safetensors created them 0600)
        assert os.stat(w).st_mode & 0o777 == 0o666 & ~mask, w
    for n, f in index["weight_map"].items():
        t = safetensors_torch.load_file(os.path.join(out2, f))[n]
        assert t.dtype == torch.bfloat16 and torch.equal(t, ref["model"][n].to(torch.bfloat16))
    with pytest.raises(TypeError, match="expected dtype to be a floating torch.dtype"):
        zerofuse.checkpoint.export_hf(native, out2, dtype=torch.int8)


# ---------------------------------------------------------------------------------------- files a rank opens

def _opened_rank(rank, ws, path, stage):
    opened = []
    real = files.read_tensors

    def spy(file):
        opened.append(os.path.basename(file))
        return real(file)

    files.read_tensors = spy
    model = make_model()
    zerofuse.zero.parallelize(model, stage=stage, bucket_mb=0.25)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD)
    zerofuse.checkpoint.load(path, model, opt)
    return sorted(set(opened))


def _save4(rank, ws, path):
    model = make_model()
    zerofuse.zero.parallelize(model, stage=2, bucket_mb=0.25)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD)
    _steps(rank, ws, model, opt, batches(1))
    zerofuse.checkpoint.save(path, model, opt)


def test_each_rank_opens_only_the_files_holding_its_pieces(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_save4, 4, path, timeout=300)
    same = run_distributed(_opened_rank, 4, path, 2, timeout=300)
    assert same == [["common.pt", f"rank{r}.pt"] for r in range(4)]
    half = run_distributed(_opened_rank, 2, path, 2, timeout=300)
    assert half[0][0] == "common.pt" and "rank3.pt" not in half[0] and "rank0.pt" not in half[1], half
    assert GLOBAL_BATCH % 4 == 0


# ------------------------------------------------------------------ what a review reproduced (each failed before)

def _tied():
    from zerofuse.models import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=65, seq_len=16, n_layer=1, n_head=2, dim=32, tie_embeddings=True), seed=1)


def _tied_and_lamb_rank(rank, ws, tied_path, lamb_path):
    from dist_utils import error_text

    model = zerofuse.zero.parallelize(_tied(), stage=2)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-2)
    idx = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(idx, idx)[1].backward()
    opt.step()
    zerofuse.checkpoint.save(tied_path, model, opt, format="dcp")
    lamb = zerofuse.zero.Optimizer(model, "lamb", lr=1e-2)
    zerofuse.checkpoint.save(lamb_path, model, lamb, format="dcp")
    return error_text(lambda: zerofuse.checkpoint.load(lamb_path, model, opt))


def test_dcp_keeps_a_tied_weights_second_name_and_the_optimizer_kind(tmp_path):
    """A tied weight's second name (GPT's head.weight) is written as torch's get_state_dict writes it
    (it was left out: torch's dcp.load into the tied model failed, consolidate had no head.weight,
    export_hf no tie); LAMB's moments are refused by an AdamW (a DCP checkpoint named no kind)."""
    tied, lamb = str(tmp_path / "tied"), str(tmp_path / "lamb")
    for err in run_distributed(_tied_and_lamb_rank, 2, tied, lamb, timeout=240):
        assert "the checkpoint's optimizer is 'lamb', this one is 'adamw'" in err, err
    full = zerofuse.checkpoint.consolidate(tied)["model"]
    assert full["head.weight"] is full["wte.weight"]
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    model = _tied()
    msd = get_model_state_dict(model)
    dcp.load({"model": msd}, checkpoint_id=tied)
    set_model_state_dict(model, msd)
    assert torch.equal(model.head.weight, full["wte.weight"]) and model.head.weight is model.wte.weight
    cfg = json.load(open(zerofuse.checkpoint.export_hf(tied, str(tmp_path / "hf"))[-1]))
    assert cfg["tie_word_embeddings"] and cfg["zerofuse_tied"] == {"head.weight": "wte.weight"}


def test_a_flat_dcp_checkpoint_with_keys_starting_model_dot_is_read_flat(tmp_path):
    """A Hugging Face model's state dict saved flat (model.layers..., lm_head.weight) was read as
    torch's nested {"model", "optim"}: consolidate dropped lm_head and stripped the prefixes."""
    sd = {"model.embed.weight": torch.randn(5, 3), "model.norm.weight": torch.randn(3), "lm_head.weight": torch.randn(5, 3)}
    dcp.save(sd, checkpoint_id=str(tmp_path / "flat"), no_dist=True)
    got = zerofuse.checkpoint.consolidate(str(tmp_path / "flat"))["model"]
    assert got.keys() == sd.keys() and all(torch.equal(got[k], v) for k, v in sd.items())


def _load_plain_rank(rank, ws, path):
    from dist_utils import error_text

    model = zerofuse.zero.parallelize(make_model(), stage=1)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD)
    return error_text(lambda: zerofuse.checkpoint.load(path, model, opt))


@pytest.mark.parametrize("option", ["maximize", "amsgrad"])
def test_a_torch_optimizer_option_zero_lacks_is_refused(tmp_path, option):
    """torch's AdamW(maximize=True) resumed as gradient descent; amsgrad's max_exp_avg_sq was dropped."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, **{option: True})
    _plain_steps(model, opt, batches(1))
    msd, osd = get_state_dict(model, opt)
    path = str(tmp_path / option)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True)
    for err in run_distributed(_load_plain_rank, 2, path, timeout=240):
        assert f"was saved by an optimizer with {option}=True (param group 0)" in err, err


def _load_plain_rank_keeps_weights(rank, ws, path):
    from dist_utils import error_text

    model = zerofuse.zero.parallelize(make_model(), stage=2)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD)
    with zerofuse.zero.full_params(model):
        before = {k: v.clone() for k, v in model.state_dict().items()}
    err = error_text(lambda: zerofuse.checkpoint.load(path, model, opt))
    with zerofuse.zero.full_params(model):
        return err, [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]


def test_a_torch_checkpoint_without_state_for_a_frozen_param_is_refused_by_name(tmp_path):
    """A torch AdamW run with wpe frozen saves no moments for it: the load died inside DCP's planner
    with a CheckpointException (a BaseException: `except Exception` did not catch it)."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    model.wpe.weight.requires_grad_(False)
    _plain_steps(model, opt, batches(1))
    model.wpe.weight.requires_grad_(True)
    msd, osd = get_state_dict(model, opt)
    path = str(tmp_path / "frozen")
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True)
    for err, changed in run_distributed(_load_plain_rank_keeps_weights, 2, path, timeout=240):
        assert err.startswith(f"ValueError: zerofuse.checkpoint.load: the DCP checkpoint at {path!r} holds no "
                              "optimizer state for ['wpe.weight']"), err
        assert changed == [], changed


def test_export_hf_replaces_an_earlier_export_and_names_the_dtype_it_wrote(tmp_path):
    """A sharded export over a one-file one left model.safetensors (what transformers opens first);
    dtype= casting the tensors kept the given config's torch_dtype."""
    native = str(tmp_path / "native")
    run_distributed(_tied_and_lamb_rank, 2, native + "-dcp", native, timeout=240)
    out = str(tmp_path / "hf")
    zerofuse.checkpoint.export_hf(native, out)
    # (transformers 5 writes and reads "dtype" first: the file dtype goes under both keys; only the
    # legacy key was written, and a bf16 model's config exported in fp32 loaded back in bf16)
    zerofuse.checkpoint.export_hf(native, out, dtype=torch.bfloat16, max_shard_bytes=4_000,
                                  config={"torch_dtype": "float32", "dtype": "float32"})
    names = sorted(os.listdir(out))
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names, names
    written = json.load(open(os.path.join(out, "config.json")))
    assert written["torch_dtype"] == written["dtype"] == "bfloat16"
    with pytest.warns(UserWarning, match=r"config.json has no 'model_type': transformers' from_pretrained refuses"):
        zerofuse.checkpoint.export_hf(native, out)  # (no config saved or given: it loaded nowhere, unsaid)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def test_export_hf_that_fails_midway_leaves_the_earlier_export_whole(tmp_path, monkeypatch):
    """The weights were written in place after the earlier export's were deleted: a failure midway
    (disk full, a kill) left half an export; now the earlier one stays as it was, and no .part file."""
    import safetensors.torch

    native = str(tmp_path / "native")
    run_distributed(_tied_and_lamb_rank, 2, native + "-dcp", native, timeout=240)
    out = str(tmp_path / "hf")
    zerofuse.checkpoint.export_hf(native, out)
    before = {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)}
    real, calls = safetensors.torch.save_file, []

    def fail_second(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("No space left on device")
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", fail_second)
    with pytest.raises(OSError, match="No space left"):
        zerofuse.checkpoint.export_hf(native, out, dtype=torch.bfloat16, max_shard_bytes=4_000)
    assert {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)} == before
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    zerofuse.checkpoint.export_hf(native, out, dtype=torch.bfloat16, max_shard_bytes=4_000)
    assert "model.safetensors" not in os.listdir(out) and not any(n.endswith(".part") for n in os.listdir(out))


def _pp_dcp_rank(rank, ws, path):
    from zerofuse.models import GPT, GPTConfig
    from zerofuse.pipeline import split_gpt

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=65, seq_len=16, n_layer=4, n_head=2, dim=32), seed=0)
    (stage,) = split_gpt(model, 2, [rank], device="cpu")
    alone = [torch.distributed.new_group([r]) for r in range(ws)][rank]
    zerofuse.zero.parallelize(stage, stage=1, group=alone, pp_group=torch.distributed.group.WORLD)
    out = []
    for call in (lambda: zerofuse.checkpoint.save(path, stage, format="dcp"),
                 lambda: zerofuse.checkpoint.load(path, stage)):
        try:
            call()
            out.append("no error")
        except (NotImplementedError, FileNotFoundError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def test_dcp_format_refuses_a_pipeline_parallel_model(tmp_path):
    """Every stage wrote the same DCP directory: a crash (a rename raced), or a checkpoint without
    the later stages' weights, saved with no error."""
    path = str(tmp_path / "ck")
    for save, load in run_distributed(_pp_dcp_rank, 2, path, timeout=120):
        assert save.startswith("NotImplementedError: zerofuse.checkpoint: format='dcp' does not take "
                               "pipeline-parallel models yet"), save
        assert load.startswith("FileNotFoundError"), load
    assert not os.path.exists(path) and not os.path.exists(path + ".tmp")


def _adamw_save(rank, ws, path, fmt):
    model = make_model()
    zerofuse.zero.parallelize(model, stage=2)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD)
    _steps(rank, ws, model, opt, batches(1))
    zerofuse.checkpoint.save(path, model, opt, format=fmt)
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("fmt", ["zerofuse", "dcp"])
def test_export_hf_reads_the_model_only(tmp_path, fmt):
    """export_hf consolidated the optimizer's states too (AdamW's m and v: twice the fp32 model) only
    to drop them: its peak was 3x the model's bytes (36.6 MiB for a 12.2 MiB GPT, measured
    2026-12-07). consolidate(optimizer=False) reads the model alone: the peak is the model's bytes
    (zerofuse's format; DCP's reader 1.22x)."""
    path = str(tmp_path / "ckpt")
    model_bytes = run_distributed(_adamw_save, 2, path, fmt, timeout=300)[0]
    with zerofuse.zero.peak_memory() as full:
        whole = zerofuse.checkpoint.consolidate(path)
    with zerofuse.zero.peak_memory() as lean:
        model_only = zerofuse.checkpoint.consolidate(path, optimizer=False)
    assert whole["optimizer"] is not None and model_only["optimizer"] is None
    assert model_only["model"].keys() == whole["model"].keys()
    for n, t in whole["model"].items():
        assert torch.equal(model_only["model"][n], t), n
    # (DCP's reader holds some of what it reads twice: 1.22x the model's bytes for the model alone)
    limit = (1.05 if fmt == "zerofuse" else 1.3) * model_bytes
    assert full.peak >= 2.5 * model_bytes and lean.peak <= limit, (full.peak, lean.peak, model_bytes)
    with zerofuse.zero.peak_memory() as export:
        zerofuse.checkpoint.export_hf(path, str(tmp_path / "hf"), config={"model_type": "zerofuse-gpt"})
    assert export.peak <= limit, (export.peak, model_bytes)
    with pytest.raises(TypeError, match=r"consolidate: expected optimizer True or False, got 'no'"):
        zerofuse.checkpoint.consolidate(path, optimizer="no")
