"""The fused optimizers' flat-buffer functional API, bad options and op checks (see test_optim.py)."""
import copy

import pytest
import torch

import zerofuse
from zerofuse import reference
from zerofuse.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedLARS, functional

from dist_utils import run_distributed
from optim_common import SHAPES, _grads, _params, _run, path  # noqa: F401  (path: the fixture)


# ---------------------------------------------------------------------------------- flat buffers


def test_kernel_tables_promise_16_byte_alignment_only_when_every_address_has_it():
    """The Triton kernels read tensor addresses from a table and vectorise only when the table
    says all are 16-byte aligned: a view at an odd element offset (a ZeRO segment) must turn it off."""
    from zerofuse.kernels import optim as K

    base = torch.zeros(2048)
    cpu = torch.device("cpu")
    assert base.data_ptr() % 16 == 0
    assert K._Table([[base[:512], base[512:1024]], None], cpu).aligned
    assert not K._Table([[base[:512], base[1:513]]], cpu).aligned
    assert not K._Table([[base[:512]], [base[3:515]]], cpu).aligned


# fp32 arrays each kernel loads and stores per element on its unmasked (full-block) path
# (arrays read, arrays written) by a full block; the one-launch LAMB has both stages' code paths
_FP32_ARRAYS = {"adam": (4, 3), "lamb_stage1": (4, 2), "lamb_stage2": (3, 1), "lamb_fused": (7, 3), "lars": (3, 2), "sum_squares": (1, 0),
                "sum_squares_scaled": (1, 0)}


def test_full_blocks_compile_to_16_byte_accesses_for_an_h100():
    """Compiled for sm_90 on this CPU machine (tools/kernel_asm.py): with aligned tables every
    fp32 array of a full block moves in 16-byte vectors (BLOCK / threads / 4 per array and
    thread); without the alignment promise, none may. A mask against the runtime numel on every
    block made all of them 4-byte accesses (the kernels before this test reached 0.47 of the H100's
    copy bandwidth)."""
    from zerofuse.kernels import optim as K

    from common import kernel_asm

    rows = kernel_asm()
    per_array = K.BLOCK // (32 * K._NUM_WARPS) // 4
    seen = set()
    assert {"segment_sum", "clip"} <= {r["kernel"] for r in rows if r["aligned"] is None}  # they compile
    for row in rows:
        loads, stores = row["loads"].get("v4.b32", 0), row["stores"].get("v4.b32", 0)
        if row["aligned"] is None:
            continue
        if not row["aligned"]:
            assert loads == stores == 0, row
        elif row["kernel"] in _FP32_ARRAYS:
            n_in, n_out = _FP32_ARRAYS[row["kernel"]]
            assert (loads, stores) == (n_in * per_array, n_out * per_array), row
            seen.add(row["kernel"])
    assert seen == set(_FP32_ARRAYS)
    bf16 = next(r for r in rows if r["kernel"] == "adam_bf16_master" and r["aligned"])
    # grad (bf16: half the vectors), master, m, v in; master, m, v, bf16 param out
    assert bf16["loads"]["v4.b32"] == 3 * per_array + per_array // 2, bf16
    assert bf16["stores"]["v4.b32"] == 3 * per_array + per_array // 2, bf16


def test_adamw_flat_equals_the_optimizer_on_separate_tensors(path):
    params = _params(device=path)
    flat = torch.cat([p.reshape(-1) for p in params])
    m, v, step = torch.zeros_like(flat), torch.zeros_like(flat), torch.zeros((), device=path)
    twin = [torch.nn.Parameter(p.clone()) for p in params]
    opt = FusedAdamW(twin, lr=1e-2, weight_decay=0.1)
    for s in range(5):
        grads = _grads(s, device=path)
        functional.adamw_flat(flat, torch.cat([g.reshape(-1) for g in grads]), m, v, step, lr=1e-2, weight_decay=0.1)
        for t, g in zip(twin, grads):
            t.grad = g
        opt.step()
    torch.testing.assert_close(flat, torch.cat([t.detach().reshape(-1) for t in twin]), rtol=1e-6, atol=1e-6)


def _segments(shapes):
    out, off = [], 0
    for s in shapes:
        n = torch.Size(s).numel()
        out.append((off, n))
        off += n
    return out


