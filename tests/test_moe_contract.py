"""zerofuse.moe where a review (2026-11-27) reproduced behaviour a Megatron-Core MoE user would call
wrong (each check failed before its fix), on 2 real gloo ranks: a standalone MoE(ep_group=) balanced
each rank's own loads (the replicated expert bias drifted apart; the global aux loss acted as the
local one), the global aux loss of ranks given different token counts was not one process's, a
rank given no tokens had NaN aux and z losses, moe_permute took out-of-range expert ids as dropped."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerofuse

from dist_utils import run_distributed

pytestmark = pytest.mark.usefixtures("native_kernels")
D, H, E = 16, 24, 4


def _tokens(n, seed):
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed))


def _contract_rank(rank, ws):
    from zerofuse.moe import MoE, Router

    out = {}
    # a standalone MoE(ep_group=): the loads summed over the group (rank 0's tokens all to expert 0,
    # rank 1's all to expert 3)
    torch.manual_seed(0)
    moe = MoE(D, H, E, 1, ep_group=dist.group.WORLD, bias_update_rate=0.1, aux_loss_coef=1.0,
              aux_loss_scope="global")
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0 if rank == 0 else 3, 0] = 10.0
    x = _tokens(6, rank).abs()  # feature 0 > 0: the router picks the expert set above
    (moe(x).sum() + moe.aux_loss).backward()
    mine = 0 if rank == 0 else 3
    assert moe.router.last_load.tolist() == [6 if e == mine else 0 for e in range(E)]
    p = torch.softmax(x @ moe.router.weight.detach().t(), -1)
    # over the group: f = 1/2 for experts 0 and 3; P_e as this rank's share of the group's 12 tokens
    out["aux_global"] = (moe.router_losses[0].item(), E * 0.5 * (p[:, 0] + p[:, 3]).sum().item() * ws / 12)
    moe.router.update_bias()
    out["bias"] = moe.router.expert_bias.tolist()
    # the global aux loss of 10 and 2 tokens: the ranks' mean is one process's over the 12
    torch.manual_seed(0)
    router = Router(D, E, 2, aux_loss_coef=1.0, aux_loss_scope="global", group=dist.group.WORLD)
    aux = router(_tokens(10 if rank == 0 else 2, 100 + rank)).aux_loss.detach().clone()
    dist.all_reduce(aux)
    out["uneven_mean_aux"] = aux.item() / ws
    # no tokens on this rank: losses of 0
    torch.manual_seed(0)
    router = Router(D, E, 2, aux_loss_coef=1.0, z_loss_coef=1.0)
    empty = router(torch.zeros(0, D))
    out["empty"] = (empty.aux_loss.item(), empty.z_loss.item())
    return out


def test_moe_balancing_matches_one_process_over_the_group():
    from zerofuse.moe import Router

    results = run_distributed(_contract_rank, 2, timeout=120)
    torch.manual_seed(0)
    one = Router(D, E, 2, aux_loss_coef=1.0)(torch.cat([_tokens(10, 100), _tokens(2, 101)])).aux_loss.item()
    for rank, out in enumerate(results):
        # experts 0 and 3 each got half the group's 12 choices: above the mean of 3, 1 and 2 below it
        assert out["bias"] == pytest.approx([-0.1, 0.1, 0.1, -0.1]), (rank, out["bias"])
        got, want = out["aux_global"]  # (each rank's own loads: f = 1 for its expert, about twice this)
        assert got == pytest.approx(want, rel=1e-5), (rank, got, want)
        assert out["uneven_mean_aux"] == pytest.approx(one, rel=1e-5), (rank, out["uneven_mean_aux"], one)
        assert out["empty"] == (0.0, 0.0), rank


def test_moe_permute_refuses_expert_ids_out_of_range():
    from zerofuse.ops.moe import moe_permute

    x = torch.randn(3, 4)
    with pytest.raises(IndexError, match=r"expected experts in \[0, 2\) or -1, got 5"):
        moe_permute(x, torch.tensor([[0], [5], [1]]), 2)
    with pytest.raises(IndexError, match=r"expected experts in \[0, 2\) or -1, got -3"):
        moe_permute(x, torch.tensor([[0], [-3], [1]]), 2)
    _, pos, _, counts = moe_permute(x, torch.tensor([[0], [-1], [1]]), 2)  # -1: dropped
    assert counts.tolist() == [1, 1] and pos[1, 0].item() == -1


def _eval_alone_rank(rank, ws):
    router = zerofuse.moe.Router(8, 4, 2, aux_loss_coef=0.01, group=torch.distributed.group.WORLD,
                                 aux_loss_scope="global")
    local = zerofuse.moe.Router(8, 4, 2, aux_loss_coef=0.01)
    local.load_state_dict(router.state_dict())
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    if rank != 0:
        return None
    with torch.no_grad():  # an evaluation on rank 0 alone
        return float(router(x).aux_loss), float(local(x).aux_loss)


def test_a_global_scope_router_evaluates_on_one_rank_without_a_collective():
    """aux_loss_scope='global' all-reduced its loads at every forward, evaluation under no_grad
    too: rank 0 evaluating alone waited for ranks that never came (or paired the all-reduce with
    their training's collectives). Without grad no backward reads the loss: its own figures."""
    got, local = run_distributed(_eval_alone_rank, 2, timeout=60)[0]
    assert got == local > 0


def test_the_routers_bias_is_fp32_under_a_bf16_default_dtype():
    """Built under torch.set_default_dtype(torch.bfloat16) the aux-loss-free bias was bf16: its
    rate-sized steps (1e-3 at 0.5) were rounded away, balancing stalled silently."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        router = zerofuse.moe.Router(8, 4, 1, bias_update_rate=1e-3)
    finally:
        torch.set_default_dtype(before)
    assert router.expert_bias.dtype == torch.float32


def test_a_dropped_choice_takes_nothing_from_another_tokens_inf():
    """On the native CPU path a dropped choice read row 0 of the expert outputs and scaled it by 0:
    an inf there (token 0's expert output overflowing fp16) made the dropped tokens' outputs NaN,
    and an inf in an output's gradient the dropped rows' gradients (a review's reproduction,
    2026-12-07). As the Triton kernels: nothing, and token 0 keeps its inf."""
    from zerofuse.ops.moe import moe_permute, moe_unpermute

    x, w = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.full((2, 2), 0.5)
    experts = torch.tensor([[0, -1], [1, -1]])  # each token's second choice dropped
    out, pos, src, counts = moe_permute(x, experts, 2)
    y = out.clone()
    y[0] = float("inf")
    assert moe_unpermute(y, pos, src, w).tolist() == [[float("inf")] * 2, [1.5, 2.0]]
    xr = x.clone().requires_grad_()
    out, pos, src, counts = moe_permute(xr, experts, 2)
    g = torch.ones_like(out)
    g[0] = float("inf")
    out.backward(g)
    assert xr.grad.tolist() == [[float("inf")] * 2, [1.0, 1.0]]
    yr = out.detach().clone().requires_grad_()
    z = moe_unpermute(yr, pos, src, w)
    gz = torch.ones_like(z)
    gz[0] = float("inf")
    z.backward(gz)
    kept = (src >= 0).unsqueeze(1)
    assert torch.isfinite(yr.grad[~kept.squeeze(1)]).all() and (yr.grad[~kept.squeeze(1)] == 0).all(), yr.grad


def test_capacity_is_the_factor_as_written_and_bad_sizes_are_named():
    """ceil(1.1 * 50 * 1 / 5) is 11; in floats the product is 11.000000000000002 and capacity was 12.
    A float top_k or num_experts failed inside torch (topk(): argument 'k' must be int; empty() takes
    1 positional argument), a 0-d x with an IndexError (a review's reproductions, 2026-12-07)."""
    from zerofuse.moe import MoE, Router

    assert Router(D, 5, 1, capacity_factor=1.1).capacity(50) == 11
    assert Router(D, 4, 2, capacity_factor=1.25).capacity(10) == 7  # (6.25: up)
    torch.manual_seed(0)
    moe = MoE(D, H, 4, 2, capacity_factor=1.1)
    compiled = torch.compile(moe, backend="aot_eager")
    for n in (10, 13, 17):  # (the second size recompiles over a symbolic count: the ratio failed on it)
        x = _tokens(n, n)
        torch.testing.assert_close(compiled(x), moe(x), rtol=0, atol=0)
    for args, name in (((D, H, 4, 1.5), "top_k"), ((D, H, 2.0, 1), "num_experts"), ((D, 24.0, 4, 1), "hidden")):
        with pytest.raises(TypeError, match=f"zerofuse.moe.MoE: expected {name} to be an int, got"):
            MoE(*args)
    with pytest.raises(TypeError, match="zerofuse.moe.Router: expected top_k to be an int, got 1.5"):
        Router(D, 4, 1.5)
    with pytest.raises(ValueError, match=r"zerofuse.moe.MoE: expected x \[..., 16\], got \[\]"):
        MoE(D, H, 4, 1)(torch.tensor(1.0))


def test_capacity_dropping_keeps_o_tk_memory(native_kernels):
    """Router._drop placed each choice among its expert's with a (T k, E) int64 one-hot's cumsum:
    three T k E tensors (3.2 GB per MoE layer at 65536 tokens, top 8 of 256 experts; a review,
    2026-12-07). Now a stable grouping by expert: O(T k). The drops are those of the (token, slot)
    order, checked against a loop."""
    import zerofuse
    from zerofuse.moe import Router

    t, k, e = 2048, 8, 256
    experts = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(i))[:k] for i in range(t)])
    experts[:, 0] = 3  # expert 3 over capacity: the later tokens' choices of it are dropped
    r = Router(D, e, k, capacity_factor=1.0)
    with zerofuse.zero.peak_memory() as peak:
        kept, dropped = r._drop(experts)
    assert peak.peak < 16 * t * k * 8, peak.peak  # (the one-hot's three tensors: 3 * t * k * e * 8 = 100 MiB)
    cap, seen, want = r.capacity(t), [0] * e, experts.clone()
    for i in range(t):
        for j in range(k):
            x = int(experts[i, j])
            want[i, j] = x if seen[x] < cap else -1
            seen[x] += 1
    assert torch.equal(kept, want) and int(dropped) == int((want < 0).sum()) > 0
