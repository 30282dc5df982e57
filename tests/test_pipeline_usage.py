"""zerofuse.pipeline under usage patterns a torch.distributed.pipelining / Megatron user tries, against
one process on the same micro-batches: torch's own layers under the zero-bubble split, a module
unfrozen or frozen after the Pipeline was built, an embedding tied to a fused head on one stage, a
stage returning a plain tensor, a loss that is not a scalar. Each test failed before its fix
(2026-12-06)."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed

pytestmark = pytest.mark.usefixtures("native_kernels")


def _mse(out, t):
    return ((out - t) ** 2).mean()


def _data(rows=4, width=16, seq=None):
    g = torch.Generator().manual_seed(1)
    shape = (rows, seq, width) if seq else (rows, width)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


def _reference_grads(model, x, t, m=2):
    for xi, ti in zip(x.chunk(m), t.chunk(m)):
        (_mse(model(xi), ti) / m).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _encoders():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
                                 for _ in range(2)])


def _grads_rank(rank, ws, schedule, build, change):
    from zerofuse.pipeline import Pipeline, split_modules

    stages = split_modules(build(), ws, [rank], loss_fn=_mse)
    if change == "unfreeze":  # frozen when the Pipeline is built, trained from the first step
        stages[0].requires_grad_(False)
    pipe = Pipeline(stages, schedule=schedule, microbatches=2)
    if change == "unfreeze":
        stages[0].requires_grad_(True)
    elif change == "freeze_first":
        stages[0].get_submodule(next(n for n, _ in stages[0].named_children())).requires_grad_(False)
    x, t = _data(seq=5) if build is _encoders else _data()
    pipe.step(x, t)
    return {n: p.grad.clone() for n, p in stages[0].named_parameters() if p.grad is not None}


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])


@pytest.mark.parametrize("build, change", [(_encoders, None), (_mlp, "unfreeze"), (_mlp, "freeze_first")])
def test_zero_bubble_gives_every_param_its_whole_grad(build, change):
    """'zb' asked each module's outputs for that module's own params: nn.MultiheadAttention applies
    out_proj with F.multi_head_attention_forward (out_proj's forward never runs): its weight and
    bias got no grad; a module unfrozen after the Pipeline was built never trained; one frozen after
    it failed in an internal assert. Now zb gives every param what 1f1b and one process give."""
    model = build()
    if change == "freeze_first":
        for i in (0, 2):  # the first module of each stage
            model[i].requires_grad_(False)
    x, t = _data(seq=5) if build is _encoders else _data()
    want = _reference_grads(model, x, t)
    for schedule in ("1f1b", "zb"):
        got = {}
        for part in run_distributed(_grads_rank, 2, schedule, build, change, timeout=120):
            got.update(part)
        assert sorted(got) == sorted(want), (schedule, sorted(set(want) - set(got)), sorted(set(got) - set(want)))
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=f"{schedule} {n}")


def _tied_rank(rank, ws, schedule):
    from zerofuse.models import GPT, GPTConfig
    from zerofuse.pipeline import Pipeline, split_gpt

    cfg = GPTConfig(vocab_size=61, seq_len=16, n_layer=2, n_head=2, dim=32, mlp_ratio=2.0, tie_embeddings=True)
    stages = split_gpt(GPT(cfg, seed=0), 1, [0])
    g = torch.Generator().manual_seed(7)
    Pipeline(stages, schedule=schedule, microbatches=2).step(torch.randint(0, 61, (4, 16), generator=g),
                                                            torch.randint(0, 61, (4, 16), generator=g))
    return stages[0].get_parameter("wte.weight").grad.clone()


def test_zero_bubble_counts_a_tied_embedding_once():
    """One stage holding the embedding and the fused head tied to it: I gave the weight its whole
    grad (the head's and, through the graph, the embedding's), and W added the embedding's again."""
    (ref,) = run_distributed(_tied_rank, 1, "1f1b", timeout=120)
    (got,) = run_distributed(_tied_rank, 1, "zb", timeout=120)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


class _Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.s = torch.nn.Linear(16, 16), torch.nn.Parameter(torch.full((16,), 0.5))

    def forward(self, x):
        y = self.lin(x)
        return y, y * self.s


class _Join(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, y, z):
        return self.lin(y + z)


def _outputs_model(case):
    torch.manual_seed(0)
    if case == "unfreeze_between_steps":
        return torch.nn.Sequential(_Scale(), _Join())
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))


