"""ZeRO-Offload's optimizer side on real gloo ranks: parallelize(offload="optimizer") keeps the fp32
masters and Adam states in host memory, stepped by the C++ CPU kernel unit by unit (during backward
without clipping, after the global norm with it). Stages 1/2/3 at world sizes 2 and 4, fp32 and
bf16: the same bits as the same run without offload, and one process's training by the parity
rule; fp16 overflow skips on every rank; checkpoints move between offload and not; misuse is
refused."""
from __future__ import annotations

import re

import pytest
import torch

import zerofuse
from zerofuse.models import GPT, GPTConfig

from dist_utils import run_distributed
from tolerances import assert_close_training, tol

pytestmark = pytest.mark.usefixtures("native_kernels")

CFG = dict(vocab_size=65, seq_len=16, n_layer=2, n_head=4, dim=32)
GLOBAL_BATCH, SEQ, STEPS = 8, 16, 6
LR, WD, MAX_NORM = 3e-3, 0.01, 0.5


def batches(steps, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 65, (GLOBAL_BATCH, SEQ + 1), generator=g) for _ in range(steps)]


def _run(rank, ws, stage, precision, offload, clip, steps=STEPS, model=None, opt=None, micro=1, ratio=1.0):
    if model is None:
        model = GPT(GPTConfig(**CFG), seed=0)
        zerofuse.zero.parallelize(model, stage=stage, precision=precision, bucket_mb=0.01, offload=offload,
                                  **(dict(offload_ratio=ratio) if offload else {}))
        opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD, max_grad_norm=MAX_NORM if clip else None)
    per = GLOBAL_BATCH // ws
    losses = []
    for b in batches(steps):
        mine = b[rank * per:(rank + 1) * per]
        parts = mine.chunk(micro)
        for j, part in enumerate(parts):  # micro-batches: grads accumulate inside no_sync
            with model.no_sync() if j < len(parts) - 1 else torch.enable_grad():
                loss = model(part[:, :-1], part[:, 1:])[1]
                (loss / micro).backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    with zerofuse.zero.full_params(model):
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return model, opt, losses, params


def _parity_rank(rank, ws, stage, precision, clip, mode="optimizer", ratio=1.0):
    model, opt, losses, params = _run(rank, ws, stage, precision, mode, clip, micro=2, ratio=ratio)
    mem = zerofuse.zero.memory_report(model, opt)
    shard_bytes = sum(u.shard.numel() * u.shard.element_size() for u in model._zerofuse_zero.units)
    log, units = list(opt.host.last_log), sorted(model._zerofuse_zero.host_units)
    # kept on the host even for fp32 params
    masters = all("master" in opt.unit_states[i] for i in model._zerofuse_zero.host_units)
    _, _, base_losses, base_params = _run(rank, ws, stage, precision, None, clip, micro=2)
    host_shards = all(u.host_shard for u in model._zerofuse_zero.units)
    n_units = len(opt.unit_states)
    return losses, params, base_losses, base_params, log, (units, n_units), masters, (mem, shard_bytes, host_shards)


@pytest.mark.parametrize("ws,stage,precision,clip,mode,ratio", [
    (2, 1, "fp32", True, "optimizer", 1.0), (2, 2, "fp32", False, "optimizer", 1.0),
    (4, 3, "fp32", True, "optimizer", 1.0), (2, 2, "bf16", True, "optimizer", 1.0),
    (4, 3, "bf16", False, "optimizer", 1.0), (2, 3, "fp32", True, "optimizer+params", 1.0),
    (4, 3, "bf16", False, "optimizer+params", 1.0), (2, 0, "fp32", False, "optimizer", 1.0),
    (2, 2, "fp32", False, "optimizer", 0.5), (4, 1, "bf16", True, "optimizer", 0.3),  # twin flow
    (2, 2, "fp32", False, "optimizer", "auto")])  # the ratio measured: about 0.5 on a CPU, agreed by the ranks
