"""What a zerofuse.comm Communicator holds and when it lets go, on real gloo ranks: a waited
collective's buffers are freed when wait() returns ([Note: gloo lets go late]), and dropping a
communicator whose thread still holds tensors does not deadlock on the GIL ([Note: no GIL in the
communicator's destructor])."""
import time

import torch

from dist_utils import run_distributed


def _late_release_rank(rank, ws, n):
    import zerofuse
    from zerofuse import _C
    from zerofuse.comm import Communicator

    comm = Communicator(timeout=30)
    late = 0
    with zerofuse.zero.peak_memory():  # installs the counting allocator
        for _ in range(n):
            before = _C.cpu_memory_counter_current()
            t = torch.full((1 << 18,), float(rank))  # 1 MiB, reduced in place
            w = comm.all_reduce_coalesced([t], op="sum")
            w.wait()
            assert torch.equal(t, torch.full_like(t, float(ws * (ws - 1) // 2)))
            del w, t
            late += _C.cpu_memory_counter_current() > before
    return late


def test_a_waited_collectives_buffers_are_freed_when_wait_returns():
    """After wait() and dropping the tensor, nothing of the collective is allocated: before the fix,
    gloo's worker still held the Work (and the tensor) after marking it complete in 33-46 of 300
    waits here, which made test_zero_memory's peaks vary (CI 2026-11-26)."""
    assert run_distributed(_late_release_rank, 2, 300, timeout=120) == [0, 0]


def _drop_pending_rank(rank, ws, delay_ms):
    import gc

    import zerofuse  # noqa: F401
    from zerofuse.comm import Communicator, P2POp

    comm = Communicator(timeout=30, debug_delay_ms=delay_ms)
    mine = torch.full((1024,), float(rank))
    w = comm.batch_p2p([P2POp("send" if rank == 0 else "recv", mine, 1 - rank, 7)])
    del mine, w  # not waited: the launch, still delayed, holds the tensor's last reference
    t0 = time.monotonic()
    del comm
    gc.collect()
    return time.monotonic() - t0


def test_dropping_a_communicator_with_launches_pending_does_not_hang():
    """[Note: no GIL in the communicator's destructor]: the communicator is dropped by Python while
    its transport's thread still has to launch a p2p (the test-only launch delay makes the moment
    certain) and then drop the tensor whose last reference it holds, which takes the GIL. With the
    destructor joining that thread under the GIL, the rank hung (CI: a pipeline rank, at the end of
    its run)."""
    out = run_distributed(_drop_pending_rank, 2, 200.0, timeout=60)
    for took in out:
        assert 0.1 < took < 30, took  # it waited for the delayed launch, and not forever
