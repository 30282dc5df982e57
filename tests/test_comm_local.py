"""A world of one: the Communicator's collectives run in place on the current stream (comm/local.py);
nothing reaches the C++ communicator (so a CUDA step over one rank can be captured in a graph).
Unscaled calls equal the C++ transport's results at world size 1 bit for bit; scaled ones equal the
input times the factor rounded once from fp32 (the C++ CPU path rounds a bf16/fp16 factor first)."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cases():
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        for sizes in ((7,), (3, 0, 11), (129, 5)):
            yield dtype, [torch.randn(n, generator=g).to(dtype) for n in sizes]


class _Refuse:
    """Stands in for the C++ communicator: any collective through it fails the test."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        if name in ("world_size", "rank", "transport", "sequence"):
            return getattr(self._real, name)
        raise AssertionError(f"the C++ communicator was called ({name}) over one rank")


def _run_both(fn):
    """fn(comm) with the local path and with the C++ one, results as lists of tensors."""
    from zerofuse.comm import Communicator

    comm = Communicator()
    assert comm.world_size == 1 and comm._one
    real = comm._c
    comm._c = _Refuse(real)
    mine = fn(comm)
    comm._c, comm._one = real, False
    theirs = fn(comm)
    return mine, theirs


def _collectives(rank, world_size):
    def rs(scale, reduce_dtype, in_place):
        def fn(comm):
            out = []
            for dtype, ts in _cases():
                ts = [t.clone() for t in ts]
                total = sum(t.numel() for t in ts)
                if in_place and len(ts) == 1:
                    shard = ts[0]
                else:
                    shard = torch.full((total,), 7.0, dtype=dtype)
                comm.reduce_scatter_coalesced(ts, shard, op="avg", scale=scale, reduce_dtype=reduce_dtype).wait()
                out.append(shard.clone())
            return out
        return fn

    def ar(scale, reduce_dtype):
        def fn(comm):
            out = []
            for _, ts in _cases():
                ts = [t.clone() for t in ts]
                comm.all_reduce_coalesced(ts, op="sum", scale=scale, reduce_dtype=reduce_dtype).wait()
                out += ts
            return out
        return fn

    def ag(comm):
        out = []
        for dtype, ts in _cases():
            shard = torch.cat([t.reshape(-1) for t in ts])
            outs = [torch.zeros_like(t) for t in ts]
            comm.all_gather_coalesced(shard, outs).wait()
            out += outs
        return out

    def a2a(comm):
        x = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
        y = torch.empty_like(x)
        comm.all_to_all(y, x, [6], [6]).wait()
        return [y, x]

    def expect(factor, reduce_dtype, out_dtypes):
        """Each input in the reduce dtype, times factor in fp32, rounded into the output's dtype."""
        out = []
        for dtype, ts in _cases():
            flat = torch.cat([t.reshape(-1).to(reduce_dtype or dtype) for t in ts])
            res = (flat.float() * factor).to(reduce_dtype or dtype).to(dtype)
            out += [res] if out_dtypes == "flat" else list(res.split([t.numel() for t in ts]))
        return out

    results = {}
    for name, fn, ref in [("rs", rs(None, None, False), None), ("rs scale", rs(0.37, None, False), (0.37, None)),
                          ("rs fp32 reduce", rs(0.37, torch.float32, False), (0.37, torch.float32)),
                          ("rs bf16 reduce", rs(3.0, torch.bfloat16, False), (3.0, torch.bfloat16)),
                          ("rs in place", rs(0.5, None, True), None), ("ar", ar(None, None), None),
                          ("ar scale", ar(0.37, None), (0.37, None)),
                          ("ar fp32 reduce", ar(0.37, torch.float32), (0.37, torch.float32)),
                          ("ar bf16 reduce", ar(1.0, torch.bfloat16), None), ("ag", ag, None), ("a2a", a2a, None)]:
        mine, theirs = _run_both(fn)
        if ref is not None:  # scaled: vs the formula (C++ agrees where it rounds the factor in fp32)
            theirs = expect(*ref, "flat" if name.startswith("rs") else "split")
        results[name] = all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    return results


def test_one_rank_collectives_equal_the_transport_and_skip_it():
    results = run_distributed(_collectives, 1, timeout=120)[0]
    assert all(results.values()), results


