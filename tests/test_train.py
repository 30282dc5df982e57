"""zerofuse-train: the training job end to end (subprocesses on the C++ CPU kernels, tiny dims) and
its flags; its pieces in process (data, sampler, schedule, launch environment) in test_train_pieces.py."""
import contextlib
import json
import math
import re
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import zerofuse.checkpoint
from zerofuse import train

from train_common import TIMEOUT, TINY, _cmd, _env, _ok, ckpt_step, metrics, run


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """nproc 2, ZeRO-2, 6 steps with a checkpoint every 3: the reference run."""
    out = tmp_path_factory.mktemp("straight")
    p = run("--nproc", 2, "--zero-stage", 2, "--steps", 6, "--ckpt-every", 3, "--eval-every", 3, "--out", out,
            "--export")
    return out, p


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """The same run told to stop after step 3 (as on SIGTERM)."""
    out = tmp_path_factory.mktemp("stopped")
    p = run("--nproc", 2, "--zero-stage", 2, "--steps", 6, "--ckpt-every", 3, "--eval-every", 3, "--out", out,
            "--stop-after", 3)
    return out, p


# ---------------------------------------------------------------------------------------------- end to end

@pytest.mark.timeout(TIMEOUT)
def test_end_to_end_zero2(straight):
    out, p = straight
    _ok(p)
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 7))
    for r in rows:
        assert {"step", "loss", "lr", "tokens_per_s", "step_time", "comm_time", "grad_norm"} <= set(r)
        assert r["tokens_per_s"] > 0 and 0 <= r["comm_time"] <= r["step_time"] and r["grad_norm"] > 0
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["zero_stage"] == 2 and summary["steps_done"] == 6
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.3
    assert summary["mfu"] is None and len(summary["memory_per_rank"]) == 2
    assert all(m["optimizer"] > 0 and m["max_rss"] > 0 for m in summary["memory_per_rank"])
    assert (out / "loss.png").stat().st_size > 0
    assert (out / "ckpt" / "meta.json").is_file() and ckpt_step(out) == 6
    # --export: the final weights as transformers' GPT-2 (the default model's shape), whose logits are
    # the GPT's with the checkpoint's weights (zerofuse's names and model_type "zerofuse-gpt" before)
    import transformers

    from zerofuse.models import GPT, GPTConfig

    cfg = json.loads((out / "hf" / "config.json").read_text())
    assert cfg["model_type"] == "gpt2" and cfg["n_layer"] >= 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    saved = zerofuse.checkpoint.consolidate(str(out / "ckpt"))
    gpt = GPT(GPTConfig(**saved["extra"]["config"]))
    gpt.load_state_dict(saved["model"])
    idx = torch.randint(0, gpt.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, gpt.eval()(idx)[0], rtol=1e-4, atol=1e-4)
    assert "zerofuse-train summary" in p.stdout and "exposed comm" in p.stdout and "--- sample" in p.stdout


@pytest.mark.timeout(TIMEOUT)
def test_stop_and_resume_gives_identical_losses(straight, stopped, tmp_path):
    ref, _ = straight
    src, p = stopped
    _ok(p, 128 + signal.SIGTERM)
    assert ckpt_step(src) == 3 and [r["step"] for r in metrics(src)] == [1, 2, 3]
    assert "stopped by SIGTERM after step 3" in p.stdout
    out = tmp_path / "out"
    shutil.copytree(src, out)
    p = run("--nproc", 2, "--zero-stage", 2, "--steps", 6, "--ckpt-every", 3, "--eval-every", 3, "--out", out,
            "--resume")
    _ok(p)
    assert "resumed at step 3" in p.stdout
    got, want = metrics(out), metrics(ref)
    assert [r["step"] for r in got] == list(range(1, 7))
    for key in ("loss", "lr", "grad_norm", "val_loss"):  # bitwise: same layout, same data, same state
        assert [r.get(key) for r in got] == [r.get(key) for r in want], key


