"""The fused step of one param group of ``zerofuse.zero.Optimizer`` (zero/optimizer.py), a mixin:
Adam/AdamW over the group's merged runs, LAMB and LARS over its param pieces with the per-param
norms summed over the ranks between their passes, on step plans kept while the shards stay put."""
from __future__ import annotations

import torch

from zerofuse.kernels.common import upload
from zerofuse.ops import adam_, l2norm, lamb_stage1_, lamb_stage2_, lars_
from zerofuse.ops._optim import Prepared
from zerofuse.zero.options import STATE_KEYS


class _Lists:
    """A group's step plan (kept in the one StepPlans cache while the shards it views stay where
    they are): the views of its pieces per key ('param', 'grad', the state keys, 'master'), the
    ops' launch tables, and (LAMB/LARS) the piece -> param index on the device. Made at every step,
    these were hundreds of views and a host-to-device copy of the index (a host sync on CUDA).
    The 'grad' views are the plan's only references to the grad shards: ``release_grads`` drops
    them when the shards are freed (zero_grad(set_to_none=True) at stage 2/3), or the cache would
    keep every shard alive through the next forward and backward ([Note: bucket buffers])."""

    __slots__ = ("views", "prepared", "index", "grad_key")

    def __init__(self, views, index):
        self.views, self.index, self.prepared = views, index, Prepared()
        self.grad_key = None  # the grad shards' addresses views["grad"] was made from

    def release_grads(self) -> None:
        self.views["grad"], self.grad_key = None, None


class GroupSteps:
    """Reads the Optimizer's engine, unit_states, _plans, _runs/_device_runs/_pieces, _steps,
    kind and scale."""

    def _lists(self, gi: int, pieces) -> _Lists:
        """The group's views (see _Lists), made again when a unit's shard or grad shard moved (a
        grad shard may be a new buffer after a no_sync window) or the states were rebuilt."""
        bases, grads = {}, {}
        for pc in pieces:
            u = pc.unit
            if u.index not in bases:
                bases[u.index] = {"param": u.shard, **self.unit_states[u.index]}
                grads[u.index] = u.grad_shard()
        key = (tuple((i, tuple(t.data_ptr() for t in b.values())) for i, b in bases.items()), id(self.unit_states))

        def build():
            keys = ("param",) + STATE_KEYS[self.kind] + (("master",) if self.engine.dtype != torch.float32 else ())
            views = {k: [bases[pc.unit.index][k].narrow(0, pc.start, pc.length) for pc in pieces] for k in keys}
            views.setdefault("master", [])
            index = None
            if pieces and pieces[0].param is not None:
                index = upload(torch.tensor([pc.param for pc in pieces], dtype=torch.long), self.scale.device)
            return _Lists(views, index)

        lists = self._plans.get(gi, key, build)
        grad_key = tuple(g.data_ptr() for g in grads.values())
        if lists.grad_key != grad_key:  # made again after the shards were freed or moved
            lists.views["grad"] = [grads[pc.unit.index].narrow(0, pc.start, pc.length) for pc in pieces]
            lists.grad_key = grad_key
        return lists

    def _step_group(self, gi, group, mult, found):
        step = self._steps[gi]
        if self.kind in ("adam", "adamw"):
            runs = self._device_runs[gi]
            if not runs:  # no piece of the group here (or all on the host): count the step as the others do
                step += 1.0 if found is None else 1.0 - found
                return
            lists = self._lists(gi, runs)
            v = lists.views
            b1, b2 = group["betas"]
            adam_(v["param"], v["grad"], v["exp_avg"], v["exp_avg_sq"], [step] * len(runs), lr=self._lr(gi, group),
                  beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"],
                  decoupled=self.kind == "adamw", maximize=False, masters=v["master"], grad_mult=mult, found_inf=found,
                  prepared=lists.prepared)
        elif self.kind == "lamb":
            self._lamb(gi, group, mult, found, step)
        else:
            self._lars(gi, group, mult, found)

    def _lamb(self, gi, group, mult, found, step):
        pieces = self._pieces[gi]
        lists = self._lists(gi, pieces)
        v = lists.views
        b1, b2 = group["betas"]
        kw = dict(beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"],
                  bias_correction=group["bias_correction"], masters=v["master"], found_inf=found,
                  prepared=lists.prepared)
        norms = torch.zeros((len(pieces), 2), dtype=torch.float32, device=self.scale.device)
        steps = [step] * len(pieces)
        if pieces:
            lamb_stage1_(v["param"], v["grad"], v["exp_avg"], v["exp_avg_sq"], steps, norms, grad_mult=mult, **kw)
        norms = self._per_param_norms(norms, lists.index)
        if pieces:
            lamb_stage2_(v["param"], v["exp_avg"], v["exp_avg_sq"], steps, norms, lr=self._lr(gi, group),
                         mode=group["mode"], min_trust=group["min_trust"], max_trust=group["max_trust"], **kw)
        else:
            step += 1.0 if found is None else 1.0 - found

    def _lars(self, gi, group, mult, found):
        pieces = self._pieces[gi]
        lists = self._lists(gi, pieces)
        v = lists.views
        params, grads, masters = v["param"], v["grad"], v["master"]
        n = len(pieces)
        if n:
            _, each = l2norm((masters or params) + grads, per_tensor=True, prepared=lists.prepared, mult=mult,
                             mult_from=n)  # (the grads' norms times grad_mult: lars_'s norms)
            sums = (each.float() ** 2).reshape(2, n).t().contiguous()
        else:
            sums = torch.zeros((0, 2), dtype=torch.float32, device=self.scale.device)
        sums = self._per_param_norms(sums, lists.index)
        if not n:
            return
        lars_(params, grads, v["momentum_buffer"], lr=self._lr(gi, group), momentum=group["momentum"],
              weight_decay=group["weight_decay"], trust_coefficient=group["trust_coefficient"], eps=group["eps"],
              masters=masters, grad_mult=mult, found_inf=found, norms=sums.sqrt().t().contiguous().reshape(-1),
              prepared=lists.prepared)
