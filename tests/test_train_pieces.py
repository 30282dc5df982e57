"""zerofuse-train's pieces in process: the corpus, sampler and schedule, the launch environment
(torchrun's and SLURM's variables), the launcher's stop and grace, the loss plot, the out lock."""
import os
import signal
import subprocess
import time

import pytest
import torch

from zerofuse import train

from train_common import LAUNCH_VARS, _cmd, _env


# ---------------------------------------------------------------------------------------------- pieces

def test_corpus_char_and_byte_fallback(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("abcab\n" * 50, encoding="utf-8")
    c = train.Corpus.load(text)
    assert c.kind == "char" and c.chars == ["\n", "a", "b", "c"] and c.vocab_size == 4
    assert len(c.train[0]) == 270 and len(c.val[0]) == 30
    assert c.decode(c.encode("cab\n")) == "cab\n"
    binary = tmp_path / "b.dat"  # (a .bin file is GPT-2 token shards)
    binary.write_bytes(bytes(range(256)) * 4)  # not UTF-8
    b = train.Corpus.load(binary)
    assert b.kind == "byte" and b.vocab_size == 256 and b.train[0][:256].tolist() == list(range(256))
    assert train.Corpus.load(text, "byte").kind == "byte"


def test_sampler_deterministic_distinct_and_layout_free():
    tokens = torch.arange(10_000, dtype=torch.int32)
    ranks = [train.Sampler(tokens, 8, 3, 2, 2, r, seed=1) for r in range(2)]
    x0, y0 = ranks[0].get(5)
    x1, _ = ranks[1].get(5)
    assert x0.shape == (2, 3, 8) and torch.equal(y0[..., :-1], x0[..., 1:])
    assert torch.equal(x0, ranks[0].get(5)[0])  # a function of (seed, step)
    assert not torch.equal(x0, x1) and not torch.equal(x0, ranks[0].get(6)[0])
    # one rank with the whole global batch sees what the two ranks see together
    whole, _ = train.Sampler(tokens, 8, 6, 2, 1, 0, seed=1).get(5)
    assert torch.equal(whole, torch.cat([x0, x1], dim=1))


def test_lr_schedule():
    args = type("A", (), dict(lr=1.0, min_lr=0.1, warmup=10, steps=110))()
    f = train.lr_lambda(args)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0) and f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)


