"""FusedAdam / FusedAdamW: torch.optim.Adam / AdamW with zerofuse's fused step.

Subclasses of torch's optimizers: constructor arguments and defaults, param groups, LR
schedulers, state_dict layout and keys ('step', 'exp_avg', 'exp_avg_sq') are torch's own, so a
checkpoint moves both ways. Only step() differs: every parameter of a group is updated by one
call of zerofuse::adam_ (one parallel pass over all tensors). Moments are kept in fp32 whatever
the parameter dtype; with master_weights=True, bf16/fp16 parameters also get an fp32 master copy
(state key 'master') that the kernel updates and rounds into the parameter.

step(closure=None, *, grad_scale=None, found_inf=None): grads are divided by grad_scale in the same
pass; if found_inf is nonzero nothing changes (params, moments, step counters).
"""
from __future__ import annotations

import torch

from zerofuse.ops import adam_

_LOW = (torch.bfloat16, torch.float16)


def _check_unsupported(name, amsgrad, capturable, differentiable, fused):
    for arg, value in (("amsgrad", amsgrad), ("capturable", capturable), ("differentiable", differentiable)):
        if value:
            raise ValueError(f"zerofuse.optim.{name}: {arg}=True is not supported (use torch.optim.{name[5:]})")
    if fused is False:
        raise ValueError(f"zerofuse.optim.{name}: fused=False asks for an unfused step; use torch.optim.{name[5:]}")


class _FusedAdamMixin:
    _decoupled: bool

    def load_state_dict(self, state_dict):
        """Also takes torch.optim's state dicts (no 'master_weights' in their groups)."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group.setdefault("master_weights", self.defaults["master_weights"])

    def _init_state(self, p, master_weights):
        state = self.state[p]
        if state:
            # states loaded from torch.optim follow the param's dtype: the kernel keeps fp32 moments
            for key in ("exp_avg", "exp_avg_sq"):
                if state[key].dtype != torch.float32:
                    state[key] = state[key].float()
            if master_weights and p.dtype in _LOW and "master" not in state:
                state["master"] = p.detach().float()
            return state
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        if master_weights and p.dtype in _LOW:
            state["master"] = p.detach().float()
        return state

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale=None, found_inf=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inv_scale = 1.0 if grad_scale is None else 1.0 / float(grad_scale)
        skip = found_inf is not None and bool(found_inf.ne(0).any())
        name = type(self).__name__
        for group in self.param_groups:
            items = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"zerofuse.optim.{name}: sparse gradients are not supported")
                if p.is_complex():
                    raise RuntimeError(f"zerofuse.optim.{name}: complex parameters are not supported")
                items.append((p, self._init_state(p, group["master_weights"])))
            if skip or not items:
                continue
            # one host read and one add for all step counters (per-param .item() and += cost
            # ~5 us each: a quarter of a 1M-parameter step)
            steps = [s["step"] for _, s in items]
            counts = torch.stack(steps).tolist()
            torch._foreach_add_(steps, 1.0)
            batches: dict[tuple, list] = {}  # parameters sharing a device, step count and master use
            for (p, s), count in zip(items, counts):
                batches.setdefault((p.device, int(count), "master" in s), []).append((p, s))
            beta1, beta2 = group["betas"]
            for (_, count, _), batch in batches.items():
                self._step_items(group, batch, count + 1, beta1, beta2, inv_scale)
        return loss

    def _step_items(self, group, items, step, beta1, beta2, inv_scale):
        if not items:
            return
        adam_(
            [p for p, _ in items],
            [p.grad if p.grad.is_contiguous() else p.grad.contiguous() for p, _ in items],
            [s["exp_avg"] for _, s in items],
            [s["exp_avg_sq"] for _, s in items],
            masters=[s["master"] for _, s in items if "master" in s],
            step=step,
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            decoupled=self._decoupled,
            maximize=group["maximize"],
            inv_grad_scale=inv_scale,
        )


class FusedAdam(_FusedAdamMixin, torch.optim.Adam):
    """torch.optim.Adam (L2 weight decay; decoupled_weight_decay=True makes it AdamW) with a fused
    step; extra keyword: master_weights."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False, master_weights=False):
        _check_unsupported("FusedAdam", amsgrad, capturable, differentiable, fused)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize,
                         decoupled_weight_decay=decoupled_weight_decay)
        self._decoupled = decoupled_weight_decay
        for group in self.param_groups:
            group.setdefault("master_weights", master_weights)
        self.defaults["master_weights"] = master_weights


class FusedAdamW(_FusedAdamMixin, torch.optim.AdamW):
    """torch.optim.AdamW (decoupled weight decay) with a fused step; extra keyword: master_weights."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 master_weights=False):
        _check_unsupported("FusedAdamW", amsgrad, capturable, differentiable, fused)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
        for group in self.param_groups:
            group.setdefault("master_weights", master_weights)
        self.defaults["master_weights"] = master_weights
