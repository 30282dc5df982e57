"""FusedLARS: LARS with momentum (You, Gitman & Ginsburg 2017, Algorithm 1), fused.

Per tensor: local_lr = trust_coefficient * |p| / (|g| + weight_decay * |p| + eps) (1 when a norm
is 0, as NVIDIA's LARC), buf = momentum * buf + lr * local_lr * (g + weight_decay * p), p -= buf.
The norms of all params and grads come from one zerofuse::l2norm pass, the update from one
zerofuse::lars_ pass. State key 'momentum_buffer' (as torch.optim.SGD), + 'master' with
master_weights. The math is zerofuse.reference.lars_step.
"""
from __future__ import annotations

import math

import torch

from zerofuse.ops import lars_
from zerofuse.optim._base import FusedOptimizerMixin


class FusedLARS(FusedOptimizerMixin, torch.optim.Optimizer):
    _STATE_KEYS = ("momentum_buffer",)
    _USES_STEP = False

    def __init__(self, params, lr=0.1, momentum=0.9, weight_decay=0.0, *, trust_coefficient=1e-3, eps=1e-8,
                 max_grad_norm=None, master_weights=False):
        name = "zerofuse.optim.FusedLARS"
        for arg, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay),
                           ("trust_coefficient", trust_coefficient), ("eps", eps)):
            if not (value >= 0 and math.isfinite(value)):  # inf: NaN params
                raise ValueError(f"{name}: expected {arg} finite and >= 0, got {value}")
        if max_grad_norm is not None and not max_grad_norm >= 0:  # 0: no clipping
            raise ValueError(f"{name}: expected max_grad_norm >= 0 or None, got {max_grad_norm}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient,
                        eps=eps, max_grad_norm=max_grad_norm, master_weights=master_weights)
        super().__init__(params, defaults)

    def _update(self, group, params, grads, states, masters, steps, mult, found, prepared):
        lars_(params, grads, states[0], lr=float(group["lr"]), momentum=group["momentum"],
              weight_decay=group["weight_decay"], trust_coefficient=group["trust_coefficient"], eps=group["eps"],
              masters=masters, grad_mult=mult, found_inf=found, prepared=prepared)