def test_lamb_flat_equals_the_optimizer_on_separate_tensors(path):
    params = _params(device=path)
    flat = torch.cat([p.reshape(-1) for p in params])
    m, v, step = torch.zeros_like(flat), torch.zeros_like(flat), torch.zeros((), device=path)
    twin = [torch.nn.Parameter(p.clone()) for p in params]
    opt = FusedLAMB(twin, lr=1e-2, max_grad_norm=None)
    calls = []
    for s in range(5):
        grads = _grads(s, device=path)
        functional.lamb_flat(flat, torch.cat([g.reshape(-1) for g in grads]), m, v, step, _segments(SHAPES),
                             lr=1e-2, norm_reduce=calls.append)
        for t, g in zip(twin, grads):
            t.grad = g
        opt.step()
    assert len(calls) == 5 and calls[0].shape == (len(SHAPES), 2)
    torch.testing.assert_close(flat, torch.cat([t.detach().reshape(-1) for t in twin]), rtol=1e-5, atol=1e-6)


def _lamb_shard_rank(rank, world_size):
    """Each rank holds 1/world_size of the flat buffer (padded); segments are the pieces of the
    params that fall in its shard; norm sums are all-reduced between the stages."""
    import torch.distributed as dist

    params, total = _params(), sum(torch.Size(s).numel() for s in SHAPES)
    shard = -(-total // world_size)
    flat = torch.zeros(shard * world_size)
    flat[:total] = torch.cat([p.reshape(-1) for p in params])
    lo, hi = rank * shard, (rank + 1) * shard
    segments = []  # (offset in shard, length) of each param's piece, also when empty
    for off, n in _segments(SHAPES):
        b, e = max(off, lo), min(off + n, hi)
        segments.append((b - lo, max(0, e - b)) if e > b else (0, 0))
    mine = flat[lo:hi].clone()
    m, v, step = torch.zeros_like(mine), torch.zeros_like(mine), torch.zeros(())
    for s in range(3):
        g = torch.zeros(shard * world_size)
        g[:total] = torch.cat([x.reshape(-1) for x in _grads(s)])
        functional.lamb_flat(mine, g[lo:hi].clone(), m, v, step, segments, lr=1e-2, mode="nvlamb",
                             norm_reduce=dist.all_reduce)
    out = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(out, mine)
    return torch.cat(out)[:total]


@pytest.mark.parametrize("world_size", [2, 3])
def test_lamb_on_shards_with_all_reduced_norms_equals_unsharded(world_size, cpu_kernels):
    got = run_distributed(_lamb_shard_rank, world_size, timeout=120)
    ref = _params()
    states = [[torch.zeros_like(p) for p in ref] for _ in range(2)]
    for s in range(3):
        reference.lamb_step(ref, _grads(s), *states, step=s + 1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6,
                            weight_decay=0.01, mode="nvlamb")
    want = torch.cat([p.reshape(-1) for p in ref])
    for r in range(world_size):
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------- errors, op checks


@pytest.mark.parametrize(
    "make,exc,msg",
    [
        (lambda p: FusedAdamW([p], amsgrad=True), ValueError, r"FusedAdamW: amsgrad=True is not supported \(use torch.optim.AdamW\)"),
        (lambda p: FusedAdam([p], differentiable=True), ValueError, r"FusedAdam: differentiable=True is not supported"),
        (lambda p: FusedAdamW([p], max_grad_norm=-1.0), ValueError, r"FusedAdamW: expected max_grad_norm >= 0 or None \(0: no clipping\), got -1.0"),
        (lambda p: FusedLAMB([p], mode="lars"), ValueError, r"FusedLAMB: expected mode 'paper' or 'nvlamb', got 'lars'"),
        (lambda p: FusedLAMB([p], min_trust=2.0, max_trust=1.0), ValueError, r"expected 0 <= min_trust <= max_trust"),
        (lambda p: FusedLARS([p], momentum=-0.1), ValueError, r"FusedLARS: expected momentum finite and >= 0, got -0.1"),
        # a review's reproductions (2026-12-07): Python's bare "'>=' not supported", or "no" taken as True
        (lambda p: FusedLARS([p], lr="a"), TypeError, r"FusedLARS: expected lr to be a number, got 'a'"),
        (lambda p: FusedLARS([p], momentum=None), TypeError, r"FusedLARS: expected momentum to be a number, got None"),
        (lambda p: FusedLAMB([p], eps=None), TypeError, r"FusedLAMB: expected eps to be a number, got None"),
        (lambda p: FusedLAMB([p], min_trust=None), TypeError, r"FusedLAMB: expected min_trust to be a number, got None"),
        (lambda p: FusedLAMB([p], max_grad_norm="1"), TypeError,
         r"FusedLAMB: expected max_grad_norm to be a number or None, got '1'"),
        (lambda p: FusedAdamW([p], max_grad_norm="1"), TypeError,
         r"FusedAdamW: expected max_grad_norm to be a number or None, got '1'"),
        (lambda p: FusedLAMB([p], bias_correction="no"), TypeError,
         r"FusedLAMB: expected bias_correction True or False, got 'no'"),
    ],
)
def test_bad_options_raise(make, exc, msg):
    with pytest.raises(exc, match=msg):
        make(torch.nn.Parameter(torch.randn(3)))


@pytest.mark.parametrize("opt_cls", [FusedAdamW, FusedLAMB, FusedLARS])
def test_sparse_and_complex_gradients_raise(opt_cls):
    name = opt_cls.__name__
    p = torch.nn.Parameter(torch.randn(4, 3))
    p.grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match=f"{name}: sparse gradients are not supported"):
        opt_cls([p]).step()
    q = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    q.grad = torch.randn(3, dtype=torch.complex64)
    with pytest.raises(RuntimeError, match=f"{name}: complex parameters are not supported"):
        opt_cls([q]).step()