def _outputs_rank(rank, ws, case):
    from zerofuse.pipeline import Pipeline, Stage, split_modules

    model = _outputs_model(case)
    if case == "rows":  # a Stage of one's own whose run returns one tensor
        run = (lambda x, targets=None: model[0](x)) if rank == 0 else (lambda h, targets=None: _mse(model[1](h), targets))
        stages = [Stage([(str(rank), model[rank])], run, rank, 2)]
    else:
        stages = split_modules(model, ws, [rank], loss_fn=_mse)
    pipe = Pipeline(stages, schedule="1f1b", microbatches=2)
    x, t = _data()
    if case == "unfreeze_between_steps":  # frozen in the first step: the product saved no output
        model[0].s.requires_grad_(False)
        pipe.step(x, t)
        model[0].s.requires_grad_(True)
        model.zero_grad()
    return float(pipe.step(x, t)), {n: p.grad.clone()
                                    for n, p in stages[0].named_parameters()}


@pytest.mark.parametrize("case", ["rows", "unfreeze_between_steps"])
def test_stage_outputs_cross_whole(case):
    """A stage returning one tensor (not a tuple) was iterated: sent as its rows (a (2, 16) output as
    two (16,) tensors: a wrong loss, silently). A param unfrozen between steps made autograd save an
    output the first step's forward had not saved: it was freed after its send (a size error)."""
    model = _outputs_model(case)
    x, t = _data()
    run = (lambda xi: model[1](*model[0](xi))) if case == "unfreeze_between_steps" else model
    losses = []
    for xi, ti in zip(x.chunk(2), t.chunk(2)):
        loss = _mse(run(xi), ti)
        (loss / 2).backward()
        losses.append(loss.item())
    want = {n: p.grad for n, p in model.named_parameters()}
    got, reported = {}, []
    for loss, grads in run_distributed(_outputs_rank, 2, case, timeout=120):
        reported.append(loss)
        got.update(grads)
    assert reported == pytest.approx([sum(losses) / 2] * 2, rel=1e-6)
    assert sorted(got) == sorted(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)


def _bad_loss_rank(rank, ws, case):
    from dist_utils import error_text
    from zerofuse.pipeline import Pipeline, split_modules

    loss_fn = {"elementwise": lambda o, t: (o - t) ** 2, "with_metrics": lambda o, t: (_mse(o, t), {"n": 1})}[case]
    pipe = Pipeline(split_modules(_mlp(), 1, [0], loss_fn=loss_fn), schedule="1f1b", microbatches=2)
    x, t = _data()
    return error_text(lambda: pipe.step(x, t)), error_text(lambda: pipe.step(list(x), t)), \
        error_text(lambda: pipe.step(x[:0], t[:0]))


@pytest.mark.parametrize("case", ["elementwise", "with_metrics"])
def test_a_loss_that_is_no_scalar_is_refused(case):
    """An unreduced loss trained on its sum while its mean was reported (grads 16x, no error); a loss
    returned with metrics failed on 'tuple has no attribute detach'; a list batch on '.shape'."""
    (bad_loss, listed, empty), = run_distributed(_bad_loss_rank, 1, case, timeout=120)
    what = "a tensor of shape [2, 16]" if case == "elementwise" else "tuple"
    assert bad_loss.startswith(f"ValueError: zerofuse.pipeline.Pipeline: the last stage (0) returned {what}; expected "
                               "the micro-batch's loss as a floating scalar tensor"), bad_loss
    assert listed == "ValueError: zerofuse.pipeline.Pipeline.step: expected idx as a tensor (the whole batch, every " \
                     "rank passes it), got list", listed
    assert "expected the batch size (0) to be a positive multiple of the number of micro-batches (2)" in empty, empty


