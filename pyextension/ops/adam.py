"""``zerofuse::adam_``: Adam / AdamW over lists of tensors (or the segments of a flat ZeRO shard), in place.

Schema in csrc/registration.cpp; CPU kernel csrc/cpu/adam.cpp (vectorised, parallel); CUDA (and
CPU under ZEROFUSE_TRITON_ON_CPU=1) kernels/optim.py. Fake impl and the Python face here; the
optimizers in zerofuse.optim call :func:`adam_`.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from zerofuse import reference
from zerofuse.kernels import optim as K
from zerofuse.ops import register
from zerofuse.ops._optim import (LIB, Prepared, call, lr_arg, check_no_overlap, check_param_lists, direct, mutated,
                                 selftest_tensors)


def _check(params, grads, exp_avgs, exp_avg_sqs, masters, steps):
    check_param_lists("adam_", params, {"grads": grads}, {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs},
                      masters, steps)
    check_no_overlap("adam_", {"params": params, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "masters": masters})


@torch.library.register_fake("zerofuse::adam_")
def _adam_fake(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, beta1, beta2, eps, weight_decay,
               decoupled, maximize, grad_mult, found_inf):
    _check(params, grads, exp_avgs, exp_avg_sqs, masters, steps)


def _launch(params, grads, exp_avgs, exp_avg_sqs, masters, steps):
    """The op's checks, then the kernel tables."""
    _check(params, grads, exp_avgs, exp_avg_sqs, masters, steps)
    return K.moment_launch(params, grads, exp_avgs, exp_avg_sqs, masters, steps)


def _adam_triton(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, beta1, beta2, eps, weight_decay,
                 decoupled, maximize, grad_mult, found_inf):
    K.adam(_launch(params, grads, exp_avgs, exp_avg_sqs, masters, steps), lr=lr, beta1=beta1, beta2=beta2, eps=eps,
           weight_decay=weight_decay, decoupled=decoupled, maximize=maximize, has_master=bool(masters),
           grad_mult=grad_mult, found_inf=found_inf)


LIB.impl("adam_", _adam_triton, "CUDA")


def adam_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool = False,
    masters: Sequence[torch.Tensor] = (),
    grad_mult: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    prepared: Prepared | None = None,
) -> None:
    """One Adam/AdamW step (zerofuse.reference.adam_step) for every tensor of the lists, in place.

    steps[i] is the step count of params[i] (a 1-element float tensor, on the params' device for
    CUDA), advanced by 1 here before use (each distinct tensor once; not on a skipped step). Optional fp32 master weights (params written from
    them), grads multiplied by grad_mult (a 1-element tensor: 1 / loss scale, times a clipping
    factor), and found_inf (1-element tensor): nonzero skips the step, read by the kernel (no host
    sync on CUDA). prepared: launch tables kept between calls by an optimizer (see
    zerofuse.ops._optim.Prepared; its promise holds for the states, masters and steps)."""
    if not params:  # nothing to update (and no tensor to dispatch on)
        return
    if prepared is not None and direct(params):
        args = (params, grads, exp_avgs, exp_avg_sqs, masters, steps)
        K.adam(prepared.launch("adam", params, grads, lambda: _launch(*map(list, args))), lr=lr_arg(lr),
               beta1=float(beta1), beta2=float(beta2), eps=float(eps), weight_decay=float(weight_decay),
               decoupled=bool(decoupled), maximize=bool(maximize), has_master=bool(masters), grad_mult=grad_mult,
               found_inf=found_inf)
        mutated(params)
        return
    args = (list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(masters), list(steps), float(lr),
            float(beta1), float(beta2), float(eps), float(weight_decay), bool(decoupled), bool(maximize), grad_mult,
            found_inf)
    call("adam_", _adam_triton, args)


def _selftest(device: torch.device) -> None:
    ps, refs, state, ref_state, steps = selftest_tensors(device)
    g = torch.Generator().manual_seed(1)
    for step in (1, 2, 3):
        grads = [torch.randn(p.shape, generator=g).to(device) for p in ps]
        kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
        adam_(ps, grads, *state, steps, decoupled=True, **kw)
        for i in range(len(ps)):
            reference.adam_step(refs[i], grads[i], ref_state[0][i], ref_state[1][i], step=step, **kw)
    for p, r in zip(ps, refs):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)
    assert all(s.item() == 3 for s in steps)


register("zerofuse::adam_", "C++ (CPU), Triton (CUDA)", _selftest)
