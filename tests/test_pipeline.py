"""zerofuse.pipeline on real gloo ranks: every schedule at pp 2 and 4 (interleaved also with 2
virtual stages per rank) trains a GPT for 10 steps with the losses and final params of
single-process training on the same global batch; stage splitting; bad input."""
import dataclasses
import math

import pytest
import torch

from dist_utils import error_text, run_distributed

pytestmark = pytest.mark.usefixtures("native_kernels")  # the C++ CPU kernels, in this process and the ranks
STEPS = 10
BATCH, SEQ, MICRO = 8, 16, 4


def _cfg(n_layer=4, tied=False, bias=False):
    from zerofuse.models import GPTConfig

    return GPTConfig(vocab_size=61, seq_len=SEQ, n_layer=n_layer, n_head=2, dim=32, mlp_ratio=2.0, tie_embeddings=tied,
                     bias=bias)


def _batches(steps=STEPS, batch=BATCH):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 61, (batch, SEQ), generator=g), torch.randint(0, 61, (batch, SEQ), generator=g))
            for _ in range(steps)]


def _documents(idx, on: bool):
    """Packed documents of a batch: one starts at each token divisible by 7 (or None)."""
    return (idx % 7 == 0).cumsum(1) if on else None


def _reference(n_layer, steps=STEPS, batch=BATCH, split=1, tied=False, documents=False, bias=False):
    """Single-process training on the whole batch (split > 1: the same batch as that many
    accumulated micro-batches, the equally valid reordering assert_close_training allows for):
    losses and final params by name."""
    import zerofuse  # noqa: F401
    from zerofuse.models import GPT

    torch.manual_seed(0)
    model = GPT(_cfg(n_layer, tied, bias), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    losses = []
    for idx, tgt in _batches(steps, batch):
        total = 0.0
        for i, t in zip(idx.chunk(split), tgt.chunk(split)):
            _, loss = model(i, t, document_ids=_documents(i, documents))
            (loss / split).backward()
            total += loss.item() / split
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_matches_reference(out, n_layer, micro, tied=False, documents=False, bias=False):
    """Each rank's losses (rtol 1e-5) and params (the training-parity rule) against single-process
    training; every param of the model on exactly one rank."""
    from tolerances import assert_close_training

    ref_losses, ref_params = _reference(n_layer, tied=tied, documents=documents, bias=bias)
    # tied: the weight's grad is also summed in another order (its two uses' grads on two ranks),
    # so the reordering allowance takes the batch split several ways (tolerances.assert_close_training)
    splits = sorted({micro, 2, BATCH}) if tied else [micro]
    alts = [_reference(n_layer, split=k, tied=tied, documents=documents, bias=bias)[1] for k in splits]
    for rank, (losses, named, *_rest) in enumerate(out):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, p in named.items():
            assert_close_training(p, ref_params[name], [a[name] for a in alts], msg=f"rank {rank} {name}")
    names = [n for _, named, *_rest in out for n in named]
    assert sorted(names) == sorted(ref_params)


def _pp_rank(rank, ws, schedule, v, n_layer, microbatches, layout=None, recompute=False, tied=False,
             documents=False, bias=False):
    import zerofuse  # noqa: F401
    from zerofuse.models import GPT
    from zerofuse.pipeline import Pipeline, split_gpt

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(_cfg(n_layer, tied, bias), seed=0)
    model.activation_checkpointing = recompute  # the stages run the model's blocks: recomputed in backward
    stages = split_gpt(model, ws * v, [rank + k * ws for k in range(v)], layout=layout, device="cpu")
    pipe = Pipeline(stages, schedule=schedule, microbatches=microbatches)
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, eps=1e-6)
    losses, peaks, transfers, post = [], [], [], pipe.comm.batch_p2p

    def logged(ops):  # each transfer as posted: (send/recv, peer, tag, shape)
        transfers.extend((o.op, o.peer, o.tag, tuple(o.tensor.shape)) for o in ops)
        return post(ops)

    pipe.comm.batch_p2p = logged
    for idx, tgt in _batches():
        transfers.clear()
        losses.append(pipe.step(idx, tgt, document_ids=_documents(idx, documents)).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        peaks.append(dict(pipe.peak_live))
    named = {n: p.detach().clone() for s in stages for n, p in s.named_parameters()}
    return losses, named, peaks[-1], transfers


def assert_each_pair_in_order(out):
    """Every rank posts its sends to a peer in the order the peer posts their receives (the last
    step's; after the first, no headers): NCCL pairs a pair's transfers by order, not by tag."""
    for src, (*_, sent) in enumerate(out):
        for dst, (*_, got) in enumerate(out):
            sends = [(tag, shape) for op, peer, tag, shape in sent if op == "send" and peer == dst]
            recvs = [(tag, shape) for op, peer, tag, shape in got if op == "recv" and peer == src]
            assert sends == recvs, (src, dst, sends, recvs)


CASES = [("gpipe", 2, 1), ("1f1b", 2, 1), ("zb", 2, 1), ("interleaved", 2, 2),
         ("gpipe", 4, 1), ("1f1b", 4, 1), ("zb", 4, 1), ("interleaved", 4, 2)]


@pytest.mark.parametrize("schedule", ["zb", "1f1b"])
def test_biased_blocks_train_every_param_under_each_schedule(schedule):
    """GPT blocks with biases fold attn.proj's bias into norm2: zb's W pass asks each module's outputs
    for its own params, so that bias got no grad under zb and never trained (GPT-2 presets)."""
    out = run_distributed(_pp_rank, 2, schedule, 1, 4, MICRO, bias=True, timeout=300)
    assert_matches_reference(out, 4, MICRO, bias=True)


@pytest.mark.parametrize("schedule,pp,v", CASES)
def test_schedule_matches_single_process(schedule, pp, v):
    from zerofuse.pipeline import build_schedule, simulate

    n_layer = 8 if pp * v > 4 else 4
    micro = MICRO if pp * v <= 4 or schedule == "interleaved" else 8
    micro = max(micro, pp) if schedule != "interleaved" else pp * (micro // pp)
    out = run_distributed(_pp_rank, pp, schedule, v, n_layer, micro, timeout=300)
    assert_matches_reference(out, n_layer, micro)
    assert_each_pair_in_order(out)
    sim = simulate(build_schedule(schedule, pp, micro, v), pp)
    for rank, (_, _, peak, _) in enumerate(out):  # live micro-batch activations per stage, as simulated
        assert peak == {s: sim.peak_live[s] for s in peak}, (rank, peak, sim.peak_live)


@pytest.mark.parametrize("schedule,pp,v", [("1f1b", 2, 1), ("zb", 2, 1), ("interleaved", 2, 2), ("1f1b", 4, 1),
                                          ("interleaved", 4, 2)])
def test_tied_embeddings_across_stages_match_single_process(schedule, pp, v):
    """GPT-2's tied embedding and output layer on the first and last stage's ranks: the last stage
    reads a mirror of the weight, the first trains it on both uses' grads, as one process does.
    The weight goes out in the order its receiver takes it (interleaved at pp 2 sent it with the
    first micro-batch's activations, received after the last stage's: NCCL would have paired it
    with an activation's receive; a review's reproduction, 2026-11-28)."""
    n_layer = 8 if pp * v > 4 else 4
    out = run_distributed(_pp_rank, pp, schedule, v, n_layer, MICRO, None, False, True, timeout=300)
    assert_matches_reference(out, n_layer, MICRO, tied=True)
    assert_each_pair_in_order(out)


@pytest.mark.parametrize("schedule,pp,v,recompute", [("1f1b", 2, 1, True), ("zb", 2, 1, False),
                                                    ("interleaved", 2, 2, False)])
def test_packed_documents_through_the_stages_match_single_process(schedule, pp, v, recompute):
    """document_ids chunked with the batch into micro-batches reach every stage's attention (also
    recomputed in backward, and through the zero-bubble split backward): the losses and params of
    one process training GPT(idx, targets, document_ids=); and not those of training without them."""
    out = run_distributed(_pp_rank, pp, schedule, v, 4, MICRO, None, recompute, False, True, timeout=300)
    assert_matches_reference(out, 4, MICRO, documents=True)
    plain = _reference(4)[0]
    assert all(abs(a - b) > 1e-4 for a, b in zip(out[0][0][1:], plain[1:]))


def _zb_recompute_rank(rank, ws):
    from zerofuse.models import GPT
    from zerofuse.pipeline import Pipeline, split_gpt

    with torch.device("meta"):
        model = GPT(_cfg(4), seed=0)
    pipe = Pipeline(split_gpt(model, ws, [rank], device="cpu"), schedule="zb", microbatches=2)
    idx, tgt = _batches(1)[0]
    out = []
    for mode in ("full", "selective"):
        model.activation_checkpointing = mode
        out.append(error_text(lambda: pipe.step(idx, tgt)))
    model.activation_checkpointing = "none"
    out.append(pipe.step(idx, tgt).item())  # still usable
    return out


def test_zero_bubble_with_activation_checkpointing_is_refused_on_every_rank():
    """'zb' with full checkpointing recomputed each block once per module with params in its W
    pass (8 forwards of a block per micro-batch, 1f1b's 2); with selective it raised torch's
    "backward an extra time" at the first W. Refused at the step, on every rank, before anything runs."""
    for full, selective, loss in run_distributed(_zb_recompute_rank, 2, timeout=120):
        for got, mode in ((full, "full"), (selective, "selective")):
            assert got.startswith(f"ValueError: zerofuse.pipeline.Pipeline: schedule 'zb' with activation_checkpointing "
                                  f"'{mode}': its weight-grad pass is a second backward"), got
        assert math.isfinite(loss)


def _documents_refused_rank(rank, ws):
    import zerofuse  # noqa: F401
    from zerofuse.pipeline import Pipeline, split_modules

    layers = torch.nn.Sequential(torch.nn.Embedding(61, 8), torch.nn.Linear(8, 61))
    stages = split_modules(layers, ws, [rank], loss_fn=lambda out, t: torch.nn.functional.cross_entropy(
        out.flatten(0, 1), t.flatten()))
    pipe = Pipeline(stages, schedule="1f1b", microbatches=2)
    idx, tgt = _batches(1)[0]
    errors = []
    for docs in (_documents(idx, True), idx[:, :3], idx.float()):
        try:
            pipe.step(idx, tgt, document_ids=docs)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_document_ids_are_refused_where_they_cannot_apply():
    """Stages of split_modules (modules that take no documents) and ids not of the batch's shape or
    an integer dtype: a ValueError on every rank before anything runs (nothing hangs)."""
    for errors in run_distributed(_documents_refused_rank, 2, timeout=120):
        assert len(errors) == 3, errors
        assert "document_ids given, but stages [" in errors[0] and "take none" in errors[0]
        for e in errors[1:]:
            assert "expected document_ids as an integer tensor of the batch's shape [8, 16]" in e, e


def _dealloc_rank(rank, ws, steps, moe=False):
    import zerofuse  # noqa: F401
    from zerofuse.models import GPT
    from zerofuse.pipeline import Pipeline, split_gpt

    with torch.device("meta"):
        model = GPT(dataclasses.replace(_cfg(), moe_experts=4 if moe else 0), seed=0)
    (stage,) = split_gpt(model, ws, [rank], device="cpu")
    pipe = Pipeline([stage], schedule="1f1b", microbatches=MICRO)
    hooks, freed, saved_freed = [0], [], []
    real_hooks, communicate = torch.autograd.graph.saved_tensors_hooks, pipe._communicate

    def counted_hooks(*args):
        hooks[0] += 1
        return real_hooks(*args)

    def checked_communicate(actions):
        communicate(actions)
        for a in actions:
            if a.kind == "SEND_F":
                outs, keep = pipe._outputs[(a.stage, a.mb)]
                freed.append(sum(t.numel() == 0 for t in outs))
                saved_freed.append(sum(t.numel() == 0 for t, k in zip(outs, keep) if k))

    torch.autograd.graph.saved_tensors_hooks, pipe._communicate = counted_hooks, checked_communicate
    try:
        for idx, tgt in _batches(steps):
            pipe.step(idx, tgt)
    finally:
        torch.autograd.graph.saved_tensors_hooks = real_hooks
    return hooks[0], freed, saved_freed


@pytest.mark.parametrize("moe", [False, True])
def test_sent_outputs_are_freed_and_saved_ones_looked_up_once(moe):
    """The first stage frees each sent output autograd did not save (Megatron's
    deallocate_output_tensor) and keeps those it saved; which ones autograd saves is seen through
    saved_tensors_hooks in the stage's first forward only, not in every micro-batch's. An MoE
    block's output delta is a view of its layer's output: freed with it (kept before 2026-12-07)."""
    steps = 3
    (hooks0, freed, saved_freed), (hooks1, freed1, _) = run_distributed(_dealloc_rank, 2, steps, moe, timeout=120)
    assert hooks0 == 1 and hooks1 == 0, (hooks0, hooks1)
    assert len(freed) == steps * MICRO and min(freed) >= 1, freed  # the block output delta at least
    assert max(saved_freed) == 0, saved_freed
    assert freed1 == []  # the last stage sends no activations


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2)])
def test_activation_checkpointing_inside_stages(schedule, v):
    """(zb refuses checkpointing: test_zero_bubble_with_activation_checkpointing_is_refused_on_every_rank)"""
    out = run_distributed(_pp_rank, 2, schedule, v, 4, MICRO, None, True, timeout=300)
    assert_matches_reference(out, 4, MICRO)


