"""FusedLAMB: LAMB (You et al. 2019) with a fused two-stage step (zerofuse::lamb_stage1_ / _stage2_).

Defaults follow Apex's FusedLAMB (lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
bias_correction=True, max_grad_norm=1.0). mode="nvlamb" (default; Apex with use_nvlamb=True):
trust ratio |p| / |u| (1 when either is 0) on every tensor; mode="paper": phi(|p|) / |u| with phi
clamping to [min_trust, max_trust] (Algorithm 2 of the paper). Grads are first clipped to a
global norm of max_grad_norm (None or 0: no clipping). State keys 'step', 'exp_avg', 'exp_avg_sq'
(+ 'master' with master_weights). The math is zerofuse.reference.lamb_step.
"""
from __future__ import annotations

import math
import numbers

import torch

from zerofuse.ops import lamb_
from zerofuse.ops.lamb import TRUST_MODES
from zerofuse.optim._base import FusedOptimizerMixin, check_betas, check_real


class FusedLAMB(FusedOptimizerMixin, torch.optim.Optimizer):
    _STATE_KEYS = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, *, bias_correction=True,
                 max_grad_norm=1.0, mode="nvlamb", min_trust=0.0, max_trust=10.0, master_weights=False):
        check_real("zerofuse.optim.FusedLAMB", "max_grad_norm", max_grad_norm, none=True)
        if max_grad_norm is not None and not max_grad_norm >= 0:
            raise ValueError(f"zerofuse.optim.FusedLAMB: expected max_grad_norm >= 0 or None, got {max_grad_norm}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        max_grad_norm=max_grad_norm, mode=mode, min_trust=min_trust, max_trust=max_trust,
                        master_weights=master_weights)
        self._check_group(defaults)
        super().__init__(params, defaults)

    def _check_group(self, group) -> None:
        """The constructor's checks, on every group before any is stepped: a group added or edited
        with mode="nvLAMB" was refused inside the kernel call after the groups before it had stepped,
        and min_trust > max_trust or a beta2 of 1.5 ran (a review's reproduction, 2026-12-07)."""
        name = "zerofuse.optim.FusedLAMB"
        check_betas("FusedLAMB", group["betas"])
        for arg in ("lr", "eps", "weight_decay", "min_trust", "max_trust"):
            check_real(name, arg, group[arg])
        bc = group["bias_correction"]  # ("no" was taken as True; Apex's 0 and 1 and numpy's bools are taken)
        if not (isinstance(bc, numbers.Integral) and bc in (0, 1) or type(bc).__module__ == "numpy" and bc in (0, 1)):
            raise TypeError(f"{name}: expected bias_correction True or False, got {bc!r}")
        for arg in ("eps", "weight_decay"):
            value = group[arg]
            if not (value >= 0 and math.isfinite(value)):  # inf: NaN params
                raise ValueError(f"{name}: expected {arg} finite and >= 0, got {value}")
        lr = group["lr"]
        if not torch.is_tensor(lr) and not (lr >= 0 and math.isfinite(lr)):
            raise ValueError(f"{name}: expected lr finite and >= 0, got {lr}")
        if group["mode"] not in TRUST_MODES:
            raise ValueError(f"{name}: expected mode 'paper' or 'nvlamb', got {group['mode']!r}")
        if not 0 <= group["min_trust"] <= group["max_trust"]:
            raise ValueError(f"{name}: expected 0 <= min_trust <= max_trust, got {group['min_trust']}, "
                             f"{group['max_trust']}")
        # other optimizers' options LAMB has none of (maximize=True descended, silently; a review's
        # reproduction, 2026-12-07), as FusedLARS refuses SGD's
        for arg in ("maximize", "amsgrad", "nesterov"):
            if group.get(arg):
                raise ValueError(f"{name}: {arg}=True in a param group is not supported by LAMB")
        if group.get("grad_averaging", True) is False:
            raise ValueError(f"{name}: grad_averaging=False in a param group (Apex's) is not supported: LAMB here "
                             "averages the gradients into exp_avg with (1 - beta1)")

    def _update(self, group, params, grads, states, masters, steps, mult, found, prepared):
        beta1, beta2 = group["betas"]
        lamb_(params, grads, states[0], states[1], steps, lr=float(group["lr"]), beta1=beta1, beta2=beta2,
              eps=group["eps"], weight_decay=group["weight_decay"], bias_correction=group["bias_correction"],
              mode=group["mode"], min_trust=group["min_trust"], max_trust=group["max_trust"], masters=masters,
              grad_mult=mult, found_inf=found, prepared=prepared)
