"""Tied embeddings over two pipeline ranks ([Note: tied embeddings across stages]) beyond fp32
training: ZeRO's bf16 precision (the CUDA default of zerofuse-train), a frozen embedding, and
halves cast apart. Each failed before its fix (a review's reproductions, 2026-12-07): under bf16 the
mirror stayed an fp32 tensor the head no longer read (ZeRO's Module.to replaced the buffer), the
weight was received into it short and gloo aborted the process on the grad's byte count; a frozen
embedding got the mirror's grad and was changed by the optimizer."""
import pytest
import torch

from dist_utils import error_text, run_distributed
from test_pipeline import _batches, _cfg

pytestmark = pytest.mark.usefixtures("native_kernels")


def _bf16_rank(rank, ws, schedule):
    import zerofuse  # noqa: F401
    from zerofuse import zero
    from zerofuse.models import GPT
    from zerofuse.parallel import init_mesh
    from zerofuse.pipeline import Pipeline, split_gpt

    mesh = init_mesh(dp=1, tp=1, pp=2)
    with torch.device("meta"):
        model = GPT(_cfg(2, tied=True), seed=0)
    stages = split_gpt(model, 2, [rank], device="cpu")
    zero.parallelize(stages[0], stage=1, group=mesh.dp_group, pp_group=mesh.pp_group, precision="bf16",
                     param_init_fn=model.param_init_fn)
    opt = zero.Optimizer(stages[0], "adamw", lr=1e-2)
    pipe = Pipeline(stages, schedule=schedule, microbatches=2, group=mesh.pp_group)
    losses = []
    for idx, tgt in _batches(steps=3):
        losses.append(float(pipe.step(idx, tgt)))
        opt.step()
        opt.zero_grad()
    idx, tgt = _batches(steps=1)[0]
    val = float(pipe.forward_only(idx, tgt))  # receives the stepped weight into the mirror first
    head = stages[0].head.weight if rank == 1 else stages[0].wte.weight
    return losses, val, head.detach().clone(), head.dtype


def _reference_bf16(split):
    """The unsplit model under ZeRO bf16 in one process, the batch as ``split`` accumulated
    micro-batches: its losses and final weight."""
    from zerofuse import zero
    from zerofuse.models import GPT

    with torch.device("meta"):
        model = GPT(_cfg(2, tied=True), seed=0)
    zero.parallelize(model, stage=1, precision="bf16", param_init_fn=model.param_init_fn)
    opt = zero.Optimizer(model, "adamw", lr=1e-2)
    losses = []
    for idx, tgt in _batches(steps=3):
        total = 0.0
        for i, t in zip(idx.chunk(split), tgt.chunk(split)):
            loss = model(i, t)[1] / split
            loss.backward()
            total += float(loss)
        losses.append(total)
        opt.step()
        opt.zero_grad()
    return losses, model.wte.weight.detach().clone()


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_tied_embeddings_under_zero_bf16(schedule, world_of_one):
    from tolerances import assert_close_training

    out = run_distributed(_bf16_rank, 2, schedule, timeout=120)
    (losses0, _, weight, dtype0), (losses, val, mirror, dtype1) = out
    assert dtype0 == dtype1 == torch.bfloat16
    assert torch.equal(mirror, weight)  # the head reads the first stage's stepped weight, bit for bit
    assert losses == losses0
    _, ref = _reference_bf16(2)
    alts = [_reference_bf16(k)[1] for k in (1, 4)]
    assert_close_training(weight, ref, alts, msg=f"tied weight, pp 2 {schedule}, ZeRO-1 bf16")


def _frozen_rank(rank, ws, when):
    import zerofuse  # noqa: F401
    from zerofuse.models import GPT
    from zerofuse.pipeline import Pipeline, split_gpt

    model = GPT(_cfg(2, tied=True), seed=0)
    if when == "before split":
        model.wte.weight.requires_grad_(False)
    stages = split_gpt(model, 2, [rank], device="cpu")
    if when == "after split":  # every rank, as one process would: the last one's mirror follows at the build
        model.wte.weight.requires_grad_(False)
    pipe = Pipeline(stages, schedule="1f1b", microbatches=2)
    opt = torch.optim.AdamW(list(stages[0].parameters()), lr=1e-2, weight_decay=0.1)
    w0 = model.wte.weight.detach().clone()
    for idx, tgt in _batches(steps=2):
        pipe.step(idx, tgt)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if rank == 0:
        return model.wte.weight.grad is None, torch.equal(model.wte.weight.detach(), w0)
    return pipe._tied_mirror.requires_grad


@pytest.mark.parametrize("when", ["before split", "after split"])
def test_a_frozen_tied_embedding_stays_frozen(when):
    (no_grad, unchanged), mirror_requires_grad = run_distributed(_frozen_rank, 2, when, timeout=120)
    assert no_grad and unchanged and not mirror_requires_grad


def _cast_apart_rank(rank, ws):
    import zerofuse  # noqa: F401
    from zerofuse.models import GPT
    from zerofuse.pipeline import Pipeline, split_gpt

    stages = split_gpt(GPT(_cfg(2, tied=True), seed=0), 2, [rank], device="cpu")
    if rank == 0:
        stages[0].to(torch.bfloat16)
    return error_text(lambda: Pipeline(stages, schedule="1f1b", microbatches=2))


def test_halves_cast_apart_are_refused_on_both_ranks():
    for text in run_distributed(_cast_apart_rank, 2, timeout=120):
        assert text.startswith("ValueError: zerofuse.pipeline.Pipeline: the tied embedding's weight on the first "
                               "stage is torch.bfloat16 of shape [61, 32], its mirror on the last stage "
                               "torch.float32"), text
