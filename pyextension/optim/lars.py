"""FusedLARS: LARS with momentum (You, Gitman & Ginsburg 2017, Algorithm 1), fused.

Per tensor: local_lr = trust_coefficient * |p| / (|g| + weight_decay * |p| + eps) (1 when a norm
is 0, as NVIDIA's LARC), buf = momentum * buf + lr * local_lr * (g + weight_decay * p), p -= buf,
with no weight decay where a norm is 0 (LARC's: a param with all-zero grads is not decayed).
The norms of all params and grads come from one zerofuse::l2norm pass, the update from one
zerofuse::lars_ pass. State key 'momentum_buffer' (as torch.optim.SGD), + 'master' with
master_weights. The math is zerofuse.reference.lars_step.
"""
from __future__ import annotations

import math

import torch

from zerofuse.ops import lars_
from zerofuse.optim._base import FusedOptimizerMixin, check_real


class FusedLARS(FusedOptimizerMixin, torch.optim.Optimizer):
    _STATE_KEYS = ("momentum_buffer",)
    _USES_STEP = False

    def __init__(self, params, lr=0.1, momentum=0.9, weight_decay=0.0, *, trust_coefficient=1e-3, eps=1e-8,
                 max_grad_norm=None, master_weights=False):
        check_real("zerofuse.optim.FusedLARS", "max_grad_norm", max_grad_norm, none=True)
        if max_grad_norm is not None and not max_grad_norm >= 0:  # 0: no clipping
            raise ValueError(f"zerofuse.optim.FusedLARS: expected max_grad_norm >= 0 or None, got {max_grad_norm}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient,
                        eps=eps, max_grad_norm=max_grad_norm, master_weights=master_weights)
        self._check_group(defaults)
        super().__init__(params, defaults)

    def _check_group(self, group) -> None:
        """The constructor's checks on every group before any is stepped, and torch.optim.SGD's options
        LARS has none of (a group loaded from an SGD state_dict with nesterov or maximize stepped
        without them, silently: maximize descended; a review's reproduction, 2026-12-07)."""
        name = "zerofuse.optim.FusedLARS"
        for arg in ("lr", "momentum", "weight_decay", "trust_coefficient", "eps"):
            value = group[arg]
            if arg == "lr" and torch.is_tensor(value):
                continue
            check_real(name, arg, value)
            if not (value >= 0 and math.isfinite(value)):  # inf: NaN params
                raise ValueError(f"{name}: expected {arg} finite and >= 0, got {value}")
        for arg in ("nesterov", "maximize"):
            if group.get(arg):
                raise ValueError(f"{name}: {arg}=True in a param group (torch.optim.SGD's) is not supported by LARS; "
                                 "use torch.optim.SGD")
        if group.get("dampening"):
            raise ValueError(f"{name}: dampening={group['dampening']} in a param group (torch.optim.SGD's) is not "
                             "supported by LARS (expected 0); use torch.optim.SGD")

    def _update(self, group, params, grads, states, masters, steps, mult, found, prepared):
        lars_(params, grads, states[0], lr=float(group["lr"]), momentum=group["momentum"],
              weight_decay=group["weight_decay"], trust_coefficient=group["trust_coefficient"], eps=group["eps"],
              masters=masters, grad_mult=mult, found_inf=found, prepared=prepared)