def test_offload_equals_the_same_run_without_it(ws, stage, precision, clip, mode, ratio):
    out = run_distributed(_parity_rank, ws, stage, precision, clip, mode, ratio, timeout=240)
    assert len({tuple(o[5][0]) for o in out}) == 1  # every rank steps the same units on the host
    for rank, (losses, params, base_losses, base_params, log, units, masters, memory) in enumerate(out):
        mem, shard_bytes, host_shards = memory
        units, n_units = units
        if ratio == 1.0:
            assert mem["optimizer"] == 0 and mem["optimizer_host"] > 0 and len(units) == n_units, mem
        else:  # the first-ready units (ratio of the shard) on the host, the others' states on the device
            assert 0 < len(units) < n_units and units == list(range(len(units))), units
            assert mem["optimizer"] > 0 and mem["optimizer_host"] > 0, mem
            for key in ("optimizer", "optimizer_host"):
                assert abs(mem[key] - mem["formula"][key]) <= 0.1 * mem["formula"][key], (key, mem)
        if mode == "optimizer+params":  # the param shards in host memory, nothing of them on the device
            assert host_shards and mem["params_host"] == shard_bytes and mem["params"] == 0, (mem, shard_bytes)
        else:
            assert not host_shards and "params_host" not in mem
        # every unit stepped on the host each step: during backward, as its grads arrived, unless
        # clipping had to wait for the global norm
        assert masters and sorted(u for u, _ in log) == units, log
        assert {w for _, w in log} == ({"step"} if clip else {"backward"}), log
        assert losses == base_losses, rank  # the same kernel on the same values: the same bits
        for name, want in base_params.items():
            assert torch.equal(params[name], want), (rank, name)


def test_offload_matches_one_process_training():
    """fp32, ZeRO-2 at world size 4 with clipping every step, against torch.optim.AdamW."""
    def reference(micro):
        model = GPT(GPTConfig(**CFG), seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        for b in batches(STEPS):
            for part in b.chunk(micro):
                (model(part[:, :-1], part[:, 1:])[1] / micro).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            opt.zero_grad()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    ref, alt = reference(1), reference(4)
    params = run_distributed(_parity_rank, 4, 2, "fp32", True, timeout=240)[0][1]
    for name, want in ref.items():
        assert_close_training(params[name], want, alt[name], msg=name)


def _fp16_rank(rank, ws):
    model = GPT(GPTConfig(**CFG), seed=0)
    zerofuse.zero.parallelize(model, stage=2, precision="fp16", offload="optimizer")
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, initial_scale=1024.0)
    per = GLOBAL_BATCH // ws
    record = []
    for i, b in enumerate(batches(3)):
        mine = b[rank * per:(rank + 1) * per]
        loss = model(mine[:, :-1], mine[:, 1:])[1]
        if i == 1 and rank == ws - 1:
            loss = loss * float("inf")  # one rank overflows
        with zerofuse.zero.full_params(model):
            before = [p.detach().clone() for p in model.parameters()]
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
        with zerofuse.zero.full_params(model):
            changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        record.append((changed, bool(opt.last_step_skipped.item()), opt.loss_scale, float(opt._steps[0].item())))
    return record


def test_fp16_overflow_skips_the_offloaded_step_on_every_rank():
    records = run_distributed(_fp16_rank, 2, timeout=240)
    assert records[0] == records[1]
    (c0, s0, sc0, st0), (c1, s1, sc1, st1), (c2, s2, sc2, st2) = records[0]
    assert c0 and not s0 and sc0 == 1024.0 and st0 == 1.0
    assert not c1 and s1 and sc1 == 512.0 and st1 == 1.0  # skipped: nothing changed, the scale backed off
    assert c2 and not s2 and st2 == 2.0


def _ckpt_rank(rank, ws, path, save_offload, load_offload, fmt, ratio):
    from zerofuse import checkpoint

    model, opt, _, _ = _run(rank, ws, 2, "fp32", save_offload, True, steps=2, ratio=ratio)
    checkpoint.save(path, model, opt, format=fmt)
    model2 = GPT(GPTConfig(**CFG), seed=1)  # other weights: all come from the checkpoint
    zerofuse.zero.parallelize(model2, stage=2, bucket_mb=0.01, offload=load_offload)
    opt2 = zerofuse.zero.Optimizer(model2, "adamw", lr=LR, weight_decay=WD, max_grad_norm=MAX_NORM)
    checkpoint.load(path, model2, opt2)
    # both go on for two steps: the same losses and params (masters, states and step counts restored)
    _, _, l1, p1 = _run(rank, ws, 2, "fp32", None, True, steps=2, model=model, opt=opt)
    _, _, l2, p2 = _run(rank, ws, 2, "fp32", None, True, steps=2, model=model2, opt=opt2)
    return l1, l2, all(torch.equal(p1[n], p2[n]) for n in p1)


