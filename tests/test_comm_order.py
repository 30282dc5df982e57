"""zerofuse.comm.Communicator where a review (2026-12-06) reproduced wrong results on real gloo
processes (each check failed before its fix): reduce_scatter_fp32_sum(all_gather=True) launched its
gather at wait(), so ranks waiting in other orders swapped two calls' results or hung; integer and
floating tensors reduced in one promoted dtype; a param that requires grad taken as the flat buffer;
written tensors that overlap, a complex tensor in a list and a refused batch_p2p under the checker
all found only after the collective had run or been published; false checker mismatches for
reduce_dtype None and scale None against their explicit equivalents."""
from __future__ import annotations

import pytest
import torch

from dist_utils import error_text, run_distributed
from zerofuse.comm import Communicator, P2POp

TIMEOUT = 90


def _fp32_sum_orders(rank, ws):
    comm = Communicator(timeout=30)
    a = torch.full((4,), 1.0 + rank, dtype=torch.bfloat16)
    b = torch.full((4,), 100.0 + rank, dtype=torch.bfloat16)
    wa, wb = comm.reduce_scatter_fp32_sum(a, all_gather=True), comm.reduce_scatter_fp32_sum(b, all_gather=True)
    for w in ((wa, wb) if rank == 0 else (wb, wa)):  # the waits in other orders
        w.wait()
    c = torch.full((4,), 1.0 + rank, dtype=torch.bfloat16)
    x = torch.full((2,), 10.0 * (rank + 1))
    wc = comm.reduce_scatter_fp32_sum(c, all_gather=True)
    if rank == 0:  # the next collective called before this rank waits, after the other's wait
        wx = comm.all_reduce_coalesced([x])
        wc.wait()
    else:
        wc.wait()
        wx = comm.all_reduce_coalesced([x])
    wx.wait()
    return a.tolist(), b.tolist(), c.tolist(), x.tolist()


def test_fp32_sum_gathers_pair_in_the_order_of_the_calls():
    ws = 2
    for a, b, c, x in run_distributed(_fp32_sum_orders, ws, timeout=TIMEOUT):
        assert a == [3.0] * 4 and b == [201.0] * 4 and c == [3.0] * 4 and x == [30.0] * 2, (a, b, c, x)


def _lists(rank, ws):
    comm = Communicator()
    out = {}
    big = torch.tensor([2 ** 40 + 3 + rank], dtype=torch.int64)
    out["int+float"] = error_text(lambda: comm.all_reduce_coalesced([big, torch.ones(3)]))
    ints = [torch.tensor([2 ** 40 + rank], dtype=torch.int64), torch.tensor([7], dtype=torch.int32)]
    comm.all_reduce_coalesced(ints).wait()  # integers of two widths: exact
    out["ints"] = [int(t) for t in ints]
    p = torch.nn.Parameter(torch.full((2 * ws,), 1.0 + rank))
    shard = torch.zeros(2)
    out["param as flat"] = error_text(lambda: comm.reduce_scatter_coalesced([p], shard, op="avg").wait())
    out["shard"] = shard.tolist()
    x = torch.zeros(6)
    out["overlap"] = error_text(lambda: comm.all_reduce_coalesced([x[0:4], x[2:6]]))
    z = torch.ones(2, dtype=torch.complex64)
    out["complex in a list"] = error_text(lambda: comm.all_reduce_coalesced([z, torch.ones(2)]))
    comm.all_reduce_coalesced([z]).wait()  # one complex tensor: its own flat buffer
    out["complex alone"] = z.tolist()
    y = torch.ones(3)
    comm.all_reduce_coalesced([y]).wait()  # still usable: nothing was launched by the refusals
    out["after"] = y.tolist()
    return out


def test_tensor_lists_are_refused_at_the_call_or_reduced_exactly():
    for r, out in enumerate(run_distributed(_lists, 2, timeout=TIMEOUT)):
        assert out["int+float"].startswith("ValueError: zerofuse.comm.all_reduce_coalesced: expected tensors all "
                                           "integer or all floating without a reduce_dtype"), out
        assert out["ints"] == [2 * 2 ** 40 + 1, 14], out
        assert out["param as flat"] == "no error" and out["shard"] == [1.5, 1.5], out
        assert out["overlap"] == ("ValueError: zerofuse.comm.all_reduce_coalesced: expected tensors[0] and "
                                  "tensors[1] not to share memory (both are written), got tensors that overlap"), out
        assert out["complex in a list"].startswith("ValueError: zerofuse.comm.all_reduce_coalesced: expected "
                                                   "tensors[0] of a real dtype"), out
        assert out["complex alone"] == [2 + 0j, 2 + 0j] and out["after"] == [2.0] * 3, out