@pytest.mark.timeout(TIMEOUT)
def test_resume_at_another_layout(stopped, tmp_path):
    """A 2-rank ZeRO-2 checkpoint continues in one process with ZeRO-3 (resharded on load), with the
    same global batch (one rank of --batch 8 for two of 4)."""
    src, p = stopped
    _ok(p, 128 + signal.SIGTERM)
    shutil.copytree(src / "ckpt", tmp_path / "ckpt")
    p = run("--nproc", 1, "--zero-stage", 3, "--steps", 5, "--eval-every", 3, "--out", tmp_path, "--resume",
            "--batch", 8)
    _ok(p)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [4, 5] and all(math.isfinite(r["loss"]) for r in rows)
    # the validation set is the same for the same dp x --batch: the loaded model scores what it scored
    start_val = float(p.stdout.split("resumed at step 3: val loss ")[1].split()[0])
    assert start_val == pytest.approx(metrics(src)[2]["val_loss"], abs=1e-4)


@pytest.mark.timeout(TIMEOUT)
def test_resume_follows_this_runs_schedule_flags(straight, stopped, tmp_path):
    """--resume with a new --lr ran the checkpoint's base lr (with the new --min-lr floor: 10x what
    was asked) and its first step at the old schedule's last lr; a new --seed changed the data
    without a word; a new --weight-decay was ignored (the checkpoint's kept); --steps below the checkpoint's step exited 0 having done nothing; a new --precision or batch layout
    went unsaid."""
    from types import SimpleNamespace

    from zerofuse.train.build import lr_lambda

    old = lr_lambda(SimpleNamespace(lr=1e-2, min_lr=1e-3, warmup=2, steps=6))
    assert all(r["lr"] == pytest.approx(1e-2 * old(r["step"] - 1), rel=1e-6) for r in metrics(straight[0]))
    src, p = stopped
    _ok(p, 128 + signal.SIGTERM)
    shutil.copytree(src / "ckpt", tmp_path / "ckpt")
    p = run("--nproc", 1, "--zero-stage", 2, "--steps", 6, "--eval-every", 0, "--out", tmp_path, "--resume",
            "--lr", "5e-3", "--min-lr", "5e-4", "--seed", "5", "--weight-decay", "0.5", "--precision", "bf16",
            "--batch", 3)
    _ok(p)
    new = lr_lambda(SimpleNamespace(lr=5e-3, min_lr=5e-4, warmup=2, steps=6))
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [4, 5, 6]
    assert [r["lr"] for r in rows] == pytest.approx([5e-3 * new(s - 1) for s in (4, 5, 6)], rel=1e-6)
    assert "--resume: --lr 0.005 (the checkpoint's run: 0.01) from step 3" in p.stdout
    assert "--resume: --seed 5 differs from the checkpoint's run (0)" in p.stdout
    assert "--resume: --precision bf16 (the checkpoint's run: fp32) from step 3" in p.stdout
    assert re.search(r"--resume: --grad-accum 1 x dp 1 x --batch 3 \(the checkpoint's run: 1 x 2 x \d+\) from "
                     "step 3: its batches", p.stdout)
    # a new --weight-decay applies from the resumed step (the load restored the checkpoint's 0.1)
    assert "--resume: --weight-decay 0.5 (the checkpoint's run: 0.1) from step 3" in p.stdout
    groups = json.loads((tmp_path / "ckpt" / "meta.json").read_text())["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0]
    p = run("--nproc", 1, "--steps", 2, "--eval-every", 0, "--out", tmp_path, "--resume")
    assert p.returncode == 2 and "--steps: expected at least the checkpoint's step 6 to resume, got 2" in p.stderr
    assert "Traceback" not in p.stderr


def test_skipped_steps_are_flagged_outside_fp16(tmp_path):
    """fp32 with --clip: a step whose grad norm is not finite is skipped by the optimizer; its
    record says so ("skipped": true, the NaN/inf norm kept: it was logged as null, the record of a
    run without clipping) and the summary counts the skipped steps. --lr 1e30 makes step 2's grads
    non-finite; the params then stay, so every later step is skipped too (below SKIP_LIMIT
    in a row: the job goes on; test_steps_skipped_in_a_row_stop_the_job)."""
    p = run("--nproc", 1, "--steps", 3, "--warmup", 0, "--lr", "1e30", "--clip", 1, "--eval-every", 0,
            "--sample-tokens", 0, "--log-every", 3, "--out", tmp_path)
    _ok(p)
    rows = metrics(tmp_path)
    assert math.isfinite(rows[0]["grad_norm"]) and "skipped" not in rows[0]
    for r in rows[1:]:
        assert r["skipped"] is True and not math.isfinite(r["grad_norm"]), r
    assert rows[2]["loss"] == rows[1]["loss"]  # the params did not move
    assert json.loads((tmp_path / "summary.json").read_text())["skipped_steps"] == 2
    assert "skipped steps  2" in p.stdout


def test_steps_skipped_in_a_row_stop_the_job(tmp_path):
    """fp32: SKIP_LIMIT (10) steps in a row skipped for a non-finite grad norm is a diverged run (no
    loss scale backs off outside fp16, the params stay): the job stops there with an error, the
    records written (it finished as a success, the params never moving, a review, 2026-12-07).
    Counted across log windows (--log-every 3 here): one skip in a short window is ridden out."""
    p = run("--nproc", 1, "--steps", 14, "--warmup", 0, "--lr", "1e30", "--clip", 1, "--eval-every", 0,
            "--sample-tokens", 0, "--log-every", 3, "--out", tmp_path)
    assert p.returncode != 0, p.stdout
    assert ("the last 11 steps (2-12) were all skipped for a non-finite gradient norm (bf16/fp32" in p.stderr), p.stderr
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 13)) and "skipped" not in rows[0]
    assert all(r["skipped"] is True for r in rows[1:])


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


