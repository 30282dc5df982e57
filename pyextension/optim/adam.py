"""FusedAdam / FusedAdamW: torch.optim.Adam / AdamW with zerofuse's fused step.

Subclasses of torch's optimizers: constructor arguments and defaults, param groups, LR
schedulers, state_dict layout and keys ('step', 'exp_avg', 'exp_avg_sq') are torch's own, so a
checkpoint moves both ways. Only step() differs: the params of a group are updated by one call of
zerofuse::adam_ (one parallel pass on CPU, one launch per dtype pair on CUDA). Moments are kept in
fp32 whatever the param dtype; with master_weights=True, bf16/fp16 params also get an fp32 master
copy (state key 'master') that the kernel updates and rounds into the param. Extra keywords:
master_weights, max_grad_norm (clip the global grad norm, computed in one fused pass, before the
update; the norm is kept in ``last_grad_norm``).

step(closure=None, *, grad_scale=None, found_inf=None): grads are divided by grad_scale inside the
update; found_inf != 0 skips the step (see [Note: skipped steps] in _base.py).
"""
from __future__ import annotations

import torch

from zerofuse.ops import adam_
from zerofuse.optim._base import FusedOptimizerMixin, check_betas, check_real, check_unsupported


def _check(name, amsgrad, capturable, differentiable, fused, betas):
    check_unsupported(name, amsgrad=amsgrad, capturable=capturable, differentiable=differentiable)
    check_betas(name, betas)
    if fused is False:
        raise ValueError(f"zerofuse.optim.{name}: fused=False asks for an unfused step; use torch.optim.{name[5:]}")


class _FusedAdamBase(FusedOptimizerMixin):
    _STATE_KEYS = ("exp_avg", "exp_avg_sq")
    _decoupled: bool

    def _extra_defaults(self, master_weights, max_grad_norm):
        check_real(self._name(), "max_grad_norm", max_grad_norm, none=True)
        if max_grad_norm is not None and not max_grad_norm >= 0:  # 0: no clipping, as the other optimizers'
            raise ValueError(f"{self._name()}: expected max_grad_norm >= 0 or None (0: no clipping), got "
                             f"{max_grad_norm}")
        for key, value in (("master_weights", master_weights), ("max_grad_norm", max_grad_norm)):
            self.defaults[key] = value
            for group in self.param_groups:
                group.setdefault(key, value)

    def _check_group(self, group) -> None:
        if group.get("amsgrad"):  # (set in a group or loaded from torch.optim.Adam(amsgrad=True))
            raise ValueError(f"{self._name()}: amsgrad=True in a param group is not supported (no max_exp_avg_sq "
                             f"is kept); use torch.optim.{type(self).__name__[5:]}")

    def _update(self, group, params, grads, states, masters, steps, mult, found, prepared):
        beta1, beta2 = group["betas"]
        decoupled = bool(group.get("decoupled_weight_decay", self._decoupled))  # per group, as torch's
        adam_(params, grads, states[0], states[1], steps, lr=float(group["lr"]), beta1=float(beta1),
              beta2=float(beta2), eps=group["eps"], weight_decay=group["weight_decay"], decoupled=decoupled,
              maximize=group["maximize"], masters=masters, grad_mult=mult, found_inf=found, prepared=prepared)


class FusedAdam(_FusedAdamBase, torch.optim.Adam):
    """torch.optim.Adam (L2 weight decay; decoupled_weight_decay=True makes it AdamW) with a fused
    step; extra keywords: master_weights, max_grad_norm."""

    _decoupled = False  # (a class default: a deepcopied or unpickled optimizer keeps no instance attribute)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False, master_weights=False, max_grad_norm=None):
        _check("FusedAdam", amsgrad, capturable, differentiable, fused, betas)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize,
                         decoupled_weight_decay=decoupled_weight_decay)
        self._decoupled = decoupled_weight_decay
        self._extra_defaults(master_weights, max_grad_norm)


class FusedAdamW(_FusedAdamBase, torch.optim.AdamW):
    """torch.optim.AdamW (decoupled weight decay) with a fused step; extra keywords:
    master_weights, max_grad_norm."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 master_weights=False, max_grad_norm=None):
        _check("FusedAdamW", amsgrad, capturable, differentiable, fused, betas)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
        self._extra_defaults(master_weights, max_grad_norm)