def _shared_twice():
    torch.manual_seed(0)
    shared = torch.nn.Linear(16, 16)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), shared, torch.nn.Tanh(), shared)


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_a_module_used_twice_in_a_sequential_runs_twice(schedule):
    """named_children() skips a module's second use: the pipeline trained a model without it, its loss
    and every grad wrong, silently (a review's reproduction, 2026-12-07)."""
    x, t = _data()
    want = _reference_grads(_shared_twice(), x, t)
    (got,) = run_distributed(_grads_rank, 1, schedule, _shared_twice, None, timeout=120)
    assert sorted(got) == sorted(want)
    for n, g in want.items():
        torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_a_module_on_two_stages_and_bad_stage_ids_are_refused():
    """A param (or buffer) on two stages was two copies on two ranks, each trained on its stage's
    part of the grad; a stage id past the stages raised IndexError, -1 gave a stage numbered -1. A
    module of neither, an activation, may be on two."""
    from zerofuse.pipeline import split_modules

    with pytest.raises(ValueError, match=r"'4.weight' is also '2.weight', on stage 0: expected each param and buffer "
                                         r"on one stage .* got it on stages 0 and 1"):
        split_modules(_shared_twice(), 2, [0], layout=[3, 2])
    act = torch.nn.GELU()  # a module of no param or buffer may run on two stages
    free = torch.nn.Sequential(torch.nn.Linear(16, 16), act, torch.nn.Linear(16, 16), act)
    assert [s.parts for s in split_modules(free, 2, [1], layout=[2, 2])] == [["2", "3"]]
    for ids, n in (([2], 2), ([-1], 2), ([0, 0], 2), ([0], 0)):
        with pytest.raises(ValueError, match=r"expected (stage_ids to be distinct ints in \[0, 2\) \(num_stages 2\), "
                                             r"got \[|the number of stages to be an int >= 1, got 0)"):
            split_modules(_mlp(), n, ids)
    assert [s.parts for s in split_modules(_shared_twice(), 2, [1], layout=[1, 4])] == [["1", "2", "3", "4"]]


def _raise_once_rank(rank, ws):
    import time

    from zerofuse.comm import Communicator
    from zerofuse.pipeline import Pipeline, split_modules

    calls = [0]

    def loss(out, t):
        calls[0] += 1
        if calls[0] == 3:  # the second step's first micro-batch, on the last stage only
            raise ValueError("bad targets in this micro-batch")
        return _mse(out, t)

    stages = split_modules(_mlp(), ws, [rank], loss_fn=loss)
    pipe = Pipeline(stages, schedule="1f1b", microbatches=2, comm=Communicator(None, timeout=4))
    x, t = _data()
    log = []
    for _ in range(3):  # a job that logs a failed step and goes on
        t0 = time.monotonic()
        try:
            pipe.step(x, t)
            log.append(("ok", time.monotonic() - t0))
        except Exception as e:
            log.append((f"{type(e).__name__}: {e}", time.monotonic() - t0))
    return log


def test_a_step_that_raised_on_one_rank_is_not_run_again_there():
    """The other ranks are left inside the step (they fail at the communicator's timeout): the next
    step on the rank that raised paired its transfers with theirs, waiting for the timeout too, or
    mixing micro-batches. It is refused at once, naming the first error."""
    first, last = run_distributed(_raise_once_rank, 2, timeout=120)
    assert last[0][0] == "ok" and last[1][0] == "ValueError: bad targets in this micro-batch", last
    assert last[2][0].startswith("RuntimeError: zerofuse.pipeline.Pipeline.step: an earlier step raised on this rank "
                                 "midway (ValueError: bad targets in this micro-batch)") and last[2][1] < 1.0, last
    assert first[0][0] == "ok" and first[1][0].startswith("DistBackendError") and first[1][1] < 30, first


def _inplace_rank(rank, ws):
    from dist_utils import error_text
    from zerofuse.pipeline import Pipeline, split_modules

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(inplace=True), torch.nn.Linear(16, 16))
    pipe = Pipeline(split_modules(model, ws, [rank], loss_fn=_mse, layout=[1, 2]), schedule="1f1b", microbatches=2)
    return error_text(lambda: pipe.step(*_data()))


