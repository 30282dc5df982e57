"""``zerofuse::lamb_`` and its two stages ``lamb_stage1_`` / ``lamb_stage2_``: LAMB over lists of tensors.

Stage 1 advances the step counters, updates the moments and writes, per tensor, (sum p^2,
sum u^2) into ``norms`` (n, 2); stage 2 applies ``p -= lr * trust * u``. The split lets ZeRO
all-reduce the sums of a tensor sharded over ranks between the stages; ``lamb_`` runs both (on
CPU blocked for the cache, so stage 2 reads p, m, v from cache, not memory). Math: zerofuse.reference.lamb_step. Schemas in
csrc/registration.cpp; CPU kernels csrc/cpu/lamb.cpp; CUDA kernels/lamb.py.
"""
from __future__ import annotations

import torch

from zerofuse import reference
from zerofuse.kernels import optim as K
from zerofuse.ops import register
from zerofuse.ops._optim import (LIB, Prepared, call, lr_arg, check_no_overlap, check_norms, check_param_lists, direct,
                                 mutated, selftest_tensors)

TRUST_MODES = {"paper": 0, "nvlamb": 1}


def _check_norms(op, norms, n, device):
    check_norms(op, norms, (n, 2), device)


def _check1(params, grads, exp_avgs, exp_avg_sqs, masters, steps, norms):
    check_param_lists("lamb_stage1_", params, {"grads": grads}, {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs},
                      masters, steps)
    check_no_overlap("lamb_stage1_", {"params": params, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs,
                                      "masters": masters})
    if norms is not None:  # None: checked at each call (a Prepared launch)
        _check_norms("lamb_stage1_", norms, len(params), params[0].device if params else None)


def _check2(params, exp_avgs, exp_avg_sqs, masters, steps, norms, trust_mode):
    check_param_lists("lamb_stage2_", params, {}, {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}, masters, steps)
    check_no_overlap("lamb_stage2_", {"params": params, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs,
                                      "masters": masters})
    if norms is not None:
        _check_norms("lamb_stage2_", norms, len(params), params[0].device if params else None)
    if trust_mode not in (0, 1):
        raise ValueError(f"zerofuse::lamb_stage2_: expected trust_mode 0 (paper) or 1 (nvlamb), got {trust_mode}")


@torch.library.register_fake("zerofuse::lamb_stage1_")
def _stage1_fake(params, grads, exp_avgs, exp_avg_sqs, masters, steps, beta1, beta2, eps, weight_decay,
                 bias_correction, grad_mult, found_inf, norms):
    _check1(params, grads, exp_avgs, exp_avg_sqs, masters, steps, norms)


@torch.library.register_fake("zerofuse::lamb_stage2_")
def _stage2_fake(params, exp_avgs, exp_avg_sqs, masters, steps, norms, lr, beta1, beta2, eps, weight_decay,
                 bias_correction, trust_mode, min_trust, max_trust, found_inf):
    _check2(params, exp_avgs, exp_avg_sqs, masters, steps, norms, trust_mode)


def _stage1_triton(params, grads, exp_avgs, exp_avg_sqs, masters, steps, beta1, beta2, eps, weight_decay,
                   bias_correction, grad_mult, found_inf, norms):
    _check1(params, grads, exp_avgs, exp_avg_sqs, masters, steps, norms)
    K.lamb_stage1(K.moment_launch(params, grads, exp_avgs, exp_avg_sqs, masters, steps), norms, beta1=beta1,
                  beta2=beta2, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                  has_master=bool(masters), grad_mult=grad_mult, found_inf=found_inf)


def _stage2_triton(params, exp_avgs, exp_avg_sqs, masters, steps, norms, lr, beta1, beta2, eps, weight_decay,
                   bias_correction, trust_mode, min_trust, max_trust, found_inf):
    _check2(params, exp_avgs, exp_avg_sqs, masters, steps, norms, trust_mode)
    K.lamb_stage2(K.moment_launch(params, None, exp_avgs, exp_avg_sqs, masters, steps), norms, lr=lr, beta1=beta1,
                  beta2=beta2, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                  trust_mode=trust_mode, min_trust=min_trust, max_trust=max_trust, has_master=bool(masters),
                  found_inf=found_inf)