@contextlib.contextmanager
def _running_job(out, *flags, env=None):
    """A --nproc 2 job of 100000 steps into out, yielded once it has logged two steps (killed if
    still running after)."""
    proc = subprocess.Popen(_cmd("--nproc", 2, "--steps", 100000, "--eval-every", 0, *flags, "--out", out),
                            env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT - 30
        path = Path(out) / "metrics.jsonl"
        while not (path.exists() and len(path.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.1)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.timeout(TIMEOUT)
def test_sigterm_to_launcher_with_a_failing_save_is_no_clean_stop(tmp_path):
    """The ranks' stop-time save failed (a full disk, injected here) and the launcher still returned
    128 + SIGTERM, "stopped", with no checkpoint: a requeue took it for a clean stop (a review's
    reproduction, 2026-12-07). It returns 1 and says the ranks did not finish cleanly."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') is not None:\n"
        "    from zerofuse.checkpoint import files\n"
        "    def begin(path):\n"
        "        raise OSError(28, 'No space left on device (injected)')\n"
        "    files.begin = begin\n")
    env = dict(_env(), PYTHONPATH=os.pathsep.join(filter(None, [str(inject), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "out"
    with _running_job(out, "--ckpt-every", 0, env=env) as proc:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=90)
    assert proc.returncode == 1, output[-3000:]
    assert "stopped by SIGTERM, but the ranks did not finish cleanly" in output, output[-3000:]
    assert "No space left on device (injected)" in output and not (out / "ckpt").exists()


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("to", ["launcher", "rank1"])
def test_sigusr1_stops_with_a_checkpoint(tmp_path, to):
    """SLURM's --signal=USR1@<s> (to the batch script's launcher, or srun's to each task): a rank's
    default action ended it with no checkpoint, and the launcher's ended it before its ranks (a
    review's reproduction, 2026-12-07). Now a stop signal like SIGTERM: every rank saves at one step."""
    with _running_job(tmp_path) as proc:
        os.kill(proc.pid if to == "launcher" else max(_children(proc.pid)), signal.SIGUSR1)
        output, _ = proc.communicate(timeout=90)
    assert proc.returncode == 128 + signal.SIGUSR1, output[-3000:]
    steps = [r["step"] for r in metrics(tmp_path)]
    assert ckpt_step(tmp_path) == steps[-1] and (tmp_path / "summary.json").exists() and (tmp_path / "loss.png").exists()


@pytest.mark.timeout(TIMEOUT)
def test_sigterm_to_launcher_checkpoints_and_exits(tmp_path):
    with _running_job(tmp_path) as proc:
        ranks = _children(proc.pid)
        assert len(ranks) == 2
        # a second job on the same --out is refused before it writes there (it deleted the running
        # job's checkpoint in the making and mixed its lines into metrics.jsonl before)
        second = run("--steps", 3, "--ckpt-every", 1, "--eval-every", 0, "--out", tmp_path)
        assert second.returncode == 2 and f"another zerofuse-train job (pid {proc.pid}) is writing into" in \
            second.stderr, second.stderr
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, output
    steps = [r["step"] for r in metrics(tmp_path)]
    assert ckpt_step(tmp_path) == steps[-1] and steps == list(range(1, len(steps) + 1))
    time.sleep(0.2)
    assert not [r for r in ranks if Path(f"/proc/{r}").exists() and "zerofuse.train" in
                Path(f"/proc/{r}/cmdline").read_text(errors="replace")], "orphan ranks"


@pytest.mark.timeout(TIMEOUT)
def test_runs_under_torchrun(tmp_path):
    """Started by torchrun the job takes its world from the environment (ZeRO-1 here)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "zerofuse.train", *TINY, "--steps", "3", "--zero-stage", "1", "--out", str(tmp_path)]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    _ok(p)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["zero_stage"] == 1 and summary["steps_done"] == 3


@pytest.mark.timeout(TIMEOUT)
def test_ranks_starting_further_apart_than_the_timeout(tmp_path):
    """--timeout bounds the collectives, not how far apart the ranks start: rank 1 starts 6 s late
    (a sitecustomize sleeping in it) and the job with --timeout 3 trains (its group's connection
    timed out before the ranks met on the store first)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os, time\nif os.environ.get('RANK') == '1':\n    time.sleep(6)\n")
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    p = subprocess.run(_cmd("--nproc", 2, "--timeout", 3, "--steps", 2, "--eval-every", 0, "--sample-tokens", 0,
                            "--out", tmp_path / "out"), env=env, capture_output=True, text=True, timeout=TIMEOUT)
    _ok(p)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps_done"] == 2


@pytest.mark.timeout(TIMEOUT)
def test_dp2_tp2(tmp_path):
    p = run("--nproc", 4, "--dp", 2, "--tp", 2, "--steps", 4, "--eval-every", 2, "--out", tmp_path)
    _ok(p)
    rows = metrics(tmp_path)
    assert len(rows) == 4 and rows[-1]["loss"] < rows[0]["loss"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["dp"], summary["tp"], summary["world_size"]) == (2, 2, 4)


@pytest.mark.timeout(TIMEOUT)
def test_moe_expert_parallel_job(tmp_path):
    """moe-tiny's layout (8 SwiGLU experts, top-2, every other block) at ep 2 with ZeRO-2 and
    aux-loss-free balancing: trains, reports the routers' figures, checkpoints the experts whole and
    resumes at ep 1."""
    moe = ["--experts", 4, "--top-k", 2, "--moe-every", 2, "--bias-rate", 1e-3, "--capacity", 1.5]
    p = run("--nproc", 2, "--ep", 2, *moe, "--steps", 4, "--eval-every", 2, "--out", tmp_path,
            "--activation-checkpointing", "full")  # (its recompute sends dispatch and combine again)
    _ok(p)
    rows = metrics(tmp_path)
    assert len(rows) == 4 and rows[-1]["loss"] < rows[0]["loss"]
    for m in rows:  # the routers' figures, read at each log point
        f = m["moe"]
        assert len(f["max_over_mean_load"]) == 1 and all(1.0 <= x <= 4.0 for x in f["max_over_mean_load"])
        assert f["dropped"] >= 0 and f["aux_loss"] > 0 and f["z_loss"] > 0 and f["a2a_exposed_s_per_step"] > 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["moe"]["ep"] == 2 and s["moe"]["experts"] == 4 and s["model"]["active_params"] < s["model"]["params"]
    # with a capacity some choices may be dropped: the rows on the wire at most the dropless count,
    # which counts the recompute's (it was 1.5x the count made for no checkpointing)
    assert 4 / 6 * s["moe"]["a2a_bytes_per_step_analytic"] < s["moe"]["a2a_bytes_per_step"] \
        <= s["moe"]["a2a_bytes_per_step_analytic"]
    assert "experts" in p.stdout and "MiB/step (dropless count" in p.stdout
    full = zerofuse.checkpoint.consolidate(str(tmp_path / "ckpt"))["model"]
    assert full["blocks.1.mlp.w1"].shape[0] == 4 and "blocks.1.mlp.router.expert_bias" in full
    p = run("--nproc", 2, "--ep", 1, *moe, "--steps", 6, "--eval-every", 2, "--out", tmp_path, "--resume",
            "--activation-checkpointing", "selective")
    _ok(p)
    assert [m["step"] for m in metrics(tmp_path)] == list(range(1, 7))


# ---------------------------------------------------------------------------------------------- flags

def test_bad_flag_exits_2_before_starting(tmp_path):
    p = run("--nproc", 2, "--tp", 3, "--out", tmp_path, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "--tp" in p.stderr
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


BAD = [
    (["--nproc", "2", "--dp", "3"], "--nproc: expected dp × tp = 3 × 1 = 3 ranks, got 2"),
    (["--nproc", "4", "--tp", "3"], "--tp"),
    (["--heads", "4", "--kv-heads", "3"], "--kv-heads: expected a divisor of the head count 4"),
    (["--heads", "3"], "--heads: expected a divisor of the model width 160"),
    (["--precision", "fp16", "--device", "cpu"], "--precision fp16: expected --device cuda"),
    (["--sequence-parallel"], "--sequence-parallel: expected --tp > 1"),
    (["--batch", "0"], "--batch: expected >= 1, got 0"),
    (["--grad-accum", "0"], "--grad-accum: expected >= 1"),
    (["--steps", "0"], "--steps: expected >= 1"),
    (["--lr", "0"], "--lr: expected > 0"),
    (["--min-lr", "1", "--lr", "0.1"], "--min-lr"),
    (["--data", "/no/such/file.txt"], "--data: expected a readable text file"),
    (["--seq-len", "0"], "--seq-len: expected >= 1"),
]
BAD.append((["--nproc", "2", "--tp", "2", "--sequence-parallel", "--seq-len", "33", "--heads", "2", "--dim", "32"],
            "--seq-len: expected a multiple of --tp (2)"))
if not torch.cuda.is_available():
    BAD.append((["--device", "cuda"], "--device cuda: expected a CUDA device"))


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_flags(argv, message, capsys, tmp_path):
    assert train.main(argv + ["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.timeout(TIMEOUT)
def test_resume_with_another_model_shape_is_refused_before_launch(stopped, capsys, tmp_path):
    """--resume with flags that build another model: one line naming the flags and the checkpoint's
    values, before any rank starts (each rank's load raised with a traceback of its own)."""
    src, p = stopped
    _ok(p, 128 + signal.SIGTERM)
    shutil.copytree(src / "ckpt", tmp_path / "ckpt")
    flags = ["--device", "cpu", "--resume", "--out", str(tmp_path), *TINY]
    assert train.main([*flags, "--dim", "48", "--layers", "3"]) == 2  # (the last of a repeated flag counts)
    err = capsys.readouterr().err
    assert (f"--resume: the checkpoint at {tmp_path / 'ckpt'} holds another model: --layers 3 (the checkpoint's: "
            "2), --dim 48 (the checkpoint's: 32); expected the flags of the run that wrote it") in err
    assert "Traceback" not in err
    assert train.main([*flags, "--steps", "1"]) == 2  # below the checkpoint's step: refused before launch too
    err = capsys.readouterr().err
    assert "--steps: expected at least the checkpoint's step 3 to resume, got 1" in err and err.count("\n") == 1, err
    # another update rule (each rank's load raised, exit code 1; a review's reproduction, 2026-11-28)
    assert train.main([*flags, "--optimizer", "lamb"]) == 2
    err = capsys.readouterr().err
    assert (f"--optimizer: the checkpoint at {tmp_path / 'ckpt'} was trained with adamw, got lamb; expected the "
            "optimizer of the run that wrote it") in err and err.count("\n") == 1, err


def test_resume_without_checkpoint(capsys, tmp_path):
    assert train.main(["--resume", "--out", str(tmp_path)]) == 2
    assert f"--resume: expected a complete checkpoint at {tmp_path / 'ckpt'}" in capsys.readouterr().err


def test_data_too_short(capsys, tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("hello world\n" * 20)
    assert train.main(["--data", str(f), "--seq-len", "64", "--out", str(tmp_path)]) == 2
    assert "--data: expected at least 65 validation tokens" in capsys.readouterr().err


def test_argparse_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--zero-stage", "5"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--zero-stage" in err and err.count("\n") == 1
