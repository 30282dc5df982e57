"""zerofuse-train --pp: the training job pipeline-parallel end to end (subprocesses, C++ CPU
kernels, tiny dims): the same losses as the unsplit job with as many accumulated micro-batches,
the summary's measured bubble beside the formula, checkpoints saved at pp 2 resumed at pp 1 and
pp 4 with the losses of the run that never stopped, consolidated into the unsplit model, bad flags."""
import math
import shutil
import signal

import pytest
import torch

import zerofuse.checkpoint
from train_common import _ok, metrics, run

PP = ["--layers", "4", "--steps", "6", "--ckpt-every", "3", "--eval-every", "3", "--sample-tokens", "0"]


@pytest.fixture(scope="module")
def unsplit(tmp_path_factory):
    """One process, 4 accumulated micro-batches: what the pipeline runs must equal."""
    out = tmp_path_factory.mktemp("unsplit")
    _ok(run("--nproc", 1, "--grad-accum", 4, *PP, "--out", out))
    return metrics(out)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp2-stopped")
    _ok(run("--nproc", 2, "--pp", 2, "--microbatches", 4, *PP, "--stop-after", 3, "--out", out),
        128 + signal.SIGTERM)
    return out


def _losses(rows):
    return {r["step"]: r["loss"] for r in rows}


def _assert_same_losses(tmp_path, reference: str, names) -> None:
    """Each run's losses at steps 1-4 are the reference run's (rtol 1e-5)."""
    want = _losses(metrics(tmp_path / reference))
    for name in names:
        got = _losses(metrics(tmp_path / name))
        assert sorted(got) == [1, 2, 3, 4], (name, got)
        for step in want:
            assert got[step] == pytest.approx(want[step], rel=1e-5), (name, step)


@pytest.mark.parametrize("schedule,extra", [("1f1b", ()), ("zb", ()), ("1f1b", ("--zero-stage", 3)),
                                            ("interleaved", ("--virtual-stages", 2, "--zero-stage", 1))])
def test_pp2_job_matches_the_unsplit_job(unsplit, schedule, extra, tmp_path):
    """ZeRO-2 (the default), ZeRO-3 (stages built on meta, materialized shard by shard) and two
    virtual stages per rank under one ZeRO-1 engine (merge_stages)."""
    p = run("--nproc", 2, "--pp", 2, "--pp-schedule", schedule, "--microbatches", 4, *extra, *PP, "--out", tmp_path)
    _ok(p)
    got, want = _losses(metrics(tmp_path)), _losses(unsplit)
    assert got.keys() == want.keys()
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    summary = __import__("json").loads((tmp_path / "summary.json").read_text())
    pl = summary["pipeline"]
    assert pl["pp"] == 2 and pl["schedule"] == schedule and pl["microbatches"] == 4
    assert len(pl["bubble_measured_per_rank"]) == 2 and all(0 <= b < 1 for b in pl["bubble_measured_per_rank"])
    assert pl["bubble_formula"] == pytest.approx({"1f1b": 0.2, "zb": 1 / 13, "interleaved": 1 / 9}[schedule])
    assert "bubble (idle fraction) per rank" in p.stdout
    # each rank holds its stage only: half the params of the unsplit model (within one block's share)
    mem = summary["memory_per_rank"]
    assert mem[0]["params"] < 0.75 * sum(m["params"] for m in mem)
    # launches per layer of rank 0's own 2 blocks (over the model's 4 it read half the truth; a review)
    lc = summary["launches"]
    assert lc["per_layer"] == pytest.approx(lc["launches"] / 2) and lc["step"] == 2


@pytest.mark.parametrize("layout", [["--nproc", 1, "--grad-accum", 4], ["--nproc", 4, "--pp", 4, "--microbatches", 4]])
def test_pp2_checkpoint_resumes_at_another_pipeline_layout(unsplit, stopped, layout, tmp_path):
    shutil.copytree(stopped / "ckpt", tmp_path / "ckpt")
    p = run(*layout, *PP, "--out", tmp_path, "--resume", "--sample-tokens", 5)
    _ok(p)
    got, want = _losses(metrics(tmp_path)), _losses(unsplit)
    assert sorted(got) == [4, 5, 6]
    # a sample from the whole model; with --pp none, said (it was skipped without a word)
    if "--pp" in layout:
        assert "note: no sample with --pp 4 (each stage holds part of the model" in p.stdout
    else:
        assert "--- sample (5 tokens" in p.stdout
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