@torch.library.register_fake("zerofuse::lamb_")
def _lamb_fake(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, beta1, beta2, eps, weight_decay,
               bias_correction, trust_mode, min_trust, max_trust, grad_mult, found_inf):
    _check1(params, grads, exp_avgs, exp_avg_sqs, masters, steps, None)
    _check2(params, exp_avgs, exp_avg_sqs, masters, steps, None, trust_mode)


def _launch(params, grads, exp_avgs, exp_avg_sqs, masters, steps):
    """The checks of both stages, then the kernel tables (stage 2 ignores the grads' row)."""
    _check1(params, grads, exp_avgs, exp_avg_sqs, masters, steps, None)
    _check2(params, exp_avgs, exp_avg_sqs, masters, steps, None, 0)
    return K.moment_launch(params, grads, exp_avgs, exp_avg_sqs, masters, steps)


def _lamb_triton(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, beta1, beta2, eps, weight_decay,
                 bias_correction, trust_mode, min_trust, max_trust, grad_mult, found_inf):
    _run(_launch(params, grads, exp_avgs, exp_avg_sqs, masters, steps), lr, beta1, beta2, eps, weight_decay,
         bias_correction, trust_mode, min_trust, max_trust, bool(masters), grad_mult, found_inf)


def _run(launch, lr, beta1, beta2, eps, weight_decay, bias_correction, trust_mode, min_trust, max_trust, has_master,
         grad_mult, found_inf):
    """Both stages over one launch (stage 2 ignores the grads' row): two kernel launches per dtype
    group, or one with K.LAMB_ONE_LAUNCH on ([Note: one-launch LAMB] in kernels/lamb.py)."""
    if K.LAMB_ONE_LAUNCH:
        K.lamb_fused(launch, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                     bias_correction=bias_correction, trust_mode=trust_mode, min_trust=min_trust, max_trust=max_trust,
                     has_master=has_master, grad_mult=grad_mult, found_inf=found_inf)
        return
    norms = torch.empty((launch.n, 2), device=launch.device, dtype=torch.float32)
    kw = dict(beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
              has_master=has_master, found_inf=found_inf)
    K.lamb_stage1(launch, norms, grad_mult=grad_mult, **kw)
    K.lamb_stage2(launch, norms, lr=lr, trust_mode=trust_mode, min_trust=min_trust, max_trust=max_trust,
                  rows_ready=True, **kw)


LIB.impl("lamb_", _lamb_triton, "CUDA")
LIB.impl("lamb_stage1_", _stage1_triton, "CUDA")
LIB.impl("lamb_stage2_", _stage2_triton, "CUDA")


def _mode(op, mode):
    if mode not in TRUST_MODES:
        raise ValueError(f"zerofuse::{op}: expected mode 'paper' or 'nvlamb', got {mode!r}")
    return TRUST_MODES[mode]


def lamb_(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay, bias_correction=True,
          mode="nvlamb", min_trust=0.0, max_trust=10.0, masters=(), grad_mult=None, found_inf=None,
          prepared: Prepared | None = None) -> None:
    """One LAMB step (reference.lamb_step, without the clipping: fold it into grad_mult) of every
    tensor; steps are advanced by 1 (not on a skipped step). prepared: as in adam_."""
    trust_mode = _mode("lamb_", mode)
    if not params:
        return
    if prepared is not None and direct(params):
        args = (params, grads, exp_avgs, exp_avg_sqs, masters, steps)
        _run(prepared.launch("lamb", params, grads, lambda: _launch(*map(list, args))), lr_arg(lr), float(beta1),
             float(beta2), float(eps), float(weight_decay), bool(bias_correction), trust_mode, float(min_trust),
             float(max_trust), bool(masters), grad_mult, found_inf)
        mutated(params)
        return
    args = (list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(masters), list(steps), float(lr),
            float(beta1), float(beta2), float(eps), float(weight_decay), bool(bias_correction), trust_mode,
            float(min_trust), float(max_trust), grad_mult, found_inf)
    call("lamb_", _lamb_triton, args)


