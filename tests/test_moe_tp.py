"""MoE GPT with tensor parallelism on real gloo ranks against one process training the same global
batch: tp 2 with and without sequence parallelism (the MoE layers whole on every TP rank; with
sequence parallelism each routes its shard of the sequence and the routers balance over the whole
sequence), and dp 2 x tp 2 x ep 2; ZeRO stages 0-3, aux loss (local at dp 1, global over the batch at
dp 2), z-loss and aux-loss-free balancing on, AdamW with clipping: losses and grad norms at rtol
1e-5, params by the training-parity rule, every rank's slice. Checkpoints saved at dp2 x tp2 x ep2
load at other layouts."""
from __future__ import annotations

import pytest
import torch

import zerofuse
from zerofuse import tp
from zerofuse.models import GPT, GPTConfig
from zerofuse.moe import expert_spec

import test_moe_train as moe_train
from dist_utils import run_distributed
from test_moe_train import LR, WD
from tolerances import assert_close_training

pytestmark = pytest.mark.usefixtures("native_kernels")

CFG = dict(vocab_size=65, seq_len=16, n_layer=2, n_head=4, dim=32, mlp="swiglu", mlp_hidden=48, moe_experts=4,
           moe_top_k=2, moe_aux_loss=1e-2, moe_z_loss=1e-3, moe_bias_rate=1e-3)
GLOBAL = dict(moe_aux_scope="global")  # dp > 1: the aux loss's loads over the batch, as one process's
STEPS = 6


def reference_run(over, micro=1):
    """One process: losses (CE + aux + z over the global batch), grad norms (before clipping, every
    odd step), params (test_moe_train's, with the aux loss on)."""
    return moe_train.reference_run(micro, over, cfg=CFG, steps=STEPS)


def _build(mesh, stage, sp, over):
    model = GPT(GPTConfig(**CFG | over), seed=0, tp_group=mesh.tp_group, sequence_parallel=sp,
                ep_group=mesh.ep_group, edp_group=mesh.edp_group, dp_group=mesh.dp_group)
    zerofuse.zero.parallelize(model, stage=stage, group=mesh.dp_group, bucket_mb=0.01)
    return model, zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD)


def _train(mesh, model, opt, steps=STEPS, start=0):
    return moe_train._train(mesh.dp_rank, mesh.dp, model, opt, steps, group=mesh.dp_group, start=start)


def _slices(model) -> dict:
    """This rank's params (gathered over ZeRO) with how each slices the full one."""
    with zerofuse.zero.full_params(model):
        return {n: (p.detach().clone(), tp.spec_of(p) or expert_spec(p)) for n, p in model.named_parameters()}


