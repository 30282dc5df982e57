"""zerofuse.comm.Communicator: what a review reproduced as wrong, on real gloo processes (each
check failed before its fix): integer reductions by a fraction refused at the call (they raised
after the collective, and a second wait() returned "done" with the tensors unwritten); the fp16
average not overflowing where the mean fits (gloo summed first: inf for the avg of 40000); a failed
reduce_scatter_fp32_sum failing the communicator as the C++ Works do; an infinite timeout (it
overflowed into 1 ms); the checker's numbering after a refused call; clear errors for a group the
rank is not in, a float peer or split, and a bad out_shard; the messages of world size 1 and 2
the same."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import error_text, run_distributed
from zerofuse.comm import Communicator, P2POp

TIMEOUT = 90


def _integer_fractions(rank, world_size):
    comm = Communicator()
    calls = {
        "all_reduce avg": lambda: comm.all_reduce_coalesced([torch.ones(4, dtype=torch.int64)], op="avg"),
        "all_reduce scale": lambda: comm.all_reduce_coalesced([torch.ones(4, dtype=torch.int32)], op="sum", scale=0.5),
        "reduce_scatter avg": lambda: comm.reduce_scatter_coalesced([torch.ones(4, dtype=torch.int64)],
                                                                    torch.zeros(-(-4 // world_size), dtype=torch.int64)),
    }
    out = {k: error_text(f) for k, f in calls.items()}
    t = torch.full((4,), 3, dtype=torch.int64)  # what stays allowed: a sum of integers
    comm.all_reduce_coalesced([t], op="sum").wait()
    out["sum"] = t.tolist()
    return out


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("world_size", [1, 2])
def test_integer_reductions_by_a_fraction_are_refused_at_the_call(world_size):
    for got in run_distributed(_integer_fractions, world_size):
        for what, fn in (("all_reduce avg", "all_reduce_coalesced"), ("reduce_scatter avg", "reduce_scatter_coalesced")):
            assert got[what] == (f"ValueError: zerofuse::comm.{fn}: expected a floating dtype with op 'avg' or a scale "
                                 "(the result is multiplied by a fraction), got Long with op 'avg'"), got[what]
        assert got["all_reduce scale"].endswith("got Int with a scale"), got["all_reduce scale"]
        assert got["sum"] == [3 * world_size] * 4


def _fp16_avg(rank, world_size):
    comm = Communicator()
    t = torch.full((5,), 40000.0, dtype=torch.float16)
    comm.all_reduce_coalesced([t], op="avg").wait()
    shard = torch.zeros(comm.shard_numel([t]), dtype=torch.float16)
    comm.reduce_scatter_coalesced([torch.full((5,), 40000.0, dtype=torch.float16)], shard, op="avg").wait()
    third = torch.full((3,), float(rank + 1), dtype=torch.float16)  # (1 + 2 + 3) / 3 = 2: rounding
    comm.all_reduce_coalesced([third], op="avg").wait()
    return t.tolist(), shard.tolist(), third.tolist()


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("world_size", [2, 3])
def test_fp16_average_does_not_overflow_where_the_mean_fits(world_size):
    """gloo has no avg: the sum of the ranks' fp16 values overflowed (inf) before the division."""
    for t, shard, third in run_distributed(_fp16_avg, world_size):
        assert t == [40000.0] * 5 and max(shard) == 40000.0 and set(shard) <= {40000.0, 0.0}  # (0: padding)
        assert third == [pytest.approx((world_size + 1) / 2, rel=1e-3)] * 3


def _fp32_sum_failure(rank, world_size):
    comm = Communicator(timeout=2)
    if rank == 1:  # never joins: rank 0's all-to-all times out
        time.sleep(6)
        return None
    flat = torch.ones(4, dtype=torch.bfloat16)
    out = torch.full((2,), -1.0)
    work = comm.reduce_scatter_fp32_sum(flat, out)
    first = error_text(work.wait)
    second = error_text(work.wait)
    t0 = time.perf_counter()
    later = error_text(lambda: comm.all_reduce_coalesced([torch.ones(3)]).wait())
    return first, second, later, time.perf_counter() - t0, out.tolist()


@pytest.mark.timeout(TIMEOUT)
def test_a_failed_fp32_sum_fails_the_communicator():
    first, second, later, later_s, out = run_distributed(_fp32_sum_failure, 2)[0]
    assert first.startswith("DistBackendError: zerofuse.comm: reduce_scatter_fp32_sum #0 on rank 0 of 2"), first
    assert second == first  # (it returned, out_shard unwritten)
    assert later.startswith("DistBackendError: zerofuse.comm: all_reduce_coalesced #0 on rank 0 of 2") and \
        "refused: the communicator failed earlier" in later and "reduce_scatter_fp32_sum #0" in later, later
    assert later_s < 1.0 and out == [-1.0, -1.0]  # refused at once (it waited a timeout again)