def lamb_stage1_(params, grads, exp_avgs, exp_avg_sqs, steps, norms, *, beta1, beta2, eps, weight_decay,
                 bias_correction=True, masters=(), grad_mult=None, found_inf=None,
                 prepared: Prepared | None = None) -> None:
    """Advances steps, updates the moments of every tensor, and writes norms[i] = (sum p_i^2,
    sum u_i^2) (fp32, (n, 2)). prepared: as in adam_ (norms is checked at every call)."""
    if not params:
        return
    if prepared is not None and direct(params):
        args = (params, grads, exp_avgs, exp_avg_sqs, masters, steps)
        launch = prepared.launch("lamb", params, grads, lambda: _launch(*map(list, args)))
        _check_norms("lamb_stage1_", norms, launch.n, launch.device)
        K.lamb_stage1(launch, norms, beta1=float(beta1), beta2=float(beta2), eps=float(eps),
                      weight_decay=float(weight_decay), bias_correction=bool(bias_correction),
                      has_master=bool(masters), grad_mult=grad_mult, found_inf=found_inf)
        return  # the params are not written
    args = (list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(masters), list(steps), float(beta1),
            float(beta2), float(eps), float(weight_decay), bool(bias_correction), grad_mult, found_inf, norms)
    call("lamb_stage1_", _stage1_triton, args)


def lamb_stage2_(params, exp_avgs, exp_avg_sqs, steps, norms, *, lr, beta1, beta2, eps, weight_decay,
                 bias_correction=True, mode="nvlamb", min_trust=0.0, max_trust=10.0, masters=(),
                 found_inf=None, prepared: Prepared | None = None) -> None:
    """p -= lr * trust(norms) * u for every tensor; mode "paper" or "nvlamb" (reference.lamb_step).
    prepared: as in adam_ (norms is checked at every call)."""
    trust_mode = _mode("lamb_stage2_", mode)
    if not params:
        return
    if prepared is not None and direct(params):
        def build():
            lists = [list(t) for t in (params, exp_avgs, exp_avg_sqs, masters, steps)]
            _check2(*lists, None, trust_mode)
            return K.moment_launch(lists[0], None, *lists[1:])
        launch = prepared.launch("lamb_stage2", params, None, build)
        _check_norms("lamb_stage2_", norms, launch.n, launch.device)
        K.lamb_stage2(launch, norms, lr=lr_arg(lr), beta1=float(beta1), beta2=float(beta2), eps=float(eps),
                      weight_decay=float(weight_decay), bias_correction=bool(bias_correction), trust_mode=trust_mode,
                      min_trust=float(min_trust), max_trust=float(max_trust), has_master=bool(masters),
                      found_inf=found_inf)
        mutated(params)
        return
    args = (list(params), list(exp_avgs), list(exp_avg_sqs), list(masters), list(steps), norms, float(lr),
            float(beta1), float(beta2), float(eps), float(weight_decay), bool(bias_correction), trust_mode,
            float(min_trust), float(max_trust), found_inf)
    call("lamb_stage2_", _stage2_triton, args)


def _selftest(device: torch.device) -> None:
    ps, refs, state, ref_state, steps = selftest_tensors(device)
    g = torch.Generator().manual_seed(1)
    kw = dict(beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01)
    for step, mode in ((1, "nvlamb"), (2, "paper")):
        grads = [torch.randn(p.shape, generator=g).to(device) for p in ps]
        if step == 1:
            lamb_(ps, grads, *state, steps, lr=1e-2, mode=mode, **kw)
        else:
            norms = torch.empty((len(ps), 2), device=device)
            lamb_stage1_(ps, grads, *state, steps, norms, **kw)
            lamb_stage2_(ps, *state, steps, norms, lr=1e-2, mode=mode, **kw)
        reference.lamb_step(refs, grads, *ref_state, step=step, lr=1e-2, mode=mode, **kw)
    for p, r in zip(ps, refs):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


register("zerofuse::lamb_", "C++ (CPU), Triton (CUDA)", _selftest)
register("zerofuse::lamb_stage1_", "C++ (CPU), Triton (CUDA)", _selftest)
register("zerofuse::lamb_stage2_", "C++ (CPU), Triton (CUDA)", _selftest)