def test_launch_environment(monkeypatch):
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    assert train._dist_env() is None
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_NNODES", "4")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert train._dist_env() is None  # an sbatch script (no srun step): one process, not rank 0 of 8
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")  # an srun step of 4 tasks on 2 nodes, in that allocation
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", "2")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert train._dist_env() == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    # an uneven step, 5 tasks as 3 + 2: the first node's third task (LOCAL_WORLD_SIZE 2 before)
    for k, v in (("SLURM_PROCID", "2"), ("SLURM_STEP_NUM_TASKS", "5"), ("SLURM_LOCALID", "2"), ("SLURM_NODEID", "0"),
                 ("SLURM_STEP_TASKS_PER_NODE", "3,2")):
        monkeypatch.setenv(k, v)
    assert train._dist_env() == {"RANK": "2", "WORLD_SIZE": "5", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3"}
    # (a list of another length than the step's nodes is not this step's: the even split, 5 // 2)
    for spec, nodes, node, want in (("2(x3),1", "4", "3", "1"), ("2(x3),1", "4", "1", "2"), ("4(x2)", "2", "1", "4"),
                                    ("2(x3),1", "2", "0", "2")):
        monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", spec)
        monkeypatch.setenv("SLURM_STEP_NUM_NODES", nodes)
        monkeypatch.setenv("SLURM_NODEID", node)
        assert train._dist_env()["LOCAL_WORLD_SIZE"] == want, (spec, node)
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", "2")
    monkeypatch.delenv("SLURM_STEP_TASKS_PER_NODE")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    for nodes, first in (("gpu[03-05,09],cpu1", "gpu03"), ("n[1-2]-ib", "n1-ib"),  # (n1 and rack1 before)
                         ("rack[1-2]-node[01-02]", "rack1-node01"), ("a,b", "a")):
        monkeypatch.setenv("SLURM_JOB_NODELIST", nodes)
        assert train._slurm_master() == first
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train._dist_env()["WORLD_SIZE"] == "2"  # torchrun's variables win


def test_slurm_ports_differ_by_job_and_step(monkeypatch):
    """29500 + job % 1000 gave jobs 1234 and 2234 (and two steps of one job) one port: the second
    job's rank 0 failed to bind and its rank 1 joined the first job's group and hung."""
    from zerofuse.train.launch_env import _slurm_port

    ports = set()
    for job, step in (("1234", "0"), ("2234", "0"), ("1234", "1"), ("3234", None)):
        monkeypatch.setenv("SLURM_JOB_ID", job)
        if step is None:
            monkeypatch.delenv("SLURM_STEP_ID", raising=False)
        else:
            monkeypatch.setenv("SLURM_STEP_ID", step)
        ports.add(_slurm_port())
    assert len(ports) == 4 and all(20000 <= p < 30000 for p in ports)
    monkeypatch.setenv("SLURM_STEP_ID", "batch")  # not a number: no crash
    assert 20000 <= _slurm_port() < 30000


def test_launch_judges_a_stop_by_this_launch_s_files_and_runs_off_the_main_thread(monkeypatch, tmp_path):
    """A signalled launch is a clean stop only if this launch's ranks wrote summary.json (a second
    in-process launch into the same --out took the first one's summary for its own: 143); launch()
    from another thread raised installing its signal handlers and left the ranks' variables set
    (reviews' reproductions, 2026-12-07)."""
    import threading

    import torch.distributed.launcher.api as api
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from zerofuse.train.launch import launch

    for k in ("ZEROFUSE_TRAIN_LAUNCHED", "ZEROFUSE_TRAIN_T0"):
        monkeypatch.delenv(k, raising=False)
    plan = []

    def fake_launch(config, entry):
        def run(*args):
            writes, stop = plan.pop(0)
            for name in writes:
                (tmp_path / name).write_text("{}")
            if stop:
                raise SignalException("stop", sigval=signal.SIGTERM)
        return run

    monkeypatch.setattr(api, "elastic_launch", fake_launch)
    plan[:] = [(("metrics.jsonl", "summary.json"), False), (("metrics.jsonl",), True),
               (("metrics.jsonl", "summary.json"), True), ((), True)]
    assert launch([], 2, out=str(tmp_path)) == 0
    time.sleep(0.05)  # (a later mtime for the next launch's writes)
    assert launch([], 2, out=str(tmp_path)) == 1  # trained, no summary of its own: not a clean stop
    assert launch([], 2, out=str(tmp_path)) == 143
    got = []
    thread = threading.Thread(target=lambda: got.append(launch([], 2, out=str(tmp_path / "new"))))
    thread.start()
    thread.join(60)
    assert got == [143] and "ZEROFUSE_TRAIN_LAUNCHED" not in os.environ  # (stopped in its start: no step)


def test_launch_gives_the_ranks_their_grace_and_keeps_its_variables_to_them(monkeypatch):
    """The launcher's variables reach the ranks only (they stayed set in the calling process: a later
    in-process run took them for its own); the agent waits --timeout for signalled ranks to save
    their checkpoint (torch's 30 s killed them mid-save); ranks ended by a stop signal's default
    action (outside the loop) count as stopped, 128 + signal."""
    import torch.distributed.launcher.api as api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from zerofuse.train.launch import launch

    for k in ("ZEROFUSE_TRAIN_LAUNCHED", "ZEROFUSE_TRAIN_T0"):
        monkeypatch.delenv(k, raising=False)
    seen = []

    def fake_launch(config, entry):
        def run(*args):
            seen.append((config.shutdown_timeout, os.environ.get("ZEROFUSE_TRAIN_LAUNCHED")))
            if len(seen) == 2:
                raise ChildFailedError("zerofuse.train", {0: ProcessFailure(0, 1, -15, ""),
                                                          1: ProcessFailure(1, 2, 143, "")})
        return run

    monkeypatch.setattr(api, "elastic_launch", fake_launch)
    assert launch([], 2, timeout=900.0) == 0
    assert launch([], 2) == 143
    assert seen == [(900, "1"), (600, "1")]
    assert "ZEROFUSE_TRAIN_LAUNCHED" not in os.environ and "ZEROFUSE_TRAIN_T0" not in os.environ


def test_a_rank_waiting_for_its_peers_stops_at_once_on_a_signal(tmp_path):
    """Outside the training loop a stop signal takes its default action: a rank waiting for a peer
    that never comes (here for up to 300 s) ended only when killed; it ignored SIGINT and SIGTERM."""
    from zerofuse.train.launch import _free_port

    env = _env() | {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    p = subprocess.Popen(_cmd("--steps", 2, "--out", tmp_path), env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(8)  # imported and waiting in the rendezvous
        assert p.poll() is None
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=20)
        assert p.returncode == -signal.SIGTERM and time.monotonic() - t0 < 10
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_the_loss_plot_leaves_the_callers_matplotlib_alone(tmp_path):
    """loss.png is drawn without pyplot: a caller's backend (a notebook's) and its open figures stay
    as they were (matplotlib.use("Agg") switched the backend of the whole process)."""
    matplotlib = pytest.importorskip("matplotlib")
    from zerofuse.train.table import _plot
    before = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        history = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5, "val_loss": 2.7}]
        _plot(history, tmp_path / "loss.png")
        assert matplotlib.get_backend() == "svg"
        assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        matplotlib.use(before)


def test_the_out_lock_on_a_filesystem_without_locks(tmp_path, monkeypatch, capsys):
    """--out's lock (one job per --out): a second holder is refused naming the first's pid; on a
    filesystem without flock (ENOLCK) the job runs unguarded with a note, not a traceback."""
    import errno
    import fcntl

    from zerofuse.train.launch import out_lock

    with out_lock(str(tmp_path)):
        with pytest.raises(train.UsageError, match=f"another zerofuse-train job \\(pid {os.getpid()}\\)"):
            with out_lock(str(tmp_path)):
                pass

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with out_lock(str(tmp_path)):
        pass
    assert "does not support file locks" in capsys.readouterr().err
