"""zerofuse-train's start under a launcher (a review's reproductions, 2026-12-07): the launcher's
variables checked and named; a rank whose --nproc launcher died before it armed PR_SET_PDEATHSIG
ends at once; ranks left running by a launcher that exited first keep --out from a second job;
under SLURM a rank 0 refused --out tells the other ranks at the rendezvous."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from zerofuse import train
from zerofuse.train.launch import out_lock, rank_lock

from common import tiny_job_argv

pytestmark = pytest.mark.usefixtures("cpu_kernels")


@pytest.mark.parametrize("env,msg", [
    (dict(RANK="0", WORLD_SIZE="abc"), "environment: WORLD_SIZE='abc': expected a whole number"),
    (dict(RANK="x", WORLD_SIZE="2"), "environment: RANK='x': expected a whole number"),
    (dict(RANK="3", WORLD_SIZE="2"), r"environment: RANK=3 of WORLD_SIZE=2: expected 0 <= rank < world size >= 1"),
    (dict(RANK="0", WORLD_SIZE="0"), r"environment: RANK=0 of WORLD_SIZE=0"),
    (dict(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="abc"), "environment: SLURM_STEP_NUM_TASKS='abc': expected a whole "
     "number"),
    (dict(SLURM_PROCID="5", SLURM_STEP_NUM_TASKS="2"), "environment: SLURM_PROCID=5 of SLURM_STEP_NUM_TASKS=2"),
], ids=["world-abc", "rank-x", "rank-past-world", "world-0", "slurm-ntasks-abc", "slurm-procid-past"])
def test_the_launchers_variables_are_checked_by_name(tmp_path, monkeypatch, capsys, env, msg):
    """int() tracebacks before; RANK=3 of 2 waited STARTUP_S for peers; WORLD_SIZE=0 blamed --nproc."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
              "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert train.main(tiny_job_argv(tmp_path, "--steps", "1")) == 2
    import re
    assert re.search(msg, capsys.readouterr().err)


def test_ranks_left_running_keep_out_a_second_job(tmp_path, monkeypatch):
    """A launcher that exits first (a third Ctrl-C, kill -9) left its ranks saving a checkpoint while
    a second job took --out and replaced it: the ranks hold RANKS_LOCK shared while they live."""
    monkeypatch.setenv("ZEROFUSE_TRAIN_LAUNCHED", "1")
    with rank_lock(str(tmp_path)):  # a rank of the first job, its launcher gone
        monkeypatch.delenv("ZEROFUSE_TRAIN_LAUNCHED")
        with pytest.raises(train.UsageError, match=r"--out: ranks of an earlier zerofuse-train job are still running"):
            with out_lock(str(tmp_path)):
                pass
    with out_lock(str(tmp_path)):  # they have ended: free
        pass


