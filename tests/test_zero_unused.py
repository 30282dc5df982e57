"""parallelize(find_unused_parameters=True) ([Note: unused params], zero/unused.py): a param with no
grad on some ranks in a model that runs a collective during backward. Without the option the rank
holding it reached the backward collective while the others waited for reductions it had held back:
a hang until the timeout (the limit documented in [Note: launch order])."""
import dataclasses

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from dist_utils import run_distributed
from tolerances import assert_close

pytestmark = pytest.mark.usefixtures("native_kernels")

D = 8


class _CollectiveInBackward(torch.autograd.Function):
    """Identity; its backward runs an all-reduce over ``group`` (as MoE's all-to-all or TP's
    all-reduce do), of a tensor the math does not use."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist
        dist.all_reduce(torch.ones(1), group=ctx.group)
        return g, None


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(D, D)
        self.gate = torch.nn.Parameter(torch.rand(D) + 0.5)  # used by the last block on some ranks only

    def forward(self, h, use_gate=False):
        h = self.lin(h)
        return h * self.gate if use_gate else h


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin0 = torch.nn.Linear(D, D)
        self.mid = torch.nn.ModuleList(_Block() for _ in range(6))  # (stage 3: a unit each)
        self.extra = torch.nn.Linear(D, D)  # registered last: first in the launch order
        self.group = None
        self.reentrant = False

    def forward(self, x, use_extra):
        h = self.lin0(x)
        if self.group is not None:
            h = _CollectiveInBackward.apply(h, self.group)
        for i, m in enumerate(self.mid):
            use_gate = use_extra and i == len(self.mid) - 1  # (first in stage 3's launch order)
            h = checkpoint(m, h, use_gate, use_reentrant=True) if self.reentrant else m(h, use_gate)
            h = torch.tanh(h)
        return (self.extra(h) if use_extra else h).pow(2).mean()


def _x(rank, k=0):
    return torch.randn(4, D, generator=torch.Generator().manual_seed(100 * k + rank))


def _uses(rank, k=0):
    return (rank + k) % 3 != 1


def _reference(ws, micro):
    ref = _Model()
    for r in range(ws):
        for k in range(micro):
            (ref(_x(r, k), _uses(r, k)) / (ws * micro)).backward()
    return {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in ref.named_parameters()}


def _rank(rank, ws, stage, micro):
    import torch.distributed as dist
    import zerofuse

    want = _reference(ws, micro)
    m = _Model()
    m.group = dist.new_group(list(range(ws)))  # the backward collective's own group (an ep/tp group)
    zerofuse.zero.parallelize(m, stage=stage, bucket_mb=1e-6, max_inflight=1, find_unused_parameters=True)
    zerofuse.zero.Optimizer(m, "adamw")
    for k in range(micro):
        ctx = m.no_sync() if k < micro - 1 else torch.enable_grad()
        with ctx:
            (m(_x(rank, k), _uses(rank, k)) / micro).backward()
    with zerofuse.zero.full_grads(m):
        return [(n, p.grad.clone(), want[n]) for n, p in m.named_parameters()]


@pytest.mark.parametrize("stage,ws,micro", [(0, 2, 1), (1, 3, 1), (2, 3, 1), (2, 4, 2), (3, 3, 1)])
def test_unused_params_do_not_hold_back_a_rank_with_collectives_in_backward(stage, ws, micro):
    """Rank 1 (and, accumulating, another each micro-batch) leaves `extra` and the last block's gate
    without a grad; every rank's grads equal the single-process mean."""
    for got in run_distributed(_rank, ws, stage, micro, timeout=60):
        for n, g, want in got:
            assert_close(g, want, msg=lambda m, n=n: f"{n}: {m}")


def _outside_rank(rank, ws):
    import zerofuse

    m = _Model()
    zerofuse.zero.parallelize(m, stage=2, bucket_mb=1e-6, find_unused_parameters=True)
    h = torch.tanh(m.mid[0].lin(m.lin0(_x(rank))))  # a forward that never reaches `extra`...
    out = m(_x(rank), use_extra=False)
    try:
        (out + m.extra(h).sum()).backward()  # ...then a loss term from outside it
    except RuntimeError as e:
        return str(e)
    return None


def test_a_grad_for_a_param_the_forward_did_not_reach_is_refused():
    for msg in run_distributed(_outside_rank, 2, timeout=60):
        assert msg is not None and ("'extra.weight'" in msg or "'extra.bias'" in msg), msg
        assert "find_unused_parameters" in msg


def _reentrant_rank(rank, ws):
    import zerofuse

    m = _Model()
    m.reentrant = True
    zerofuse.zero.parallelize(m, stage=1, find_unused_parameters=True)
    try:
        m(_x(rank), True)
    except RuntimeError as e:
        return str(e)
    return None


def test_reentrant_checkpointing_is_refused_at_the_forward():
    for msg in run_distributed(_reentrant_rank, 2, timeout=60):
        assert msg is not None and "use_reentrant=False" in msg, msg


def test_find_unused_parameters_must_be_a_bool(world_of_one):
    import zerofuse

    with pytest.raises(TypeError, match="find_unused_parameters"):
        zerofuse.zero.parallelize(_Model(), stage=1, find_unused_parameters=1)


class _Opaque:
    def __init__(self, loss):
        self.loss = loss


@dataclasses.dataclass
class _Aux:
    loss: torch.Tensor


def _dataclass_rank(rank, ws):
    import zerofuse

    m = _Model()
    forward = m.forward
    # (h, a dataclass holding a loss of its own): the walk took only h and refused extra's grad
    m.forward = lambda x, use: (forward(x, False), _Aux(m.extra(torch.ones(2, D)).pow(2).mean()))
    zerofuse.zero.parallelize(m, stage=2, bucket_mb=1e-6, find_unused_parameters=True)
    h, aux = m(_x(rank), False)
    (h + aux.loss).backward()
    with zerofuse.zero.full_grads(m):
        return m.extra.weight.grad.clone()


def test_an_output_dataclass_is_walked():
    """DDP looks into dataclasses in the output, stage 3's hooks too; the walk (torch's tree_leaves)
    did not: a loss held in one was 'not reached' and its params' grads refused (a review's
    reproduction, 2026-12-06)."""
    ref = _Model()
    ref.extra(torch.ones(2, D)).pow(2).mean().backward()
    for got in run_distributed(_dataclass_rank, 2, timeout=60):
        assert_close(got, ref.extra.weight.grad)


def _opaque_rank(rank, ws):
    import zerofuse

    m = _Model()
    forward = m.forward
    m.forward = lambda x, use: _Opaque(forward(x, use))  # an output pytree cannot look into
    zerofuse.zero.parallelize(m, stage=2, bucket_mb=1e-6, find_unused_parameters=True)
    m(_x(rank), True).loss.backward()
    with zerofuse.zero.full_grads(m):
        return {n: p.grad.clone() for n, p in m.named_parameters()}


def test_an_output_the_walk_cannot_look_into_marks_nothing():
    """No tensor found in the output: every param was marked unused, and every grad refused."""
    want = {n: g for n, g, _ in _reference_named(2)}
    for got in run_distributed(_opaque_rank, 2, timeout=60):
        for n, g in got.items():
            assert_close(g, want[n], msg=lambda m, n=n: f"{n}: {m}")


def _reference_named(ws):
    ref = _Model()
    for r in range(ws):
        (ref(_x(r), True) / ws).backward()
    return [(n, p.grad if p.grad is not None else torch.zeros_like(p), None) for n, p in ref.named_parameters()]