def test_split_keeps_names_and_materializes_only_its_stage():
    import zerofuse  # noqa: F401
    from zerofuse.models import GPT
    from zerofuse.pipeline import split_gpt

    full = GPT(_cfg(8), seed=0)
    with torch.device("meta"):
        model = GPT(_cfg(8), seed=0)
    (stage,) = split_gpt(model, 4, [1], layout="E2,2,2,2L")
    assert stage.parts == ["blocks.2", "blocks.3"]
    ref = dict(full.named_parameters())
    for n, p in stage.named_parameters():
        assert not p.is_meta and torch.equal(p, ref[n]), n
    assert all(p.is_meta for p in model.blocks[0].parameters())  # other stages' params hold no memory
    (first,) = split_gpt(GPT(_cfg(8), seed=0), 4, [0], layout="E,3,3,2L")
    assert first.parts == ["wte", "wpe"]


def test_balanced_layout_by_parameters():
    from zerofuse.pipeline.stage import balanced_layout

    # embedding as large as 3 blocks: the first stage takes fewer blocks
    assert balanced_layout(8, 3, 10, 30, 5) == [(True, 1, False), (False, 4, False), (False, 3, True)]
    assert [n for _, n, _ in balanced_layout(12, 4, 10, 0, 0)] == [3, 3, 3, 3]


