"""A rank that stops mid-operation makes every other rank fail within the timeout, with one error
naming the collective, its sequence number, the group and the timeout, through every entry point:
the Communicator, ZeRO stage 2 and 3, tensor parallelism and the training job (gloo ranks); and on
a GPU, the NCCL transport's watchdog (a stuck collective injected at world size one).

A stopped rank is frozen with SIGSTOP: its sockets stay open, so its peers see silence rather than
a closed connection (a dead rank, the faster case, is tested in test_comm.py). The time from the
stop to each other rank's error is measured across processes (wall clock, one machine) and must be
at most the timeout + SLACK_S.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_utils import DistributedFailure, run_distributed

TIMEOUT_S = 3.0  # the groups' timeout: short, since every test waits it out
SLACK_S = 5.0
STOPPED = 1  # the rank that stops


def _group(ws):
    return dist.new_group(list(range(ws)), timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _stop_here(record: str) -> None:
    Path(record, "stopped").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP)


def _record(record: str, rank: int, e: BaseException, **extra) -> None:
    Path(record, f"rank{rank}.json").write_text(
        json.dumps({"type": type(e).__name__, "message": str(e), "at": time.time(), **extra}))


def _failures(record: Path, fn, ws: int, *args) -> dict[int, dict]:
    """Run fn(rank, ws, record, *args) on ws ranks, where rank STOPPED stops and the others record
    the error they get; returns the others' records, with "after": seconds from the stop."""
    with pytest.raises(DistributedFailure) as info:
        run_distributed(fn, ws, str(record), *args, timeout=90)
    report = str(info.value)
    assert f"--- rank {STOPPED} ---\ndid not finish" in report, report
    stopped_at = float((record / "stopped").read_text())
    out = {}
    for r in range(ws):
        if r != STOPPED:
            path = record / f"rank{r}.json"
            assert path.is_file(), f"rank {r} recorded no error:\n{report}"
            out[r] = json.loads(path.read_text())
            out[r]["after"] = out[r]["at"] - stopped_at
    return out


def _assert_named(failure: dict, rank: int, ws: int) -> None:
    """One DistBackendError naming the collective, its number, the group and the timeout, in time."""
    assert failure["type"] == "DistBackendError", failure
    pattern = (rf"zerofuse\.comm: (reduce_scatter|all_gather|all_reduce)\w* #\d+ on rank {rank} of {ws} in group \d+ "
               rf"failed \(timeout {TIMEOUT_S:g} s\): ")
    assert re.search(pattern, failure["message"]), failure["message"]
    print(f"rank {rank} of {ws}: failed {failure['after']:.2f} s after rank {STOPPED} stopped: {failure['message']}")
    assert 0 < failure["after"] <= TIMEOUT_S + SLACK_S, failure


# ---------------------------------------------------------------------------- where timeouts come from


def test_timeouts_come_from_the_groups(tmp_path):
    """A Communicator takes its group's timeout unless given one; init_mesh's groups take the one
    init_process_group was given (new_group alone would fall back to torch's default)."""
    from zerofuse.comm import Communicator, group_timeout
    from zerofuse.parallel import init_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=7))
    try:
        assert Communicator().timeout == 7
        mesh = init_mesh(dp=1)
        assert group_timeout(mesh.dp_group) == group_timeout(mesh.tp_group) == 7
        assert Communicator(mesh.dp_group).timeout == 7
        assert Communicator(_group(1)).timeout == TIMEOUT_S
        assert Communicator(timeout=2.5).timeout == 2.5
        assert group_timeout(dist.new_group([0])) == dist.default_pg_timeout.total_seconds()
    finally:
        dist.destroy_process_group()


def test_training_job_timeout_flag(capsys, tmp_path):
    from zerofuse import train

    assert train.main(["--timeout", "0", "--out", str(tmp_path)]) == 2
    assert "--timeout: expected seconds > 0, got 0.0" in capsys.readouterr().err


# ---------------------------------------------------------------------------- Communicator


