"""zerofuse.comm point-to-point: send / recv / batch_p2p on real gloo ranks, the checker on a
mismatched pair, bad input."""
import time

import pytest
import torch

from dist_utils import run_distributed


def _ring_rank(rank, ws):
    """Each rank sends to the next and receives from the previous in one batch (a ring: posted
    one at a time it would deadlock on a blocking transport), in several dtypes and odd sizes,
    then a chain of single sends/recvs with tags posted out of order on the receiver."""
    import zerofuse  # noqa: F401
    from zerofuse.comm import Communicator, P2POp

    comm = Communicator(timeout=60)
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    checked = 0
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for n in (1, 97, 4099):
            mine = (torch.arange(n) + 1000 * rank).to(dtype)
            got = torch.empty(n, dtype=dtype)
            comm.batch_p2p([P2POp("send", mine, nxt), P2POp("recv", got, prv)]).wait()
            assert torch.equal(got, (torch.arange(n) + 1000 * prv).to(dtype))
            checked += 1
    # tags: rank 0 sends two messages; rank 1 posts their receives in the reverse order
    if rank == 0:
        works = [comm.send(torch.full((5,), 1.0), 1, tag=1), comm.send(torch.full((7,), 2.0), 1, tag=2)]
        for w in works:
            w.wait()
    elif rank == 1:
        b, a = torch.empty(7), torch.empty(5)
        wb, wa = comm.recv(b, 0, tag=2), comm.recv(a, 0, tag=1)
        wb.wait()
        wa.wait()
        assert torch.equal(a, torch.full((5,), 1.0)) and torch.equal(b, torch.full((7,), 2.0))
        checked += 1
    # p2p takes no collective sequence number: a collective after it still lines up on every rank
    assert comm._c.sequence == 0
    t = torch.ones(3)
    comm.all_reduce_coalesced([t], op="sum").wait()
    assert torch.equal(t, torch.full((3,), float(ws)))
    return checked


@pytest.mark.parametrize("world_size", [2, 3])
def test_p2p_ring_and_tags(world_size):
    out = run_distributed(_ring_rank, world_size, timeout=120)
    assert out == [9 + (r == 1) for r in range(world_size)]


def _mismatch_rank(rank, ws):
    """Rank 0 sends 4 floats, rank 1 expects 5: with the checker both ranks raise, naming the transfer."""
    import zerofuse  # noqa: F401
    from zerofuse.comm import CollectiveMismatch, Communicator

    comm = Communicator(timeout=20)
    t0 = time.perf_counter()
    try:
        if rank == 0:
            comm.send(torch.zeros(4), 1).wait()
        else:
            comm.recv(torch.zeros(5), 0).wait()
    except CollectiveMismatch as e:
        return str(e), time.perf_counter() - t0
    return "no error", time.perf_counter() - t0


def test_checker_names_a_mismatched_transfer_on_both_ranks(monkeypatch):
    monkeypatch.setenv("ZEROFUSE_CHECK_COLLECTIVES", "1")
    out = run_distributed(_mismatch_rank, 2, timeout=60)
    for rank, (msg, seconds) in enumerate(out):
        assert "transfer #0 from rank 0 to rank 1 differs" in msg, (rank, msg)
        assert "(4,):float32" in msg and "(5,):float32" in msg
        assert seconds < 10


def _unmatched_rank(rank, ws):
    """Both ranks send and nobody receives: the checker names the missing receive after its timeout."""
    import zerofuse  # noqa: F401
    from zerofuse.comm import CollectiveMismatch, Communicator

    comm = Communicator(timeout=2)
    try:
        comm.send(torch.zeros(3), 1 - rank).wait()
    except CollectiveMismatch as e:
        return str(e)
    return "no error"


def test_checker_names_a_send_nobody_receives(monkeypatch):
    monkeypatch.setenv("ZEROFUSE_CHECK_COLLECTIVES", "1")
    out = run_distributed(_unmatched_rank, 2, timeout=60)
    for rank, msg in enumerate(out):
        assert f"rank {1 - rank} did not post the recv matching rank {rank}'s send #0" in msg, msg


def _bad_input_rank(rank, ws):
    import zerofuse  # noqa: F401
    from zerofuse.comm import Communicator, P2POp

    comm = Communicator(timeout=10)
    errors = []
    for ops in ([P2POp("send", torch.zeros(3), ws)], [P2POp("send", torch.zeros(3), rank)],
                [P2POp("recv", torch.zeros(4, 4).t(), 1 - rank)], [("send", torch.zeros(3), 1 - rank)],
                [P2POp("put", torch.zeros(3), 1 - rank)], [P2POp("send", torch.zeros(3), 1 - rank, -1)]):
        try:
            comm.batch_p2p(ops)
        except (ValueError, RuntimeError) as e:
            errors.append(str(e).split("\n")[0])
        else:
            errors.append("accepted")
    return errors


