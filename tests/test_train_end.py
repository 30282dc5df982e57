"""zerofuse-train at the end of a job and at a resume, in process (one rank): a signal during the last
log point, a metrics.jsonl whose last line a kill cut short. Each test failed before its fix
(2026-12-06)."""
from __future__ import annotations

import json
import os
import signal

import pytest

from common import tiny_job_args

pytestmark = pytest.mark.usefixtures("native_kernels")


def test_a_signal_during_the_last_log_point_stops_the_job(tmp_path, monkeypatch):
    """A SIGTERM after the last step's stop vote (during the final evaluation or checkpoint) was
    recorded and never read: the job sampled, exported and exited 0."""
    from zerofuse.train.loop import Trainer

    evaluate = Trainer.evaluate

    def evaluate_then_signal(self):
        if self.step == self.args.steps:  # the final evaluation
            os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(self)

    monkeypatch.setattr(Trainer, "evaluate", evaluate_then_signal)
    args = tiny_job_args(tmp_path, "--steps", "2", "--eval-every", "2", "--sample-tokens", "8", "--export")
    assert Trainer(args, None).run() == 128 + signal.SIGTERM
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and summary["steps_done"] == 2
    assert (tmp_path / "ckpt" / "meta.json").is_file() and not (tmp_path / "hf").exists()


def test_a_resume_drops_a_metrics_line_cut_short(tmp_path):
    """A kill during a metrics write leaves a partial last line: the resume crashed on it
    (json.decoder.JSONDecodeError) although the checkpoint was whole."""
    from zerofuse.train.loop import Trainer

    flags = ("--ckpt-every", "1", "--log-every", "1")
    assert Trainer(tiny_job_args(tmp_path, "--steps", "2", *flags), None).run() == 0
    path = tmp_path / "metrics.jsonl"
    whole = path.read_text()
    path.write_text(whole + whole.splitlines()[-1][:25])
    assert Trainer(tiny_job_args(tmp_path, "--steps", "3", "--resume", *flags), None).run() == 0
    assert [json.loads(ln)["step"] for ln in path.read_text().splitlines()] == [1, 2, 3]
    path.write_text("{oops\n" + path.read_text())  # not the last line: refused by file and line
    with pytest.raises(RuntimeError, match=r"metrics.jsonl line 1 is no metrics record"):
        Trainer(tiny_job_args(tmp_path, "--steps", "4", "--resume", *flags), None).run()
    import torch.distributed as dist
    assert not dist.is_initialized()  # a run refused in its setup leaves no process group behind


def _final_vote_rank(rank, ws, last_step_signal):
    import torch

    from zerofuse.train.metrics import StopVote

    vote = StopVote(ws, torch.device("cpu"))
    vote.vote(0)
    got = vote.vote(signal.SIGTERM if last_step_signal and rank == 1 else 0)  # the last step's vote
    final = vote.final(signal.SIGINT if not last_step_signal and rank == 0 else 0)
    vote.close()
    return got, final


@pytest.mark.parametrize("last_step_signal", [True, False])
def test_the_final_vote_agrees_on_a_signal_one_rank_got(last_step_signal):
    """After the loop every rank agrees on a signal got at the last step (its vote was never read)
    or after it, by one rank only: all stop, none goes on sampling alone."""
    from dist_utils import run_distributed

    want = signal.SIGTERM if last_step_signal else signal.SIGINT
    assert run_distributed(_final_vote_rank, 2, last_step_signal, timeout=60) == [(0, want), (0, want)]


