"""The standalone optimizers under a large loss scale (GradScaler's grows without bound where no
step overflows: bf16 or fp32 autocast). The clipping norm and LARS's grad norms were summed from
the scaled grads' squares in fp32 and unscaled after: past |scale * grad| ~ 1.8e19 the squares
overflowed, every step was skipped as non-finite (GradScaler saw finite grads and never lowered
the scale) and LARS froze its tensors (a review's reproduction, 2026-12-07). The grads are now
unscaled before they are squared (zerofuse::l2norm's mult), on both kernel paths."""
from __future__ import annotations

import pytest
import torch

from zerofuse.ops import l2norm
from zerofuse.optim import FusedAdamW, FusedLAMB, FusedLARS

from tolerances import assert_close

SCALE = 2.0 ** 100


def _grads():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in [(7, 5), (33,), (1,)]]


def test_l2norm_multiplies_before_it_squares(kernel_path):
    grads = _grads()
    scaled = [g * SCALE for g in grads]
    params = [torch.randn(4) for _ in grads]
    plain_total, plain_each = l2norm(params + grads, per_tensor=True)
    total, each = l2norm(params + scaled, per_tensor=True, mult=torch.tensor([1 / SCALE]), mult_from=len(params))
    assert torch.isfinite(total) and torch.isfinite(each).all()
    assert_close(total, plain_total, msg="total")
    assert_close(each, plain_each, msg="per tensor")
    with pytest.raises(RuntimeError, match=r"expected mult_from >= 0, got -1"):  # (Triton: scaled all, unsaid)
        l2norm(scaled, mult=torch.tensor([1 / SCALE]), mult_from=-1)


@pytest.mark.parametrize("make", [lambda ps: FusedAdamW(ps, lr=1e-2, max_grad_norm=1.0), lambda ps: FusedLAMB(ps),
                                  lambda ps: FusedLARS(ps, lr=0.1), lambda ps: FusedLARS(ps, lr=0.1, max_grad_norm=0.5)],
                         ids=["adamw-clipped", "lamb", "lars", "lars-clipped"])
def test_a_large_loss_scale_steps_as_the_unscaled_grads(make, kernel_path):
    grads = _grads()
    runs = []
    for scale in (None, SCALE):
        g = torch.Generator().manual_seed(1)
        ps = [torch.nn.Parameter(torch.randn(t.shape, generator=g)) for t in grads]
        opt = make(ps)
        for _ in range(2):
            for p, t in zip(ps, grads):
                p.grad = t.clone() if scale is None else t * scale
            opt.step(grad_scale=None if scale is None else torch.tensor(scale))
        runs.append(ps)
    for i, (a, b) in enumerate(zip(*runs)):
        assert_close(b.detach(), a.detach(), msg=f"param {i}")
    start = torch.randn(grads[0].shape, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(runs[1][0].detach(), start)  # (it stepped: skipped steps left it as it was)