def test_a_rank_whose_launcher_died_during_its_start_ends_at_once(tmp_path):
    """PR_SET_PDEATHSIG was armed after the imports: a launcher killed before left its ranks waiting
    in the rendezvous for minutes. The rank checks its launcher is its parent when it arms it."""
    env = dict(os.environ, ZEROFUSE_TRAIN_LAUNCHED="1", ZEROFUSE_TRAIN_LAUNCHER="1",  # (pid 1: not our parent)
               RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "zerofuse.train", *tiny_job_argv(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 143 and time.monotonic() - t0 < 60, (p.returncode, p.stderr[-2000:])


def _slurm_env(tasks=2):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return dict(os.environ, SLURM_NTASKS=str(tasks), SLURM_STEP_NUM_TASKS=str(tasks), SLURM_JOB_ID="4242", SLURM_STEP_ID="0",
                SLURM_JOB_NODELIST="127.0.0.1", MASTER_PORT=str(port))


@pytest.mark.timeout(300)
def test_slurm_rank0_refused_its_out_tells_the_others(tmp_path):
    """srun without --kill-on-bad-exit: rank 0 refused --out (another job holds it) exited 2 and rank
    1 waited STARTUP_S (300 s) at the rendezvous; now it exits 2 as soon as it gets there."""
    base = _slurm_env()
    argv = [sys.executable, "-m", "zerofuse.train", *tiny_job_argv(tmp_path, "--steps", "2", "--nproc", "2")]
    with out_lock(str(tmp_path)):  # the other job
        t0 = time.monotonic()
        ranks = [subprocess.Popen(argv, env=dict(base, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (1, 0)]
        outs = [p.communicate(timeout=200) for p in ranks]
    assert [p.returncode for p in ranks] == [2, 2], outs
    assert "--out: another zerofuse-train job" in outs[1][1] and outs[0][1].strip() == "", outs
    assert time.monotonic() - t0 < 120


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tasks", [2, 3])
def test_slurm_rank1_refused_says_why_and_tells_rank0(tmp_path, tasks):
    """A --data missing on rank 1's node: rank 1 exited 2 without a word (only rank 0 printed its
    refusals) and rank 0 waited max(--timeout, STARTUP_S) at the rendezvous, then failed with
    torch's store timeout (a review's reproduction, 2026-12-07). With a third rank, rank 0 (the
    store's host) waits until it has read the abort too (it left at once: rank 2's read failed)."""
    base = _slurm_env(tasks)
    here, there = tmp_path / "node0", tmp_path / "node1"
    here.mkdir()
    there.mkdir()
    (here / "data.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    argv = [sys.executable, "-m", "zerofuse.train", *tiny_job_argv(tmp_path / "out", "--steps", "2", "--nproc",
                                                                  str(tasks), "--data", "data.txt")]
    t0 = time.monotonic()
    ranks = [subprocess.Popen(argv, env=dict(base, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)), cwd=str(d),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, d in ((1, there), (0, here), (2, here))[:tasks]]
    outs = [p.communicate(timeout=200) for p in ranks]
    assert [p.returncode for p in ranks] == [2] * tasks, outs
    assert outs[0][1].startswith("zerofuse-train: error: rank 1: --data:"), outs
    assert "zerofuse-train: error: rank 1 was refused at its start (its error says why)" in outs[1][1], outs
    assert time.monotonic() - t0 < 120


@pytest.mark.timeout(300)
def test_an_sbatch_script_without_srun_launches_its_ranks_here(tmp_path):
    """A batch script carries SLURM_PROCID=0 and SLURM_NTASKS=2 but is one process, in no srun step:
    taken for rank 0 of 2, the job waited max(--timeout, STARTUP_S) in the rendezvous for a rank
    that never comes, printing nothing (a review's reproduction, 2026-12-07). It launches --nproc
    ranks here, with a note."""
    env = {k: v for k, v in _slurm_env().items() if not k.startswith("SLURM_STEP")}
    env.update(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NNODES="1")
    argv = [sys.executable, "-m", "zerofuse.train", *tiny_job_argv(tmp_path, "--steps", "2", "--nproc", "2")]
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "SLURM allocated SLURM_NTASKS=2 tasks, but this process is no srun task" in p.stderr, p.stderr[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["world_size"] == 2


@pytest.mark.timeout(300)
def test_slurm_rank1_with_a_bad_flag_tells_rank0(tmp_path):
    """argparse's refusal (and a bad launcher variable) came before the path that tells the peers: rank 1
    exited 2 and rank 0 waited max(--timeout, STARTUP_S) at the rendezvous (a review's reproduction,
    2026-12-07)."""
    base = _slurm_env()
    argv = [sys.executable, "-m", "zerofuse.train", *tiny_job_argv(tmp_path, "--steps", "2", "--nproc", "2")]
    t0 = time.monotonic()
    ranks = [subprocess.Popen(argv + (["--steps", "abc"] if r == 1 else []), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=dict(base, SLURM_PROCID=str(r), SLURM_LOCALID=str(r))) for r in (1, 0)]
    outs = [p.communicate(timeout=200) for p in ranks]
    assert [p.returncode for p in ranks] == [2, 2], outs
    assert "argument --steps: invalid int value: 'abc'" in outs[0][1], outs
    assert "zerofuse-train: error: rank 1 was refused at its start (its error says why)" in outs[1][1], outs
    assert time.monotonic() - t0 < 120


def test_the_launcher_reports_the_signal_its_ranks_stopped_on(tmp_path, monkeypatch, capsys):
    """SIGTERM, then SIGUSR1 during the stop's checkpoint: the ranks stopped on SIGTERM (their summary
    says so), the launcher said SIGUSR1 and exited 138, the last signal the agent raised (a review's
    reproduction, 2026-12-07)."""
    import json
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher import api

    from zerofuse.train.launch import launch

    def fake_launch(config, entrypoint):
        def run(*args):
            (tmp_path / "metrics.jsonl").write_text("{}\n")
            (tmp_path / "summary.json").write_text(json.dumps({"stopped_by": "SIGTERM"}))
            raise SignalException("got SIGUSR1", sigval=signal.SIGUSR1)
        return run

    monkeypatch.setattr(api, "elastic_launch", fake_launch)
    assert launch(["--steps", "2"], 2, 30.0, str(tmp_path)) == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in capsys.readouterr().err