def test_a_checkpoint_from_before_rope_scaling_is_another_model(tmp_path):
    """A config saved before GPTConfig had rope_scaling has no such key: --resume skipped the field and
    a plain-RoPE llama3-1b run went on under Llama 3.2's scaled frequencies, silently (a review's
    reproduction, 2026-12-06). Now compared as None: refused, naming the field."""
    import torch

    from zerofuse import train
    from zerofuse.train.loop import Trainer

    flags = ["--model", "llama3-1b", "--heads", "2", "--kv-heads", "1", "--layers", "1", "--dim", "32",
             "--seq-len", "16", "--ckpt-every", "2", "--warmup", "1"]
    assert Trainer(tiny_job_args(tmp_path, *flags, "--steps", "2"), None).run() == 0
    common = tmp_path / "ckpt" / "common.pt"
    saved = torch.load(common, weights_only=True)
    assert saved["extra"]["config"]["rope_scaling"]["factor"] == 32.0
    tiny_job_args(tmp_path, *flags, "--steps", "3", "--resume")  # (as saved: accepted)
    del saved["extra"]["config"]["rope_scaling"]
    torch.save(saved, common)
    with pytest.raises(train.UsageError, match=r"holds another model: rope_scaling \{'rope_type': 'llama3'.*"
                                               r"\(the checkpoint's: None; --model llama3-1b\)"):
        tiny_job_args(tmp_path, *flags, "--steps", "3", "--resume")


class _Writer:
    """torch.utils.tensorboard's SummaryWriter, recording (tensorboard is not installed for tests)."""
    made: list = []

    def __init__(self, log_dir, purge_step=None):
        self.purge_step, self.scalars = purge_step, []
        _Writer.made.append(self)

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, step))

    def close(self):
        pass


def test_a_resume_keeps_the_first_val_loss_and_purges_the_stopped_runs_events(tmp_path, monkeypatch):
    """A resumed run's summary had no initial val loss and its loss.png neither that point nor the
    resume's val; its TensorBoard events past the checkpoint showed twice (the stopped run's and its
    own). The run here saved its last checkpoint at step 2 and logged to step 3 (as a kill leaves it)."""
    import sys
    import types

    from zerofuse.train import report
    from zerofuse.train.loop import Trainer

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=_Writer))
    _Writer.made.clear()
    plotted = []
    monkeypatch.setattr(report, "_plot", lambda history, path: plotted.append(history))
    save = Trainer.save
    monkeypatch.setattr(Trainer, "save", lambda self: save(self) if self.step <= 2 else None)
    flags = ("--ckpt-every", "1", "--log-every", "1")
    assert Trainer(tiny_job_args(tmp_path, "--steps", "3", *flags), None).run() == 0
    first = json.loads((tmp_path / "summary.json").read_text())["initial_val_loss"]
    assert first is not None and _Writer.made[0].purge_step is None
    assert Trainer(tiny_job_args(tmp_path, "--steps", "4", "--resume", *flags), None).run() == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["start_step"] == 2 and summary["initial_val_loss"] == first
    writer = _Writer.made[1]
    assert writer.purge_step == 3  # TensorBoard drops the first run's events from step 3 on
    assert [s for tag, s in writer.scalars if tag == "loss/val"] == [2, 4]
    vals = [(m["step"], m["val_loss"]) for m in plotted[1] if "val_loss" in m]
    assert sorted(s for s, _ in vals) == [0, 2, 4] and (0, first) in vals


def test_a_resume_on_another_validation_set_says_so_and_reports_no_initial_val(tmp_path, capsys):
    """--eval-batches (or dp x --batch, --seed) draws the validation set: a resume that changed it
    compared the first run's initial val loss (another set) with its own, without a word (a review's
    reproduction, 2026-12-07)."""
    from zerofuse.train.loop import Trainer

    assert Trainer(tiny_job_args(tmp_path, "--steps", "2", "--eval-batches", "2"), None).run() == 0
    assert json.loads((tmp_path / "summary.json").read_text())["initial_val_loss"] is not None
    assert Trainer(tiny_job_args(tmp_path, "--steps", "3", "--resume", "--eval-batches", "3"), None).run() == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["start_step"] == 2 and summary["initial_val_loss"] is None
    out = capsys.readouterr().out
    assert "--resume: the validation set is not the checkpoint's run's (--eval-batches 3 x dp x --batch" in out, out


