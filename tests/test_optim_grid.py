"""The optimizer kernels' launch machinery (kernels/multi_tensor.py): the persistent grid
([Note: persistent grid]) against one program per block, the step-scalars launch ([Note: step
scalars]), and what they compile to for an H100 (registers, float64, cache hints).

The Triton kernels run in the interpreter on CPU tensors here (tests/conftest.py); on a GPU the
``cuda`` cases run them compiled.
"""
import pytest
import torch

from zerofuse import kernels
from zerofuse.kernels import multi_tensor as MT
from zerofuse.kernels import optim as K
from zerofuse.optim import FusedAdamW, FusedLAMB, FusedLARS

from common import HAS_CUDA

# 13 blocks of 2048 (with the shipped BLOCK) over tensors of 0, 1, partial and several blocks: more
# blocks than the interpreter's 3 programs, so each program loops with a stride
SHAPES = [(37, 5), (1,), (0,), (4099,), (9000,), (3, 2048)]


@pytest.fixture(params=["triton", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, monkeypatch):
    if request.param == "triton":
        if not kernels.interpreted():
            pytest.skip("Triton on CPU tensors needs the interpreter (ZEROFUSE_TRITON_ON_CPU=1 before import)")
        monkeypatch.setattr(kernels, "TRITON_ON_CPU", True)
        return torch.device("cpu")
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")


def _params(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype)) for s in SHAPES]


_CASES = {
    "adamw_bf16_masters_clipped": (FusedAdamW, dict(lr=1e-2, weight_decay=0.1, master_weights=True, max_grad_norm=0.5),
                                   torch.bfloat16),
    "adamw_fp32": (FusedAdamW, dict(lr=1e-2, weight_decay=0.1), torch.float32),
    "lamb": (FusedLAMB, dict(lr=1e-2), torch.float32),
    "lamb_one_launch": (FusedLAMB, dict(lr=1e-2, master_weights=True), torch.bfloat16),
    "lars": (FusedLARS, dict(lr=0.1, weight_decay=1e-4, max_grad_norm=1.0), torch.float32),
}


def _run(device, case, monkeypatch):
    cls, kw, dtype = _CASES[case]
    monkeypatch.setattr(K, "LAMB_ONE_LAUNCH", case == "lamb_one_launch")
    params = _params(device, dtype)
    opt = cls([{"params": params[:3]}, {"params": params[3:], "lr": kw["lr"] * 3}], **kw)
    for step in range(4):
        g = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(device=device, dtype=dtype) * (50.0 if step == 2 else 1.0)
        if step == 1:  # a skipped step: an inf grad under clipping, or found_inf
            if "max_grad_norm" in kw:
                params[3].grad[0] = float("inf")
                opt.step()
            else:
                opt.step(found_inf=torch.ones(1, device=device))
        else:
            opt.step()
    return params, opt


