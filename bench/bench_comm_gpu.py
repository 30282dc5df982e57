"""The Communicator's NCCL transport on one GPU (CUDA only; skipped elsewhere).

With one rank a reduce-scatter or all-gather moves no data between GPUs, so what is timed is the
cost zerofuse adds around NCCL per bucket: the copy-in of a bucket's tensors into the flat buffer
(one launch) or the copy-out, NCCL's world-of-one collective (a device copy), and the event
handshakes between the caller's and the communication stream. Buckets of 1, 5, 25 and 100 MB made
of 64 fp32 tensors of mixed sizes.

Cases: reduce_scatter (tensors -> flat shard) and all_gather (shard -> tensors). Providers:
- copy: zerofuse.ops.flatten_into (reduce_scatter) or unflatten_from (all_gather) alone, the
  floor of the other two; GB/s counts the bytes read + written;
- torch: torch.cat + dist.reduce_scatter_tensor, or dist.all_gather_into_tensor + unflatten_from,
  on torch's own NCCL process group;
- zerofuse_nccl: Communicator(transport="nccl").reduce_scatter_coalesced / all_gather_coalesced
  through the NCCL transport (its world-of-one shortcut turned off here: the C++ path, comm stream
  and events, what a bucket costs at any world size besides the transfer);
- zerofuse: the same calls as a job of one rank makes them (comm/local.py: in place on the current
  stream, no NCCL call).
extra_info: overhead_us_vs_copy = (median - copy's median) per bucket, in microseconds.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

BUCKET_MB = [1, 5, 25, 100]
PROVIDERS = ["copy", "torch", "zerofuse_nccl", "zerofuse"]  # zerofuse last: measure() adds its speedups


@pytest.fixture(scope="module")
def nccl_world(device):
    if device.type != "cuda":
        pytest.skip("NCCL transport benchmark: needs a CUDA device")
    import zerofuse

    if not zerofuse.build_info()["nccl"]:
        pytest.skip("this build has no NCCL")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    tmp = tempfile.TemporaryDirectory(prefix="zerofuse-bench-nccl-")
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{os.path.join(tmp.name, 'init')}",
                            rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    tmp.cleanup()


def _tensors(total_bytes: int, device) -> list[torch.Tensor]:
    """64 fp32 tensors of log-uniform sizes adding up to about total_bytes."""
    g = torch.Generator().manual_seed(0)
    w = torch.exp(torch.rand(64, generator=g) * 6)
    sizes = [max(1, int(x)) for x in (w / w.sum() * total_bytes / 4).tolist()]
    return [torch.randn(n, device=device) for n in sizes]


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("mb", BUCKET_MB, ids=lambda mb: f"{mb}MB")
@pytest.mark.parametrize("coll", ["reduce_scatter", "all_gather"])
def bench_nccl_bucket(measure, registry, benchmark, nccl_world, device, smoke, coll, mb, provider):
    from zerofuse.comm import Communicator
    from zerofuse.ops import flatten_into, unflatten_from

    ts = _tensors((mb << 20) // (64 if smoke else 1), device)
    n = sum(t.numel() for t in ts)
    offsets = [0]
    for t in ts[:-1]:
        offsets.append(offsets[-1] + t.numel())
    flat = torch.cat(ts)
    ref = [t.clone() for t in ts]
    comm = Communicator(transport="nccl") if provider.startswith("zerofuse") else None
    if provider == "zerofuse_nccl":
        comm._one = False  # the transport itself, as with more ranks (a world of one otherwise skips it)
    shard = torch.empty(comm.shard_numel(ts) if comm else n, device=device)
    shard[:n].copy_(flat)
    if coll == "reduce_scatter":
        op = {
            "copy": lambda: flatten_into(ts, shard, offsets),
            "torch": lambda: dist.reduce_scatter_tensor(shard, torch.cat(ts), op=dist.ReduceOp.SUM),
            "zerofuse": lambda: comm.reduce_scatter_coalesced(ts, shard, op="sum").wait(),
        }[provider.replace("zerofuse_nccl", "zerofuse")]
        check = lambda: torch.testing.assert_close(shard[:n], flat)  # noqa: E731
    else:
        def torch_ag():
            dist.all_gather_into_tensor(flat, shard)
            unflatten_from(flat, ts, offsets)

        op = {
            "copy": lambda: unflatten_from(shard, ts, offsets),
            "torch": torch_ag,
            "zerofuse": lambda: comm.all_gather_coalesced(shard, ts).wait(),
        }[provider.replace("zerofuse_nccl", "zerofuse")]

        def check():
            for t, r in zip(ts, ref):
                torch.testing.assert_close(t, r)
    # clear the destination first, so that the check sees what the collective wrote
    if coll == "reduce_scatter":
        shard.zero_()
    else:
        for t in ts:
            t.zero_()
    op()
    torch.cuda.synchronize(device)
    check()  # a world of one gives back what it was given
    case = f"nccl_{coll}/{mb}MB"
    seconds = measure(op, case=case, provider=provider, bytes_moved=8 * n if provider == "copy" else None)
    copy = registry.medians.get((case, "copy"))
    if provider != "copy" and copy and seconds is not None:
        benchmark.extra_info["overhead_us_vs_copy"] = round((seconds - copy) * 1e6, 1)