def _timeouts(rank, world_size):
    bad = {repr(v): error_text(lambda v=v: Communicator(timeout=v)) for v in (0, -1.0, float("nan"), "soon")}
    comm = Communicator(timeout=float("inf"))
    if rank == 1:
        time.sleep(1.0)  # a peer 1 s late: an infinite timeout waits for it
    t = torch.ones(3)
    comm.all_reduce_coalesced([t]).wait()
    dist.barrier()  # the group is intact
    return bad, comm.timeout, t.tolist()


@pytest.mark.timeout(TIMEOUT)
def test_an_infinite_timeout_waits_and_bad_ones_are_refused():
    for bad, timeout, t in run_distributed(_timeouts, 2):
        assert timeout == 1e8 and t == [2.0] * 3
        for v, got in bad.items():
            assert got == f"ValueError: zerofuse.comm.Communicator: expected timeout > 0 seconds, got {v}", got


def _checker_after_refusal(rank, world_size):
    comm = Communicator()
    refused = error_text(lambda: comm.reduce_scatter_coalesced([torch.ones(4)], torch.zeros(7)))  # wrong size
    t = torch.full((4,), float(rank))
    comm.all_reduce_coalesced([t]).wait()
    return refused, t.tolist()


@pytest.mark.timeout(TIMEOUT)
def test_the_checker_numbers_calls_itself_so_a_refused_call_leaves_no_stale_signature(monkeypatch):
    """The same refused call on every rank, then a good one: the next call was compared with the
    other ranks' refused one (a false CollectiveMismatch on one rank, the other entering alone)."""
    monkeypatch.setenv("ZEROFUSE_CHECK_COLLECTIVES", "1")
    for refused, t in run_distributed(_checker_after_refusal, 2):
        assert refused.startswith("ValueError: zerofuse::comm.reduce_scatter_coalesced: expected out_shard to have 2 "
                                  "elements"), refused
        assert t == [1.0] * 4


def _arguments(rank, world_size):
    sub = dist.new_group([0, 1])
    out = {"nonmember": error_text(lambda: Communicator(sub)) if rank == 2 else None}
    comm = Communicator()
    out["peer"] = error_text(lambda: comm.batch_p2p([P2POp("send", torch.ones(2), 1.7)]))
    rows = torch.ones(3, 2)
    out["splits"] = error_text(lambda: comm.all_to_all(rows, rows, [1.5, 1, 0.5], [1, 1, 1]))
    flat = torch.ones(6, dtype=torch.bfloat16)
    out["2-D shard"] = error_text(lambda: comm.reduce_scatter_fp32_sum(flat, torch.zeros(1, 2)))
    out["int shard"] = error_text(lambda: comm.reduce_scatter_fp32_sum(flat, torch.zeros(2, dtype=torch.int64)))
    out["shape"] = error_text(lambda: comm.reduce_scatter_coalesced([torch.ones(6)], torch.zeros(1, 2)))
    return out


@pytest.mark.timeout(TIMEOUT)
def test_bad_arguments_are_named():
    got = run_distributed(_arguments, 3)
    assert got[2]["nonmember"].startswith("ValueError: zerofuse.comm.Communicator: expected a process group this rank "
                                          "(2) belongs to"), got[2]["nonmember"]
    for r in got:
        assert r["peer"].startswith("ValueError: zerofuse.comm.batch_p2p: expected ops[0] to be a P2POp("), r["peer"]
        assert r["splits"] == ("ValueError: zerofuse::comm.all_to_all: expected output_splits to be whole row counts, "
                               "got [1.5, 1, 0.5]"), r["splits"]
        for k in ("2-D shard", "int shard"):
            assert r[k].startswith("ValueError: zerofuse.comm.reduce_scatter_fp32_sum: expected out_shard as a 1-D "
                                   "contiguous floating tensor"), r[k]
        # the message of world size 3 is world size 1's word for word ("zerofuse::comm: .fn" before)
        assert r["shape"] == ("RuntimeError: zerofuse::comm.reduce_scatter_coalesced: expected out_shard to be a 1-D "
                              "contiguous tensor, got shape [1, 2] with strides [2, 1]"), r["shape"]


