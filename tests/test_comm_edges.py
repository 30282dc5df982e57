"""The communicator on gloo where a review (2026-12-07) reproduced a failure, each test failing
before its fix: a timed wait of a point-to-point batch (gloo's send/recv report no completion
before their wait: every timed p2p wait failed the communicator); reduce_scatter_fp32_sum's gather
into a 2-D flat; its Work's is_completed() (False until wait(): a polling loop never ended); the
time blocked on its all-to-all at the next call, missing from wait_seconds(); all_to_all into its
own input (wrong rows, silently); an expanded tensor to be written (refused only after the
collective); the collective checker's count of a pair's transfers by order where gloo pairs them
by tag (a false mismatch)."""
from __future__ import annotations

import os
import time

import pytest
import torch

from dist_utils import error_text, run_distributed

pytestmark = pytest.mark.usefixtures("native_kernels")


def _edges(rank, ws):
    from zerofuse.comm import Communicator, P2POp, wait_seconds

    comm = Communicator(timeout=30)
    out = {}
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    got = torch.empty(4)
    t0 = time.perf_counter()
    comm.batch_p2p([P2POp("send", torch.arange(4.0) + rank, nxt), P2POp("recv", got, prv)]).wait(timeout=5)
    out["p2p"], out["p2p_s"] = got.tolist(), time.perf_counter() - t0
    flat = torch.ones(2 * ws, 3, dtype=torch.bfloat16) * (rank + 1)
    w = comm.reduce_scatter_fp32_sum(flat, all_gather=True)
    deadline = time.monotonic() + 20
    while not w.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    out["polled"] = w.is_completed()
    w.wait()
    out["fp32 2-D"] = flat.float().unique().tolist()
    x = torch.arange(2.0 * ws).reshape(ws, 2)
    out["a2a in place"] = error_text(lambda: comm.all_to_all(x, x, [1] * ws, [1] * ws))
    out["expanded"] = error_text(lambda: comm.all_reduce_coalesced([torch.ones(1).expand(4), torch.ones(3)]))
    if rank == 1:
        time.sleep(1.0)  # late for the fp32 sum's all-to-all: rank 0 blocks at its next call
    w0 = wait_seconds()
    a = comm.reduce_scatter_fp32_sum(torch.ones(2 * ws, dtype=torch.bfloat16), all_gather=True)
    b = comm.all_reduce_coalesced([torch.ones(2)])
    out["blocked_s"] = wait_seconds() - w0  # before any wait(): the time blocked launching b
    a.wait()
    b.wait()
    out["after"] = error_text(lambda: comm.all_reduce_coalesced([torch.ones(1)]).wait(timeout=5))
    return out


def test_communicator_edges_on_gloo():
    for rank, r in enumerate(run_distributed(_edges, 3, timeout=120)):
        prv = (rank - 1) % 3
        assert r["p2p"] == [float(i + prv) for i in range(4)] and r["p2p_s"] < 4, r
        assert r["polled"] and r["fp32 2-D"] == [6.0], r
        assert r["a2a in place"].startswith("ValueError: zerofuse::comm.all_to_all: expected out not to share memory "
                                            "with input"), r
        assert r["expanded"].startswith("ValueError: zerofuse.comm.all_reduce_coalesced: expected tensors[0] to "
                                        "hold each element once"), r
        if rank == 0:
            assert r["blocked_s"] > 0.5, r
        assert r["after"] == "no error", r


def test_all_to_all_into_its_input_is_refused_over_one_rank_too(world_of_one):
    from zerofuse.comm import Communicator

    x = torch.arange(4.0).reshape(2, 2)
    assert error_text(lambda: Communicator().all_to_all(x, x, [2], [2])).startswith(
        "ValueError: zerofuse::comm.all_to_all: expected out not to share memory with input")


def _tags_in_other_orders(rank, ws):
    os.environ["ZEROFUSE_CHECK_COLLECTIVES"] = "1"
    from zerofuse.comm import Communicator, P2POp

    comm = Communicator(timeout=20)
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    a, b = torch.empty(2), torch.empty(3)
    comm.batch_p2p([P2POp("send", torch.full((2,), float(rank)), nxt, 1),
                    P2POp("send", torch.full((3,), 10.0 + rank), nxt, 2),
                    P2POp("recv", b, prv, 2), P2POp("recv", a, prv, 1)]).wait()
    return a.tolist() + b.tolist()


def test_the_checker_pairs_gloo_transfers_by_tag():
    for rank, got in enumerate(run_distributed(_tags_in_other_orders, 3, timeout=120)):
        prv = (rank - 1) % 3
        assert got == [float(prv)] * 2 + [10.0 + prv] * 3