def _bad_input(rank, world_size):
    from zerofuse.comm import Communicator

    comm = Communicator()
    msgs = []
    for call in (lambda: comm.reduce_scatter_coalesced([torch.ones(4)], torch.empty(3)),
                 lambda: comm.reduce_scatter_coalesced([torch.ones(4)], torch.empty(4), op="mean"),
                 lambda: comm.all_gather_coalesced(torch.ones(2, 2), [torch.empty(4)]),
                 lambda: comm.all_to_all(torch.empty(4), torch.ones(5), [4], [5]),
                 lambda: comm.all_to_all(torch.empty(5, dtype=torch.float64), torch.ones(5), [5], [5]),
                 lambda: comm.all_to_all(torch.empty(5), torch.ones(5), [5, 0], [5]),
                 lambda: comm.all_to_all(torch.empty(5), torch.ones(5), [5], [-5]),
                 lambda: comm.all_to_all(torch.empty(5, 2), torch.ones(2, 5).t(), [5], [5]),
                 lambda: comm.all_to_all(torch.empty(5, 3), torch.ones(5, 2), [5], [5]),
                 lambda: comm.all_to_all(torch.empty(5), torch.ones(5), [5], [4])):
        try:
            call()
            msgs.append(None)
        except (ValueError, RuntimeError) as e:
            msgs.append(f"{type(e).__name__}: {e}")
    return msgs


def test_one_rank_bad_input_is_refused_with_the_transport_messages():
    msgs = run_distributed(_bad_input, 1, timeout=60)[0]
    assert msgs[0].startswith("ValueError") and "expected out_shard to have 4 elements" in msgs[0], msgs[0]
    assert "expected op 'sum', 'avg', 'max' or 'min', got 'mean'" in msgs[1], msgs[1]
    assert "expected shard to be a 1-D contiguous tensor" in msgs[2], msgs[2]
    # all_to_all: the transport's checks, then what one rank adds (the input goes to the output whole)
    assert "expected equal splits, got in_splits [5], out_splits [4]" in msgs[3], msgs[3]
    assert "expected out on input's device with its dtype (cpu, torch.float32), got cpu, torch.float64" in msgs[4]
    assert msgs[5].startswith("ValueError") and "expected out_splits to hold 1 row counts (one per rank), got 2" in msgs[5]
    assert "expected in_splits >= 0, got [-5]" in msgs[6], msgs[6]
    assert "expected contiguous input and out" in msgs[7], msgs[7]
    assert "expected input and out of one row shape, got [5, 2] and [5, 3]" in msgs[8], msgs[8]
    assert "expected in_splits to sum to input's 5 rows, got [4]" in msgs[9], msgs[9]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_rank_zero_step_runs_no_transport_collective(stage):
    run_distributed(_zero_steps, 1, stage, timeout=120)


def _zero_steps(rank, world_size, stage):
    """A ZeRO model over one rank trains like plain AdamW without the C++ communicator being called."""
    import copy

    from zerofuse import zero

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.GELU(), torch.nn.Linear(31, 5))
    ref = copy.deepcopy(model)
    zm = zero.parallelize(model, stage=stage, bucket_mb=0.001)
    eng = zm._zerofuse_zero
    comms = [eng.comm] + [u.comm for u in eng.units if u.comm is not None]
    for c in comms:
        c._c = _Refuse(c._c)
    opt = zero.Optimizer(zm, "adamw", lr=1e-2, weight_decay=0.1, max_grad_norm=1.0)
    reduced = {}  # unit -> the address of the gflat it reduced last
    for u in eng.units:
        def start(comm, u=u, real=u.start_grad_sync):
            reduced[u.index] = u.gflat.data_ptr()
            real(comm)
        u.start_grad_sync = start
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    first = None
    for _ in range(4):
        x, y = torch.randn(8, 13, generator=g), torch.randn(8, 5, generator=g)
        torch.nn.functional.mse_loss(zm(x), y).backward()
        eng.finish_grad_sync()  # over one rank the grads are taken at a sync point ([Note: a world of one])
        if stage in (0, 2):  # the reduced gflat became the grad itself: no copy into another buffer
            assert {u.index: u.gshard.data_ptr() for u in eng.units} == reduced, stage
            # ... and the same buffer every step (kept between steps: the optimizer's tables stay valid)
            first = first or dict(reduced)
            assert reduced == first, stage
        opt.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ropt.step()
        ropt.zero_grad()
    with zero.full_params(zm):
        for (n, a), b in zip(zm.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6, msg=n)