@pytest.mark.parametrize("case", list(_CASES))
def test_persistent_grid_equals_one_program_per_block_bit_for_bit(device, case, monkeypatch):
    """The same per-element math and the same per-block sums in the same order: the persistent
    loop (each program taking blocks pid, pid + programs, ...) must give the bits of one program
    per block, over empty, 1-element, partial and many-block tensors in two dtype groups, with a
    skipped step. A loop that skipped or repeated a block, or used the wrong tensor's row for a
    block (the prefetched owner), would differ. On a GPU as if it had one SM: the 13 blocks looped over by
    PROGRAMS_PER_SM programs (an H200's 132 SMs ran 13 programs of one block: no loop, nothing shown)."""
    if device.type == "cuda":
        monkeypatch.setattr(MT, "sm_count", lambda dev: 1)
    runs = {}
    for grid in ("flat", "persistent"):
        monkeypatch.setattr(MT, "GRID", grid)
        runs[grid] = _run(device, case, monkeypatch)
    (ours, opt), (theirs, ref) = runs["persistent"], runs["flat"]
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
        for key, value in opt.state[a].items():
            if torch.is_tensor(value):
                assert torch.equal(value, ref.state[b][key]), key
    blocks = sum(-(-p.numel() // MT.BLOCK) for p in ours)
    monkeypatch.setattr(MT, "GRID", "persistent")
    assert MT.programs(blocks, device) < blocks  # the loop ran strided


def test_optim_grid_is_chosen_by_the_environment(monkeypatch):
    """ZEROFUSE_OPTIM_GRID: unset or persistent = a few programs per SM looping over blocks, flat =
    one program per block; anything else is refused with the variable's name and value."""
    monkeypatch.delenv("ZEROFUSE_OPTIM_GRID", raising=False)
    assert MT._grid_from_env() == "persistent"
    monkeypatch.setenv("ZEROFUSE_OPTIM_GRID", "flat")
    assert MT._grid_from_env() == "flat"
    monkeypatch.setenv("ZEROFUSE_OPTIM_GRID", "wide")
    with pytest.raises(ValueError, match=r"ZEROFUSE_OPTIM_GRID must be .*got 'wide'"):
        MT._grid_from_env()
    monkeypatch.setattr(MT, "GRID", "flat")
    assert MT.programs(13, torch.device("cpu")) == 13


def test_a_changed_block_size_builds_its_own_block_map(monkeypatch):
    """The block -> tensor map (and the one-launch LAMB's schedule) are kept per layout: a layout is
    the block starts, not only the sizes, so a BLOCK changed in the same process (bench_optimizers'
    sweep) gets its own map (a map kept by sizes alone gave 5 owners to 8 blocks: blocks read past
    it and wrote before their tensor)."""
    from zerofuse.kernels import lamb as KL

    ts = [torch.empty(5000), torch.empty(3000)]
    maps = {}
    for block in (2048, 1024, 2048):
        monkeypatch.setattr(MT, "BLOCK", block)
        table = MT._Table([ts], torch.device("cpu"))
        own = table.own.tolist()
        assert len(own) == table.blocks == -(-5000 // block) + -(-3000 // block)
        assert own == [0] * -(-5000 // block) + [1] * -(-3000 // block)
        sched = KL._schedule(table, torch.device("cpu"))
        assert sorted(sched.tolist()) == list(range(2 * table.blocks))  # each block's two stages once
        maps.setdefault(block, own)
    assert maps[1024] != maps[2048]


def test_step_scalars_rows_hold_the_float64_bias_corrections(device):
    """[Note: step scalars]: one launch advances each distinct counter once (two tensors share one
    here), not at all on a skipped step, and writes (1 - beta1^t, 1 - beta2^t, lr / (1 - beta1^t),
    sqrt(1 - beta2^t)) computed in float64 and rounded once to fp32, which the Adam kernel reads."""
    ps = [torch.zeros(n, device=device) for n in (5, 3000, 7)]
    shared, own = torch.zeros((), device=device), torch.tensor(4.0, device=device)
    steps = [shared, own, shared]
    launch = K.moment_launch(ps, [torch.ones_like(p) for p in ps], [torch.zeros_like(p) for p in ps],
                             [torch.zeros_like(p) for p in ps], [], steps)
    lr, beta1, beta2 = 3e-3, 0.9, 0.95
    consts = launch.consts((lr, beta1, beta2, 1e-8, 0.0))
    for found, expect in ((None, (1.0, 5.0)), (torch.zeros(1, device=device), (2.0, 6.0)),
                          (torch.ones(1, device=device), (2.0, 6.0))):
        launch.advance(consts, found, b1_at=1, lr_at=0)
        assert (shared.item(), own.item()) == expect
    rows = launch.step_rows.cpu()
    for j, t in enumerate((2, 6)):
        bc1, bc2 = 1.0 - beta1 ** t, 1.0 - beta2 ** t
        want = torch.tensor([bc1, bc2, lr / bc1, bc2 ** 0.5], dtype=torch.float64).float()
        assert torch.equal(rows[j], want), (j, rows[j], want)


def test_lamb_stage2_called_alone_computes_its_own_bias_corrections(device):
    """ZeRO calls LAMB's stages as two ops (an all-reduce of the norms between), each with its own
    launch tables: stage 2 must then compute its scalars rows from the advanced counters (without
    advancing them again), giving the bits of the one-op step. Rows never written would be zeros:
    a division by bc1 = 0."""
    from zerofuse.ops import lamb_, lamb_stage1_, lamb_stage2_
    from zerofuse.ops._optim import Prepared

    kw = dict(beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01)
    results = []
    for split in (False, True):
        ps = [p.detach().clone() for p in _params(device)]
        m, v = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
        steps = [torch.zeros((), device=device) for _ in ps]
        prepared = Prepared()
        for step in range(3):
            g = torch.Generator().manual_seed(7 + step)
            grads = [torch.randn(p.shape, generator=g).to(device) for p in ps]
            if split:
                norms = torch.empty((len(ps), 2), device=device)
                lamb_stage1_(ps, grads, m, v, steps, norms, prepared=prepared, **kw)
                lamb_stage2_(ps, m, v, steps, norms, lr=1e-2, prepared=prepared, **kw)
            else:
                lamb_(ps, grads, m, v, steps, lr=1e-2, prepared=prepared, **kw)
        results.append((ps, m, v, steps))
    for a, b in zip(*results):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert results[1][3][0].item() == 3


def test_streaming_kernels_stay_resident_and_run_no_float64_power_chain():
    """Compiled for sm_90 (tools/kernel_asm.py, ptxas -v): every streaming kernel variant, aligned
    or not, fits PROGRAMS_PER_SM programs of _NUM_WARPS warps in an SM's 65536 registers (the
    persistent grid counts on them being resident together) without spilling; the bias
    corrections' float64 power chain lives in the one-program steps kernel, not in the streaming
    ones (which load a few float64 constants: < 25 instructions, against ~250 for the chain);
    Adam and LARS stream with evict_first, the sum of squares of the grads (re-read by the step)
    with the default policy."""
    from common import kernel_asm

    rows = kernel_asm()
    budget = 65536 // (MT.PROGRAMS_PER_SM * 32 * MT._NUM_WARPS)
    streaming = [r for r in rows if r["aligned"] is not None]
    assert {r["kernel"] for r in streaming} >= {"adam", "adam_bf16_master", "lamb_stage1", "lamb_stage2", "lars",
                                               "sum_squares", "sum_squares_scaled"}
    for r in streaming:
        assert r["registers"] <= budget and r["spill_stores"] == r["spill_loads"] == 0, r
        assert r["f64"] < 25, r
    steps = next(r for r in rows if r["kernel"] == "steps")
    assert steps["f64"] > 100, steps
    for r in streaming:
        if r["kernel"] in ("adam", "adam_bf16_master", "lars"):
            assert r["hints"].get("evict_first", 0) > 0, r
        if r["kernel"] in ("sum_squares", "sum_squares_scaled"):
            assert r["hints"] == {}, r