def test_op_errors_name_the_argument(path):
    from zerofuse.ops._optim import Prepared

    prepared = Prepared()
    p, g = [torch.randn(5, device=path)], [torch.randn(5, device=path)]
    z = lambda *s, **k: torch.zeros(*s, device=path, **k)  # noqa: E731
    steps = [torch.ones((), device=path)]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    with pytest.raises(ValueError, match=r"zerofuse::adam_: expected exp_avgs to have one tensor per param \(1\), got 0"):
        zerofuse.ops.adam_(p, g, [], [z(5)], steps, **kw)
    with pytest.raises(RuntimeError, match=r"zerofuse::adam_: expected exp_avgs\[0\] in float32, got .*[bB][fF]loat16"):
        zerofuse.ops.adam_(p, g, [z(5, dtype=torch.bfloat16)], [z(5)], steps, **kw)
    with pytest.raises(ValueError, match=r"expected grads\[0\] to have 5 elements like params\[0\], got 4"):
        zerofuse.ops.adam_(p, [torch.randn(4, device=path)], [z(5)], [z(5)], steps, **kw)
    with pytest.raises(RuntimeError, match=r"expected params\[0\] to be contiguous"):
        zerofuse.ops.adam_([torch.randn(5, 2, device=path).t()], [z(2, 5)], [z(10)], [z(10)], steps, **kw)
    with pytest.raises(ValueError, match=r"expected steps to have one tensor per param \(1\), got 0"):
        zerofuse.ops.adam_(p, g, [z(5)], [z(5)], [], **kw)
    with pytest.raises(RuntimeError, match=r"lamb_stage1_: expected norms to be a contiguous float32 (cpu )?tensor of shape \[1, 2\]"):
        zerofuse.ops.lamb_stage1_(p, g, [z(5)], [z(5)], steps, z(2), beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0)
    with pytest.raises(ValueError, match=r"zerofuse::lamb_: expected mode 'paper' or 'nvlamb', got 'x'"):
        zerofuse.ops.lamb_(p, g, [z(5)], [z(5)], steps, lr=1, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0, mode="x")
    with pytest.raises(ValueError, match=r"lamb_stage2_: expected mode 'paper' or 'nvlamb', got 'x'"):
        zerofuse.ops.lamb_stage2_(p, [z(5)], [z(5)], steps, z(1, 2), lr=1, beta1=0.9, beta2=0.99, eps=1e-6,
                                  weight_decay=0, mode="x")
    lars = dict(lr=0.1, momentum=0.9, weight_decay=0.0, trust_coefficient=1e-3)
    with pytest.raises(RuntimeError, match=r"lars_: expected norms to be a contiguous float32 (cpu )?tensor of shape \[2\]"):
        zerofuse.ops.lars_(p, g, [z(5)], norms=z(3), **lars)
    # kept launch tables (an optimizer's Prepared) still check the norms, which may change at every call
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"lamb_stage2_: expected norms to be a contiguous float32 (cpu )?tensor "
                                               r"of shape \[1, 2\]"):
            zerofuse.ops.lamb_stage2_(p, [z(5)], [z(5)], steps, z(2), lr=1, beta1=0.9, beta2=0.99, eps=1e-6,
                                      weight_decay=0, prepared=prepared)
        with pytest.raises(RuntimeError, match=r"lars_: expected norms (on the params' device|to be a contiguous float32 "
                                               r"cpu tensor).*meta"):
            zerofuse.ops.lars_(p, g, [z(5)], norms=torch.zeros(2, device="meta"), prepared=prepared, **lars)
    with pytest.raises(ValueError, match=r"segments\[1\] = \(3, 9\) runs outside the flat buffer of 5 elements"):
        functional.lamb_flat(z(5), z(5), z(5), z(5), steps[0], [(0, 3), (3, 9)], lr=1e-3)


