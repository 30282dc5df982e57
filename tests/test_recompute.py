"""Activation checkpointing of the GPT's blocks (zerofuse/models/recompute.py): "full" and
"selective" give the grads of "none" bit for bit (dense and MoE blocks, and at ZeRO-3 under the
unit hooks, and under tensor parallelism with and without SP), and hold less at the peak of forward + backward: full < selective < none, measured
by zerofuse.zero.peak_memory during the step."""
import pytest
import torch

import zerofuse
from zerofuse.models import GPT, GPTConfig

from dist_utils import run_distributed

pytestmark = pytest.mark.usefixtures("native_kernels")

CFG = dict(vocab_size=65, seq_len=64, n_layer=3, n_head=4, dim=96)


def _step(cfg, mode, x):
    model = GPT(GPTConfig(**cfg), seed=0)
    model.activation_checkpointing = mode
    with zerofuse.zero.peak_memory() as peak:
        model(x[:, :-1], x[:, 1:])[1].backward()
    return peak.peak, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("moe", [False, True])
def test_recomputed_grads_are_the_same_bits_and_the_peak_drops(moe):
    cfg = dict(CFG, mlp="swiglu", moe_experts=4, moe_top_k=2, moe_bias_rate=1e-3) if moe else CFG
    x = torch.randint(0, 65, (8, 65), generator=torch.Generator().manual_seed(0))
    peaks = {}
    base_peak, base = _step(cfg, "none", x)
    for mode in ("full", "selective", True):
        peaks[mode], grads = _step(cfg, mode, x)
        for n, g in base.items():
            assert torch.equal(grads[n], g), (mode, n)
    assert peaks["full"] < peaks["selective"] < base_peak, (peaks, base_peak)
    assert peaks[True] == peaks["full"]


def _compiled_step(mode):
    """One step of a 2-block GPT whose blocks recompute.compile_block compiled, counted on the graphs
    AOTAutograd hands the backend: (forward graph runs, each forward graph's matmuls and saved
    tensors, each backward graph's matmuls, the model)."""
    from torch._dynamo.backends.common import aot_autograd

    from zerofuse.models import recompute
    from zerofuse.models.gpt import Block

    def mms(gm):
        return sum(n.op == "call_function" and getattr(n.target, "__name__", "").split(".")[0] in ("mm", "addmm", "bmm")
                   for n in gm.graph.nodes)

    torch._dynamo.reset()  # (graphs another test compiled for Block.forward would serve these calls uncounted)
    runs, fwd_mm, saved, bwd_mm = [0], [], [], []

    def fw(gm, example):
        fwd_mm.append(mms(gm))
        saved.append(len(next(n for n in gm.graph.nodes if n.op == "output").args[0]))

        def run(*args):
            runs[0] += 1
            return gm(*args)
        return run

    def bw(gm, example):
        bwd_mm.append(mms(gm))
        return gm

    x = torch.randint(0, 65, (2, 33), generator=torch.Generator().manual_seed(0))
    model = GPT(GPTConfig(**dict(CFG, n_layer=2)), seed=0)
    model.activation_checkpointing = mode
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    kept = {recompute.compile_block(b, mode, backend=aot_autograd(fw_compiler=fw, bw_compiler=bw)) for b in blocks}
    assert kept == {mode}
    model(x[:, :-1], x[:, 1:])[1].backward()
    return runs[0], fwd_mm, saved, bwd_mm, model


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_compiled_blocks_keep_the_mode(mode):
    """recompute.compile_block: under "selective" the checkpoint goes inside the compiled forward, so
    the policy holds there (an eager checkpoint around a compiled block re-ran the whole compiled
    forward in backward: full's recompute and memory, 2026-12-06's note). Each compiled forward runs
    once per block, its backward graph holds two matmuls per forward matmul (none recomputed), and
    the forward saves fewer tensors than without checkpointing (the rest recomputed); "full" re-runs
    each forward. The grads are those of the eager model."""
    runs, fwd_mm, saved, bwd_mm, model = _compiled_step(mode)
    assert runs == 2 * (2 if mode == "full" else 1)
    assert fwd_mm and all(n > 0 for n in fwd_mm) and bwd_mm == [2 * n for n in fwd_mm], (fwd_mm, bwd_mm)
    if mode == "selective":  # (without the checkpoint inside, selective's graphs were none's)
        assert sum(saved) < sum(_compiled_step("none")[2]), saved
    x = torch.randint(0, 65, (2, 33), generator=torch.Generator().manual_seed(0))
    ref = GPT(GPTConfig(**dict(CFG, n_layer=2)), seed=0)
    ref.activation_checkpointing = mode
    ref(x[:, :-1], x[:, 1:])[1].backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)