def _checked_calls(rank, ws):
    comm = Communicator(timeout=20)
    out = {}
    t = torch.ones(4, 2)
    bad = [P2POp("send", t.t(), 1)] if rank == 0 else []
    out["refused"] = error_text(lambda: comm.batch_p2p(bad)) if rank == 0 else "-"
    buf = torch.full((2, 4), float(rank))
    comm.batch_p2p([P2POp("send", buf, 1)] if rank == 0 else [P2POp("recv", buf, 0)]).wait()
    out["received"] = buf[0, 0].item()
    mixed = [torch.ones(2), torch.ones(2, dtype=torch.float16)]
    comm.all_reduce_coalesced(mixed, reduce_dtype=None if rank == 0 else torch.float32).wait()
    comm.all_reduce_coalesced([torch.ones(2)], scale=None if rank == 0 else 1.0).wait()
    out["mixed"] = [m.tolist() for m in mixed]
    ints = torch.arange(3, dtype=torch.int64) + rank  # (a scale of 1.0 on integers: the signature took it as
    out["ints"] = error_text(lambda: comm.all_reduce_coalesced([ints], scale=None if rank == 0 else 1.0).wait())
    out["ints"] += f" {ints.tolist()}"  # none, the C++ check refused it: one rank entered alone; 2026-12-07)
    return out


def test_the_checker_publishes_no_refused_call_and_takes_equivalent_calls_as_equal(monkeypatch):
    monkeypatch.setenv("ZEROFUSE_CHECK_COLLECTIVES", "1")
    outs = run_distributed(_checked_calls, 2, timeout=TIMEOUT)
    assert outs[0]["refused"].startswith("ValueError: zerofuse.comm.batch_p2p: expected ops[0].tensor to be contiguous"), outs
    assert [o["received"] for o in outs] == [0.0, 0.0] and all(o["mixed"] == [[2.0] * 2] * 2 for o in outs), outs
    assert [o["ints"] for o in outs] == ["no error [1, 3, 5]"] * 2, outs


def _factors(rank, ws):
    comm = Communicator(timeout=30)
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        for how in ("avg", "scale"):
            x = torch.tensor([-14.0, 5.0, 7.0, 100.0], dtype=dtype) * (rank == 0)
            kw = dict(op="avg") if how == "avg" else dict(op="sum", scale=0.1)
            comm.all_reduce_coalesced([x], **kw).wait()
            shard = torch.empty(2, dtype=dtype)
            comm.reduce_scatter_coalesced([torch.tensor([-14.0, 5.0, 7.0, 100.0] * ws, dtype=dtype)[:2 * ws] *
                                           (rank == 0)], shard, **kw).wait()
            out[(str(dtype), how)] = (x.tolist(), shard.tolist())
    return out


def test_averages_and_scales_round_once_in_low_precision():
    """An average over 3 ranks or a scale of 0.1 multiplied bf16/fp16 by the factor rounded to the
    dtype first (aten's mul_(Scalar): bf16(1/3) = 0.334): -14 averaged to -4.6875 where one rank's
    path and torch's x * (1 / 3) give -4.65625 (a review's reproduction, 2026-12-07). Only rank 0's
    values are non-zero: the sum is exact and the result is x times the factor, rounded once."""
    ws = 3
    outs = run_distributed(_factors, ws, timeout=TIMEOUT)
    for dtype in (torch.bfloat16, torch.float16):
        for how, factor in (("avg", 1 / ws), ("scale", 0.1)):
            x = torch.tensor([-14.0, 5.0, 7.0, 100.0], dtype=dtype)
            want = (x * factor).tolist()
            per_rank = torch.tensor([-14.0, 5.0, 7.0, 100.0] * ws, dtype=dtype)[:2 * ws].view(ws, 2)
            for rank, out in enumerate(outs):
                assert out[(str(dtype), how)] == (want, (per_rank[rank] * factor).tolist()), (dtype, how, rank, out)


def _delayed_then_direct(rank, ws):
    import time

    comm = Communicator(timeout=20, debug_delay_ms=100)
    x = torch.full((4,), float(rank + 1))
    first = comm.all_reduce_coalesced([x])
    if rank == 1:
        time.sleep(0.3)
    out = torch.empty(2)
    summed = comm.reduce_scatter_fp32_sum(torch.full((2 * ws,), 10.0 * (rank + 1), dtype=torch.bfloat16), out)
    first.wait()
    summed.wait()
    return x.tolist(), out.tolist()


def test_a_fp32_sum_waits_for_the_test_delays_earlier_launches():
    """With ZEROFUSE_COMM_DELAY_MS (the tests' launch delay) the fp32-sum all-to-all, launched on the
    c10d group directly, overtook an earlier call still in the delay's chain: the ranks paired them
    differently and both timed out (a review's reproduction, 2026-12-07)."""
    assert run_distributed(_delayed_then_direct, 2, timeout=TIMEOUT) == [([3.0] * 4, [30.0] * 2)] * 2