def test_the_world_of_one_says_the_same(world_of_one):
    comm = Communicator()
    assert error_text(lambda: comm.reduce_scatter_coalesced([torch.ones(6)], torch.zeros(1, 2))) == (
        "RuntimeError: zerofuse::comm.reduce_scatter_coalesced: expected out_shard to be a 1-D contiguous tensor, "
        "got shape [1, 2] with strides [2, 1]")


def test_arguments_of_the_wrong_type_are_named(world_of_one):
    """None, a float or a string where a tensor, a number or a dtype goes failed inside the call
    (AttributeError, pybind's overload list); a NaN scale made every result NaN (a review's
    reproduction, 2026-12-07). Checked before the world-of-one shortcut: every world says the same."""
    comm, one = Communicator(), torch.ones(2)
    rows = torch.ones(1, 2)
    cases = {
        "all_reduce_coalesced: expected tensors[1] to be a tensor, got float": lambda: comm.all_reduce_coalesced([one, 3.0]),
        "all_reduce_coalesced: expected tensors to be a list of tensors, got Tensor": lambda: comm.all_reduce_coalesced(one),
        "all_reduce_coalesced: expected scale to be a finite number or None, got nan":
            lambda: comm.all_reduce_coalesced([one], scale=float("nan")),
        "all_reduce_coalesced: expected scale to be a finite number or None, got '0.5'":
            lambda: comm.all_reduce_coalesced([one], scale="0.5"),
        "all_reduce_coalesced: expected reduce_dtype to be a torch.dtype or None, got 'float32'":
            lambda: comm.all_reduce_coalesced([one], reduce_dtype="float32"),
        "reduce_scatter_coalesced: expected out_shard to be a tensor, got NoneType":
            lambda: comm.reduce_scatter_coalesced([one], None),
        "all_gather_coalesced: expected shard to be a tensor, got list": lambda: comm.all_gather_coalesced([one], [one]),
        "reduce_scatter_fp32_sum: expected out_shard to be a tensor, got list":
            lambda: comm.reduce_scatter_fp32_sum(one.bfloat16(), [one]),
        ":comm.all_to_all: expected output_splits to be a list of row counts, got NoneType":
            lambda: comm.all_to_all(rows, rows, None, [1]),
    }
    for message, call in cases.items():
        got = error_text(call)
        assert got.startswith("ValueError: zerofuse") and got.endswith(message), (message, got)
    work = comm.all_reduce_coalesced([one], scale=2)  # (an int scale: a number)
    work.wait()
    assert one.tolist() == [2.0, 2.0]



def _wait_timeouts(rank, world_size):
    import datetime

    comm = Communicator(timeout=4.0)
    out = {}
    t = torch.full((3,), float(rank + 1))
    comm.all_reduce_coalesced([t]).wait(timeout=datetime.timedelta(seconds=60))  # done in time: as wait()
    out["sum"] = t.tolist()
    shard = torch.zeros(2)
    comm.reduce_scatter_fp32_sum(torch.ones(4, dtype=torch.bfloat16), shard).wait(timeout=30)
    out["fp32 sum"] = shard.tolist()
    out["list"] = error_text(lambda: comm.reduce_scatter_fp32_sum([torch.ones(4)], shard))
    out["bad"] = {repr(v): error_text(lambda v=v: comm.all_reduce_coalesced([torch.ones(1)]).wait(timeout=v))
                  for v in (-1.0, float("nan"), "soon")}
    dist.barrier()
    if rank == 1:
        time.sleep(2.0)  # late: rank 0's wait(timeout=0.3) gives up on it
    t0 = time.perf_counter()
    out["late"] = error_text(lambda: comm.all_reduce_coalesced([torch.ones(3)]).wait(timeout=0.3))
    out["late_s"] = time.perf_counter() - t0
    out["after"] = error_text(lambda: comm.all_reduce_coalesced([torch.ones(3)]).wait())
    return out


@pytest.mark.timeout(TIMEOUT)
def test_wait_takes_a_timeout_on_every_world_size():
    """Work.wait(timeout=) as torch's (seconds or a timedelta): it raised TypeError at world size > 1
    while the world of one took it. Done in time it is wait(); past it the collective fails the
    communicator (as its own timeout does), and bad values are refused by name."""
    got = run_distributed(_wait_timeouts, 2)
    for r in got:
        assert r["sum"] == [3.0] * 3 and r["fp32 sum"] == [2.0, 2.0]
        assert r["list"] == "ValueError: zerofuse.comm.reduce_scatter_fp32_sum: expected flat to be a tensor, got list"
        for v, text in r["bad"].items():
            assert text == ("ValueError: zerofuse.comm.Work.wait: expected timeout >= 0 seconds or a timedelta (0: "
                            f"the communicator's), got {v}"), text
    late = got[0]
    assert late["late"].startswith("DistBackendError: zerofuse.comm: all_reduce_coalesced") and \
        "did not finish within the wait's timeout of 0.3 s" in late["late"], late["late"]
    assert 0.3 <= late["late_s"] < 1.5, late["late_s"]
    assert "refused: the communicator failed earlier" in late["after"], late["after"]


