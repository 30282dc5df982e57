"""Expert parallelism on real gloo ranks: an MoE layer with its experts split over ep 2, 3 and 4
ranks (all-to-all dispatch on the Communicator) gives each rank's tokens the outputs and grads of
one process running the whole batch through all the experts; ranks with no tokens, experts and
ranks that receive none, everything routed to one rank; the all-to-all and its checker."""
import pytest
import torch

from dist_utils import run_distributed
from tolerances import assert_close

D, H = 24, 40


def _full(e, k, activation, seed=0):
    from zerofuse.moe import MoE

    torch.manual_seed(seed)
    return MoE(D, H, e, k, activation=activation)


def _tokens(ws, per_rank, skew=False):
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, D, generator=g) for n in per_rank]
    dys = [torch.randn(n, D, generator=g) for n in per_rank]
    if skew:  # a constant feature that the skewed router weighs heavily
        for x in xs:
            x[:, 0] = 3.0
    return xs, dys


def _skew(full, e, ws):
    """Every token prefers the experts of rank 0."""
    with torch.no_grad():
        full.router.weight[: e // ws, 0] += 5.0


def _ep_rank(rank, ws, e, k, activation, per_rank, skew, autocast=False):
    import zerofuse  # noqa: F401
    from zerofuse.moe import MoE

    full = _full(e, k, activation)
    if skew:
        _skew(full, e, ws)
    m = MoE(D, H, e, k, activation=activation, ep_group=torch.distributed.group.WORLD)
    local = e // ws
    with torch.no_grad():
        m.router.weight.copy_(full.router.weight)
        m.w1.copy_(full.w1[rank * local:(rank + 1) * local])
        m.w2.copy_(full.w2[rank * local:(rank + 1) * local])
    xs, dys = _tokens(ws, per_rank, skew)
    from zerofuse.moe.dispatch import sent_bytes

    x = xs[rank].clone().requires_grad_()
    before = sent_bytes()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        y = m(x)
    (y.float() * dys[rank]).sum().backward()
    router_grad = m.router.weight.grad.clone()
    torch.distributed.all_reduce(router_grad)
    return y.detach(), x.grad, m.w1.grad, m.w2.grad, router_grad, sent_bytes() - before


@pytest.mark.parametrize("ws,e,k,activation,per_rank,skew", [
    (2, 4, 2, "swiglu", (37, 21), False),
    (3, 6, 2, "gelu", (11, 0, 17), False),  # rank 1 has no tokens
    (4, 8, 1, "swiglu", (9, 13, 5, 7), True),  # all routed to rank 0's experts: the others receive none
    (4, 4, 4, "gelu", (6, 6, 6, 6), False),  # top-k = E: every rank's tokens everywhere
])
def test_expert_parallel_layer_matches_one_process(ws, e, k, activation, per_rank, skew):
    out = run_distributed(_ep_rank, ws, e, k, activation, per_rank, skew, timeout=120)
    full = _full(e, k, activation)
    if skew:
        _skew(full, e, ws)
    xs, dys = _tokens(ws, per_rank, skew)
    x = torch.cat(xs).requires_grad_()
    y = full(x)
    (y * torch.cat(dys)).sum().backward()
    local = e // ws
    starts = [sum(per_rank[:r]) for r in range(ws)]
    # the rows on the wire: dispatch, combine and their backward, each every (token, choice) once
    assert sum(r[-1] for r in out) == 4 * sum(per_rank) * k * D * 4
    for rank, (y_r, dx_r, dw1, dw2, router_grad, _) in enumerate(out):
        rows = slice(starts[rank], starts[rank] + per_rank[rank])
        assert_close(y_r, y.detach()[rows], atol=1e-6, rtol=1e-5)
        assert_close(dx_r, x.grad[rows], atol=1e-6, rtol=1e-5)
        experts = slice(rank * local, (rank + 1) * local)
        assert_close(dw1, full.w1.grad[experts], atol=1e-5, rtol=1e-5)
        assert_close(dw2, full.w2.grad[experts], atol=1e-5, rtol=1e-5)
        assert_close(router_grad, full.router.weight.grad, atol=1e-5, rtol=1e-5)
    if skew:
        assert all(not dw1.any() for _, _, dw1, _, _, _ in out[1:])  # their experts got no rows


def _a2a_rank(rank, ws, check):
    import os

    if check:
        os.environ["ZEROFUSE_CHECK_COLLECTIVES"] = "1"
    from zerofuse.comm import CollectiveMismatch, Communicator

    comm = Communicator()
    sends = [[(r + 2 * s) % 3 for s in range(ws)] for r in range(ws)]  # rank r sends sends[r][s] rows to s
    x = torch.arange(sum(sends[rank]) * 3, dtype=torch.float32).view(-1, 3) + 100 * rank
    recv = [sends[s][rank] for s in range(ws)]
    out = torch.empty(sum(recv), 3)
    comm.all_to_all(out, x, recv, sends[rank]).wait()
    errors = []
    if check:  # rank 0 expects one row too many from rank 1
        wrong = list(recv)
        if rank == 0:
            wrong[1] += 1
        try:
            comm.all_to_all(torch.empty(sum(wrong), 3), x, wrong, sends[rank]).wait()
        except CollectiveMismatch as e:
            errors.append(str(e))
    for bad in () if check else (lambda: comm.all_to_all(out, x, recv[:-1], sends[rank]),
                                 lambda: comm.all_to_all(out, x, recv, [n + 1 for n in sends[rank]])):
        try:
            bad()
        except Exception as e:  # noqa: BLE001
            errors.append(str(e))
    return out, errors


@pytest.mark.parametrize("check", [False, True])
def test_all_to_all_with_per_rank_row_counts(check):
    ws = 3
    out = run_distributed(_a2a_rank, ws, check, timeout=60)
    sends = [[(r + 2 * s) % 3 for s in range(ws)] for r in range(ws)]
    for rank, (got, errors) in enumerate(out):
        parts = []
        for s in range(ws):
            x = torch.arange(sum(sends[s]) * 3, dtype=torch.float32).view(-1, 3) + 100 * s
            start = sum(sends[s][:rank])
            parts.append(x[start:start + sends[s][rank]])
        assert torch.equal(got, torch.cat(parts)), rank
        if check:  # every rank raises, naming the pair
            assert "all_to_all #1 differs across ranks: rank 1 sends 1 rows to rank 0, which expects 2" in errors[0], errors
            continue
        assert any("expected out_splits to hold 3 row counts (one per rank), got 2" in e for e in errors), errors
        assert any("expected in_splits to sum to input's" in e for e in errors), errors


def test_expert_parallel_under_autocast_with_a_rank_receiving_no_rows():
    """CPU autocast ran an empty expert batch's matmul in bf16 while the other ranks' grouped matmuls
    stayed fp32: the return all-to-all's byte counts differed and gloo aborted the process (a
    review's reproduction, 2026-12-07). The experts' outputs go back in the rows' dtype."""
    ws, e, per_rank = 2, 4, (6, 6)
    out = run_distributed(_ep_rank, ws, e, 1, "swiglu", per_rank, True, True, timeout=120)
    full = _full(e, 1, "swiglu")
    _skew(full, e, ws)  # every token to rank 0's experts: rank 1's receive none
    xs, dys = _tokens(ws, per_rank, True)
    x = torch.cat(xs).requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        y = full(x)
    (y.float() * torch.cat(dys)).sum().backward()
    for r, (got, dx, *_rest) in enumerate(out):
        rows = slice(sum(per_rank[:r]), sum(per_rank[:r + 1]))
        assert got.dtype == y.dtype
        assert_close(got, y[rows].detach(), msg=f"rank {r} outputs")
        assert_close(dx, x.grad[rows], msg=f"rank {r} input grads")
