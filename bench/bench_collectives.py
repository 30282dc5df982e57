"""Collectives on gloo with 2 and 4 ranks: zerofuse's coalesced collectives vs one collective per
tensor and torch's coalescing paths; a bucket-size sweep (algorithm and bus bandwidth, vs one
collective of the same total size); exposed communication of a backward with overlap on and off.

The pytest process is rank 0 and times with pytest-benchmark; ranks 1.. are helper processes that
run the same collective in lockstep (every round starts after a barrier, outside the timing).
Timings therefore include gloo's work on every rank, on this machine's cores. Each rank gets
cores // world_size intra-op threads, as torchrun sets OMP_NUM_THREADS for co-located ranks
(measured: with every rank on all cores, OpenMP threads spinning after each parallel copy made a
1 MB gloo all-reduce ~12 ms instead of ~2 ms).

Bandwidths (nccl-tests conventions): algbw = bytes / time, with bytes the full input of the
collective; busbw = algbw * 2 (ws - 1) / ws for all-reduce, algbw * (ws - 1) / ws for
reduce-scatter and all-gather.

The *_interleaved benchmarks run zerofuse and its peers in turn within every round (each after a
barrier) and report medians of per-round ratios: on this 2-core VM, back-to-back providers moved
single ratios by 20-40% (the 2026-11-21 CPU run's 0.83x of torch's cat + reduce_scatter_tensor for 256 small
tensors was 1.3x when the two were interleaved).

Checked ([Note: checked results] in bench/conftest.py): every workload runs once more, untimed, on
every rank before its timing, and rank 0 compares what it produced with torch's computation on the
ranks' inputs (regenerated from their seeds): the collectives' inputs are integer-valued floats, so
their reduced tensors must equal the sums exactly (check_equal); the ZeRO-2 backward's gradients
(zerofuse.zero.full_grads) the mean of the ranks' local gradients by the reference rule (float64
reference, fp32 peer; no_comm: rank 0's own).
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import statistics
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist

from collective_cases import (_bucket_grads, _bucket_mb, _bucketed, _check, _coalesced_inputs, _model_sizes, _mlp,
                              _pad)  # bench/collective_cases.py: the inputs, and the check of the results
from timing import timed  # bench/timing.py (the ranks import this suite by name)

CPU = torch.device("cpu")  # the ranks run on gloo

WORLD_SIZES = [2, 4]
BUCKET_MB = [1, 5, 25, 100]
# The simulated link of bench_backward_overlap's link_* providers: every launch waits this many ms
# after the one before it (the Communicator's debug_delay_ms: a sleep on its launch thread, no
# CPU). On gloo a bucket goes out as all-reduce pieces of at most 4 MB, so this is a ~0.4 GB/s
# link in front of the real gloo transfer.
LINK_MS = 10
warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.* is deprecated")


class _Workload:
    """One timed collective (op) and the bytes it moves, built the same way on every rank; first()
    runs it once more, untimed, and returns what it produced (rank 0 checks it: _check)."""

    def __init__(self, spec: tuple, rank: int, ws: int, smoke: bool):
        import zerofuse
        from zerofuse.comm import Communicator

        suite, case, provider = spec[:3]
        self.bytes, self.subs = 0, None
        if suite in ("all_reduce", "reduce_scatter"):
            ts = _coalesced_inputs(case, rank, smoke)
            self.bytes = 4 * sum(t.numel() for t in ts)
            comm = Communicator() if provider == "zerofuse" else None
            if suite == "all_reduce":
                self.op = {
                    "per_tensor": lambda: [w.wait() for w in [dist.all_reduce(t, async_op=True) for t in ts]],
                    "torch_all_reduce_coalesced": lambda: dist.all_reduce_coalesced(ts, async_op=True).wait(),
                    "torch_coalescing_manager": lambda: self._coalesced(lambda: [dist.all_reduce(t) for t in ts]),
                    "zerofuse": lambda: comm.all_reduce_coalesced(ts, op="sum").wait(),
                }[provider]
                self.result = lambda: ts
            else:
                padded = [torch.cat([t, t.new_zeros(_pad(t.numel(), ws) - t.numel())]) for t in ts]
                outs = [torch.empty(p.numel() // ws) for p in padded]
                total = sum(t.numel() for t in ts)
                flat_out = torch.empty(_pad(total, ws) // ws)

                def cat_flat():
                    flat = torch.cat([t.reshape(-1) for t in ts] + [ts[0].new_zeros(_pad(total, ws) - total)])
                    dist.reduce_scatter_tensor(flat_out, flat)

                def per_tensor():
                    works = [dist.reduce_scatter_tensor(o, p, async_op=True) for o, p in zip(outs, padded)]
                    for w in works:
                        w.wait()

                self.op = {
                    "per_tensor": per_tensor,
                    "torch_coalescing_manager": lambda: self._coalesced(
                        lambda: [dist.reduce_scatter_tensor(o, p) for o, p in zip(outs, padded)]),
                    "torch_cat_flat": cat_flat,
                    "zerofuse": lambda: comm.reduce_scatter_coalesced(ts, flat_out, op="sum").wait(),
                }[provider]
                self.result = (lambda: outs) if provider in ("per_tensor", "torch_coalescing_manager") else \
                    (lambda: [flat_out])
        elif suite == "buckets":
            params = [torch.nn.Parameter(torch.zeros(n)) for n in _model_sizes(smoke)]
            for p, grad in zip(params, _bucket_grads(rank, smoke)):
                p.grad = grad
            self.bytes = 4 * sum(p.numel() for p in params)
            comm = Communicator()
            if provider == "single":  # one reduce-scatter of every grad, copied into one flat buffer as the
                # buckets' are (a flat buffer made outside the timing took the no-copy path: the ratio
                # charged the buckets a copy the reference skipped)
                grads = [p.grad for p in reversed(params)]
                out = torch.empty(comm.shard_numel(grads))
                self.op = lambda: comm.reduce_scatter_coalesced(grads, out, op="sum").wait()
                self.result = lambda: [out]
            else:  # ZeRO-2's buckets: grads in reverse order, about mb each, one reduce-scatter per bucket
                buckets = _bucketed([p.grad for p in params], _bucket_mb(provider, smoke))
                outs = [torch.empty(comm.shard_numel(b)) for b in buckets]

                def bucketed():
                    for w in [comm.reduce_scatter_coalesced(b, o, op="sum") for b, o in zip(buckets, outs)]:
                        w.wait()

                self.op = bucketed
                self.result = lambda: outs
        elif suite == "interleaved":
            # spec[1] = "<suite>/<case>", spec[2] = "name+name+...": the named workloads of that
            # suite, each timed on its own after a barrier, in turn within every round
            sub_suite, sub_case = case.split("/", 1)
            self.subs = {name: _Workload((sub_suite, sub_case, name), rank, ws, smoke) for name in provider.split("+")}
            self.times = {name: [] for name in self.subs}
            self.bytes = next(iter(self.subs.values())).bytes

            def rotate():
                for name, sub in self.subs.items():
                    dist.barrier()
                    self.times[name].append(timed(sub.op, CPU))

            self.op = rotate
        elif suite == "overlap":
            model, x = _mlp(rank, smoke)
            self.bytes = 4 * sum(p.numel() for p in model.parameters())
            if provider != "no_comm":  # ZeRO-2: bucketed reduce-scatters launched in backward (or after it)
                if provider.startswith("link_"):
                    os.environ["ZEROFUSE_COMM_DELAY_MS"] = str(LINK_MS)
                try:
                    zerofuse.zero.parallelize(model, stage=2, bucket_mb=8 / (64 if smoke else 1),
                                              overlap=provider.endswith("overlap_on"))
                finally:
                    os.environ.pop("ZEROFUSE_COMM_DELAY_MS", None)

            def step():
                model.zero_grad(set_to_none=False)
                if provider != "no_comm":
                    model._zerofuse_zero.zero_grad()
                model(x).square().mean().backward()  # the engine waits for every reduction at its end

            def grads():  # (full_grads: an all-gather, on every rank)
                if provider == "no_comm":
                    return [p.grad.clone() for p in model.parameters()]
                with zerofuse.zero.full_grads(model):
                    return [p.grad.clone() for p in model.parameters()]

            self.op, self.result = step, grads

    def first(self):
        """The op once, untimed, after a barrier (every rank), and its result; {name: result} of the
        workloads of an interleaved one."""
        if self.subs is not None:
            return {name: sub.first() for name, sub in self.subs.items()}
        dist.barrier()
        self.op()
        return [t.detach().clone() for t in self.result()]  # (the timed rounds write on)

    @staticmethod
    def _coalesced(launch):
        with dist._coalescing_manager(async_ops=True) as cm:
            launch()
        cm.wait()


def _threads(ws: int) -> int:
    return max(1, (os.cpu_count() or 1) // ws)


def _helper(rank: int, ws: int, init_file: str, smoke: bool) -> None:
    torch.set_num_threads(_threads(ws))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=600))
    try:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                break
            spec, rounds = box[0]
            work = _Workload(spec, rank, ws, smoke)
            work.first()
            for _ in range(rounds):
                dist.barrier()
                work.op()
    finally:
        dist.destroy_process_group()


class _Group:
    def __init__(self, ws: int, smoke: bool):
        self.ws, self.smoke = ws, smoke
        self.tmp = tempfile.TemporaryDirectory(prefix="zerofuse-bench-")
        init = os.path.join(self.tmp.name, "init")
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_helper, args=(r, ws, init, smoke), daemon=True) for r in range(1, ws)]
        for p in self.procs:
            p.start()
        self.threads = torch.get_num_threads()
        torch.set_num_threads(_threads(ws))
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=ws,
                                timeout=datetime.timedelta(seconds=600))

    def run(self, benchmark, spec: tuple, rounds: int = 10, warmup: int = 2) -> _Workload:
        total = 1 if benchmark.disabled else rounds + warmup
        dist.broadcast_object_list([(spec, total)], src=0)
        work = _Workload(spec, 0, self.ws, self.smoke)
        got = work.first()  # (checked after the timing: a wrong result's row is recorded as failed)
        benchmark.pedantic(work.op, setup=dist.barrier, rounds=1 if benchmark.disabled else rounds,
                           warmup_rounds=0 if benchmark.disabled else warmup)
        work.warmup = 0 if benchmark.disabled else warmup
        info = benchmark.extra_info
        info.update(case="/".join(map(str, spec[:2])) + f"/ws{self.ws}", provider=spec[2], world_size=self.ws,
                    device="cpu (gloo)", torch=torch.__version__)
        if spec[0] == "interleaved":
            sub_suite, sub_case = spec[1].split("/", 1)
            for name, res in got.items():
                _check((sub_suite, sub_case, name), res, self.ws, self.smoke)
        else:
            _check(spec, got, self.ws, self.smoke)
        return work

    def close(self):
        dist.broadcast_object_list([None], src=0)
        dist.destroy_process_group()
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        torch.set_num_threads(self.threads)
        self.tmp.cleanup()


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda ws: f"ws{ws}")
def group(request, smoke, device):
    if device.type != "cpu":
        pytest.skip("gloo collectives between CPU processes: run with --bench-device cpu (bench_comm_gpu.py times NCCL)")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    g = _Group(request.param, smoke)
    yield g
    g.close()


def _median(benchmark):
    return None if benchmark.stats is None else benchmark.stats.stats.median


_MEDIANS: dict[tuple, float] = {}


def _record(benchmark, key, peers=()):
    """Keep this median; for zerofuse, add speedups over the peers measured earlier."""
    m = _median(benchmark)
    if m is None:
        return
    _MEDIANS[key] = m
    for peer in peers:
        pm = _MEDIANS.get(key[:-1] + (peer,))
        if pm:
            benchmark.extra_info[f"speedup_vs_{peer}"] = round(pm / m, 3)


def _bw(benchmark, work, factor):
    m = _median(benchmark)
    if m is None:
        return
    algbw = work.bytes / m / 1e9
    benchmark.extra_info.update({"GB/s": round(algbw, 3), "busbw_GB/s": round(algbw * factor, 3)})


AR_PROVIDERS = ["per_tensor", "torch_all_reduce_coalesced", "torch_coalescing_manager", "zerofuse"]
RS_PROVIDERS = ["per_tensor", "torch_coalescing_manager", "torch_cat_flat", "zerofuse"]


@pytest.mark.parametrize("provider", AR_PROVIDERS)
@pytest.mark.parametrize("case", ["small", "mixed"])
def bench_all_reduce_coalesced(benchmark, group, case, provider):
    work = group.run(benchmark, ("all_reduce", case, provider))
    _bw(benchmark, work, 2 * (group.ws - 1) / group.ws)
    _record(benchmark, ("all_reduce", case, group.ws, provider), AR_PROVIDERS[:-1] if provider == "zerofuse" else ())


@pytest.mark.parametrize("provider", RS_PROVIDERS)
@pytest.mark.parametrize("case", ["small", "mixed"])
def bench_reduce_scatter_coalesced(benchmark, group, case, provider):
    work = group.run(benchmark, ("reduce_scatter", case, provider))
    _bw(benchmark, work, (group.ws - 1) / group.ws)
    _record(benchmark, ("reduce_scatter", case, group.ws, provider), RS_PROVIDERS[:-1] if provider == "zerofuse" else ())


@pytest.mark.parametrize("provider", ["single"] + [f"bucket_{mb}MB" for mb in BUCKET_MB])
def bench_bucket_sweep(benchmark, group, provider):
    """Reduce-scatter of ~300 MB of grads in buckets of 1..100 MB vs one collective of it all."""
    work = group.run(benchmark, ("buckets", "300MB", provider), rounds=5, warmup=1)
    _bw(benchmark, work, (group.ws - 1) / group.ws)
    _record(benchmark, ("buckets", group.ws, provider))
    single = _MEDIANS.get(("buckets", group.ws, "single"))
    if provider != "single" and single and _median(benchmark):
        benchmark.extra_info["busbw_vs_single"] = round(single / _median(benchmark), 3)


@pytest.mark.parametrize("provider", ["no_comm", "overlap_off", "overlap_on", "link_overlap_off", "link_overlap_on"])
def bench_backward_overlap(benchmark, group, provider):
    """Backward of a 12-layer MLP (width 1024) with its gradient reduce-scatter in 8 MB buckets:
    exposed comm = time - backward-alone time; overlap_on launches buckets from grad-ready hooks,
    overlap_off after the backward. gloo's work is CPU work (copies through loopback sockets and
    the reduction) on the cores the backward uses, so on a 2-core machine with every rank
    computing it cannot hide: there, overlap shows only with link_*, where every collective also
    waits LINK_MS on a simulated link, time the backward can use."""
    group.run(benchmark, ("overlap", "mlp12", provider), rounds=8, warmup=2)
    _record(benchmark, ("overlap", group.ws, provider))
    if not provider.endswith("overlap_on"):
        return
    prefix = provider.removesuffix("overlap_on")
    base = _MEDIANS.get(("overlap", group.ws, "no_comm"))
    off = _MEDIANS.get(("overlap", group.ws, prefix + "overlap_off"))
    m = _median(benchmark)
    if base and off and m:
        comm_off, exposed_on = off - base, m - base
        benchmark.extra_info.update(comm_ms_overlap_off=round(comm_off * 1e3, 3),
                                    exposed_comm_ms_overlap_on=round(exposed_on * 1e3, 3),
                                    exposed_ratio=round(exposed_on / comm_off, 3) if comm_off > 0 else None)


def _interleaved(benchmark, group, suite, case, names, rounds, warmup=2):
    """Runs the named workloads of suite in turn every round; per-name times after warmup (s)."""
    work = group.run(benchmark, ("interleaved", f"{suite}/{case}", "+".join(names)), rounds=rounds, warmup=warmup)
    benchmark.extra_info["timing"] = "rounds"  # (the timed unit is a round of every workload: summarize.py)
    return {name: ts[work.warmup:] for name, ts in work.times.items()}


@pytest.mark.parametrize("suite,peer", [("all_reduce", "torch_all_reduce_coalesced"),
                                        ("all_reduce", "torch_coalescing_manager"),
                                        ("reduce_scatter", "torch_cat_flat"),
                                        ("reduce_scatter", "torch_coalescing_manager")])
@pytest.mark.parametrize("case", ["small", "mixed"])
def bench_coalesced_interleaved(benchmark, group, case, suite, peer):
    """zerofuse's coalesced collective and one of torch's equivalents (all_reduce_coalesced, cat +
    reduce_scatter_tensor, or _coalescing_manager) in turn within each round; speedup_vs_<peer> is
    the median over rounds of peer time / zerofuse time (goal: >= 1)."""
    times = _interleaved(benchmark, group, suite, case, ["zerofuse", peer], rounds=8 if case == "mixed" else 30)
    if benchmark.stats is None or not times["zerofuse"]:
        return
    ratios = [p / z for p, z in zip(times[peer], times["zerofuse"])]
    benchmark.extra_info[f"speedup_vs_{peer}"] = round(statistics.median(ratios), 3)
    for name, ts in times.items():
        benchmark.extra_info[f"{name}_median_ms"] = round(statistics.median(ts) * 1e3, 3)


@pytest.mark.parametrize("link", ["gloo", "link"])
def bench_backward_overlap_interleaved(benchmark, group, link):
    """bench_backward_overlap's three steps (backward alone, then buckets after it, then buckets
    from grad-ready hooks) in turn within each round; exposed_ratio is the median over rounds of
    (overlap_on - no_comm) / (overlap_off - no_comm) (goal: <= 0.5). link: with the simulated link
    of LINK_MS per launch. Rounds whose overlap_off step was not slower than no_comm's (no
    communication time to expose, measured: the ratio has no meaning) are left out of the median;
    exposed_ratio_rounds says how many of the rounds it is over."""
    pre = "link_" if link == "link" else ""
    names = ["no_comm", pre + "overlap_off", pre + "overlap_on"]
    times = _interleaved(benchmark, group, "overlap", "mlp12", names, rounds=10)
    if benchmark.stats is None or not times["no_comm"]:
        return
    base, off, on = (times[n] for n in names)
    ratios = [(n - b) / (f - b) for b, f, n in zip(base, off, on) if f > b]
    med = {n: statistics.median(times[n]) for n in names}
    benchmark.extra_info.update(
        comm_ms_overlap_off=round((med[names[1]] - med["no_comm"]) * 1e3, 3),
        exposed_comm_ms_overlap_on=round((med[names[2]] - med["no_comm"]) * 1e3, 3),
        exposed_ratio=round(statistics.median(ratios), 3) if ratios else None, exposed_ratio_rounds=len(ratios),
        rounds=len(base),
        **{f"{n}_median_ms": round(m * 1e3, 3) for n, m in med.items()})
