"""zerofuse.zero under usage patterns a DeepSpeed/FSDP user tries, against torch on the same
data (the global batch over the ranks): clips composed, a backward that raised and was caught,
params read outside their module's forward, ranks taking different branches, grads a step would
not use. Each test failed before its fix (2026-12-06)."""
from __future__ import annotations

import copy

import pytest
import torch

import zerofuse

from dist_utils import run_distributed

pytestmark = pytest.mark.usefixtures("native_kernels")


def _clip_rank(rank, ws, case):
    """Two clips in one step, or a clip plus the Optimizer's max_grad_norm, against torch's clipping of
    the same grads (the global batch over the ranks)."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3))
    model = zerofuse.zero.parallelize(copy.deepcopy(ref), stage=2, bucket_mb=1e-4)
    max_grad_norm, clips = {"log_then_max": (0.05, [float("inf")]), "tight_then_loose": (None, [0.05, 1.0]),
                            "loose_then_tight": (None, [1.0, 0.05])}[case]
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=3e-2, max_grad_norm=max_grad_norm)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-2)
    g = torch.Generator().manual_seed(1)
    got, want = [], []
    for _ in range(3):
        x, y = torch.randn(6 * ws, 9, generator=g) * 4, torch.randn(6 * ws, 3, generator=g)
        torch.nn.functional.mse_loss(model(x[rank * 6:(rank + 1) * 6]), y[rank * 6:(rank + 1) * 6]).backward()
        got.append([float(opt.clip_grad_norm_(c)) for c in clips])
        opt.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        want.append([float(torch.nn.utils.clip_grad_norm_(ref.parameters(), c)) for c in clips])
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
        ref_opt.step()
        ref_opt.zero_grad()
    with zerofuse.zero.full_params(model):
        err = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return got, want, err


@pytest.mark.parametrize("case", ["log_then_max", "tight_then_loose", "loose_then_tight"])
def test_clips_compose_as_torchs_do(case):
    """A clip_grad_norm_(inf) to log the norm switched the Optimizer's max_grad_norm off for that step
    (LAMB clips by default); a second clip replaced the first (0.05 then 1.0 clipped to 1.0)."""
    for got, want, err in run_distributed(_clip_rank, 2, case, timeout=120):
        assert sum(got, []) == pytest.approx(sum(want, []), rel=1e-5), (got, want)
        assert err < 1e-5, err


class _Boom(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if _Boom.armed:
            raise RuntimeError("boom")
        return g


class _BoomNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(9, 17), torch.nn.Linear(17, 17), torch.nn.Linear(17, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.b(_Boom.apply(torch.tanh(self.a(x))))))


def _failed_backward_rank(rank, ws, stage, zero_grad_after):
    """A backward raises midway at step 1 (b's and c's grads made, a's not); the loop catches it and
    goes on, with zero_grad() or without (torch keeps the partial grads in .grad then)."""
    torch.manual_seed(0)
    ref = _BoomNet()
    kw = dict(wrap=[torch.nn.Linear]) if stage == 3 else {}
    model = zerofuse.zero.parallelize(copy.deepcopy(ref), stage=stage, bucket_mb=1e-4, **kw)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=3e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-2)
    g = torch.Generator().manual_seed(1)
    norms, gathered = [], []
    for step in range(4):
        x, y = torch.randn(4 * ws, 9, generator=g), torch.randn(4 * ws, 3, generator=g)
        _Boom.armed = step == 1
        failed = False
        for net, o, mine in ((model, opt, slice(rank * 4, rank * 4 + 4)), (ref, ref_opt, slice(None))):
            loss = torch.nn.functional.mse_loss(net(x[mine]), y[mine])
            try:
                loss.backward()
            except RuntimeError as e:
                assert "boom" in str(e)
                failed = True
                if zero_grad_after:
                    o.zero_grad()
                    if o is opt:  # stage 3: none left gathered (they stayed until the next forward's hooks)
                        gathered.append(sum(u.state != "free" for u in model._zerofuse_zero.units)
                                        if stage == 3 else 0)
        if failed:
            continue
        norms.append((float(opt.clip_grad_norm_(float("inf"))),
                      float(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")))))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    _Boom.armed = False
    with zerofuse.zero.full_params(model):
        err = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return norms, err, gathered


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("zero_grad_after", [True, False], ids=["zero_grad", "no_zero_grad"])
def test_a_caught_failed_backward_does_not_stop_gradient_sync(stage, zero_grad_after):
    """The failed backward's end-of-backward callback never ran: it stayed queued, so no later backward
    queued one again and every later step reduced nothing (partial or zero grads, no error). Now the
    next forward finds it (or zero_grad resets it): the run goes on as torch's. zero_grad after it
    frees stage 3's units as its end would have (they stayed gathered until the next forward's hooks:
    a review's reproduction, 2026-12-07)."""
    for norms, err, gathered in run_distributed(_failed_backward_rank, 2, stage, zero_grad_after, timeout=120):
        assert len(norms) == 3 and all(a == pytest.approx(b, rel=1e-5) for a, b in norms), norms
        assert err < 1e-5, err
        assert gathered == ([0] if zero_grad_after else []), gathered


class _ReadsChildWeight(torch.nn.Module):
    """forward reads self.head's params without calling self.head (as a tied output layer often is)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        return torch.nn.functional.linear(torch.tanh(self.body(x)), self.head.weight, self.head.bias)


def _param_gather_rank(rank, ws, stage, param_gather):
    ref = _ReadsChildWeight()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.0)
    model = zerofuse.zero.parallelize(_ReadsChildWeight(), stage=stage, bucket_mb=1e-6, param_gather=param_gather)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=0.05, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    after_step, saved = [], []
    for _ in range(3):
        x, y = torch.randn(4 * ws, 16, generator=g), torch.randn(4 * ws, 4, generator=g)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rank * 4:rank * 4 + 4]), y[rank * 4:rank * 4 + 4]).backward()
        opt.step()
        opt.zero_grad()
        after_step.append(max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())))
        sd = model.state_dict()  # (torch.save(model.state_dict()) right after a step)
        saved.append(max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items()))
    return after_step, saved


@pytest.mark.parametrize("stage", [1, 2])
def test_params_are_whole_when_the_step_returns(monkeypatch, stage):
    """Stages 1/2 all-gathered the stepped shards in the background, waited only by the forward of each
    module holding the params: a forward reading another module's weight, an EMA or a log right after
    step() read other ranks' old shards (0.14 off torch after 4 steps, no error). param_gather="step"
    (the default) returns whole params; "module" keeps the overlap for models that keep its rule, and
    its state_dict() waits."""
    monkeypatch.setenv("ZEROFUSE_COMM_DELAY_MS", "30")  # (the gathers still running when the step returns)
    for after_step, saved in run_distributed(_param_gather_rank, 2, stage, "step", timeout=120):
        assert max(after_step) < 1e-5 and max(saved) < 1e-5, (after_step, saved)
    for after_step, saved in run_distributed(_param_gather_rank, 2, stage, "module", timeout=120):
        assert max(saved) < 1e-5, saved


def _load_after_step_rank(rank, ws, stage, tries):
    worst = 0.0
    for _ in range(tries):  # (a race: the gathers landed after the load on some tries)
        torch.manual_seed(0)
        model = zerofuse.zero.parallelize(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)),
                                          stage=stage, param_gather="module", bucket_mb=0.01)
        opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-2)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        x = torch.randn(4, 256)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        model.load_state_dict(saved)  # (a roll back right after the step, its gathers still running)
        model(x)
        sd = model.state_dict()
        worst = max(worst, max((sd[k] - saved[k]).abs().max().item() for k in saved))
    return worst


@pytest.mark.parametrize("stage", [1, 2])
def test_a_load_right_after_a_step_is_not_overwritten_by_its_gathers(stage):
    """param_gather="module": the step's all-gathers landed on top of a load_state_dict made right
    after it (0.01 off the loaded weights on some ranks, the replicas apart, nothing said: a
    review's reproduction, 2026-12-07); the load waits for them as state_dict() does."""
    assert run_distributed(_load_after_step_rank, 2, stage, 10, timeout=120) == [0.0, 0.0]


class _Branches(torch.nn.Module):
    """Three layers; which of them give the loss a grad, and in which order, depends on the rank."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x, rank):
        a, b, c = self.layers
        if rank % 3 == 0:
            return b(a(x)).sum()  # c: no grad here
        if rank % 3 == 1:
            return c(x).sum() + a(x).pow(2).mean()  # b: no grad, a's late
        return c(b(x)).sum() + 0 * a.bias.sum()  # a.weight: no grad, a.bias a zero one


def _branch_rank(rank, ws, stage, overlap):
    from dist_utils import error_text

    ref = _Branches()
    model = zerofuse.zero.parallelize(copy.deepcopy(ref), stage=stage, bucket_mb=1e-6, overlap=overlap)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=3e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x = torch.randn(ws, 4, 16, generator=g)
        err = error_text(lambda: (model(x[rank], rank).backward(), opt.step(), opt.zero_grad()))
        if err != "no error":
            return err
        (sum(ref(x[r], r) for r in range(ws)) / ws).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with zerofuse.zero.full_params(model):
        return max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("stage, overlap", [(0, True), (1, True), (2, True), (2, False)])
@pytest.mark.parametrize("ws", [2, 3])
def test_ranks_giving_grads_to_different_params_train_as_one_process(monkeypatch, stage, overlap, ws):
    """Params with a grad on some ranks only (rank-dependent branches) launched their buckets'
    reductions at other points of backward on each rank: buckets of one size were reduced together on
    gloo (a's grads with b's), silently, or the step hung. Now every rank launches in one order, a
    bucket without grads reducing zeros (zero/bucket_group.py [Note: launch order]); the checker, on,
    finds nothing to name."""
    monkeypatch.setenv("ZEROFUSE_CHECK_COLLECTIVES", "1")
    for err in run_distributed(_branch_rank, ws, stage, overlap, timeout=120):
        assert isinstance(err, float) and err < 1e-5, err


def _ignored_grads_rank(rank, ws, stage):
    from dist_utils import error_text

    torch.manual_seed(0)
    model = zerofuse.zero.parallelize(torch.nn.Linear(8, 3), stage=stage)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=0.1)
    x = torch.randn(4, 8)
    grads = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    manual = error_text(opt.step)
    opt.zero_grad()
    with model.no_sync():
        model(x).sum().backward()
    only_no_sync = error_text(opt.step)
    return manual, only_no_sync


@pytest.mark.parametrize("stage", [0, 2])
def test_grads_a_step_would_not_use_are_refused(stage):
    """Over several ranks a .grad set by hand (torch.autograd.grad's results assigned) moved nothing,
    and a step after backwards run only inside no_sync() stepped on zeros: both silently."""
    for manual, only_no_sync in run_distributed(_ignored_grads_rank, 2, stage, timeout=120):
        assert manual.startswith("RuntimeError: zerofuse.zero.Optimizer.step: .grad was set outside autograd's "
                                 "backward on ['weight', 'bias']"), manual
        assert only_no_sync.startswith("RuntimeError: zerofuse.zero.Optimizer.step: the grads of the last backward "
                                       "passes were never reduced"), only_no_sync


C = 2.0 ** -7  # (a bf16 value: the clamp's bound is exact)


def _edit_one_rank(rank, ws, stage, offload):
    torch.manual_seed(0)
    model = zerofuse.zero.parallelize(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                                          torch.nn.Linear(32, 16)), stage=stage, precision="bf16",
                                      offload=offload, bucket_mb=25)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-2, weight_decay=0.1)
    for s in range(2):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(s + rank))
        model(x.bfloat16()).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    kept, edited = model[0].weight, model[2].bias
    before = {p: opt.state[p]["master"].clone() for p in (kept, edited) if p in opt.state}
    with zerofuse.zero.full_params(model):
        edited.data.clamp_(-C, C)
        new_bias = edited.detach().float().clone()
    out = []
    for p, old in before.items():
        now = opt.state[p]["master"]
        if p is kept:
            out.append(("kept", torch.equal(now, old)))
        else:  # this rank's piece of the bias: the clamped values, from fp32 bits where the clamp left them
            want = torch.where(old.bfloat16().float().abs() > C, old.clamp(-C, C), old)
            out.append(("edited", torch.equal(now, want)))
    return out, new_bias.abs().max().item()


@pytest.mark.parametrize("stage, offload", [(1, None), (2, "optimizer"), (3, None)])
def test_an_edit_inside_full_params_keeps_the_other_params_fp32_masters(stage, offload):
    """bf16 params train from fp32 masters; leaving full_params after an edit of one param (a clamp, a
    re-init of a head) set every master of that bucket (stage 3: unit) to its param's bf16 rounding:
    the other params lost their fp32 progress, and an edit every step stalled their small updates."""
    for out, bias_max in run_distributed(_edit_one_rank, 2, stage, offload, timeout=120):
        assert bias_max <= C, bias_max
        assert ("kept", True) in out or stage == 3 and not any(k == "kept" for k, _ in out), out
        assert all(ok for _, ok in out), out


def _stage0_low_wire_rank(rank, ws):
    torch.manual_seed(0)
    ref = torch.nn.Linear(16, 8)  # 136 params: one bucket of 256 elements at 128-alignment
    model = zerofuse.zero.parallelize(copy.deepcopy(ref), stage=0, reduce_dtype=torch.bfloat16)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(ws, 4, 16, generator=g)
        model(x[rank]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        (sum(ref(x[r]).square().mean() for r in range(ws)) / ws).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("ws", [2, 3])
def test_stage0_over_a_bf16_wire_at_any_world_size(ws):
    """Stage 0 buckets were padded to 128 elements: reduce_scatter_fp32_sum (the bf16 wire) splits a
    buffer over the ranks and refused 256 elements over 3 (a review, 2026-12-06). Within bf16's
    rounding of the grads of torch's step."""
    for err in run_distributed(_stage0_low_wire_rank, ws, timeout=120):
        assert err < 2e-3, err


def _seeded_by_rank(rank, ws, stage):
    torch.manual_seed(100 + rank)  # (a per-rank seed before the model: a common slip)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    try:
        zerofuse.zero.parallelize(model, stage=stage)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("stage", [0, 3])
def test_ranks_starting_from_different_weights_are_refused(stage):
    """Ranks that built the model under different seeds trained apart, silently (stage 0: replicas
    0.5 apart forever; stages 1-3 from a first step on other weights; a review's reproduction,
    2026-12-07): refused at parallelize on every rank, naming the params."""
    for msg in run_distributed(_seeded_by_rank, 2, stage, timeout=120):
        assert "expected every rank of the group to start from the same weights, got params ['0.weight', " \
               "'0.bias', '1.weight', '1.bias'] (4 of 4) whose values differ between rank 0 and rank(s) [1]" in msg, msg


def _same_weights_other_threads(rank, ws):
    torch.set_num_threads(1 + rank)  # (ranks on hosts of other core counts)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(10**6, generator=torch.Generator().manual_seed(10**6)))
    zerofuse.zero.parallelize(model, stage=1)
    return "ok"


def test_the_same_weights_pass_the_check_whatever_the_thread_count():
    """The check's digest summed the values in fp64, whose order (so its last bits) followed the CPU
    thread count: identical weights on ranks of 1 and 2 threads were refused (a review's
    reproduction, 2026-12-07). It sums the bit patterns as integers now."""
    assert run_distributed(_same_weights_other_threads, 2, timeout=120) == ["ok", "ok"]
