"""``zerofuse::adam_``: Adam / AdamW over lists of tensors (or one flat ZeRO shard), in place.

Schema in csrc/registration.cpp, CPU kernel in csrc/cpu/adam.cpp (vectorised, parallel). Fake impl
and the Python face here; the optimizers in zerofuse.optim call :func:`adam_`.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from zerofuse import reference
from zerofuse.ops import register


@torch.library.register_fake("zerofuse::adam_")
def _adam_fake(params, grads, exp_avgs, exp_avg_sqs, masters, lr, beta1, beta2, eps, weight_decay,
               bias_correction1, bias_correction2, decoupled, maximize, inv_grad_scale, found_inf):
    return None


def adam_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool = False,
    masters: Sequence[torch.Tensor] = (),
    inv_grad_scale: float = 1.0,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One Adam/AdamW step (see zerofuse.reference.adam_step) for every tensor of the lists, with
    optional fp32 master weights, grad unscaling and an inf flag that skips the step."""
    if step < 1:
        raise ValueError(f"zerofuse::adam_: expected step >= 1 (steps count from 1), got {step}")
    torch.ops.zerofuse.adam_(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(masters), float(lr), float(beta1),
        float(beta2), float(eps), float(weight_decay), 1.0 - beta1**step, 1.0 - beta2**step, bool(decoupled),
        bool(maximize), float(inv_grad_scale), found_inf,
    )


def _selftest(device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    shapes = [(37, 5), (1,), (0,), (4099,)]
    ps = [torch.randn(s, generator=g).to(device) for s in shapes]
    refs = [p.clone() for p in ps]
    state = [[torch.zeros_like(p) for p in ps] for _ in range(2)]
    ref_state = [[torch.zeros_like(p) for p in ps] for _ in range(2)]
    for step in (1, 2, 3):
        grads = [torch.randn(s, generator=g).to(device) for s in shapes]
        kw = dict(step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
        adam_(ps, grads, *state, decoupled=True, **kw)
        for i in range(len(ps)):
            reference.adam_step(refs[i], grads[i], ref_state[0][i], ref_state[1][i], **kw)
    for p, r in zip(ps, refs):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)


register("zerofuse::adam_", "C++", _selftest)