def test_the_world_of_one_takes_the_same_timeouts(world_of_one):
    import datetime

    comm = Communicator()
    t = torch.ones(2)
    comm.all_reduce_coalesced([t]).wait(timeout=datetime.timedelta(seconds=1))
    comm.all_reduce_coalesced([t]).wait(timeout=0)
    assert error_text(lambda: comm.all_reduce_coalesced([t]).wait(timeout=-1)) == (
        "ValueError: zerofuse.comm.Work.wait: expected timeout >= 0 seconds or a timedelta (0: the communicator's), "
        "got -1")


def test_a_timed_wait_inside_coalesce_says_the_group_is_open():
    """Inside coalesce() an NCCL collective is launched at the block's end: its wait() says so at
    once, a usage error that leaves the communicator usable. A wait with a timeout polled it for the
    whole timeout, then failed the communicator; one without reached the C++ wait, whose refusal
    failed it too. (NCCL-only; here with a stand-in for the C++ Work of an open group.)"""
    from zerofuse.comm.communicator import Work

    class Unlaunched:
        what = "all_reduce_coalesced #0"

        def is_completed(self):
            return False

        def wait(self):  # (the C++ wait's refusal failed the communicator: every collective of the group refused)
            raise AssertionError("the C++ wait was called: it fails the communicator for good")

    class Comm:
        _coalescing = 1

        class _c:  # noqa: N801
            @staticmethod
            def fail(message):
                raise AssertionError(f"the communicator was failed: {message}")

    t0 = time.perf_counter()
    for timeout in (3, None):
        with pytest.raises(RuntimeError, match=r"wait\(\) on all_reduce_coalesced #0, a collective of a group that "
                                               r"is still open: end the coalesce\(\) block first"):
            Work(Unlaunched(), Comm(), cuda=True).wait(timeout=timeout)
    assert time.perf_counter() - t0 < 1.0


def _late_peer_inside_coalesce(rank, world_size):
    """On the ProcessGroup transport a collective inside coalesce() is launched at once: a wait
    with a timeout there is bounded by it (it waited for the communicator's whole timeout, as the
    NCCL skip above was taken for every transport). Also: a timedelta timeout for the communicator."""
    import datetime

    comm = Communicator(timeout=datetime.timedelta(seconds=30))
    out = {"timeout": comm.timeout}
    if rank == 1:
        time.sleep(4)
    t0 = time.perf_counter()
    with comm.coalesce():
        out["error"] = error_text(lambda: comm.all_reduce_coalesced([torch.ones(2)]).wait(timeout=1))
    out["seconds"] = time.perf_counter() - t0
    return out


@pytest.mark.timeout(TIMEOUT)
def test_a_timed_wait_inside_coalesce_on_gloo_keeps_its_timeout():
    out = run_distributed(_late_peer_inside_coalesce, 2)[0]
    assert out["timeout"] == 30.0, out
    assert "did not finish within the wait's timeout of 1 s" in out["error"] and out["seconds"] < 3, out


def _checker_keys_and_equivalent_calls(rank, world_size):
    comm = Communicator(timeout=20)
    out = {}
    t = torch.ones(8)
    # the same call written two ways: no mismatch (scale 1 against 1.0; reduce_dtype None against
    # the dtype it defaults to)
    out["rs"] = error_text(lambda: comm.reduce_scatter_coalesced(
        [t.clone()], torch.empty(4), op="sum", reduce_dtype=None if rank == 0 else torch.float32).wait())
    out["ar"] = error_text(lambda: comm.all_reduce_coalesced([t.clone()], op="sum", scale=1 if rank == 0 else 1.0).wait())
    # a rank giving empty split lists: a mismatch named as such (it was int('') on every rank)
    x = torch.zeros(4, 3)
    out["a2a"] = error_text(lambda: comm.all_to_all(torch.zeros(4, 3), x, *(([], []) if rank == 0 else ([2, 2], [2, 2]))))
    # the store does not grow with the calls (it held a key per rank and call)
    before = comm.store.num_keys()
    for _ in range(30):
        comm.all_reduce_coalesced([torch.ones(4)]).wait()
        comm.batch_p2p([P2POp("send", torch.ones(2), 1 - rank), P2POp("recv", torch.empty(2), 1 - rank)]).wait()
    out["grown"] = comm.store.num_keys() - before
    return out


