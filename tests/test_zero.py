"""ZeRO stage 1/2/3 on real gloo ranks against single-process training with the same global batch.

Each distributed run trains every stage in turn (one spawn per world size and precision keeps the
suite fast) and returns losses, grad norms, final params and memory reports; the parent compares
them with a single-process run of the same model and data.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import zerofuse
from zerofuse.models import GPT, GPTConfig
from zerofuse.optim import FusedAdamW, FusedLAMB, FusedLARS

from dist_utils import run_distributed
from tolerances import assert_close_training, tol

pytestmark = pytest.mark.usefixtures("native_kernels")

CFG = dict(vocab_size=65, seq_len=32, n_layer=3, n_head=4, n_kv_head=2, dim=64)
GLOBAL_BATCH, SEQ = 12, 16  # divisible by world sizes 2, 3 and 4
STAGES = (0, 1, 2, 3)
LR, WD, MAX_NORM = 1e-3, 0.01, 0.5


def make_model(precision="fp32", **over):
    model = GPT(GPTConfig(**{**CFG, **over}), seed=0)
    return model.to(zerofuse.zero.engine.PRECISIONS[precision])


def batches(steps, gb=GLOBAL_BATCH, seed=123):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 65, (gb, SEQ + 1), generator=g) for _ in range(steps)]


def mean_over_ranks(x: torch.Tensor) -> float:
    t = x.detach().float().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def full_state(model) -> dict:
    with zerofuse.zero.full_params(model):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def clip_now(i: int) -> bool:
    return i % 2 == 1  # clipping on odd steps: both the clipped and the plain step are covered


# ---------------------------------------------------------------------------- single process


def reference_run(steps, precision="fp32", kind="adamw", param_groups=None, micro=1, model_over=None, clip=True, **hp):
    """Losses (mean over the global batch), clip norms and final params of single-process training."""
    model = make_model(precision, **(model_over or {}))
    params = list(model.parameters())
    if param_groups is not None:
        params = param_groups(model)
    if kind == "adamw" and precision == "fp32":
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    elif kind == "adamw":
        opt = FusedAdamW(params, lr=LR, weight_decay=WD, master_weights=True)
    elif kind == "lamb":
        opt = FusedLAMB(params, lr=LR, weight_decay=WD, **hp)
    else:
        opt = FusedLARS(params, lr=0.1, momentum=0.9, weight_decay=1e-4)
    losses, norms = [], []
    for i, b in enumerate(batches(steps)):
        total = 0.0
        for part in b.chunk(micro):
            _, loss = model(part[:, :-1], part[:, 1:])
            (loss / micro).backward()
            total += loss.item() / micro
        losses.append(total)
        if clip and kind == "adamw" and clip_now(i):
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    return losses, norms, {n: p.detach().float().clone() for n, p in model.named_parameters()}


def reference_pair(steps, micro, **kw):
    """reference_run of the whole batch, and the params of the same run with the batch split into
    ``micro`` micro-batches (how the ranks split it) and 2, 3 and 4 ways (how ranks of the other
    world sizes split it): the reorderings assert_close_params allows."""
    ref = reference_run(steps, **kw)
    alts = [reference_run(steps, **{**kw, "micro": m})[2] for m in sorted({micro, 2, 3, 4})]
    return (*ref, alts)


def assert_close_params(got: dict, ref: dict, alts: list[dict], what="") -> None:
    for name, want in ref.items():
        assert_close_training(got[name], want, [alt[name] for alt in alts], msg=f"{what} {name}")


# ---------------------------------------------------------------------------- ranks


def _train(rank, ws, model, opt, steps, *, micro=1, clip=True, no_sync=True, set_to_none=True):
    per = GLOBAL_BATCH // ws
    losses, norms = [], []
    for i, b in enumerate(batches(steps)):
        mine = b[rank * per:(rank + 1) * per]
        total = 0.0
        parts = mine.chunk(micro)
        for j, part in enumerate(parts):
            ctx = model.no_sync() if (no_sync and j < len(parts) - 1) else _null()
            with ctx:
                _, loss = model(part[:, :-1], part[:, 1:])
                (loss / micro).backward()
            total += mean_over_ranks(loss) / micro
        losses.append(total)
        if clip and clip_now(i):
            norms.append(opt.clip_grad_norm_(MAX_NORM).item())
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return losses, norms


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _parity_rank(rank, ws, precision, steps):
    out = {}
    for stage in STAGES:
        model = make_model()
        zerofuse.zero.parallelize(model, stage=stage, precision=precision, bucket_mb=0.25)
        opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD)
        # zero-filled (not freed) grad shards, so memory_report after the step shows them
        losses, norms = _train(rank, ws, model, opt, steps, set_to_none=False)
        out[stage] = dict(losses=losses, norms=norms, params=full_state(model),
                          memory=zerofuse.zero.memory_report(model, opt),
                          events=list(model._zerofuse_zero.events))
    return out


@pytest.mark.parametrize("ws,precision", [(2, "fp32"), (3, "fp32"), (4, "fp32"), (2, "bf16"), (4, "bf16")])
def test_parity_with_single_process(ws, precision):
    steps = 10
    ref_losses, ref_norms, ref_params, alt_params = reference_pair(steps, ws, precision=precision)
    results = run_distributed(_parity_rank, ws, precision, steps, timeout=240)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    t = dict(rtol=1e-5, atol=1e-6) if precision == "fp32" else tol(dtype)
    for stage in STAGES:
        r0 = results[0][stage]
        torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(ref_losses), **t,
                                   msg=lambda m: f"stage {stage} losses: {m}")
        torch.testing.assert_close(torch.tensor(r0["norms"]), torch.tensor(ref_norms), **t,
                                   msg=lambda m: f"stage {stage} grad norms: {m}")
        if precision == "fp32":
            assert_close_params(r0["params"], ref_params, alt_params, f"stage {stage}")
        else:
            for name, want in ref_params.items():
                torch.testing.assert_close(r0["params"][name], want, **tol(dtype), msg=lambda m: f"stage {stage} {name}: {m}")
        for r in range(1, ws):  # every rank ends with the same params
            for name, want in r0["params"].items():
                torch.testing.assert_close(results[r][stage]["params"][name], want, rtol=0, atol=0)
        # memory against the ZeRO formulas (K = 8 fp32 m/v, + 4 for the masters of bf16 params)
        mem = r0["memory"]
        assert mem["K"] == (8 if precision == "fp32" else 12)
        for key in ("params", "grads", "optimizer", "total"):
            want = mem["formula"][key]
            assert abs(mem[key] - want) <= 0.02 * want, (stage, key, mem)
        # every reduce-scatter was launched during backward, as soon as its unit was ready
        assert r0["events"] and all(when == "backward" for _, _, when in r0["events"]), r0["events"]


def _zero_adamw(ws, **parallelize_kw):
    """(model, engine, AdamW, sequences per rank) for a fresh model parallelized with the kwargs."""
    model = make_model()
    zerofuse.zero.parallelize(model, **parallelize_kw)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD)
    return model, model._zerofuse_zero, opt, GLOBAL_BATCH // ws


def _stage0_buffer_rank(rank, ws):
    model, eng, opt, per = _zero_adamw(ws, stage=0, bucket_mb=0.25)
    out = {"ptrs": [], "grads": [], "formula": None}
    for b in batches(3):
        mine = b[rank * per:(rank + 1) * per]
        _, loss = model(mine[:, :-1], mine[:, 1:])
        loss.backward()
        opt.step()
        out["ptrs"].append([u.gshard.data_ptr() for u in eng.units])
        mem = zerofuse.zero.memory_report(model, opt)
        out["grads"].append(mem["grads"])
        out["formula"] = mem["formula"]["grads"]
        opt.zero_grad(set_to_none=False)  # keeps (zeroes) the buffer; True frees it
    return out


def test_stage0_keeps_one_grad_buffer():
    """Stage 0 all-reduces in place; each backward writes into the buffer the last step's reduced
    grads were in (they are dead after zero_grad), so a rank holds one grad buffer, as DDP does."""
    r = run_distributed(_stage0_buffer_rank, 2, timeout=120)[0]
    assert len(r["ptrs"][0]) > 1 and all(p == r["ptrs"][0] for p in r["ptrs"]), r["ptrs"]
    assert all(abs(g - r["formula"]) <= 0.02 * r["formula"] for g in r["grads"]), (r["grads"], r["formula"])


def _accum_rank(rank, ws, steps):
    out = {}
    for stage in STAGES:
        for no_sync in (True, False):
            model = make_model()
            zerofuse.zero.parallelize(model, stage=stage, bucket_mb=0.25)
            opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD)
            losses, _ = _train(rank, ws, model, opt, steps, micro=3, clip=False, no_sync=no_sync)
            out[(stage, no_sync)] = dict(losses=losses, params=full_state(model))
    # bf16 params, fp32 reduction: accumulation happens in fp32 buffers
    model = make_model()
    zerofuse.zero.parallelize(model, stage=2, precision="bf16", reduce_dtype=torch.float32)
    per = GLOBAL_BATCH // ws
    part = batches(1)[0][rank * per:(rank + 1) * per]
    with model.no_sync():
        _, loss = model(part[:, :-1], part[:, 1:])
        loss.backward()
    out["fp32_accum"] = [u.gflat.dtype for u in model._zerofuse_zero.units]
    return out


def test_gradient_accumulation_matches_one_big_batch():
    steps, ws = 3, 2
    ref_losses, _, ref_params, alt_params = reference_pair(steps, ws * 3, clip=False)
    results = run_distributed(_accum_rank, ws, steps, timeout=240)
    for key, r in results[0].items():
        if key == "fp32_accum":
            assert r and all(d == torch.float32 for d in r)
            continue
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        assert_close_params(r["params"], ref_params, alt_params, str(key))


def _other_optimizers_rank(rank, ws, kind, stage, steps, hp):
    model = make_model()
    zerofuse.zero.parallelize(model, stage=stage, bucket_mb=0.25)
    if kind == "lamb":
        opt = zerofuse.zero.Optimizer(model, "lamb", lr=LR, weight_decay=WD, **hp)
    else:
        opt = zerofuse.zero.Optimizer(model, "lars", lr=0.1, momentum=0.9, weight_decay=1e-4)
    losses, _ = _train(rank, ws, model, opt, steps, clip=False)
    return losses, full_state(model)


@pytest.mark.parametrize("kind,stage,ws,hp", [("lamb", 0, 2, {}), ("lamb", 2, 2, {}), ("lamb", 3, 3, {}),
                                               ("lamb", 2, 2, dict(max_grad_norm=0)), ("lars", 1, 3, {}),
                                               ("lars", 3, 2, {})])
def test_lamb_and_lars_on_shards(kind, stage, ws, hp):
    """Per-param trust ratios need norms of params split across ranks: summed over the ranks.
    LAMB's max_grad_norm=0 is no clipping, as FusedLAMB's (it clipped at the default 1.0:
    zerofuse-train --optimizer lamb --clip 0, a review's reproduction, 2026-12-06)."""
    steps = 5
    ref_losses, _, ref_params, alt_params = reference_pair(steps, ws, kind=kind, **hp)
    losses, params = run_distributed(_other_optimizers_rank, ws, kind, stage, steps, hp, timeout=240)[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert_close_params(params, ref_params, alt_params)


# (optimizer, stage, precision, hyper-parameters): clipping (AdamW, LAMB's default), master weights
TRITON_CASES = [("adamw", 0, "fp32", dict(max_grad_norm=0.5)), ("adamw", 2, "bf16", {}), ("lamb", 1, "fp32", {}),
                ("lamb", 3, "bf16", {}), ("lars", 2, "fp32", dict(lr=0.1, momentum=0.9, weight_decay=1e-4))]


def _triton_optimizer_rank(rank, ws, steps):
    """Each case twice, the optimizer on the Triton kernels (in the interpreter) then on the C++
    ones (the model always on the native kernels); the Triton run counts the kernel tables built
    per step."""
    from zerofuse import kernels
    from zerofuse.kernels import optim as K

    built = []
    real = K._Table.__init__
    K._Table.__init__ = lambda self, *a, **k: (built.append(1), real(self, *a, **k))[1]
    per = GLOBAL_BATCH // ws
    out = {}
    for kind, stage, precision, hp in TRITON_CASES:
        runs = []
        for triton_step in (True, False):
            model = make_model(n_layer=1)  # the interpreter's cost is per program: a small model
            zerofuse.zero.parallelize(model, stage=stage, precision=precision, bucket_mb=0.25)
            opt = zerofuse.zero.Optimizer(model, kind, **hp)
            tables, masters = [], None
            for b in batches(steps):
                mine = b[rank * per:(rank + 1) * per]
                kernels.TRITON_ON_CPU = False
                _, loss = model(mine[:, :-1], mine[:, 1:])
                loss.backward()
                kernels.TRITON_ON_CPU = triton_step
                before = len(built)
                opt.step()
                opt.zero_grad(set_to_none=False)  # grad shards kept: their addresses, and the tables, stay
                tables.append(len(built) - before)
                if masters is None:
                    masters = [st["master"].clone() for st in opt.unit_states if "master" in st]
            kernels.TRITON_ON_CPU = False
            runs.append((full_state(model) if precision == "fp32" else masters, tables))
        out[(kind, stage, precision)] = runs
    return out


def test_zero_optimizer_on_the_triton_kernels_matches_cpp_and_keeps_its_tables(monkeypatch):
    """zerofuse.zero.Optimizer's Triton path (what runs on GPUs), in the interpreter on gloo ranks:
    the same params as the C++ kernels after 2 steps, and kernel tables built at the first step
    only (the views, tables and piece index are kept while the shards stay). bf16: each rank's fp32
    masters after the first step. (After that the runs part: the kernels differ in the last bits
    of fp32, which flip a few bf16 params, and Adam's normalised update magnifies the changed
    grads of elements with tiny grads: masters 1.6e-5 apart after 2 steps.)"""
    monkeypatch.setenv("ZEROFUSE_TRITON_ON_CPU", "1")  # the ranks define their kernels for the interpreter
    results = run_distributed(_triton_optimizer_rank, 2, 2, timeout=300)
    for rank_result in results:
        for case, ((got, tables), (want, cpp_tables)) in rank_result.items():
            pairs = got.items() if isinstance(got, dict) else enumerate(got)
            for name, g in pairs:
                torch.testing.assert_close(g, want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} {name}: {m}")
            assert tables[0] > 0 and tables[1:] == [0], (case, tables)
            assert cpp_tables == [0, 0], (case, cpp_tables)


def _no_decay_groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


def _groups_rank(rank, ws, steps):
    model = make_model()
    zerofuse.zero.parallelize(model, stage=2, bucket_mb=0.25)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD, param_groups=_no_decay_groups(model))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    per = GLOBAL_BATCH // ws
    lrs = []
    for b in batches(steps):
        mine = b[rank * per:(rank + 1) * per]
        _, loss = model(mine[:, :-1], mine[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs, full_state(model)


def test_param_groups_and_lr_scheduler():
    steps = 4

    def reference(micro):
        model = make_model()
        opt = torch.optim.AdamW(_no_decay_groups(model), lr=LR, weight_decay=WD)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        lrs = []
        for b in batches(steps):
            for part in b.chunk(micro):
                _, loss = model(part[:, :-1], part[:, 1:])
                (loss / micro).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
        return lrs, {n: p.detach().clone() for n, p in model.named_parameters()}

    lrs, ref_params = reference(1)
    got_lrs, params = run_distributed(_groups_rank, 2, steps, timeout=240)[0]
    assert got_lrs == lrs
    assert_close_params(params, ref_params, [reference(m)[1] for m in (2, 3, 4)])


def _fp16_rank(rank, ws, stage):
    model = make_model()
    zerofuse.zero.parallelize(model, stage=stage, precision="fp16")
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, initial_scale=1024.0)
    per = GLOBAL_BATCH // ws
    record = []
    for i, b in enumerate(batches(3)):
        mine = b[rank * per:(rank + 1) * per]
        _, loss = model(mine[:, :-1], mine[:, 1:])
        if i == 1 and rank == ws - 1:
            loss = loss * float("inf")  # one rank overflows
        before = full_state(model)
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
        after = full_state(model)
        changed = any(not torch.equal(before[n], after[n]) for n in before)
        record.append((changed, bool(opt.last_step_skipped.item()), opt.loss_scale,
                       float(opt._steps[0].item())))
    return record


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_overflow_skips_the_step_on_every_rank(stage):
    records = run_distributed(_fp16_rank, 2, stage, timeout=240)
    assert records[0] == records[1]
    (c0, s0, sc0, st0), (c1, s1, sc1, st1), (c2, s2, sc2, st2) = records[0]
    assert c0 and not s0 and sc0 == 1024.0 and st0 == 1.0
    assert not c1 and s1 and sc1 == 512.0 and st1 == 1.0  # skipped: nothing changed, the scale backed off
    assert c2 and not s2 and st2 == 2.0


class TiedBlocks(torch.nn.Module):
    """Two blocks sharing one weight: a param shared across stage-3 units."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.blocks[1].weight = self.blocks[0].weight

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def _tiny_models_rank(rank, ws, steps):
    out = {}
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(ws * 2, 8, generator=g) for _ in range(steps)]
    for stage in STAGES:
        for name, make in (("tied", TiedBlocks), ("one_linear", lambda: torch.nn.Linear(3, 2))):
            torch.manual_seed(0)
            model = make()
            zerofuse.zero.parallelize(model, stage=stage)
            opt = zerofuse.zero.Optimizer(model, "adamw", lr=0.01)
            for x in xs:
                x = x[rank * 2:(rank + 1) * 2, : 3 if name == "one_linear" else 8]
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            out[(stage, name)] = full_state(model)
    return out


def test_tied_params_and_ranks_without_params():
    """A weight shared by two stage-3 units lives in the root unit; a model smaller than the
    ranks leaves some ranks only padding: both train like a single process."""
    steps, ws = 3, 4
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(ws * 2, 8, generator=g) for _ in range(steps)]
    want = {}
    for name, make in (("tied", TiedBlocks), ("one_linear", lambda: torch.nn.Linear(3, 2))):
        torch.manual_seed(0)
        model = make()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        for x in xs:
            (model(x[:, : 3 if name == "one_linear" else 8]).square().mean()).backward()
            opt.step()
            opt.zero_grad()
        want[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    results = run_distributed(_tiny_models_rank, ws, steps, timeout=240)
    for (stage, name), params in results[0].items():
        for n, p in want[name].items():
            torch.testing.assert_close(params[n], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"stage {stage} {name} {n}: {m}")


def _stage3_rank(rank, ws):
    model, eng, opt, per = _zero_adamw(ws, stage=3, prefetch=2)
    out = {"units": [u.name for u in eng.units]}
    # blocks run under activation checkpointing: their forward (and its hooks) re-run inside backward
    model.activation_checkpointing = True
    for b in batches(3):
        mine = b[rank * per:(rank + 1) * per]
        _, loss = model(mine[:, :-1], mine[:, 1:])
        loss.backward()
        out.setdefault("gathered_after_backward", []).append([u.state for u in eng.units])
        opt.step()
        opt.zero_grad()
    mem = zerofuse.zero.memory_report(model, opt)
    out["param_bytes"] = mem["params"]
    out["shard_bytes"] = sum(u.shard.numel() * u.shard.element_size() for u in eng.units)
    with torch.no_grad():
        model(batches(1)[0][:2, :-1])
    out["after_eval"] = [u.state for u in eng.units]
    out["params"] = full_state(model)
    return out


def test_stage3_frees_params_and_supports_activation_checkpointing():
    results = run_distributed(_stage3_rank, 2, timeout=240)
    r = results[0]
    assert r["units"] == ["blocks.0", "blocks.1", "blocks.2", "<root>"]
    assert all(s == "free" for states in r["gathered_after_backward"] for s in states)
    assert r["after_eval"] == ["free"] * 4
    assert r["param_bytes"] == r["shard_bytes"]  # between steps a rank holds only its shards
    _, _, ref_params, alt_params = reference_pair(3, 2, clip=False)
    assert_close_params(r["params"], ref_params, alt_params)


def _free_while_gathering_rank(rank, ws):
    model, eng, _, _ = _zero_adamw(ws, stage=3)
    u = eng.units[0]
    u.start_param_sync(eng.comm)
    u.free()  # as the engine may, e.g. at the end of a backward, with a prefetch still running
    after_free = (u.state, u.gather_work is None, u.full.untyped_storage().nbytes())
    u.finish_param_sync(eng.comm)
    ref = dict(make_model().named_parameters())
    want = torch.cat([ref[n].detach().reshape(-1) for n in u.names])
    return after_free, torch.equal(u.full[:u.numel], want)


def test_stage3_free_waits_for_a_running_gather():
    """free() of a unit whose all-gather is in flight finishes the gather before dropping the
    storage (the collective would otherwise write into memory handed back to the allocator)."""
    for after_free, gathered_ok in run_distributed(_free_while_gathering_rank, 2, timeout=120):
        assert after_free == ("free", True, 0)
        assert gathered_ok


def _no_reshard_rank(rank, ws):
    model = make_model()
    zerofuse.zero.parallelize(model, stage=3, reshard_after_forward=False)
    eng = model._zerofuse_zero
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD)
    per = GLOBAL_BATCH // ws
    states = []
    for b in batches(2):
        mine = b[rank * per:(rank + 1) * per]
        _, loss = model(mine[:, :-1], mine[:, 1:])
        states.append([u.state for u in eng.units])  # after forward: everything still gathered
        loss.backward()
        states.append([u.state for u in eng.units])  # after backward: freed
        opt.step()
        opt.zero_grad()
    return states, full_state(model)


def test_stage3_without_resharding_after_forward():
    states, params = run_distributed(_no_reshard_rank, 2, timeout=240)[0]
    assert states[0] == ["gathered"] * 4 and states[1] == ["free"] * 4
    _, _, ref_params, alt_params = reference_pair(2, 2, clip=False)
    assert_close_params(params, ref_params, alt_params)


def _overlap_off_rank(rank, ws):
    model = make_model()
    zerofuse.zero.parallelize(model, stage=2, bucket_mb=0.25, overlap=False)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD)
    _train(rank, ws, model, opt, 2, clip=False)
    return list(model._zerofuse_zero.events), full_state(model)


def test_overlap_off_launches_at_the_end_and_matches():
    events, params = run_distributed(_overlap_off_rank, 2, timeout=240)[0]
    assert events and all(when == "end" for _, _, when in events)
    _, _, ref_params, alt_params = reference_pair(2, 2, clip=False)
    assert_close_params(params, ref_params, alt_params)


def _events_rank(rank, ws):
    model = make_model()
    zerofuse.zero.parallelize(model, stage=2, bucket_mb=0.25)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD)
    sizes = []
    for _ in range(3):
        _train(rank, ws, model, opt, 1, clip=False)
        sizes.append(len(model._zerofuse_zero.events))
    return sizes, len(model._zerofuse_zero.units)


def test_the_launch_record_is_the_last_backwards():
    """engine.events kept every step's launches: one entry per unit and step, host memory growing
    without bound (a review's reproduction, 2026-12-07: 18 -> 1818 entries over 100 steps)."""
    for sizes, units in run_distributed(_events_rank, 2, timeout=240):
        assert sizes == [units] * 3, (sizes, units)


def _errors_rank(rank, ws):
    msgs = {}

    def catch(key, fn):
        try:
            fn()
        except (ValueError, TypeError) as e:
            msgs[key] = str(e)

    catch("stage", lambda: zerofuse.zero.parallelize(make_model(), stage=4))
    catch("precision", lambda: zerofuse.zero.parallelize(make_model(), stage=1, precision="fp8"))
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    catch("no_params", lambda: zerofuse.zero.parallelize(frozen, stage=2))
    catch("plain", lambda: zerofuse.zero.Optimizer(make_model(), "adamw"))
    model = zerofuse.zero.parallelize(make_model(), stage=2)
    catch("twice", lambda: zerofuse.zero.parallelize(model, stage=2))
    catch("kind", lambda: zerofuse.zero.Optimizer(model, "sgd"))
    catch("hyper", lambda: zerofuse.zero.Optimizer(model, "adamw", momentum=0.9))
    opt = zerofuse.zero.Optimizer(model, "adamw")
    other = zerofuse.zero.parallelize(make_model(), stage=3)
    other_opt = zerofuse.zero.Optimizer(other, "adamw")
    catch("layout", lambda: other_opt.load_state_dict(opt.state_dict()))
    catch("groups", lambda: zerofuse.zero.Optimizer(model, "adamw", param_groups=[{"params": [torch.zeros(2)]}]))
    return msgs


def test_bad_input_errors():
    msgs = run_distributed(_errors_rank, 2, timeout=240)[0]
    assert "expected stage 0, 1, 2 or 3, got 4" in msgs["stage"]
    assert "precision" in msgs["precision"] and "'fp8'" in msgs["precision"]
    assert "no trainable parameters" in msgs["no_params"]
    assert "zerofuse.zero.parallelize" in msgs["plain"]
    assert "already parallelized" in msgs["twice"]
    assert "'sgd'" in msgs["kind"]
    assert "momentum" in msgs["hyper"]
    assert "stage=2" in msgs["layout"] and "stage=3" in msgs["layout"]
    assert "not a trainable parameter" in msgs["groups"]


def test_checker_catches_diverging_ranks_in_zero():
    """A rank skipping a step (different collective sequences) fails fast with the checker on."""
    os.environ["ZEROFUSE_CHECK_COLLECTIVES"] = "1"
    try:
        with pytest.raises(AssertionError, match="differs across ranks|did not reach"):
            run_distributed(_diverging_rank, 2, timeout=120)
    finally:
        del os.environ["ZEROFUSE_CHECK_COLLECTIVES"]


def _diverging_rank(rank, ws):
    model = make_model()
    zerofuse.zero.parallelize(model, stage=3)
    opt = zerofuse.zero.Optimizer(model, "adamw", max_grad_norm=1.0 if rank == 0 else None)
    b = batches(1)[0][:2]
    _, loss = model(b[:, :-1], b[:, 1:])
    loss.backward()
    opt.step()  # rank 0 all-reduces a grad norm first, rank 1 goes straight to the next forward's gather
    model(b[:, :-1], b[:, 1:])


def _cuda_rank(rank, ws, precision, steps):
    out = {}
    for stage in STAGES:
        model = make_model().cuda()
        zerofuse.zero.parallelize(model, stage=stage, precision=precision, bucket_mb=0.25)
        opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD)
        losses = []
        for b in batches(steps):
            b = b.cuda()
            _, loss = model(b[:, :-1], b[:, 1:])
            opt.scale_loss(loss).backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[stage] = dict(losses=losses, params={k: v.cpu() for k, v in full_state(model).items()})
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_world_of_one_matches_single_process(precision):
    """On one GPU: CUDA tensors go through zerofuse's NCCL transport (world of one) and the Triton
    optimizer kernels; every stage matches plain single-GPU training."""
    steps = 5
    model = make_model(precision).cuda()
    opt = (torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD) if precision == "fp32"
           else FusedAdamW(model.parameters(), lr=LR, weight_decay=WD, master_weights=True))
    ref = []
    for b in batches(steps):
        b = b.cuda()
        _, loss = model(b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    results = run_distributed(_cuda_rank, 1, precision, steps, timeout=300)[0]
    t = dict(rtol=1e-5, atol=1e-5) if precision == "fp32" else tol(torch.bfloat16)
    for stage in STAGES:
        torch.testing.assert_close(torch.tensor(results[stage]["losses"]), torch.tensor(ref), **t)
        for name, p in model.named_parameters():
            torch.testing.assert_close(results[stage]["params"][name], p.detach().float().cpu(), **t)