@pytest.mark.parametrize("layout,message", [
    ("E,4,4", "places 8 blocks; expected the model's n_layer (4)"),
    ("E,x,L", "expected each stage of layout"),
    ("2,E2", "the embedding (E) must be on the first stage"),
    ("2L,2", "the loss head (L) must be on the last stage"),
])
def test_bad_layouts_are_refused(layout, message):
    from zerofuse.models import GPT
    from zerofuse.pipeline import split_gpt

    with torch.device("meta"):
        model = GPT(_cfg(4), seed=0)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        split_gpt(model, len(layout.split(",")), [0], layout=layout)


def _zb_zero1_rank(rank, ws):
    import zerofuse
    from zerofuse.models import GPT
    from zerofuse.pipeline import Pipeline, split_gpt

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(_cfg(2), seed=0)
    (stage,) = split_gpt(model, 2, [rank], device="cpu")
    alone = [torch.distributed.new_group([r]) for r in range(ws)][rank]
    zerofuse.zero.parallelize(stage, stage=1, group=alone, pp_group=torch.distributed.group.WORLD)
    opt = zerofuse.zero.Optimizer(stage, "adamw", lr=1e-2)
    pipe = Pipeline([stage], schedule="zb", microbatches=2)
    losses = []
    for idx, tgt in _batches(2):
        losses.append(float(pipe.step(idx, tgt)))
        with_history = [u.name for u in stage._zerofuse_zero.units if u.gflat is not None and u.gflat.requires_grad]
        opt.step()
        opt.zero_grad()
    return losses, with_history


def test_zero_bubble_hands_zero_its_fused_heads_grads_without_history():
    """autograd.grad gives the fused loss head's saved grads back with their autograd history (a
    backward's AccumulateGrad detaches them): copied into ZeRO's flat buffer the history went with
    them, and ZeRO-1's in-place copy raised "a leaf Variable that requires grad" (timing-dependent)."""
    out = run_distributed(_zb_zero1_rank, 2, timeout=120)
    assert out[0][0] == out[1][0] and all(not h for _, h in out), out
