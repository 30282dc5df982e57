"""zerofuse.comm: coalesced collectives, buckets, overlap, the checker and failure handling, on real
gloo ranks (world sizes 2, 3, 4), against torch.distributed's own all_reduce."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import DistributedFailure, run_distributed

SIZES = (1, 7, 1023, 4097)


def _tensors(rank, count, dtype, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return [torch.randn(SIZES[(i * 7 + seed) % len(SIZES)], generator=g).to(dtype) for i in range(count)]


def _flat_padded(ts, ws, dtype=torch.float32):
    flat = torch.cat([t.reshape(-1).to(dtype) for t in ts]) if ts else torch.zeros(0, dtype=dtype)
    shard = -(-flat.numel() // ws)
    return torch.cat([flat, flat.new_zeros(shard * ws - flat.numel())]), shard


def _collectives_rank(rank, ws):
    """Each coalesced collective vs all_reduce (+ chunk) of the same data, over several lists."""
    import zerofuse  # noqa: F401
    from zerofuse.comm import Communicator

    comm = Communicator(timeout=60)
    checked = 0
    for count in (1, 3, 300):
        for dtype in (torch.float32, torch.bfloat16):
            ts = _tensors(rank, count, dtype, seed=count)
            ref, shard = _flat_padded(ts, ws)
            dist.all_reduce(ref)
            assert comm.shard_numel(ts) == shard
            # reduce-scatter: avg (and sum with a scale), bf16 reduced in fp32
            out = torch.empty(shard, dtype=torch.float32)
            comm.reduce_scatter_coalesced(ts, out, op="avg", reduce_dtype=torch.float32).wait()
            torch.testing.assert_close(out, (ref / ws)[rank * shard:(rank + 1) * shard], rtol=1e-6, atol=1e-6)
            comm.reduce_scatter_coalesced(ts, out, op="sum", scale=0.5, reduce_dtype=torch.float32).wait()
            torch.testing.assert_close(out, (ref * 0.5)[rank * shard:(rank + 1) * shard], rtol=1e-6, atol=1e-6)
            # all-gather: every rank's shard back into the tensors' layout
            gathered = [torch.empty_like(t) for t in ts]
            mine = (ref / ws)[rank * shard:(rank + 1) * shard].to(dtype)
            comm.all_gather_coalesced(mine, gathered).wait()
            want = (ref / ws).to(dtype)
            torch.testing.assert_close(torch.cat([g.reshape(-1) for g in gathered]), want[: sum(t.numel() for t in ts)])
            # all-reduce in place, in fp32 for bf16 tensors
            comm.all_reduce_coalesced(ts, op="sum", reduce_dtype=torch.float32).wait()
            got = torch.cat([t.reshape(-1).float() for t in ts])
            torch.testing.assert_close(got, ref[: got.numel()].to(dtype).float(), rtol=0, atol=0)
            checked += 1
    # above the 4 MB piece size, the ProcessGroup transport splits an all-reduce into pieces
    g = torch.Generator().manual_seed(rank)
    big = [torch.randn(3_000_001, generator=g), torch.randn(2_500_003, generator=g)]
    ref = torch.cat(big)
    dist.all_reduce(ref)
    comm.all_reduce_coalesced(big, op="avg").wait()
    torch.testing.assert_close(torch.cat(big), ref / ws, rtol=1e-6, atol=1e-6)
    # empty list: nothing to send, a completed Work
    w = comm.reduce_scatter_coalesced([], torch.empty(0), op="avg")
    assert w.is_completed()
    w.wait()
    comm.all_reduce_coalesced([], op="sum").wait()
    return checked


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_coalesced_collectives_match_torch(world_size):
    assert run_distributed(_collectives_rank, world_size, timeout=180) == [6] * world_size


def _flat_buffers_rank(rank, ws):
    """One flat buffer of exactly the collective's size skips the copies: reduce-scatter reads it
    in place, all-gather writes into it, also with the shard being this rank's own slot of it."""
    from zerofuse.comm import Communicator

    comm = Communicator()
    n = 1000 * ws
    flat = torch.arange(n, dtype=torch.float32) * (rank + 1)
    out = torch.empty(n // ws)
    comm.reduce_scatter_coalesced([flat], out, op="sum").wait()
    total = sum(range(1, ws + 1))
    rs_ok = torch.equal(out, torch.arange(n, dtype=torch.float32)[rank * n // ws:(rank + 1) * n // ws] * total)
    full = torch.zeros(n)
    shard = full[rank * n // ws:(rank + 1) * n // ws]
    shard.copy_(torch.full((n // ws,), float(rank)))
    comm.all_gather_coalesced(shard, [full]).wait()  # in place
    ag_ok = torch.equal(full, torch.arange(ws, dtype=torch.float32).repeat_interleave(n // ws))
    other = torch.empty(n)
    comm.all_gather_coalesced(torch.full((n // ws,), float(rank + 10)), [other]).wait()
    ag2_ok = torch.equal(other, torch.arange(10, 10 + ws, dtype=torch.float32).repeat_interleave(n // ws))
    return rs_ok, ag_ok, ag2_ok


@pytest.mark.parametrize("world_size", [2, 3])
def test_flat_buffers_without_copies(world_size):
    assert all(all(r) for r in run_distributed(_flat_buffers_rank, world_size))


def _staging_rank(rank, ws):
    """Flat copies go through kept CPU staging buffers: two collectives in flight at once (each
    launch delayed) get separate buffers, repeated calls reuse them instead of growing, and a
    single contiguous tensor is all-reduced in place without one."""
    from zerofuse.comm import Communicator

    comm = Communicator(timeout=60, debug_delay_ms=20)
    a, b = _tensors(rank, 5, torch.float32, seed=1), _tensors(rank, 9, torch.float32, seed=2)
    ref_a, ref_b = torch.cat(a), torch.cat(b)
    dist.all_reduce(ref_a)
    dist.all_reduce(ref_b)
    single = torch.nn.Parameter(torch.full((4099,), float(rank + 1)))
    held = []
    for _ in range(3):
        xa, xb = [t.clone() for t in a], [t.clone() for t in b]
        wa = comm.all_reduce_coalesced(xa, op="sum")
        wb = comm.all_reduce_coalesced(xb, op="avg")
        out = torch.empty(comm.shard_numel(b))
        wr = comm.reduce_scatter_coalesced(b, out, op="sum")
        for w in (wb, wr, wa):  # out of order
            w.wait()
        torch.testing.assert_close(torch.cat(xa), ref_a, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(torch.cat(xb), ref_b / ws, rtol=1e-6, atol=1e-6)
        padded, shard = _flat_padded(b, ws)
        dist.all_reduce(padded)
        torch.testing.assert_close(out, padded[rank * shard:(rank + 1) * shard], rtol=1e-6, atol=1e-6)
        kept = [wa, wb, wr]  # waited Works kept alive must not pin their buffers  # noqa: F841
        # gloo's worker drops its reference to a finished collective just after wait() returns; a
        # call in that window takes a fresh buffer (correct, but it would make the count racy)
        time.sleep(0.05)
        held.append(comm.buffer_bytes)
    # in place: no staging, same storage, autograd leaves allowed (the data, not the graph, changes)
    before, ptr = comm.buffer_bytes, single.data_ptr()
    comm.all_reduce_coalesced([single], op="avg", scale=2.0).wait()
    in_place_ok = single.data_ptr() == ptr and comm.buffer_bytes == before
    torch.testing.assert_close(single.detach(), torch.full((4099,), 2.0 * (ws + 1) / 2))
    comm.free_buffers()
    return held[0] > 0 and held[0] == held[1] == held[2], in_place_ok, comm.buffer_bytes


@pytest.mark.parametrize("world_size", [2, 3])
def test_staging_buffers_are_reused_and_never_shared_in_flight(world_size):
    assert run_distributed(_staging_rank, world_size, timeout=120) == [(True, True, 0)] * world_size


def _buckets_rank(rank, ws, delay_ms):
    """An 8-layer model under ZeRO-2 (zerofuse's one bucket mechanism, zerofuse/zero/buckets.py):
    bucketed reduce-scatters launched from grad-ready hooks during backward give the average of
    every rank's gradient; the first bucket is launched before the first layers' backward has run
    (overlap); every bucket's shard is gathered back into the params."""
    import os

    import zerofuse

    torch.manual_seed(0)
    layers = [torch.nn.Linear(33, 33) for _ in range(8)]
    model = torch.nn.Sequential(*layers)
    plain = [p.detach().clone() for p in model.parameters()]
    os.environ["ZEROFUSE_COMM_DELAY_MS"] = str(delay_ms)
    try:  # ~2 layers a bucket, at most 2 reductions in flight
        zerofuse.zero.parallelize(model, stage=2, bucket_mb=33 * 34 * 4 * 2 / (1 << 20), max_inflight=2)
    finally:
        os.environ.pop("ZEROFUSE_COMM_DELAY_MS")
    eng = model._zerofuse_zero
    assert len(eng.units) >= 4 and all(u.padded % (ws * 128) == 0 for u in eng.units)
    launched_before_layer0 = []
    layers[0].register_full_backward_hook(lambda m, gi, go: launched_before_layer0.append(len(eng.events)))
    x = torch.randn(16, 33, generator=torch.Generator().manual_seed(rank))
    model(x).square().sum().backward()
    assert launched_before_layer0[0] > 0, "the first bucket waited for the whole backward"
    # reference: every rank's local grads, averaged
    ref = torch.nn.Sequential(*[torch.nn.Linear(33, 33) for _ in range(8)])
    with torch.no_grad():
        for p, q in zip(ref.parameters(), plain):
            p.copy_(q)
    ref(x).square().sum().backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad)
        p.grad /= ws
    with zerofuse.zero.full_grads(model):
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)
    # param sync: the shards gathered back give the params
    with torch.no_grad():
        for u in eng.units:
            keep = u.shard.clone()
            u.full.zero_()
            u.shard.copy_(keep)
    eng.start_param_sync()
    eng.finish_param_sync()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain))
    return len(eng.units)


@pytest.mark.parametrize("world_size,delay_ms", [(2, 0), (3, 0), (4, 0), (3, 30)])
def test_buckets_overlap_backward_and_match_unbucketed(world_size, delay_ms):
    """delay_ms: every collective is launched late; results must not change (missing waits)."""
    out = run_distributed(_buckets_rank, world_size, delay_ms, timeout=180)
    assert len(set(out)) == 1


def _mismatch_rank(rank, ws):
    import zerofuse  # noqa: F401
    from zerofuse.comm import CollectiveMismatch, Communicator

    os.environ["ZEROFUSE_CHECK_COLLECTIVES"] = "1"
    comm = Communicator(timeout=20)
    comm.all_reduce_coalesced([torch.ones(5)], op="sum").wait()
    n = 7 if rank == ws - 1 else 6
    t0 = time.monotonic()
    try:
        comm.all_reduce_coalesced([torch.ones(n)], op="sum").wait()
    except CollectiveMismatch as e:
        return str(e), time.monotonic() - t0
    return "no error", 0.0


def test_checker_names_the_ranks_that_differ():
    out = run_distributed(_mismatch_rank, 3, timeout=60)
    for msg, elapsed in out:
        assert "collective #1 differs across ranks" in msg
        assert "rank(s) [0, 1]: all_reduce_coalesced(tensors=[(6,):float32]" in msg
        assert "rank(s) [2]: all_reduce_coalesced(tensors=[(7,):float32]" in msg
        assert elapsed < 5


def _dying_rank(rank, ws):
    import zerofuse  # noqa: F401
    from zerofuse.comm import Communicator

    comm = Communicator(timeout=15)
    comm.all_reduce_coalesced([torch.ones(5)], op="sum").wait()
    if rank == 1:
        os._exit(3)
    comm.all_reduce_coalesced([torch.ones(1 << 16)], op="sum").wait()
    return "finished"


def test_a_dead_rank_makes_the_others_fail_clearly():
    t0 = time.monotonic()
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_dying_rank, 3, timeout=60)
    msg = str(info.value)
    assert time.monotonic() - t0 < 40
    assert "process exited with code 3" in msg
    for r in (0, 2):
        assert (f"zerofuse.comm: all_reduce_coalesced #1 on rank {r} of 3 in group 0 (default_pg) failed "
                f"(timeout 15 s)") in msg
    assert "did not finish" not in msg


# ------------------------------------------------------------------ single process


def test_nccl_transport_needs_cuda(world_of_one):
    import zerofuse
    from zerofuse.comm import Communicator

    if zerofuse.build_info()["nccl"]:
        pytest.skip("this build has NCCL")
    with pytest.raises(RuntimeError, match="the NCCL transport needs CUDA"):
        Communicator(transport="nccl")


def test_bad_arguments_raise(world_of_one):
    from zerofuse.comm import Communicator

    comm = Communicator()
    with pytest.raises(ValueError, match=r"expected out_shard to have 8 elements \(ceil\(total numel / world_size\)\), got 3"):
        comm.reduce_scatter_coalesced([torch.ones(8)], torch.empty(3))
    with pytest.raises(ValueError, match=r"expected op 'sum', 'avg', 'max' or 'min', got 'mean'"):
        comm.all_reduce_coalesced([torch.ones(8)], op="mean")
    with pytest.raises(ValueError, match=r"expected transport 'auto', 'process_group' or 'nccl', got 'mpi'"):
        Communicator(transport="mpi")


def test_coalesce_block_and_group_errors(world_of_one):
    from zerofuse.comm import Communicator

    comm = Communicator()
    ts = _tensors(0, 3, torch.float32)
    outs = [torch.empty(comm.shard_numel([t])) for t in ts]
    with comm.coalesce():
        works = [comm.reduce_scatter_coalesced([t], o, op="sum") for t, o in zip(ts, outs)]
    for w, t, o in zip(works, ts, outs):
        w.wait()
        torch.testing.assert_close(o, t)
    comm._c.group_start()
    with pytest.raises(RuntimeError, match="group_start\\(\\) inside an open group"):
        comm._c.group_start()
    comm._c.group_end()
    with pytest.raises(RuntimeError, match="group_end\\(\\) without group_start\\(\\)"):
        comm._c.group_end()


def _reinit_rank(rank, ws):
    from zerofuse.comm import Communicator

    for _ in range(rank + 1):  # the ranks make different numbers of communicators
        Communicator()
    store = dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore("again", store), rank=rank, world_size=ws)
    comm = Communicator()
    t = torch.full((5,), float(rank + 1))
    comm.all_reduce_coalesced([t], op="sum").wait()
    return comm._uid, t.tolist()


def test_communicator_numbering_restarts_with_a_new_group():
    """After destroy_process_group + init (the group name is reused), communicators are numbered
    from 0 again, so ranks that made different numbers before agree on the store keys after."""
    results = run_distributed(_reinit_rank, 2, timeout=60)
    assert results[0][0] == results[1][0], results
    assert results[0][1] == [3.0] * 5


def test_communicator_keys_are_fresh_when_the_store_outlives_the_group():
    """A new group object under a used name starts a new generation of store keys (counted in the
    store per rank), so with a store that outlives the group (torchrun's) a rank cannot read the
    NCCL id or checker entries of the old group; within one group the count goes on."""
    from zerofuse.comm.communicator import _next_uid

    class Group:  # stands for a ProcessGroup: only its identity matters
        pass

    store = dist.HashStore()
    g = Group()
    first = [_next_uid("test-fresh", g, store, rank=0) for _ in range(2)]
    g = Group()
    assert first == ["zerofuse/test-fresh/g1/0", "zerofuse/test-fresh/g1/1"]
    assert [_next_uid("test-fresh", g, store, rank=0) for _ in range(2)] == \
        ["zerofuse/test-fresh/g2/0", "zerofuse/test-fresh/g2/1"]
    assert store.add("zerofuse/test-fresh/generation/rank0", 0) == 2


def test_world_of_one_is_the_identity(world_of_one):
    from zerofuse.comm import Communicator

    comm = Communicator(transport="process_group")
    ts = _tensors(0, 5, torch.float32)
    out = torch.empty(comm.shard_numel(ts))
    comm.reduce_scatter_coalesced(ts, out, op="avg").wait()
    torch.testing.assert_close(out, torch.cat([t.reshape(-1) for t in ts]))


@pytest.mark.gpu
def test_nccl_world_of_one_matches_the_reference(world_of_one):
    """The NCCL transport on one GPU: every collective through zerofuse's own ncclComm_t."""
    import zerofuse
    from zerofuse.comm import Communicator

    if not zerofuse.build_info()["nccl"]:
        pytest.skip("this build has no NCCL")
    comm = Communicator(transport="nccl")
    ts = [t.cuda() for t in _tensors(0, 300, torch.bfloat16)]
    flat = torch.cat([t.reshape(-1).float() for t in ts])
    out = torch.empty(comm.shard_numel(ts), device="cuda")
    comm.reduce_scatter_coalesced(ts, out, op="avg", reduce_dtype=torch.float32).wait()
    torch.testing.assert_close(out, flat)
    back = [torch.empty_like(t) for t in ts]
    comm.all_gather_coalesced(out.bfloat16(), back).wait()
    torch.testing.assert_close(torch.cat([b.reshape(-1) for b in back]).float(), flat.bfloat16().float())
    comm.all_reduce_coalesced(ts, op="sum", scale=2.0, reduce_dtype=torch.float32).wait()
    torch.testing.assert_close(torch.cat([t.reshape(-1).float() for t in ts]), (flat * 2).bfloat16().float())
    # several reduce-scatters in one ncclGroupStart/End launch
    parts = [torch.randn(n, device="cuda") for n in (5, 4097, 1023)]
    outs = [torch.empty(comm.shard_numel([p]), device="cuda") for p in parts]
    with comm.coalesce():
        works = [comm.reduce_scatter_coalesced([p], o, op="sum") for p, o in zip(parts, outs)]
    for w in works:
        w.wait()
    for p, o in zip(parts, outs):
        torch.testing.assert_close(o, p)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_nccl_wait_on_another_stream_orders_both(world_of_one):
    """wait() on a side stream orders that stream after the collective, and the launch stream too
    (the flat buffer's block goes back to the allocator there): a result read on the side stream is
    right even when the launch stream at once reuses memory for other data."""
    import zerofuse
    from zerofuse.comm import Communicator

    if not zerofuse.build_info()["nccl"]:
        pytest.skip("this build has no NCCL")
    comm = Communicator(transport="nccl")
    for _ in range(3):
        ts = [torch.randn(n, device="cuda") for n in (7, 4097, 1023, 1 << 20)]
        flat = torch.cat(ts)
        out = torch.empty(comm.shard_numel(ts), device="cuda")
        work = comm.reduce_scatter_coalesced(ts, out, op="sum")
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            work.wait()
            got = out.clone()
        del work
        junk = torch.full((flat.numel() * 2,), float("nan"), device="cuda")  # on the launch stream
        side.synchronize()
        torch.testing.assert_close(got, flat)
        del junk