def test_offload_on_a_block_compiled_without_it_is_refused():
    """A block compile_block compiled for "selective" checkpoints inside its compiled forward: turning
    activation_offload on afterwards offloaded nothing, silently (a review, 2026-12-07)."""
    from zerofuse.models import recompute

    model = GPT(GPTConfig(**dict(CFG, n_layer=1)), seed=0)
    model.activation_checkpointing = "selective"
    assert recompute.compile_block(model.blocks[0], "selective", backend="eager") == "selective"
    model.activation_offload = True
    with pytest.raises(ValueError, match=r"compile_block compiled for activation_checkpointing 'selective' without "
                                         r"offload, expected activation_offload=False, got True"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("mode", ["none", "full"])
def test_another_mode_on_a_block_compiled_for_selective_is_refused(mode):
    """A block compile_block compiled for "selective" checkpoints inside its compiled forward: the
    model switched to "none" went on recomputing, to "full" wrapped it in a second checkpoint, both
    silently (a review, 2026-12-07)."""
    from zerofuse.models import recompute

    model = GPT(GPTConfig(**dict(CFG, n_layer=1)), seed=0)
    assert recompute.compile_block(model.blocks[0], "selective", backend="eager") == "selective"
    model.activation_checkpointing = mode
    with pytest.raises(ValueError, match=rf"compile_block compiled for activation_checkpointing 'selective' checkpoints "
                                         rf"inside its compiled forward, expected activation_checkpointing 'selective', "
                                         rf"got '{mode}'"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    with torch.no_grad():  # without grad nothing is checkpointed: evaluating with checkpointing off is fine
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    model.activation_checkpointing = "selective"  # the mode it was compiled for: trains
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))[1].backward()


def test_bad_mode_is_refused():
    model = GPT(GPTConfig(**CFG), seed=0)
    model.activation_checkpointing = "some"
    with pytest.raises(ValueError, match=r"expected activation_checkpointing one of \('none', 'full', 'selective'\)"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))


def _zero3_rank(rank, ws, mode):
    model = GPT(GPTConfig(**CFG), seed=0)
    model.activation_checkpointing = mode
    zerofuse.zero.parallelize(model, stage=3)
    x = torch.randint(0, 65, (4, 33), generator=torch.Generator().manual_seed(rank))
    model(x[:, :-1], x[:, 1:])[1].backward()
    with zerofuse.zero.full_grads(model):
        return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_selective_recompute_under_zero3():
    base = run_distributed(_zero3_rank, 2, "none", timeout=120)[0]
    got = run_distributed(_zero3_rank, 2, "selective", timeout=120)[0]
    for n, g in base.items():
        assert torch.equal(got[n], g), n


def _tp_rank(rank, ws, sp):
    mesh = zerofuse.parallel.init_mesh(dp=1, tp=ws)
    x = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(0))
    out = {}
    for mode in ("none", "full", "selective"):
        model = GPT(GPTConfig(**dict(CFG, vocab_size=64, seq_len=32, n_layer=2, dim=64)), seed=0,
                    tp_group=mesh.tp_group, sequence_parallel=sp)
        model.activation_checkpointing = mode
        model(x[:, :-1], x[:, 1:])[1].backward()
        out[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("sp", [False, True])
def test_recompute_under_tensor_parallelism(sp):
    """Without SP the row-parallel all-reduce ran in place on the matmul output that "selective"
    keeps: recompute reduced it again (grads 4-7% off, silently; a review's reproduction, 2026-12-06)."""
    for got in run_distributed(_tp_rank, 2, sp, timeout=180):
        for mode in ("full", "selective"):
            for n, g in got["none"].items():
                assert torch.equal(got[mode][n], g), (mode, n)


class _Shared(torch.nn.Module):
    """A block used twice in one forward (weights shared across depth, as ALBERT), each use under
    torch's re-entrant checkpointing: its params' grads arrive twice, in two inner backwards."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(16, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
                                          for _ in range(3))
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x):
        h = self.inp(x)
        for i in (0, 1, 1, 2):
            h = h + torch.utils.checkpoint.checkpoint(self.blocks[i], h, use_reentrant=True)
        return self.out(h).pow(2).mean()


def _x():
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()


def _shared_rank(rank, ws, stage, bucket_mb):
    model = zerofuse.zero.parallelize(_Shared(), stage=stage, bucket_mb=bucket_mb)
    zerofuse.zero.Optimizer(model, "adamw")
    model(_x()[rank * 4:(rank + 1) * 4]).backward()
    with zerofuse.zero.full_grads(model):
        return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage,bucket_mb", [(1, 1e-9), (2, 1e-9), (3, 25.0)])
def test_grads_arriving_twice_after_their_reduction_are_reduced_too(stage, bucket_mb):
    """The second arrival found its unit reduced already: its grads went into a buffer never
    reduced (silently lost; a review's reproduction, 2026-11-28)."""
    ref = _Shared()
    for half in _x().detach().chunk(2):
        (ref(half) / 2).backward()
    for got in run_distributed(_shared_rank, 2, stage, bucket_mb, timeout=120):
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