@pytest.mark.parametrize("save_offload,load_offload,fmt,ratio", [
    ("optimizer", None, "zerofuse", 1.0), (None, "optimizer", "zerofuse", 1.0),
    ("optimizer", None, "dcp", 0.5)])  # twin flow: fp32 masters on the host units only (DCP: KeyError, 2026-12-06)
def test_checkpoints_move_between_offload_and_not(tmp_path, save_offload, load_offload, fmt, ratio):
    for l1, l2, same in run_distributed(_ckpt_rank, 2, str(tmp_path / "ckpt"), save_offload, load_offload, fmt,
                                        ratio, timeout=240):
        assert l1 == l2 and same


def _misuse_rank(rank, ws):
    errors = []

    def expect(fn):
        try:
            fn()
        except (ValueError, RuntimeError) as e:
            errors.append(str(e))
        else:
            errors.append(None)

    model = GPT(GPTConfig(**CFG), seed=0)
    expect(lambda: zerofuse.zero.parallelize(model, stage=2, offload="params"))
    expect(lambda: zerofuse.zero.parallelize(model, stage=2, offload="optimizer+params"))
    expect(lambda: zerofuse.zero.parallelize(model, stage=2, offload="optimizer", offload_ratio=1.5))
    expect(lambda: zerofuse.zero.parallelize(model, stage=2, offload="optimizer", offload_ratio=False))
    expect(lambda: zerofuse.zero.parallelize(model, stage=3, offload="optimizer+params", offload_ratio=0.5))
    zerofuse.zero.parallelize(model, stage=2, offload="optimizer")
    expect(lambda: zerofuse.zero.Optimizer(model, "lamb"))
    opt = zerofuse.zero.Optimizer(model, "adamw")
    x = torch.randint(0, 65, (2, 9))
    model(x[:, :-1], x[:, 1:])[1].backward()
    expect(lambda: opt.clip_grad_norm_(1.0))
    expect(lambda: opt.zero_grad())
    expect(lambda: model(x[:, :-1], x[:, 1:])[1].backward())
    return errors


def test_misuse_is_refused():
    errors = run_distributed(_misuse_rank, 2, timeout=120)[0]
    wants = [r"expected offload None, 'optimizer' or 'optimizer\+params', got 'params'",
             r"offload='optimizer\+params' keeps the param shards in host memory: expected stage "
             r"3, got 2",
             r"expected offload_ratio in \[0, 1\] or .auto., got 1.5",
             r"expected offload_ratio in \[0, 1\] or .auto., got False",  # (ran as ratio 0: nothing offloaded)
             r"offload_ratio < 1 splits the optimizer step between host and device: expected "
             r"offload='optimizer', got 'optimizer\+params'",
             r"expected optimizer 'adamw' or 'adam' with offload='optimizer'.*got 'lamb'",
             r"pass max_grad_norm to the Optimizer instead",
             r"zero_grad: with offload the last backward already started its host steps",
             r"reduced .* again before step"]
    assert len(errors) == len(wants), errors
    for got, want in zip(errors, wants):
        assert got is not None and re.search(want, got), (got, want)


