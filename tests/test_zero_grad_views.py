"""parallelize(gradient_as_bucket_view=True) over one rank ([Note: a world of one] in
zerofuse/zero/world_of_one.py): each .grad is a view of its bucket's buffer, so backward holds
the grads once (measured at the peak), and training is bit for bit the engine's without it."""
import warnings

import pytest
import torch

from dist_utils import run_distributed
from test_zero_memory import three_steps
from test_zero_world_of_one import _train
from zerofuse import zero
from zerofuse.models import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("cpu_kernels")
MiB = 2 ** 20


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_views_train_bit_for_bit_as_without_them(stage, monkeypatch, world_of_one):
    """Accumulation in a no_sync window per backward, in one window, and without one (autograd
    adds into the views in place), clipping, several buckets, full_grads after a backward."""
    for window in ("each", "one", "none"):
        ours = _train(True, stage, "fp32", monkeypatch, window=window, gradient_as_bucket_view=True)
        theirs = _train(True, stage, "fp32", monkeypatch, window=window)
        assert ours[3] > 1
        for a, b in zip(ours[0] + ours[1] + ours[2], theirs[0] + theirs[1] + theirs[2]):
            assert torch.equal(a, b), window


def _peaks(build):
    """(peak bytes during the third step's backward, peak of the three steps, memory_report's grads
    or None), counted from before the model is built. A batch of one short sequence: the grads, not
    the activations, make the peak."""
    x = torch.randint(0, 65, (1, 9), generator=torch.Generator().manual_seed(0))
    mem, model = three_steps(build, x)
    report = zero.memory_report(model)["grads"] if hasattr(model, "_zerofuse_zero") else None
    return mem.phases["backward2"][1], mem.peak, report


def test_views_hold_the_grads_once(world_of_one):
    """Without views the buffer (kept between steps) and autograd's .grad both hold the grads at the
    end of backward (a review measured 61.9 against plain torch's 51.8 MiB, 2026-12-06); with them
    the peak is at most plain torch AdamW's on the same model, and memory_report counts them once."""
    cfg = GPTConfig(vocab_size=65, seq_len=64, n_layer=4, n_head=4, dim=256)

    def plain():
        model = GPT(cfg, seed=0)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

    def ours(views):
        def build():
            model = GPT(cfg, seed=0)
            zero.parallelize(model, stage=2, gradient_as_bucket_view=views)
            return model, zero.Optimizer(model, "adamw", lr=1e-3)
        return build

    grad_bytes = 4 * GPT(cfg, seed=0).num_params()
    p_bwd, p_peak, _ = _peaks(plain)
    v_bwd, v_peak, v_report = _peaks(ours(True))
    n_bwd, n_peak, n_report = _peaks(ours(False))
    assert n_bwd - v_bwd >= 0.8 * grad_bytes, (n_bwd / MiB, v_bwd / MiB, grad_bytes / MiB)
    assert v_peak <= p_peak, (v_peak / MiB, p_peak / MiB)
    assert grad_bytes <= v_report < grad_bytes + MiB and v_report == n_report


def _with_replaced_grads(views, monkeypatch):
    """A create_graph=True backward (autograd then sums out of place: .grad is a new tensor), then
    one whose .grad the caller replaces (None on one param, a tensor on another) before the step."""
    monkeypatch.setattr(zero.engine.ZeroEngine, "HOOKLESS", True)
    model = GPT(GPTConfig(vocab_size=61, seq_len=16, n_layer=1, n_head=2, dim=32), seed=0)
    zm = zero.parallelize(model, stage=0, gradient_as_bucket_view=views)
    opt = zero.Optimizer(zm, "adamw", lr=1e-2)
    params = list(zm.parameters())
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        for _ in range(2):  # two backwards a step: the second adds to the first's grads
            x = torch.randint(0, 61, (2, 16), generator=g)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (torch's create_graph reference-cycle warning)
                zm(x, x)[1].backward(create_graph=step == 0)
        if step == 1:
            params[0].grad = None
            params[1].grad = torch.full_like(params[1], 0.5)
        opt.step()
        opt.zero_grad()
        if views:  # zeros, still the views
            assert all(p.grad is not None and not p.grad.any() and zm._zerofuse_zero.is_grad_view(p) for p in params)
    return [p.detach().clone() for p in params]


def test_a_replaced_grad_is_what_the_step_reads(monkeypatch, world_of_one):
    """As torch reads .grad: a sum autograd made out of place, a tensor the caller set, None (no
    grad): the same bits as the engine without views, whose take copies whatever .grad holds."""
    ours, theirs = (_with_replaced_grads(v, monkeypatch) for v in (True, False))
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_refused_where_grads_cannot_be_views(world_of_one):
    """bf16 params summing grads in fp32 (the default reduce dtype): a view cannot be a grad of
    another dtype; bf16 summing in bf16 can."""
    model = GPT(GPTConfig(vocab_size=61, seq_len=16, n_layer=1, n_head=2, dim=32), seed=0)
    with pytest.raises(ValueError, match=r"gradient_as_bucket_view=True .* expected reduce_dtype equal to "
                                         r"torch.bfloat16 \(precision='bf16'\), got reduce_dtype=torch.float32"):
        zero.parallelize(model, stage=2, precision="bf16", gradient_as_bucket_view=True)
    with pytest.raises(TypeError, match="expected gradient_as_bucket_view to be a bool, got 1"):
        zero.parallelize(model, stage=2, gradient_as_bucket_view=1)
    zm = zero.parallelize(model, stage=2, precision="bf16", reduce_dtype=torch.bfloat16, gradient_as_bucket_view=True)
    assert all(p.grad.dtype == torch.bfloat16 and zm._zerofuse_zero.is_grad_view(p) for p in zm.parameters())


def _two_ranks(rank, ws):
    model = GPT(GPTConfig(vocab_size=61, seq_len=16, n_layer=1, n_head=2, dim=32), seed=0)
    zm = zero.parallelize(model, stage=1, gradient_as_bucket_view=True)
    x = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(rank))
    zm(x, x)[1].backward()
    return zm._zerofuse_zero.hookless, [p.grad is None for p in zm.parameters()]


def test_over_several_ranks_the_hooks_hold_grads_once_and_the_flag_changes_nothing():
    for hookless, none in run_distributed(_two_ranks, 2, timeout=120):
        assert not hookless and all(none)
