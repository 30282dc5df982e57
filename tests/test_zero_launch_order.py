"""ZeRO's launch order across ranks ([Note: launch order], zero/bucket_group.py) where a rank's order
is held back by a param with no grad on it: the expert lane and the dense lane each with their own
in-flight window, and a bucket reduced twice in one backward (re-entrant checkpointing) reduced
twice on every rank. Both hung before their fix (a review's reproductions, 2026-12-06)."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from dist_utils import run_distributed

pytestmark = pytest.mark.usefixtures("native_kernels")

D = 16


class _Lanes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin0 = torch.nn.Linear(D, D)
        self.expert = torch.nn.Parameter(torch.randn(1, D, D) * 0.1)  # this rank's one of two experts
        self.mid = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(6))
        self.extra = torch.nn.Linear(D, D)

    def forward(self, x, use_extra):
        h = self.lin0(x) @ self.expert[0]
        for m in self.mid:
            h = torch.tanh(m(h))
        return (self.extra(h) if use_extra else h).pow(2).mean()


def _lanes_rank(rank, ws, stage):
    import zerofuse
    from zerofuse.parallel import init_mesh
    from zerofuse.tp.spec import TPSpec

    mesh = init_mesh(dp=ws, ep=2)
    m = _Lanes()
    m.expert._zf_ep = TPSpec(0, (2,), (2, D, D), 2, mesh.ep_rank)  # as zerofuse.moe.MoE marks its experts
    zerofuse.zero.parallelize(m, stage=stage, group=mesh.dp_group, bucket_mb=1e-6, expert_group=mesh.edp_group)
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(100 + rank))
    m(x, use_extra=rank != 2).backward()  # rank 2's dense lane waits for `extra` until its end of backward
    with zerofuse.zero.full_grads(m):
        return {n: p.grad.clone() for n, p in m.named_parameters() if n != "expert"}


@pytest.mark.parametrize("stage", [1, 2])
def test_a_held_back_dense_lane_does_not_wait_for_the_expert_lane(stage):
    """One window over both lanes: rank 2 waited, launching its held-back dense buckets, for an
    expert reduction the other ranks launch only after those dense ones."""
    got = run_distributed(_lanes_rank, 4, stage, timeout=90)
    for n, g in got[0].items():  # the dense grads are the ranks' mean, the same on every rank
        for other in got[1:]:
            torch.testing.assert_close(other[n], g, rtol=0, atol=0)
    assert got[0]["extra.weight"].abs().sum() > 0


class _Shared(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 8)
        self.shared = torch.nn.Linear(8, 16)  # a size no other bucket has
        self.c = torch.nn.Linear(8, 8)
        self.sometimes = torch.nn.Linear(8, 8)  # registered last: first in the launch order

    def forward(self, x, use):
        h = self.a(x)
        for _ in range(2):
            h = checkpoint(lambda t: torch.tanh(self.shared(t))[:, :8], h, use_reentrant=True)
        h = self.c(h)
        return (self.sometimes(h) if use else h).pow(2).mean()


def _xs(r):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(r)).requires_grad_()


def _reentrant_rank(rank, ws, stage):
    import zerofuse

    ref = _Shared()
    for r in range(ws):
        (ref(_xs(r), r == 0) / ws).backward()
    m = _Shared()
    zerofuse.zero.parallelize(m, stage=stage, bucket_mb=1e-6)
    zerofuse.zero.Optimizer(m, "adamw")
    m(_xs(rank), rank == 0).backward()
    with zerofuse.zero.full_grads(m):
        return [(n, p.grad.clone(), q.grad) for (n, p), q in zip(m.named_parameters(), ref.parameters())]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_bucket_reduced_twice_is_so_on_every_rank(stage):
    """A shared module under re-entrant checkpointing gets its grads twice: rank 0 (every param
    used) had launched its bucket before the second grad and reduced it again; rank 1 (held back by
    `sometimes`) got both before its launch and reduced it once: rank 0 waited for a reduction rank 1
    never made."""
    for got in run_distributed(_reentrant_rank, 2, stage, timeout=90):
        for n, g, want in got:
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