@pytest.mark.timeout(TIMEOUT)
def test_the_checker_keeps_the_store_bounded_and_takes_equivalent_calls_as_equal(monkeypatch):
    monkeypatch.setenv("ZEROFUSE_CHECK_COLLECTIVES", "1")
    for out in run_distributed(_checker_keys_and_equivalent_calls, 2):
        assert out["rs"] == "no error" and out["ar"] == "no error", out
        assert out["a2a"].startswith("CollectiveMismatch: zerofuse.comm: all_to_all #") and "rank 0 sends None" in \
            out["a2a"], out["a2a"]
        assert out["grown"] <= 4, out["grown"]


def _strided_shard_on_one_rank(rank, world_size):
    comm = Communicator(timeout=20)
    out = torch.empty(8)[::2] if rank == 1 else torch.empty(4)  # rank 1's shard is refused by the call's checks
    return error_text(lambda: comm.reduce_scatter_coalesced([torch.ones(8)], out, op="sum").wait())


@pytest.mark.timeout(TIMEOUT)
def test_the_checker_sees_a_shard_only_one_rank_would_refuse(monkeypatch):
    """A strided out_shard on one rank: every rank reports the mismatch at once (rank 1 refused it
    after publishing a signature equal to rank 0's, which then waited in the collective)."""
    monkeypatch.setenv("ZEROFUSE_CHECK_COLLECTIVES", "1")
    t0 = time.monotonic()
    for err in run_distributed(_strided_shard_on_one_rank, 2, timeout=60):
        assert err.startswith("CollectiveMismatch") and "(4,):float32:strided" in err, err
    assert time.monotonic() - t0 < 15


def _bools(rank, world_size):
    """Bool tensor lists: max / min are any / all, a gather is exact (the flat copy refused bool,
    naming zerofuse::flatten_into; an all-gather only at wait(), after the collective had run); a
    sum of bools is refused by name before anything runs."""
    comm = Communicator(timeout=30)
    mine = [torch.tensor([rank == 0, True, False]), torch.tensor([[rank == 1], [False]])]
    anyof = [t.clone() for t in mine]
    comm.all_reduce_coalesced(anyof, op="max").wait()
    allof = [t.clone() for t in mine]
    comm.all_reduce_coalesced(allof, op="min").wait()
    shard = torch.tensor([rank % 2 == 0, True])
    gathered = [torch.zeros(world_size, dtype=torch.bool), torch.zeros(world_size, dtype=torch.bool)]
    comm.all_gather_coalesced(shard, gathered).wait()
    refused = error_text(lambda: comm.all_reduce_coalesced([torch.ones(2, dtype=torch.bool)] * 2, op="sum"))
    return [t.tolist() for t in anyof], [t.tolist() for t in allof], torch.cat(gathered).tolist(), refused


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("world_size", [1, 3])
def test_bool_tensor_lists_reduce_as_any_and_all_and_gather(world_size):
    for out in run_distributed(_bools, world_size):
        anyof, allof, gathered, refused = out
        assert anyof == [[True, True, False], [[world_size > 1], [False]]], out
        assert allof == [[world_size == 1, True, False], [[False], [False]]], out
        want = [x for r in range(world_size) for x in (r % 2 == 0, True)]
        assert gathered == want, (gathered, want)
        assert refused.startswith("ValueError: zerofuse.comm.all_reduce_coalesced: expected no bool tensors for op "
                                  "'sum'"), refused


def test_the_fp32_sum_waits_on_the_stream_alone_for_cuda_tensors():
    """c10d's NCCL wait with a timeout blocks the host until the GPU is done: the fp32 sum's waits
    passed one always, so each bucket's launch (which advances the last one) waited on the host
    for the last all-to-all (a review's reading, 2026-12-06). CUDA: no timeout; gloo: the timeout."""
    import types

    from zerofuse.comm.fp32_sum import _SummedWork

    class Work:
        def __init__(self):
            self.calls = []

        def wait(self, *args):
            self.calls.append(args)

    for cuda in (True, False):
        comm = types.SimpleNamespace(world_size=1, timeout=30.0)
        work = Work()
        summed = _SummedWork(comm, work, torch.ones(4), None, torch.zeros(4), False, "test")
        summed._cuda = cuda  # (what a CUDA recv buffer sets)
        summed.wait()
        assert len(work.calls) == 1 and (work.calls[0] == () if cuda else len(work.calls[0]) == 1), (cuda, work.calls)