def _threads_and_grads(rank, ws):
    import threading

    from zerofuse.comm import Communicator

    comm = Communicator(timeout=60)
    bad = []
    for it in range(60):  # two threads wait() on one Work (the bindings release the GIL)
        ts = [torch.full((200_000,), 1.0), torch.ones(3)]
        w = comm.all_reduce_coalesced(ts)
        errs = []
        threads = [threading.Thread(target=lambda: errs.append(error_text(w.wait))) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errs != ["no error", "no error"] or not ts[0].eq(ws).all():
            bad.append((it, errs))
    out = torch.zeros(4, requires_grad=True)  # e.g. an fp32 master shard that is a leaf requiring grad
    w = comm.reduce_scatter_coalesced([torch.full((8,), 1.0 + rank)], out, op="sum")
    return bad, error_text(w.wait), out.detach().tolist()


def test_a_work_waited_from_two_threads_and_an_out_shard_requiring_grad():
    """Two threads in wait() of one Work ran its copy-out and freed its buffers together: a segfault
    within a few tries; an out_shard requiring grad failed every wait() after the collective ran (in
    place on a leaf), unwritten, where a world of one wrote it (a review's reproductions, 2026-12-07)."""
    for bad, err, out in run_distributed(_threads_and_grads, 2, timeout=240):
        assert bad == [] and err == "no error"
        assert out == [3.0] * 4


def _refusals(rank, ws):
    """Each refused at the call, on every rank alike (nothing launched: the communicator stays usable)."""
    import torch.distributed as dist

    from zerofuse.comm import Communicator, P2POp

    comm = Communicator(timeout=30)
    out = {}
    out["fp32 sum int64"] = error_text(lambda: comm.reduce_scatter_fp32_sum(torch.ones(2 * ws, dtype=torch.int64)))
    out["fp32 sum float64"] = error_text(lambda: comm.reduce_scatter_fp32_sum(torch.ones(2 * ws, dtype=torch.float64)))
    x = torch.zeros(4)
    out["transposed overlap"] = error_text(lambda: comm.all_gather_coalesced(torch.ones(4 // ws), [x.view(2, 2).t(), x]))
    v = torch.zeros(8)  # a strided view over another's elements (neither check compared it: a review, 2026-12-07)
    out["strided overlap"] = error_text(lambda: comm.all_gather_coalesced(torch.ones(8 // ws), [v[::2], v[:4]]))
    y = torch.ones(4)
    comm.all_reduce_coalesced([y[::2], y[1::2]]).wait()  # interleaved: no element shared, allowed
    out["interleaved"] = y.tolist()
    z = torch.full((8,), float(rank))
    peer = 1 - rank
    out["p2p same buffer"] = error_text(lambda: comm.batch_p2p([P2POp("send", z, peer), P2POp("recv", z[2:6], peer)]))
    out["p2p tag"] = error_text(lambda: comm.send(z, peer, tag=2 ** 31))
    out["p2p peer"] = error_text(lambda: comm.send(z, 2 ** 40))
    out["torch op"] = error_text(lambda: comm.all_reduce_coalesced([torch.ones(2)], op=dist.ReduceOp.SUM))
    out["rs op"] = error_text(lambda: comm.reduce_scatter_coalesced([torch.ones(2 * ws)], torch.ones(2), op=None))
    for bad in (["a", 1], [None, 1], [float("nan"), 1]):
        out[f"splits {bad[0]}"] = error_text(lambda: comm.all_to_all(torch.empty(2), torch.ones(2), [1, 1], bad))
    w = torch.ones(3)
    comm.all_reduce_coalesced([w]).wait()
    out["after"] = w.tolist()
    return out


@pytest.mark.parametrize("ws", [1, 2])
def test_bad_calls_are_refused_at_the_call_by_name(ws):
    """A review's reproductions (2026-12-07): reduce_scatter_fp32_sum summed int64 and float64 in fp32
    (2**40 + 1 came back 2**40, silently); written tensors overlapping through a transpose were refused
    at wait(), after the collective; a send and a receive on one buffer corrupted every element; torch's
    ReduceOp, a tag or peer past int32, and splits of "a" or None failed in pybind's or int()'s words."""
    outs = run_distributed(_refusals, ws, timeout=120)
    for r in outs:
        for dt in ("int64", "float64"):
            assert r[f"fp32 sum {dt}"] == ("ValueError: zerofuse.comm.reduce_scatter_fp32_sum: expected flat bf16, "
                                           f"fp16 or fp32 (summed in fp32), got torch.{dt}; reduce_scatter_coalesced "
                                           "sums it in its own dtype"), r
        assert r["transposed overlap"] == ("ValueError: zerofuse.comm.all_gather_coalesced: expected tensors[0] and "
                                           "tensors[1] not to share memory (both are written), got tensors that "
                                           "overlap"), r
        assert r["strided overlap"] == r["transposed overlap"], r
        assert r["interleaved"] == [float(ws)] * 4, r
        assert r["torch op"].startswith("ValueError: zerofuse.comm.all_reduce_coalesced: expected op 'sum', 'avg', "
                                        "'max' or 'min', got <RedOpType.SUM"), r
        assert r["rs op"] == ("ValueError: zerofuse.comm.reduce_scatter_coalesced: expected op 'sum', 'avg', 'max' or "
                              "'min', got None"), r
        for bad in ("a", None, "nan"):
            assert r[f"splits {bad}"].startswith("ValueError: zerofuse::comm.all_to_all: expected input_splits to be "
                                                 "whole row counts"), r
        assert r["after"] == [float(ws)] * 3, r
        if ws == 2:
            assert r["p2p same buffer"] == ("ValueError: zerofuse.comm.batch_p2p: expected ops[0].tensor and "
                                            "ops[1].tensor (send, recv) not to share memory (a receive writes it), "
                                            "got tensors that overlap"), r
            assert r["p2p tag"] == "ValueError: zerofuse.comm.batch_p2p: expected ops[0].tag < 2**31 (an int32), got " \
                "2147483648", r
            assert "expected ops[0].peer to be a rank of the group (0 <= peer < 2), got 1099511627776" in r["p2p peer"], r