def _parity_rank(rank, ws, tp_size, ep, sp, stages, over):
    from zerofuse.parallel import init_mesh

    mesh = init_mesh(dp=ws // tp_size, tp=tp_size, ep=ep)
    out = {}
    for stage in stages:
        model, opt = _build(mesh, stage, sp, over)
        losses, norms = _train(mesh, model, opt)
        biases = [m.router.expert_bias.clone() for m in model.moe_layers]
        out[stage] = dict(losses=losses, norms=norms, params=_slices(model), biases=biases)
    return out


CASES = [(2, 2, 1, True, (1, 3), {}), (2, 2, 1, False, (2,), {}),
         (4, 2, 2, True, (0, 2, 3), GLOBAL), (4, 2, 2, False, (2,), GLOBAL)]


@pytest.mark.parametrize("ws,tp_size,ep,sp,stages,over", CASES,
                         ids=["tp2-sp", "tp2", "dp2-tp2-ep2-sp", "dp2-tp2-ep2"])
def test_moe_with_tensor_parallelism_matches_one_process(ws, tp_size, ep, sp, stages, over):
    ref_losses, ref_norms, ref = reference_run(over)
    alt = reference_run(over, micro=ws // tp_size)[2]
    results = run_distributed(_parity_rank, ws, tp_size, ep, sp, stages, over, timeout=300)
    for stage in stages:
        for r, res in enumerate(results):
            got = res[stage]
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {r} stage {stage} losses: {m}")
            torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {r} stage {stage} grad norms: {m}")
            for name, (p, spec) in got["params"].items():
                want, other = (ref[name], alt[name]) if spec is None else (spec.slice(ref[name]), spec.slice(alt[name]))
                assert_close_training(p, want, other, msg=f"rank {r} stage {stage} {name}")
            # the balancing bias moved with the whole sequence's loads: the same on every rank
            for b, b0 in zip(got["biases"], results[0][stage]["biases"]):
                assert torch.equal(b, b0), (r, stage)
        assert any(b.abs().sum() > 0 for b in results[0][stage]["biases"])


def _ckpt_rank(rank, ws, tp_size, ep, sp, path, save):
    from zerofuse import checkpoint
    from zerofuse.parallel import init_mesh

    mesh = init_mesh(dp=ws // tp_size, tp=tp_size, ep=ep)
    model, opt = _build(mesh, 2, sp, GLOBAL)
    if save:
        _train(mesh, model, opt, steps=3)
        checkpoint.save(path, model, opt, extra={"step": 3})
    else:
        assert checkpoint.load(path, model, opt)["step"] == 3
    state = _slices(model)
    losses, _ = _train(mesh, model, opt, steps=2, start=3)  # the saving run goes on as the loading one
    return state, losses


@pytest.mark.parametrize("load_at", [(2, 1, 2, False), (2, 2, 1, True), (1, 1, 1, False)],
                         ids=["dp2-ep2", "tp2-sp", "one"])
def test_checkpoint_of_moe_with_tp_loads_at_other_layouts(tmp_path, load_at):
    """Saved at dp2 x tp2 x ep2 (sequence parallel), loaded elsewhere: every rank's params are its
    slices of the consolidated ones, and the next steps' losses those of the saving run going on."""
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_ckpt_rank, 4, 2, 2, True, path, True, timeout=240)
    loaded = run_distributed(_ckpt_rank, *load_at, path, False, timeout=240)
    full = zerofuse.checkpoint.consolidate(path)["model"]
    for state, _ in saved + loaded:
        for name, (p, spec) in state.items():
            assert torch.equal(p, spec.slice(full[name]) if spec is not None else full[name]), name
    torch.testing.assert_close(torch.tensor(loaded[0][1]), torch.tensor(saved[0][1]), rtol=1e-5, atol=1e-6)


JOB = ["--layers", "4", "--steps", "4", "--sample-tokens", "0", "--experts", 4, "--top-k", 2, "--moe-every", 2,
       "--bias-rate", 1e-3, "--aux-loss", 1e-2, "--z-loss", 1e-3]


@pytest.mark.parametrize("split,unsplit", [
    (("--nproc", 4, "--tp", 2, "--sequence-parallel", "--ep", 2), ("--nproc", 2, "--ep", 2)),
    (("--nproc", 4, "--tp", 2, "--ep", 2, "--capacity", 1.0), ("--nproc", 2, "--ep", 2, "--capacity", 1.0)),
    (("--nproc", 4, "--pp", 2, "--tp", 2, "--sequence-parallel", "--microbatches", 4), ("--nproc", 1, "--grad-accum", 4)),
], ids=["tp2-sp-ep2", "tp2-ep2-capacity", "pp2-tp2-sp"])
def test_moe_job_with_tp_logs_the_unsplit_jobs_losses_and_router_figures(tmp_path, split, unsplit):
    """zerofuse-train --tp with MoE (refused before 2026-12-07): the losses and the routers' figures
    (aux and z losses, loads, drops) of the job without tp, read over the TP ranks (sequence
    parallel: each routed its shard; without: the same tokens, counted once; under --pp each stage's
    router losses are the sequence's on every TP rank). The all-to-all bytes are at most the summary's
    dropless count (without sequence parallelism every TP rank sends its copy: the count was tp x short)."""
    import json

    from train_common import _ok, metrics, run

    _ok(run(*unsplit, *JOB, "--out", tmp_path / "unsplit"))
    _ok(run(*split, *JOB, "--out", tmp_path / "split"))
    want, got = metrics(tmp_path / "unsplit"), metrics(tmp_path / "split")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
        for key in ("aux_loss", "z_loss"):
            assert a["moe"][key] == pytest.approx(b["moe"][key], rel=1e-4) and a["moe"][key] > 0, (key, a, b)
        assert a["moe"]["max_over_mean_load"] == pytest.approx(b["moe"]["max_over_mean_load"], rel=1e-6)
        assert a["moe"]["dropped"] == b["moe"]["dropped"], (a, b)
    if "--capacity" in split:
        assert any(r["moe"]["dropped"] > 0 for r in got)
    moe = json.loads((tmp_path / "split" / "summary.json").read_text())["moe"]
    if "--ep" in split:
        assert 0 < moe["a2a_bytes_per_step"] <= moe["a2a_bytes_per_step_analytic"], moe