def test_an_in_place_op_on_a_received_input_names_the_stage():
    """torch's bare 'a leaf Variable that requires grad is being used in an in-place operation'
    named neither the stage nor its input."""
    _, second = run_distributed(_inplace_rank, 2, timeout=120)
    assert second.startswith("RuntimeError: zerofuse.pipeline.Pipeline: stage 1 wrote a leaf in place, one of its "
                             "inputs or a param (a leaf Variable that requires grad"), second
    assert "expected no in-place op on a stage's inputs" in second, second


def _zero_layout_rank(rank, ws, case):
    from dist_utils import error_text
    from zerofuse import zero
    from zerofuse.models import GPT, GPTConfig
    from zerofuse.pipeline import Pipeline, merge_stages, split_gpt

    model = GPT(GPTConfig(vocab_size=61, seq_len=16, n_layer=4, n_head=2, dim=32), seed=0)
    stages = split_gpt(model, 2 * ws, [rank, rank + ws], device="cpu")
    alone = [torch.distributed.new_group([r]) for r in range(ws)][rank]  # dp 1
    world = torch.distributed.group.WORLD
    if case == "zero3_merged":
        held = merge_stages(stages)
        zero.parallelize(held, stage=3, group=alone, pp_group=world)
        return error_text(lambda: Pipeline(stages, schedule="interleaved", microbatches=2, zero_module=held))
    for s in stages:
        zero.parallelize(s, stage=1, group=alone, pp_group=world)
    return error_text(lambda: Pipeline(stages, schedule="interleaved", microbatches=2))


def test_virtual_stages_made_data_parallel_in_ways_that_train_wrong_are_refused():
    """Interleaved, two stages per rank: merged and made ZeRO-3, the embeddings and head (the merged
    module's root unit, gathered by its forward, which never runs) were read unfilled: NaN losses
    from the first step. Each stage made data-parallel on its own: each optimizer clipped by its
    stages' part of the grad norm (0.87 and 0.86 where the norm was 1.22). Both silently (a
    review's reproductions, 2026-12-07)."""
    for case, want in (("zero3_merged", "zero_module is never run itself"),
                       ("separate", "2 stages on this rank each made data-parallel on its own")):
        for got in run_distributed(_zero_layout_rank, 2, case, timeout=120):
            assert got.startswith(f"ValueError: zerofuse.pipeline.Pipeline: {want}"), (case, got)


def _eval_raises_rank(rank, ws):
    import time

    from dist_utils import error_text
    from zerofuse.comm import Communicator
    from zerofuse.pipeline import Pipeline, split_modules

    def loss(o, t):
        if not torch.is_grad_enabled():
            raise ValueError("bad eval batch")
        return _mse(o, t)

    pipe = Pipeline(split_modules(_mlp(), ws, [rank], loss_fn=loss), schedule="1f1b", microbatches=2,
                    comm=Communicator(None, timeout=3))
    x, t = _data()
    bad = [error_text(lambda: pipe.forward_only(None, t)), error_text(lambda: pipe.forward_only(x.tolist(), t))]
    t0 = time.monotonic()
    out = error_text(lambda: pipe.forward_only(x, t))
    seconds = time.monotonic() - t0
    if rank == ws - 1:
        time.sleep(12)  # (the last stage's process goes on: its peers must not wait for it)
    return bad, out, seconds


def test_an_evaluation_that_raised_on_the_last_stage_fails_its_peers_at_the_timeout():
    """The loss reached the other ranks by a plain broadcast: with the last stage raising in
    forward_only they waited for the process group's timeout (or as long as that rank lived), then
    failed with a bare gloo error; forward_only(None or a list) failed with an AttributeError (a
    review's reproductions, 2026-12-07)."""
    first, last = run_distributed(_eval_raises_rank, 2, timeout=120)
    for rank in (first, last):
        assert rank[0] == ["ValueError: zerofuse.pipeline.Pipeline.forward_only: expected idx as a tensor (the whole "
                           "batch, every rank passes it), got NoneType",
                           "ValueError: zerofuse.pipeline.Pipeline.forward_only: expected idx as a tensor (the whole "
                           "batch, every rank passes it), got list"], rank
    assert last[1] == "ValueError: bad eval batch", last
    assert "zerofuse.comm: all_reduce_coalesced" in first[1] and first[2] < 10, first