def _op_args():
    ps = [torch.randn(7, 3), torch.randn(5)]
    gs = [torch.randn(7, 3), torch.randn(5).bfloat16()]
    st = [torch.zeros(7, 3), torch.zeros(5)]
    st2 = [torch.zeros(7, 3), torch.zeros(5)]
    steps = [torch.tensor(1.0), torch.tensor(2.0)]  # advanced to 2 and 3 by the step
    return ps, gs, st, st2, steps


def test_opcheck(cpu_kernels):
    ps, gs, st, st2, steps = _op_args()
    masters = [p.clone() for p in ps]
    mult, found = torch.tensor([0.5]), torch.tensor([0.0])
    torch.library.opcheck(torch.ops.zerofuse.adam_.default,
                          (ps, gs, st, st2, masters, steps, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, False, mult, found))
    norms = torch.zeros(2, 2)
    torch.library.opcheck(torch.ops.zerofuse.lamb_stage1_.default,
                          (ps, gs, st, st2, [], steps, 0.9, 0.999, 1e-6, 0.01, True, mult, found, norms))
    torch.library.opcheck(torch.ops.zerofuse.lamb_.default,
                          (ps, gs, st, st2, [], steps, 1e-3, 0.9, 0.999, 1e-6, 0.01, True, 0, 0.0, 10.0, mult, None))
    torch.library.opcheck(torch.ops.zerofuse.lamb_stage2_.default,
                          (ps, st, st2, [], steps, norms.abs() + 1, 1e-3, 0.9, 0.999, 1e-6, 0.01, True, 1, 0.0, 10.0,
                           None))
    torch.library.opcheck(torch.ops.zerofuse.lars_.default,
                          (ps, gs, st, [], torch.ones(4), 0.1, 0.9, 1e-4, 1e-3, 1e-8, None, None))
    torch.library.opcheck(torch.ops.zerofuse.l2norm.default, (gs, True))


def test_torch_compile_fullgraph(cpu_kernels):
    ps, gs, st, st2, steps = _op_args()
    ref = [t.clone() for t in ps]
    ref_st = [[t.clone() for t in st], [t.clone() for t in st2]]

    def step(ps, gs, st, st2, steps):
        norm, _ = torch.ops.zerofuse.l2norm(gs, False)
        torch.ops.zerofuse.adam_(ps, gs, st, st2, [], steps, 1e-2, 0.9, 0.999, 1e-8, 0.01, True, False, None, None)
        return norm

    norm = torch.compile(step, fullgraph=True, backend="aot_eager")(ps, gs, st, st2, steps)
    torch.testing.assert_close(norm.double(), reference.global_norm(gs).float().double(), rtol=1e-6, atol=0)
    for i, s in enumerate((2, 3)):
        reference.adam_step(ref[i], gs[i].float(), ref_st[0][i], ref_st[1][i], step=s, lr=1e-2, beta1=0.9,
                            beta2=0.999, eps=1e-8, weight_decay=0.01)
        torch.testing.assert_close(ps[i], ref[i], rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_cuda_step_with_amp_inputs_never_syncs():
    """The whole CUDA step (unscale, clipping norm, inf flag, update, step counters) runs without
    a host sync: torch's sync debug mode turns any sync into an error."""
    params = [torch.nn.Parameter(p) for p in _params(device="cuda")]
    opt = FusedAdamW(params, lr=1e-2, max_grad_norm=1.0)
    for p, g in zip(params, _grads(0, device="cuda")):
        p.grad = g
    scale, found = torch.tensor(2.0, device="cuda"), torch.zeros(1, device="cuda")
    opt.step(grad_scale=scale, found_inf=found)  # warm-up: kernel compilation may sync
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step(grad_scale=scale, found_inf=found)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt.state[params[0]]["step"].item() == 2


def test_launch_constants_are_written_in_place_when_the_lr_changes():
    """A schedule changes the lr every step: the constants tensor the kernels read is one
    persistent tensor per kind of launch, updated in place (a fill on the stream), never a new
    upload through a new pinned allocation."""
    from zerofuse.kernels import optim as KO

    ps = [torch.zeros(10), torch.zeros(3)]
    launch = KO.Launch(ps, [torch.zeros_like(p) for p in ps], [None, None, None, None])
    first = launch.consts((1e-3, 0.9, 0.95, 1e-8, 0.1))
    again = launch.consts((5e-4, 0.9, 0.95, 1e-8, 0.1))
    assert again is first and again.tolist() == [5e-4, 0.9, 0.95, 1e-8, 0.1]
    lamb = launch.consts((0.9, 0.95, 1e-8, 0.1))  # another kind of launch keeps its own tensor
    assert lamb is not first and lamb.tolist() == [0.9, 0.95, 1e-8, 0.1]
    assert launch.consts((1e-4, 0.9, 0.95, 1e-8, 0.1)) is first and first[0].item() == 1e-4


def test_a_grad_of_another_dtype_at_the_same_address_is_read_as_its_dtype(path):
    """The kept launch table fixed the grads' dtype: a bf16 grad at the fp32 grad's old address was
    read as fp32 bits (the update, and a clipping norm, wrong; a review's reproduction, 2026-12-06)."""
    results = []
    for same in (False, True):
        p = torch.nn.Parameter(torch.ones(8, device=path))
        p.grad_dtype = None  # (torch takes a grad of another dtype only so)
        opt = FusedAdamW([p], lr=0.1, weight_decay=0.0, max_grad_norm=100.0)
        buf = torch.ones(8, device=path)
        p.grad = buf
        opt.step()
        g16 = buf.view(torch.bfloat16)[:8] if same else torch.empty(8, dtype=torch.bfloat16, device=path)
        g16.fill_(-1.0)
        p.grad = g16
        opt.step()
        results.append((p.detach().clone(), float(opt.last_grad_norm)))
    assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1] == pytest.approx(8 ** 0.5)