def test_a_new_run_removes_the_last_runs_summary_and_plot(tmp_path, monkeypatch):
    """A run that failed left the earlier run's summary.json (steps_done 3) beside its own metrics (a
    review's reproduction, 2026-12-07)."""
    from zerofuse.train.loop import Trainer

    assert Trainer(tiny_job_args(tmp_path, "--steps", "2"), None).run() == 0
    assert (tmp_path / "summary.json").is_file()

    def fail(self):
        raise RuntimeError("a failed step")

    monkeypatch.setattr(Trainer, "evaluate", fail)
    with pytest.raises(RuntimeError, match="a failed step"):
        Trainer(tiny_job_args(tmp_path, "--steps", "2"), None).run()
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "loss.png").exists()


def test_a_resume_says_when_its_training_data_changed_and_not_when_only_its_split_did(tmp_path, capsys):
    """Another --data of the same vocabulary (or a glob matching other shards) at --resume went
    unsaid: the checkpoint kept no key of its training data. And the batches note compared
    (--grad-accum, dp x --batch) where the sampler's invariant is their product: --grad-accum 2 of
    half the batch was named as other batches, its losses those of the run (a review, 2026-12-07)."""
    import numpy as np

    from zerofuse.train import tokens as tok
    from zerofuse.train.loop import Trainer

    rng = np.random.default_rng(0)
    for name in ("a", "b", "v"):
        tok.write_shard(tmp_path / f"{name}.bin", rng.integers(0, 1000, 4000))
    data = ("--data", tmp_path / "a.bin", "--val-data", tmp_path / "v.bin", "--batch", 4)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert Trainer(tiny_job_args(straight, *data, "--steps", 3), None).run() == 0
    assert Trainer(tiny_job_args(resumed, *data, "--steps", 2, "--ckpt-every", 2), None).run() == 0
    capsys.readouterr()
    assert Trainer(tiny_job_args(resumed, *data, "--steps", 3, "--resume", "--batch", 2, "--grad-accum", 2),
                   None).run() == 0
    out = capsys.readouterr().out
    assert "--resume: --grad-accum" not in out and "training data" not in out, out
    want, got = (json.loads((d / "metrics.jsonl").read_text().splitlines()[-1]) for d in (straight, resumed))
    assert got["step"] == want["step"] == 3 and got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert Trainer(tiny_job_args(resumed, "--data", tmp_path / "b.bin", *data[2:], "--steps", 4, "--resume"),
                   None).run() == 0
    out = capsys.readouterr().out
    assert f"--resume: --data {tmp_path / 'b.bin'} is not the checkpoint's run's training data" in out, out


def test_the_offload_split_is_said_and_summarised(tmp_path, capsys):
    """--offload-ratio went unsaid, and whole units may round it to all or nothing (0.5 of a model
    that fits one bucket stepped everything on the host; a review's reproduction, 2026-12-07): the
    start says the fraction the host units hold, summary.json keeps it."""
    from zerofuse.train.loop import Trainer

    args = ("--steps", 1, "--zero-stage", 2, "--offload", "optimizer")
    assert Trainer(tiny_job_args(tmp_path / "half", *args, "--offload-ratio", 0.5), None).run() == 0
    assert Trainer(tiny_job_args(tmp_path / "none", *args, "--offload-ratio", 0), None).run() == 0
    out = capsys.readouterr().out
    assert ("offload: optimizer, 100.0% of this rank's optimizer shard stepped on the host (--offload-ratio 0.5; "
            "the units first ready in backward, whole)") in out, out
    assert "offload: optimizer, 0.0% of this rank's optimizer shard stepped on the host (--offload-ratio 0.0" in out
    got = [json.loads((tmp_path / d / "summary.json").read_text())["offload_host_fraction"] for d in ("half", "none")]
    assert got == [1.0, 0.0]
