"""ZeRO over one rank without hooks ([Note: a world of one] in zerofuse/zero/engine.py): the grads
autograd leaves in .grad are taken at the step (or at the end of a no_sync window), and training
is bit for bit the hooked engine's."""
import pytest
import torch

from zerofuse import zero
from zerofuse.models import GPT, GPTConfig
from zerofuse.zero.engine import ZeroEngine

# the engine's hook logic, on the C++ CPU kernels (the Triton interpreter took 20-60 s a test here)
pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _train(hookless, stage, precision, monkeypatch, accum=2, steps=3, window="each", **kw):
    """window: how the accumulating backwards meet no_sync(): "each" in its own window, "one" all
    in one window, "none" not at all (each backward reduces, as a world of several ranks would).
    kw: more of parallelize's arguments."""
    monkeypatch.setattr(ZeroEngine, "HOOKLESS", hookless)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=61, seq_len=16, n_layer=2, n_head=2, dim=32), seed=0)
    zm = zero.parallelize(model, stage=stage, precision=precision, bucket_mb=0.02, **kw)
    eng = zm._zerofuse_zero
    assert eng.hookless == hookless
    assert any(p._post_accumulate_grad_hooks for p in zm.parameters()) != hookless
    opt = zero.Optimizer(zm, "adamw", lr=1e-2, weight_decay=0.1, max_grad_norm=0.5)
    g = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(steps):
        outer = zm.no_sync() if window == "one" else torch.enable_grad()
        with outer:
            for i in range(accum - 1):
                x = torch.randint(0, 61, (2, 16), generator=g)
                with zm.no_sync() if window == "each" else torch.enable_grad():
                    zm(x, x)[1].backward()
        x = torch.randint(0, 61, (2, 16), generator=g)
        zm(x, x)[1].backward()
        opt.step()
        norms.append(opt.last_grad_norm.clone())
        opt.zero_grad()
    x = torch.randint(0, 61, (2, 16), generator=g)
    zm(x, x)[1].backward()  # grads left for full_grads to take
    with zero.full_grads(zm):
        grads = [p.grad.clone() for p in zm.parameters()]
    return [p.detach().clone() for p in zm.parameters()], grads, norms, len(eng.units)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_hookless_training_equals_the_hooked_engine_bit_for_bit(stage, precision, monkeypatch, world_of_one):
    """Grad accumulation over a no_sync window (added in the reduce dtype, fp32 under bf16), clipping
    by the global norm, several buckets, full_grads after a backward: the same bits either way. A
    hookless engine that took the window's grads only at the step would accumulate bf16 grads in
    bf16 (autograd's .grad) and differ; one that never took them would train on zeros."""
    ours = _train(True, stage, precision, monkeypatch)
    theirs = _train(False, stage, precision, monkeypatch)
    assert ours[3] > 1  # several buckets
    for a, b in zip(ours[0] + ours[1] + ours[2], theirs[0] + theirs[1] + theirs[2]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("window", ["one", "none"])
@pytest.mark.parametrize("stage", [0, 2])
def test_hookless_accumulates_several_backwards_in_the_reduce_dtype(stage, window, monkeypatch, world_of_one):
    """Three backwards a step with bf16 params, all in one no_sync window or with none: the hooked
    engine adds each into its fp32 buffers; a hookless one must not leave them to autograd's bf16
    .grad until the step (bf16 sums: other bits)."""
    ours = _train(True, stage, "bf16", monkeypatch, accum=3, window=window)
    theirs = _train(False, stage, "bf16", monkeypatch, accum=3, window=window)
    for a, b in zip(ours[0] + ours[1] + ours[2], theirs[0] + theirs[1] + theirs[2]):
        assert torch.equal(a, b)


def test_the_take_hook_only_where_dtypes_differ_and_the_job_drops_it(world_of_one):
    """The forward hook is on the model only with bf16/fp16 params summing in fp32; a caller whose
    backwards each end at a sync point (zerofuse-train's loop) removes it: no hook at all."""
    hooks = {}
    for precision in ("fp32", "bf16"):
        model = GPT(GPTConfig(vocab_size=61, seq_len=16, n_layer=1, n_head=2, dim=32), seed=0)
        zm = zero.parallelize(model, stage=2, precision=precision)
        hooks[precision] = len(zm._forward_hooks) + len(zm._forward_pre_hooks)
        zm._zerofuse_zero.backwards_end_at_sync_points()
        assert not zm._forward_hooks and not zm._forward_pre_hooks
        assert not any(p._post_accumulate_grad_hooks for p in zm.parameters())
    assert hooks == {"fp32": 0, "bf16": 1}


def _two_losses_one_forward(hookless, monkeypatch):
    """bf16, stage 2: one forward, two losses backpropagated with retain_graph (no sync point in
    between), then the step; and a forward inside full_grads (a gradient-dependent metric)."""
    monkeypatch.setattr(ZeroEngine, "HOOKLESS", hookless)
    model = GPT(GPTConfig(vocab_size=61, seq_len=16, n_layer=2, n_head=2, dim=32), seed=0)
    zm = zero.parallelize(model, stage=2, precision="bf16", bucket_mb=0.02)
    opt = zero.Optimizer(zm, "adamw", lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 61, (2, 16), generator=g)
    logits, _ = zm(x)  # (no targets: the logits, two losses of them)
    logits.float().square().mean().backward(retain_graph=True)
    logits.float().mean().backward()
    with zero.full_grads(zm):
        zm(x, x)  # (under the hookless engine's hook: must not take the handed-out grads as new ones)
        grads = [p.grad.clone() for p in zm.parameters()]
    opt.step()
    return grads, [p.detach().clone() for p in zm.parameters()]


def test_hookless_two_losses_of_one_forward_and_a_forward_inside_full_grads(monkeypatch, world_of_one):
    """Several backwards of one forward (retain_graph) add in fp32 as the hooked engine's (the
    take is queued at the end of each backward through the model's outputs, not before the next
    forward), and a forward inside full_grads leaves the grads alone: bit for bit the hooked engine."""
    ours, theirs = (_two_losses_one_forward(h, monkeypatch) for h in (True, False))
    assert any(g.abs().sum() > 0 for g in ours[0])
    for a, b in zip(ours[0] + ours[1], theirs[0] + theirs[1]):
        assert torch.equal(a, b)


def test_a_world_of_one_with_offload_or_stage_3_keeps_its_hooks(world_of_one):
    """Where the hooks do work over one rank too (stage 3's gathers and frees, offload's host steps
    during backward), the engine keeps them."""
    for kw in (dict(stage=3), dict(stage=2, offload="optimizer")):
        model = GPT(GPTConfig(vocab_size=61, seq_len=16, n_layer=1, n_head=2, dim=32), seed=0)
        eng = zero.parallelize(model, **kw)._zerofuse_zero
        assert not eng.hookless and all(p._post_accumulate_grad_hooks for p in model.parameters()), kw