def test_p2p_bad_input_is_refused_with_the_argument_named():
    errors = run_distributed(_bad_input_rank, 2, timeout=60)[0]
    assert "ops[0].peer to be a rank of the group (0 <= peer < 2), got 2" in errors[0]
    assert "ops[0].peer to be another rank than this one (0), got 0" in errors[1]
    assert "ops[0].tensor to be contiguous" in errors[2]
    assert "expected ops[0] to be a P2POp" in errors[3] and "expected ops[0] to be a P2POp" in errors[4]
    assert "ops[0].tag >= 0, got -1" in errors[5]


def test_p2p_needs_no_group_wide_call():
    """Ranks 0 and 2 of 3 exchange while rank 1 does nothing (covered by the ring at ws 3 above too)."""
    out = run_distributed(_pair_only_rank, 3, timeout=60)
    assert out == [True, None, True]


def _pair_only_rank(rank, ws):
    import zerofuse  # noqa: F401
    from zerofuse.comm import Communicator

    comm = Communicator(timeout=30)
    if rank == 1:
        return None
    peer = 2 - rank
    got = torch.empty(11)
    if rank == 0:
        comm.send(torch.arange(11.0), peer).wait()
        comm.recv(got, peer).wait()
        return torch.equal(got, torch.arange(11.0) * 2)
    comm.recv(got, peer).wait()
    comm.send(got * 2, peer).wait()
    return torch.equal(got, torch.arange(11.0))



def _checker_valid_programs_rank(rank, ws):
    """Programs valid without the checker stay valid with it (it made each send wait for its
    receive to be posted: these deadlocked until the timeout, then blamed the peer)."""
    import zerofuse  # noqa: F401
    from zerofuse.comm import Communicator, P2POp

    comm = Communicator(timeout=20)
    t0 = time.perf_counter()
    peer = 1 - rank
    # each rank sends, then receives, as separate calls
    got = torch.empty(4)
    ws_ = [comm.send(torch.full((4,), float(rank)), peer), comm.recv(got, peer)]
    for w in ws_:
        w.wait()
    ring = torch.equal(got, torch.full((4,), float(peer)))
    # a batch of two sends taken one at a time, the first waited before the second is posted (what
    # the pipeline's header + activation do)
    if rank == 0:
        comm.batch_p2p([P2POp("send", torch.arange(3.0), 1, 1), P2POp("send", torch.arange(5.0), 1, 2)]).wait()
        one_by_one = True
    else:
        a, b = torch.empty(3), torch.empty(5)
        comm.recv(a, 0, tag=1).wait()
        comm.recv(b, 0, tag=2).wait()
        one_by_one = torch.equal(a, torch.arange(3.0)) and torch.equal(b, torch.arange(5.0))
    # a bad peer is refused at once, before anything is published (it waited for the timeout)
    t1 = time.perf_counter()
    bad = []
    for p in (ws, rank, -1):
        try:
            comm.send(torch.zeros(2), p)
        except ValueError as e:
            bad.append(str(e))
    return ring, one_by_one, bad, time.perf_counter() - t1, t1 - t0, comm.store.num_keys()


def test_checker_takes_valid_p2p_programs(monkeypatch):
    monkeypatch.setenv("ZEROFUSE_CHECK_COLLECTIVES", "1")
    out = run_distributed(_checker_valid_programs_rank, 2, timeout=60)
    for rank, (ring, one_by_one, bad, bad_seconds, seconds, _) in enumerate(out):
        assert ring and one_by_one, (rank, ring, one_by_one)
        assert seconds < 10 and bad_seconds < 2, (seconds, bad_seconds)
        assert "expected ops[0].peer to be a rank of the group (0 <= peer < 2), got 2" in bad[0], bad
        assert f"expected ops[0].peer to be another rank than this one ({rank}), got {rank}" in bad[1], bad
        assert "got -1" in bad[2], bad


def _pipeline_rank(rank, ws, schedule, virtual):
    import zerofuse  # noqa: F401
    from zerofuse.pipeline import Pipeline, split_modules

    torch.manual_seed(0)
    layers = [(f"layers.{i}", torch.nn.Linear(8, 8)) for i in range(ws * virtual)]
    stages = split_modules(layers, ws * virtual, [rank + k * ws for k in range(virtual)],
                           loss_fn=lambda y, t: (y - t).pow(2).mean())
    pipe = Pipeline(stages, schedule=schedule, microbatches=4)
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    loss = pipe.step(x, t)
    return None if loss is None else float(loss)


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved", 2), ("zb", 1)])
def test_checker_runs_the_pipeline_schedules(monkeypatch, schedule, virtual):
    """Every pipeline schedule hung under ZEROFUSE_CHECK_COLLECTIVES=1; now the same loss as without it."""
    plain = run_distributed(_pipeline_rank, 2, schedule, virtual, timeout=120)
    monkeypatch.setenv("ZEROFUSE_CHECK_COLLECTIVES", "1")
    checked = run_distributed(_pipeline_rank, 2, schedule, virtual, timeout=120)
    assert checked == plain and plain[-1] is not None, (checked, plain)