def test_pp2_checkpoint_consolidates_into_the_unsplit_model(stopped):
    from zerofuse.models import GPT, config

    state = zerofuse.checkpoint.consolidate(str(stopped / "ckpt"))
    model = GPT(config("tiny", **{k: v for k, v in state["extra"]["config"].items()}))
    assert sorted(state["model"]) == sorted(model.state_dict())
    model.load_state_dict(state["model"])
    assert all(math.isfinite(float(v.abs().sum())) for v in state["model"].values())
    assert state["extra"]["step"] == 3 and state["optimizer"] is not None
    assert len(state["optimizer"]["state"]) == len(list(model.parameters()))


TIED = ["--model", "gpt2-124m", "--layers", "2", "--dim", "64", "--heads", "2", "--seq-len", "32", "--batch", "2",
        "--steps", "4", "--ckpt-every", "2", "--eval-every", "2", "--sample-tokens", "0"]


def test_tied_gpt2_job_at_pp2_matches_resumes_and_consolidates(tmp_path):
    """GPT-2's tied embedding and output layer over two pipeline ranks (a mirror on the last
    stage): the losses of the unsplit job; its checkpoint resumes at pp 1 with them and
    consolidates into the unsplit model, head.weight tied to wte.weight."""
    from zerofuse.models import GPT, config

    _ok(run("--nproc", 1, "--grad-accum", 2, *TIED, "--out", tmp_path / "unsplit"))
    _ok(run("--nproc", 2, "--pp", 2, "--microbatches", 2, *TIED, "--out", tmp_path / "pp2"))
    _ok(run("--nproc", 2, "--pp", 2, "--microbatches", 2, *TIED, "--stop-after", 2, "--out", tmp_path / "resumed"),
        128 + signal.SIGTERM)
    state = zerofuse.checkpoint.consolidate(str(tmp_path / "resumed" / "ckpt"))
    _ok(run("--nproc", 1, "--grad-accum", 2, *TIED, "--out", tmp_path / "resumed", "--resume"))
    _assert_same_losses(tmp_path, "unsplit", ("pp2", "resumed"))
    model = GPT(config("gpt2-124m", **state["extra"]["config"]))
    assert sorted(state["model"]) == sorted(model.state_dict())
    model.load_state_dict(state["model"])
    assert model.head.weight is model.wte.weight and torch.equal(model.head.weight, state["model"]["wte.weight"])


def test_document_masking_at_pp2_matches_the_unsplit_job(tmp_path):
    """--document-masking over two pipeline ranks (GPT-2 token shards with a document every 3-12
    tokens): each rank makes the micro-batches' document ids and the losses (train and eval) are the
    unsplit job's with them (which test_documents_model shows apply)."""
    from test_documents_model import _shards

    train_bin, val_bin = _shards(tmp_path)
    docs = [*TIED, "--document-masking", "--data", train_bin, "--val-data", val_bin, "--ckpt-every", "0"]
    _ok(run("--nproc", 1, "--grad-accum", 2, *docs, "--out", tmp_path / "unsplit"))
    _ok(run("--nproc", 2, "--pp", 2, "--microbatches", 2, *docs, "--out", tmp_path / "pp2"))
    want, got = metrics(tmp_path / "unsplit"), metrics(tmp_path / "pp2")
    assert [r["step"] for r in got] == [r["step"] for r in want] and any("val_loss" in r for r in want)
    for a, b in zip(got, want):
        assert a.keys() >= {"loss"} and ("val_loss" in a) == ("val_loss" in b), (a, b)
        for key in {"loss", "val_loss"} & b.keys():
            assert a[key] == pytest.approx(b[key], rel=1e-5), (a, b)