def test_l2_decay_of_zero_leaves_non_finite_params_as_torch(path):
    """FusedAdam's L2 term at weight_decay 0: the Triton kernel added 0 * p, NaN for an inf param (its
    moments NaN too), where torch and the C++ kernel add nothing (a review's reproduction, 2026-12-06)."""
    def run(cls):
        p = torch.nn.Parameter(torch.tensor([1.0, float("inf"), float("-inf")], device=path))
        opt = cls([p], lr=0.1)
        p.grad = torch.ones_like(p)
        opt.step()
        return p.detach().cpu(), opt.state[p]["exp_avg"].cpu()

    for got, want in zip(run(FusedAdam), run(torch.optim.Adam)):
        torch.testing.assert_close(got, want)


def test_an_apex_state_dict_loads_with_its_step_count():
    """Apex keeps one step count per param group and none per param: torch's Adam raised KeyError
    'step', FusedLAMB too; each param takes its group's count now (a review's reproduction,
    2026-12-06), and Apex options without an equivalent are refused."""
    ps = [torch.nn.Parameter(torch.randn(7)), torch.nn.Parameter(torch.randn(3))]
    moments = {i: {"exp_avg": torch.full((n,), 0.1), "exp_avg_sq": torch.full((n,), 0.01)}
               for i, n in enumerate((7, 3))}
    group = {"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
             "step": 1000, "params": [0, 1]}
    for cls, extra in ((FusedAdamW, {}), (FusedLAMB, {"grad_averaging": True, "max_grad_norm": 1.0})):
        opt = cls(ps)
        opt.load_state_dict({"state": copy.deepcopy(moments), "param_groups": [group | extra]})
        assert all(float(opt.state[p]["step"]) == 1000 for p in ps) and "step" not in opt.param_groups[0]
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
        assert all(float(opt.state[p]["step"]) == 1001 for p in ps)
    for cls, bad, match in ((FusedAdamW, {"bias_correction": False}, "bias_correction=False"),
                            (FusedLAMB, {"grad_averaging": False}, "grad_averaging=False")):
        with pytest.raises(ValueError, match=rf"param_groups\[0\] of an Apex state dict has {match}"):
            cls(ps).load_state_dict({"state": copy.deepcopy(moments), "param_groups": [group | bad]})


@pytest.mark.parametrize("make, kw", [
    (FusedAdamW, dict(max_grad_norm=1.0)), (FusedLAMB, dict(eps=1e-6, weight_decay=0.01, min_trust=0.01)),
    (FusedLARS, dict(momentum=0.9, weight_decay=1e-4, trust_coefficient=1e-3))])
def test_hyperparameters_as_tensors_or_numpy_values_step_as_numbers(make, kw, cpu_kernels):
    """The number checks (2026-12-07) refused 0-d tensors and numpy bools that stepped bit for bit as
    numbers before (a review of the checks); they are taken again."""
    import numpy as np

    def run(**given):
        params, _ = _run(make, _params(), steps=3, **given)
        return params
    want = run(**kw)
    got = run(**{k: torch.tensor(v, dtype=torch.float64) for k, v in kw.items()}, **({"bias_correction": np.True_} if make is FusedLAMB
                                                                  else {}))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