def _apart_rank(rank, ws, case):
    import time

    from dist_utils import error_text
    from zerofuse.comm import Communicator
    from zerofuse.pipeline import Pipeline, split_modules

    stages = split_modules(_mlp(), ws, [rank], loss_fn=_mse)
    comm = Communicator(None, timeout=20)
    if case == "eval_vs_step":
        pipe = Pipeline(stages, schedule="1f1b", microbatches=2, comm=comm)
        x, t = _data()
        t0 = time.monotonic()
        err = error_text(lambda: pipe.step(x, t) if rank == 0 else pipe.forward_only(x, t))
        return err, time.monotonic() - t0
    if case == "interleaved_m":  # rank 1's 3 refused by its own schedule check: rank 0 waited in the gather
        stages = split_modules(_mlp(), 2 * ws, [rank, rank + ws], loss_fn=_mse)
    schedule, micro = {"microbatches": ("1f1b", 4 - 2 * rank), "schedule": (("1f1b", "gpipe")[rank], 2),
                       "interleaved_m": ("interleaved", 4 - rank), "microbatches 0": ("1f1b", 2 - 2 * rank),
                       "unknown schedule": (("1f1b", "1F1B")[rank], 2)}[case]
    t0 = time.monotonic()
    err = error_text(lambda: Pipeline(stages, schedule=schedule, microbatches=micro, comm=comm))
    return err, time.monotonic() - t0


@pytest.mark.parametrize("case", ["microbatches", "schedule", "eval_vs_step", "interleaved_m", "microbatches 0",
                                  "unknown schedule"])
def test_ranks_built_or_called_apart_fail_by_name_or_at_the_timeout(case):
    """Ranks given other microbatches or schedules waited out the communicator's timeout on a receive
    that never came; one rank in step and its peer in forward_only had gloo abort a process (a tag of
    another size; a review's reproductions, 2026-12-07). Now: refused at construction on every rank,
    naming each rank's settings; a step against an evaluation fails at the timeout, as a hang does."""
    outs = run_distributed(_apart_rank, 2, case, timeout=150)
    for err, seconds in outs:
        if case == "eval_vs_step":
            assert err and seconds < 60, outs
            continue
        assert "expected the same schedule, microbatches and split on every pipeline rank" in err, outs
        want = {"microbatches": "rank 0: schedule '1f1b', microbatches 4",
                "schedule": "rank 1: schedule 'gpipe', microbatches 2",
                "interleaved_m": "rank 1: schedule 'interleaved', microbatches 3",
                "microbatches 0": "rank 1: schedule '1f1b', microbatches 0",
                "unknown schedule": "rank 1: schedule unknown, microbatches 2"}[case]
        assert want in err and seconds < 10, outs


def test_stages_and_microbatches_of_the_wrong_kind_are_named(world_of_one):
    """A module or None as a stage failed with a bare AttributeError; microbatches=0 was named 'm' (a
    review's reproductions, 2026-12-07)."""
    from zerofuse.pipeline import Pipeline, split_modules

    for bad, msg in (([None], r"expected stages to be zerofuse.pipeline.Stage \(from split_gpt or split_modules\), "
                               r"got \['NoneType'\]"),
                     ([torch.nn.Linear(2, 2)], r"got \['Linear'\]")):
        with pytest.raises(ValueError, match=msg):
            Pipeline(bad, microbatches=2)
    stages = split_modules(_mlp(), 1, [0], loss_fn=_mse)
    for m in (0, 2.0, True):
        with pytest.raises(ValueError, match=rf"expected microbatches to be an int >= 1, got {m!r}"):
            Pipeline(stages, microbatches=m)


def test_a_compiled_stage_is_a_stage(world_of_one):
    """torch.compile(stage) (an OptimizedModule passing attribute access to its Stage) was refused by
    the stage type check (a review of the check, 2026-12-07); it runs as the stage."""
    from zerofuse.pipeline import Pipeline, split_modules

    stages = split_modules(_mlp(), 1, [0], loss_fn=_mse)
    x, t = _data()
    want = Pipeline(stages, microbatches=2).step(x, t)
    compiled = Pipeline([torch.compile(stages[0], backend="eager")], microbatches=2)
    assert torch.equal(compiled.step(x, t), want)
