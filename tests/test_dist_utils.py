"""The distributed test harness itself: results come back, and failures and hangs fail fast."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import DistributedFailure, run_distributed


def _all_reduce_rank(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, world_size, t.item()


def _raise_on_rank_1(rank, world_size):
    # every rank connected first: a rank that raised right after its own init could close its
    # sockets while a peer was still in gloo's connectFullMesh (seen once in CI), and that peer's
    # stack would then end in init_process_group instead of here
    dist.barrier()
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # the other ranks wait here for rank 1, forever
    return rank


def _hang_on_last_rank(rank, world_size):
    if rank == world_size - 1:
        time.sleep(3600)
    dist.barrier()


def _exit_on_rank_0(rank, world_size):
    if rank == 0:
        os._exit(3)
    dist.barrier()


def _assert_dead(pids):
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_results_come_back_in_rank_order(world_size):
    out = run_distributed(_all_reduce_rank, world_size)
    total = world_size * (world_size + 1) / 2
    assert out == [(r, world_size, total) for r in range(world_size)]


def test_raising_rank_fails_promptly_with_every_traceback():
    t0 = time.monotonic()
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_raise_on_rank_1, 3, timeout=60)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert "failed" in msg
    assert "ValueError: rank one is broken" in msg
    # the ranks blocked in the barrier either see gloo's error for the lost peer or are stopped;
    # either way their stacks are in the message
    for r in (0, 2):
        section = msg.split(f"--- rank {r} ---")[1].split("--- rank")[0]
        assert "_raise_on_rank_1" in section and "barrier" in section, section
    assert elapsed < 30, f"took {elapsed:.1f} s: the failure should end the run within the grace period"
    _assert_dead(info.value.pids)


def test_hanging_rank_times_out_with_stacks():
    t0 = time.monotonic()
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_hang_on_last_rank, 2, timeout=8)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert "timed out after 8 s" in msg
    rank1 = msg.split("--- rank 1 ---")[1]
    assert "time.sleep" in rank1 or "_hang_on_last_rank" in rank1
    assert elapsed < 25
    _assert_dead(info.value.pids)


def test_rank_that_dies_is_reported():
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_exit_on_rank_0, 2, timeout=60)
    assert "exited with code 3" in str(info.value)
    _assert_dead(info.value.pids)