@pytest.mark.parametrize("argv,message", [
    (["--nproc", 2, "--pp", 2, "--grad-accum", 2], "--grad-accum: expected 1 with --pp 2"),
    (["--nproc", 4, "--pp", 3], "--tp/--pp: expected tp × pp (1 × 3) to divide the number of ranks 4"),
    (["--nproc", 2, "--pp", 2, "--pp-schedule", "interleaved", "--virtual-stages", 2, "--microbatches", 3],
     "--microbatches: "),
    (["--nproc", 2, "--pp", 2, "--virtual-stages", 2], "--virtual-stages: expected 1 with --pp-schedule 1f1b"),
    (["--nproc", 2, "--pp", 2, "--pp-schedule", "zb", "--zero-stage", 3], "--pp-schedule zb: expected --zero-stage"),
    (["--nproc", 2, "--pp", 2, "--precision", "bf16", "--grad-accum", 1, "--microbatches", 0],
     "--microbatches: expected >= 1, got 0"),
    (["--nproc", 2, "--pp", 2, "--layers", 4, "--pp-layout", "E,4,L"], "--pp-layout: expected 2 stages"),
    (["--nproc", 2, "--pp", 2, "--layers", 4, "--pp-layout", "E3,2L"], "--pp-layout: "),
    (["--nproc", 4, "--pp", 4, "--layers", 2, "--pp-layout", "E1,0,0,1L"],  # (ZeRO refused the empty stages)
     "--pp-layout: expected every stage to hold something (a block, E or L), got stage(s) [1, 2] empty"),
    (["--nproc", 2, "--pp", 2, "--pp-schedule", "interleaved", "--virtual-stages", 2, "--microbatches", 2,
      "--layers", 2, "--pp-layout", "E1,0,1,L"], "stage(s) [1] empty"),  # (its grads were never reduced)
    (["--nproc", 2, "--pp", 2, "--model", "gpt2-124m", "--zero-stage", 3], "--zero-stage: the gpt2-124m model ties"),
    (["--nproc", 2, "--microbatches", 4], "--microbatches/--virtual-stages/--pp-layout/--pp-schedule: expected --pp > 1"),
    (["--nproc", 8, "--pp", 8, "--layers", 4], "--pp: expected at most 6 stages for 4 layers"),
])
def test_bad_pipeline_flags_exit_2(argv, message, tmp_path, capsys, monkeypatch):
    """Refused by the flag checks, before any rank starts (in this process: the CLI's exit code and
    its one line are test_train.py's test_bad_flag_exits_2_before_starting's, in a subprocess)."""
    from train_common import TINY
    from zerofuse import train

    def started(*a, **k):
        raise AssertionError(f"the job started: {argv} passed the flag checks")

    monkeypatch.setattr(train, "launch", started)
    monkeypatch.setattr(train, "Trainer", started)
    assert train.main([*TINY, *map(str, argv), "--steps", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_layout_whose_stages_have_different_param_groups_resumes(tmp_path):
    """--pp-layout E,4L: the first stage holds the embeddings only, so it has no no-decay group while
    the other stage has one. The stages' groups were merged by position (the second stage's no-decay
    group lost) and a group count compared: the checkpoint resumed in no layout (not even its own)
    and consolidate raised StopIteration (a review's reproduction, 2026-12-06)."""
    flags = ["--layers", "4", "--steps", "4", "--ckpt-every", "2", "--eval-every", "0", "--sample-tokens", "0"]
    pp = ["--nproc", 2, "--pp", 2, "--pp-layout", "E,4L", "--microbatches", 2]
    p = run(*pp, *flags, "--out", tmp_path / "straight")
    _ok(p)  # (rank 0 runs no block: no launches per layer, not its count over the model's layers)
    assert "(no layer on this rank:" in p.stdout
    assert __import__("json").loads((tmp_path / "straight" / "summary.json").read_text())["launches"]["per_layer"] is None
    _ok(run(*pp, *flags, "--stop-after", 2, "--out", tmp_path / "pp2"), 128 + signal.SIGTERM)
    shutil.copytree(tmp_path / "pp2", tmp_path / "pp1")
    state = zerofuse.checkpoint.consolidate(str(tmp_path / "pp2" / "ckpt"))
    decay = [g for g in state["optimizer"]["param_groups"] if g["weight_decay"] != 0.0]
    assert len(state["optimizer"]["param_groups"]) == 2 and len(decay) == 1
    names = list(state["model"])
    assert all(names[i].endswith(".weight") and "norm" not in names[i] for i in decay[0]["params"])
    _ok(run(*pp, *flags, "--out", tmp_path / "pp2", "--resume"))
    _ok(run("--nproc", 1, "--grad-accum", 2, *flags, "--out", tmp_path / "pp1", "--resume"))
    _assert_same_losses(tmp_path, "straight", ("pp2", "pp1"))


def test_fp16_is_accepted_with_pp(tmp_path):
    """--precision fp16 with --pp was refused as "the pipeline's backward applies no loss scale"; the
    pipeline seeds its backward with the ZeRO optimizer's loss scale (test_pipeline_compose's
    test_fp16_stages_backward_the_scaled_loss). The job's fp16 is CUDA-only: the flag check alone here."""
    from common import tiny_job_args
    from zerofuse.train import checks

    args = tiny_job_args(tmp_path, "--nproc", "2", "--pp", "2")
    args.precision, args.grad_accum, args.microbatches = "fp16", 1, None  # (as the flags give them, on a GPU)
    checks._validate_pipeline(args)
    assert args.microbatches == 4


def test_pipeline_flags_at_pp_1_are_refused_not_ignored(tmp_path):
    """--pp-schedule at --pp 1 ran with no pipeline, unsaid (its siblings were refused), and zb's
    checkpointing rule refused a run that had no pipeline (a review's reproduction, 2026-12-07)."""
    from common import tiny_job_args
    from zerofuse import train

    with pytest.raises(train.UsageError, match=r"--pp-schedule: expected --pp > 1, got --pp 1"):
        tiny_job_args(tmp_path, "--pp-schedule", "interleaved")
    with pytest.raises(train.UsageError, match=r"--pp-schedule: expected --pp > 1"):
        tiny_job_args(tmp_path, "--pp-schedule", "zb", "--activation-checkpointing", "full")
    assert tiny_job_args(tmp_path, "--activation-checkpointing", "full").pp_schedule == "1f1b"
    assert tiny_job_args(tmp_path, "--nproc", "2", "--pp", "2").pp_schedule == "1f1b"


MOE = ["--experts", 4, "--top-k", 2, "--moe-every", 2, "--bias-rate", 1e-3, "--aux-loss", 1e-2, "--z-loss", 1e-3]


def test_moe_job_at_pp2_matches_the_unsplit_job_and_resumes_unsplit(tmp_path):
    """pp 2 x dp 2 with ep 2 (ZeRO-2 over each stage's DP group, experts over its ep groups): the
    losses and the routers' figures of the unsplit job with as many accumulated micro-batches (each
    stage's router losses train through what it sends; each rank records its stages' layers, read
    over every rank); its checkpoint resumes unsplit with the losses of the run that never stopped
    (the experts of a pipeline checkpoint loaded at another layout were the first E/ep on every ep
    rank: 2026-12-07)."""
    _ok(run("--nproc", 2, "--ep", 2, "--grad-accum", 4, *MOE, *PP, "--out", tmp_path / "unsplit"))
    _ok(run("--nproc", 4, "--pp", 2, "--ep", 2, "--microbatches", 4, *MOE, *PP, "--stop-after", 3,
            "--out", tmp_path / "pp"), 128 + signal.SIGTERM)
    want, got = metrics(tmp_path / "unsplit"), metrics(tmp_path / "pp")
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
        for key in ("aux_loss", "z_loss"):
            assert a["moe"][key] == pytest.approx(b["moe"][key], rel=1e-4) and a["moe"][key] > 0, (key, a, b)
        assert a["moe"]["max_over_mean_load"] == pytest.approx(b["moe"]["max_over_mean_load"], rel=1e-6)
        assert len(a["moe"]["max_over_mean_load"]) == 2 and a["moe"]["dropped"] == b["moe"]["dropped"]
    shutil.copytree(tmp_path / "pp" / "ckpt", tmp_path / "resumed" / "ckpt")
    _ok(run("--nproc", 2, "--ep", 2, "--grad-accum", 4, *MOE, *PP, "--out", tmp_path / "resumed", "--resume"))
    resumed = _losses(metrics(tmp_path / "resumed"))
    assert sorted(resumed) == [4, 5, 6]
    for step, loss in resumed.items():
        assert loss == pytest.approx(_losses(want)[step], rel=1e-5), step


@pytest.mark.parametrize("flags", [("--offload", "optimizer", "--clip", "0.5"),
                                   ("--offload", "optimizer+params", "--zero-stage", "3")])
def test_offload_at_pp2_trains_as_without(flags, tmp_path):
    """ZeRO-Offload under --pp (the job refused it; the library trained it bit for bit as without
    offload, per a review, 2026-12-07): the losses of the same run with the states on the device."""
    plain = [f for f in flags if f not in ("--offload", "optimizer", "optimizer+params")]
    _ok(run("--nproc", 2, "--pp", 2, "--microbatches", 4, *plain, *PP, "--out", tmp_path / "device"))
    _ok(run("--nproc", 2, "--pp", 2, "--microbatches", 4, *flags, *PP, "--out", tmp_path / "host"))
    want, got = _losses(metrics(tmp_path / "device")), _losses(metrics(tmp_path / "host"))
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6), step
    import json
    for mem in json.loads((tmp_path / "host" / "summary.json").read_text())["memory_per_rank"]:
        assert mem["optimizer"] == 0 and mem["optimizer_host"] > 0, mem  # (the states on the host: offloaded)