def _cuda_rank(rank, ws, stage, mode, clip):
    out = {}
    for offload in (None, mode):
        model = GPT(GPTConfig(**CFG), seed=0).cuda()
        zerofuse.zero.parallelize(model, stage=stage, precision="bf16", offload=offload)
        opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD, max_grad_norm=MAX_NORM if clip else None)
        losses = []
        for b in batches(STEPS):
            b = b.cuda()
            loss = model(b[:, :-1], b[:, 1:])[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        pinned = all(t.is_pinned() for st in opt.unit_states for t in st.values()) if offload else None
        shards = {u.shard.device.type for u in model._zerofuse_zero.units}
        out[offload] = dict(losses=losses, pinned=pinned, shards=shards)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("stage,mode,clip", [(2, "optimizer", False), (2, "optimizer", True),
                                             (3, "optimizer+params", True)])
def test_cuda_offload_matches_the_device_step(stage, mode, clip):
    """One GPU (world of one, NCCL transport): the host step (C++ kernel, pinned states, side-stream
    copies) against the device step (Triton kernel), bf16 params with fp32 masters."""
    out = run_distributed(_cuda_rank, 1, stage, mode, clip, timeout=300)[0]
    torch.testing.assert_close(torch.tensor(out[mode]["losses"]), torch.tensor(out[None]["losses"]),
                               **tol(torch.bfloat16))
    assert out[mode]["pinned"]
    assert out[mode]["shards"] == ({"cpu"} if mode == "optimizer+params" else {"cuda"})


@pytest.mark.parametrize("stage", [3])  # (stage 2 over one rank reduces in place and keeps the buffer, as DDP)
def test_offload_holds_no_grad_shard_past_the_step(stage, world_of_one):
    """On a CPU device the host step reads the grad shards in place: it kept them referenced after
    step(), so zero_grad(set_to_none=True) freed nothing while memory_report said grads 0 (a
    review's reproduction, 2026-11-28)."""
    import gc
    import weakref

    model = GPT(GPTConfig(**CFG), seed=0)
    zerofuse.zero.parallelize(model, stage=stage, bucket_mb=0.01, offload="optimizer")
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR)
    b = batches(1)[0]
    model(b[:, :-1], b[:, 1:])[1].backward()
    refs = [weakref.ref(u.grad_shard()) for u in model._zerofuse_zero.units]
    opt.step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert zerofuse.zero.memory_report(model, opt)["grads"] == 0
    assert [r() is None for r in refs] == [True] * len(refs)


@pytest.mark.parametrize("stage", [2, 3])
def test_twin_flow_puts_the_units_backward_completes_first_on_the_host(stage, world_of_one):
    """offload_ratio < 1: the host steps the units whose grads are ready first, overlapping the rest
    of backward. Stage 3's units are in forward order (the root last): it took the last ready (a
    review's reproduction, 2026-11-28: reduced [3, 2, 1, 0, 4], host [0, 1, 2])."""
    model = GPT(GPTConfig(**CFG | {"n_layer": 4}), seed=0)
    zerofuse.zero.parallelize(model, stage=stage, bucket_mb=0.01, offload="optimizer", offload_ratio=0.5)
    zerofuse.zero.Optimizer(model, "adamw", lr=LR)
    eng = model._zerofuse_zero
    b = batches(1)[0]
    model(b[:, :-1], b[:, 1:])[1].backward()
    order = [i for kind, i, when in eng.events if kind == "reduce_scatter"]
    assert sorted(order) == sorted(u.index for u in eng.units)
    assert 0 < len(eng.host_units) < len(order)
    assert set(order[:len(eng.host_units)]) == eng.host_units, (order, eng.host_units)


def _report_rank(rank, ws, kw):
    import gc

    with zerofuse.zero.peak_memory() as mem:
        model = GPT(GPTConfig(**CFG), seed=0)
        zerofuse.zero.parallelize(model, stage=2, bucket_mb=0.01, offload="optimizer")
        opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, **kw)
        out = []
        for b in batches(3):
            mine = b[rank::ws]
            model(mine[:, :-1], mine[:, 1:])[1].backward()
            gc.collect()
            r = zerofuse.zero.memory_report(model, opt)
            out.append((mem._now()[0], r["total"] + r["optimizer_host"]))
            opt.step()
            opt.zero_grad()
        return out


@pytest.mark.parametrize("kw", [{}, dict(delayed_update=True, delayed_update_warmup=1)], ids=["plain", "delayed"])
def test_memory_report_counts_what_offload_holds(kw):
    """memory_report against the counting allocator after each backward: the delayed update's copies
    of the grad shards (kept through the next forward and backward) were left out (9.1 of 63.7 MiB
    in a review's reproduction, 2026-12-07); now in 'optimizer_host'."""
    for out in run_distributed(_report_rank, 2, kw, timeout=240):
        for live, reported in out:  # (within 8 KiB: small tensors it does not report, step counters and the
            assert abs(live - reported) < 8192, out  # like; a grad shard here is ~60 KiB)
