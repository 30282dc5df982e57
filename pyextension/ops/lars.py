"""``zerofuse::lars_``: LARS with momentum over lists of tensors, in place (reference.lars_step).

The per-tensor norms of params and grads come from one zerofuse::l2norm launch over both lists.
Schema in csrc/registration.cpp; CPU kernel csrc/cpu/lars.cpp; CUDA kernels/optim.py.
"""
from __future__ import annotations

import torch

from zerofuse import reference
from zerofuse.kernels import optim as K
from zerofuse.ops import register
from zerofuse.ops._optim import (LIB, Prepared, call, lr_arg, check_no_overlap, check_norms, check_param_lists, direct,
                                 mutated, selftest_tensors)
from zerofuse.ops.l2norm import l2norm


def _check(params, grads, momentum_buffers, masters, norms):
    check_param_lists("lars_", params, {"grads": grads}, {"momentum_buffers": momentum_buffers}, masters)
    check_no_overlap("lars_", {"params": params, "momentum_buffers": momentum_buffers, "masters": masters})
    _check_norms(norms, len(params), params[0].device if params else None)


def _check_norms(norms, n, device):
    check_norms("lars_", norms, (2 * n,), device)


@torch.library.register_fake("zerofuse::lars_")
def _lars_fake(params, grads, momentum_buffers, masters, norms, lr, momentum, weight_decay, trust_coefficient, eps,
               grad_mult, found_inf):
    _check(params, grads, momentum_buffers, masters, norms)


def _lars_triton(params, grads, momentum_buffers, masters, norms, lr, momentum, weight_decay, trust_coefficient, eps,
                 grad_mult, found_inf):
    K.lars(_launch(params, grads, momentum_buffers, masters, norms), norms, lr=lr, momentum=momentum,
           weight_decay=weight_decay, trust_coefficient=trust_coefficient, eps=eps, has_master=bool(masters),
           grad_mult=grad_mult, found_inf=found_inf)


LIB.impl("lars_", _lars_triton, "CUDA")


def _launch(params, grads, momentum_buffers, masters, norms):
    _check(params, grads, momentum_buffers, masters, norms)
    return K.lars_launch(params, grads, momentum_buffers, masters)


def lars_(params, grads, momentum_buffers, *, lr, momentum, weight_decay, trust_coefficient, eps=1e-8, masters=(),
          grad_mult=None, found_inf=None, norms: torch.Tensor | None = None,
          prepared: Prepared | None = None) -> None:
    """One LARS step for every tensor. norms: (2n,) fp32, the norms of the params (their masters
    if given) then of the grads times grad_mult, e.g. summed over the ranks that hold pieces of the
    same params (ZeRO); None: computed here in one pass (l2norm's mult: a loss-scaled grad is
    unscaled before it is squared, where its squares overflowed fp32 and froze the tensor: a
    review's reproduction, 2026-12-07). prepared: as in adam_."""
    if not params:  # nothing to update (and no tensor to dispatch on)
        return
    params, grads, masters = list(params), list(grads), list(masters)
    if norms is None:
        _, norms = l2norm((masters or params) + grads, per_tensor=True, prepared=prepared, mult=grad_mult,
                          mult_from=len(params))
    if prepared is not None and direct(params):
        bufs = list(momentum_buffers)
        launch = prepared.launch("lars", params, grads, lambda: _launch(params, grads, bufs, masters, norms))
        _check_norms(norms, launch.n, launch.device)  # norms may be a new tensor at every call
        K.lars(launch, norms, lr=lr_arg(lr), momentum=float(momentum), weight_decay=float(weight_decay),
               trust_coefficient=float(trust_coefficient), eps=float(eps), has_master=bool(masters),
               grad_mult=grad_mult, found_inf=found_inf)
        mutated(params)
        return
    args = (params, grads, list(momentum_buffers), masters, norms, float(lr), float(momentum), float(weight_decay),
            float(trust_coefficient), float(eps), grad_mult, found_inf)
    call("lars_", _lars_triton, args)


def _selftest(device: torch.device) -> None:
    ps, refs, (bufs, _), (ref_bufs, _), _ = selftest_tensors(device)
    g = torch.Generator().manual_seed(1)
    shapes = [p.shape for p in ps]
    kw = dict(lr=0.1, momentum=0.9, weight_decay=1e-4, trust_coefficient=1e-3, eps=1e-8)
    for _ in range(2):
        grads = [torch.randn(s, generator=g).to(device) for s in shapes]
        lars_(ps, grads, bufs, **kw)
        reference.lars_step(refs, grads, ref_bufs, **kw)
    for p, r in zip(ps, refs):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-7)


register("zerofuse::lars_", "C++ (CPU), Triton (CUDA)", _selftest)