def _comm_rank(rank, ws, record):
    from zerofuse.comm import Communicator

    comm = Communicator(_group(ws))
    assert comm.timeout == TIMEOUT_S  # the group's
    comm.all_reduce_coalesced([torch.ones(5)]).wait()
    if rank == STOPPED:
        _stop_here(record)
    try:
        comm.all_reduce_coalesced([torch.ones(1 << 16)], op="sum").wait()
    except dist.DistBackendError as e:
        t0 = time.monotonic()
        try:  # the communicator is unusable from now on: the next call raises at once
            comm.reduce_scatter_coalesced([torch.ones(8)], torch.empty(-(-8 // ws)))
        except dist.DistBackendError as again:
            _record(record, rank, e, again=str(again), again_s=time.monotonic() - t0)
        raise


def test_a_stopped_rank_fails_every_other_rank_within_the_timeout(tmp_path):
    for r, failure in _failures(tmp_path, _comm_rank, 3).items():
        _assert_named(failure, r, 3)
        assert "all_reduce_coalesced #1 " in failure["message"]
        assert failure["again"].startswith(f"zerofuse.comm: reduce_scatter_coalesced #2 on rank {r} of 3 in group ")
        assert "refused: the communicator failed earlier and is unusable: all_reduce_coalesced #1 " in failure["again"]
        assert failure["again_s"] < 0.5


# ---------------------------------------------------------------------------- ZeRO


def _zero_rank(rank, ws, record, stage, reduce_dtype):
    import zerofuse

    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(6)]
    model = torch.nn.Sequential(*layers)
    # ~1 layer a bucket (unit): several reductions / gathers in flight during backward
    zerofuse.zero.parallelize(model, stage=stage, group=_group(ws), reduce_dtype=reduce_dtype, bucket_mb=0.015,
                              max_inflight=1, wrap=[torch.nn.Linear] if stage == 3 else None)
    assert model._zerofuse_zero.comm.timeout == TIMEOUT_S
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-3)
    if rank == STOPPED:  # mid-backward of the second step: after layers 5..3's grads, before 2..0's
        calls = []

        def stop_on_second_call(module, grad_output):
            calls.append(1)
            if len(calls) == 2:
                _stop_here(record)

        layers[2].register_full_backward_pre_hook(stop_on_second_call)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    try:
        for _ in range(3):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    except RuntimeError as e:  # raised in backward's hooks: autograd passes it on as it is
        _record(record, rank, e)
        raise


@pytest.mark.parametrize("stage,reduce_dtype,ws", [(2, torch.bfloat16, 3), (3, None, 2)])
def test_zero_rank_stopped_mid_backward(tmp_path, stage, reduce_dtype, ws):
    """Stage 2 with bf16 reductions: rank 0 waits in the all-to-all reduce-scatter that runs on c10d
    (Communicator.reduce_scatter_fp32_sum); stage 3: in the C++ Communicator's prefetch gathers."""
    failures = _failures(tmp_path, _zero_rank, ws, stage, reduce_dtype)
    for r, failure in failures.items():
        _assert_named(failure, r, ws)
        assert ("reduce_scatter_fp32_sum" in failure["message"]) == (reduce_dtype == torch.bfloat16), failure


# ---------------------------------------------------------------------------- tensor parallelism


def _tp_rank(rank, ws, record):
    import torch.nn.functional as F

    from zerofuse import tp

    group = _group(ws)
    torch.manual_seed(0)
    col = tp.ColumnParallelLinear(24, 37, group=group)
    row = tp.RowParallelLinear(37, 20, group=group)
    x = torch.randn(2, 12, 24, generator=torch.Generator().manual_seed(7), requires_grad=True)
    try:
        row(F.gelu(col(x))).sum().backward()
        y = row(F.gelu(col(x)))
        if rank == STOPPED:  # mid-backward: before the column layer's all-reduce of the input grad
            y.register_hook(lambda g: _stop_here(record))
        y.sum().backward()
    except RuntimeError as e:
        _record(record, rank, e)
        raise


def test_tp_rank_stopped_mid_backward(tmp_path):
    for r, failure in _failures(tmp_path, _tp_rank, 2).items():
        _assert_named(failure, r, 2)


# ---------------------------------------------------------------------------- the training job


def _children(pid: int) -> dict[int, int]:
    """{RANK: pid} of the processes started by pid."""
    ranks = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            env = dict(v.split("=", 1) for v in (stat.parent / "environ").read_text().split("\0") if "=" in v)
        except (OSError, IndexError, ValueError):
            continue
        if "RANK" in env:
            ranks[int(env["RANK"])] = int(stat.parent.name)
    return ranks


@pytest.mark.timeout(150)
def test_training_job_rank_stopped(tmp_path):
    """zerofuse-train --timeout: a rank stopped mid-training makes rank 0 fail within the timeout
    (its error on stderr) and the job exit 1 naming the failed rank."""
    cmd = [sys.executable, "-m", "zerofuse.train", "--nproc", "2", "--timeout", str(TIMEOUT_S), "--layers", "2",
           "--heads", "2", "--dim", "32", "--seq-len", "32", "--batch", "4", "--steps", "100000", "--eval-every", "0",
           "--eval-batches", "1", "--ckpt-every", "0", "--sample-tokens", "0", "--log-every", "1",
           "--out", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TRITON_INTERPRET")}
    env["ZEROFUSE_TRITON_ON_CPU"] = "0"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.time(), line) for line in proc.stderr), daemon=True)
    reader.start()
    ranks = {}
    try:
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.monotonic() + 100
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(line for _, line in lines)
            time.sleep(0.05)
        ranks = _children(proc.pid)
        assert sorted(ranks) == [0, 1], ranks
        stopped_at = time.time()
        os.kill(ranks[STOPPED], signal.SIGSTOP)
        while not any("Error" in line for _, line in lines) and time.time() < stopped_at + TIMEOUT_S + 30:
            time.sleep(0.05)
        # rank 0 exits on its own (with 1); only then is rank 1 stopped for good, or the launcher
        # would take rank 1's death for the first failure and signal rank 0
        while Path(f"/proc/{ranks[0]}").exists() and proc.poll() is None and time.time() < stopped_at + 60:
            time.sleep(0.05)
    finally:
        if STOPPED in ranks:
            os.kill(ranks[STOPPED], signal.SIGKILL)  # the launcher would wait for it: a stopped process ignores SIGTERM
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        reader.join(timeout=10)
    output = "".join(line for _, line in lines)
    errors = [(t, line) for t, line in lines if "Error" in line]
    assert errors, output
    after, error = errors[0][0] - stopped_at, errors[0][1]
    print(f"training job: rank 0 failed {after:.2f} s after rank {STOPPED} stopped: {error.strip()}")
    assert after <= TIMEOUT_S + SLACK_S, output
    # Inside ZeRO (the Communicator) the error names the collective, its number, the group and the
    # timeout; the job's own step-end all-reduce of the loss and stop flags runs on c10d, whose
    # gloo error names only the timeout: "Timed out waiting ..." when the wait times out first,
    # "Application timeout caused pair closure" when the pair's read does (seen twice in 3 full
    # runs on 2026-11-25, 3.0 s after the stop, i.e. within the timeout)
    named = re.search(rf"DistBackendError: zerofuse\.comm: \w+ #\d+ on rank 0 of 2 in group \d+ failed "
                      rf"\(timeout {TIMEOUT_S:g} s\)", error)
    c10d = f"Timed out waiting {TIMEOUT_S * 1000:.0f}ms" in error or "Application timeout caused pair closure" in error
    assert named or c10d, output
    assert proc.returncode == 1 and "zerofuse-train: rank 0 failed with exit code 1" in output, output


# ---------------------------------------------------------------------------- NCCL watchdog (GPU)


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_nccl_watchdog_aborts_a_stuck_collective(world_of_one, monkeypatch):
    """Collective #1's comm stream is held by ZEROFUSE_COMM_DEBUG_STALL (a kernel spinning on a
    host-mapped flag: a peer that never arrives). wait() does not block the host, so only the
    watchdog can tell: within the timeout + 2 s the communicator is marked failed and aborted, and
    every later wait and launch raises the error naming the collective, number, group and timeout;
    the streams drain (the abort ends the stall) instead of hanging torch.cuda.synchronize()."""
    import zerofuse
    from zerofuse.comm import Communicator

    if not zerofuse.build_info()["nccl"]:
        pytest.skip("this build has no NCCL")
    monkeypatch.setenv("ZEROFUSE_COMM_DEBUG_STALL", "1")  # the transport's second launch
    timeout = 2.0
    comm = Communicator(transport="nccl", timeout=timeout)
    x = torch.ones(4096, device="cuda")
    comm.all_reduce_coalesced([x], op="sum").wait()  # #0 runs
    torch.cuda.synchronize()
    t0 = time.monotonic()
    stuck = comm.all_reduce_coalesced([x], op="sum")  # #1 is held
    other = comm.all_reduce_coalesced([torch.ones(8, device="cuda")], op="sum")  # #2 queued behind it
    assert not stuck.is_completed()
    while not stuck.is_completed() and time.monotonic() - t0 < timeout + 10:
        time.sleep(0.01)
    detected = time.monotonic() - t0
    assert detected <= timeout + 2, detected
    named = (r"all_reduce_coalesced #1 on rank 0 of 1 in group 0 \(default_pg\) did not complete within the timeout "
             r"\(2 s\) of the NCCL transport; the NCCL communicator was aborted")
    with pytest.raises(dist.DistBackendError, match=r"zerofuse\.comm: all_reduce_coalesced #1 .*refused.*" + named):
        stuck.wait()
    with pytest.raises(dist.DistBackendError, match=r"all_reduce_coalesced #2 .*refused.*" + named):
        other.wait()
    with pytest.raises(dist.DistBackendError, match=r"all_reduce_coalesced #3 .*refused.*" + named):
        comm.all_reduce_coalesced([x], op="sum")
    torch.cuda.synchronize()  # the aborted communicator's streams have drained
    del comm
    torch.cuda.synchronize()
