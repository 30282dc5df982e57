"""Materializing a model built on the meta device, one bucket at a time (see zerofuse.zero.parallelize):
the values of a bucket's params come from ``param_init_fn(module)`` while that bucket is the only
full one, so at stage 3 the model never exists whole on a rank. Frozen params and buffers are
allocated first (materialize_rest) and written by the same init: of the modules holding a
trainable param as their bucket is made, of the others at the end (Initializer.finish)."""
from __future__ import annotations

import torch

from zerofuse.tp.spec import swap_keeping_marks


class Initializer:
    """Values for the params of a model built on the meta device, one bucket at a time: each module
    holding a param of the bucket runs ``param_init_fn(module)`` (the argument, else the model's own
    ``param_init_fn`` method, else ``module.reset_parameters()``). A module's params that live in
    another bucket are scratch stand-ins meanwhile (their writes are dropped: they are initialised
    with their own bucket)."""

    def __init__(self, model, param_init_fn, rest=()):
        self.fn = param_init_fn or getattr(model, "param_init_fn", None)
        self.rest = list(rest)  # modules holding frozen params or buffers made by materialize_rest
        self.done: set[int] = set()  # modules initialised
        self.names = {id(m): n for n, m in model.named_modules()}
        self.holders: dict[int, list] = {}  # id(param) -> modules holding it directly, in module order
        for m in model.modules():
            for p in m.parameters(recurse=False):
                self.holders.setdefault(id(p), []).append(m)

    def run(self, params) -> None:
        mine = {id(p) for p in params}
        mods = list({id(m): m for p in params for m in self.holders[id(p)]}.values())
        saved = []
        for m in mods:  # another bucket's trainable params: stand-ins (its own init sets them); frozen ones take the writes
            for q in m.parameters(recurse=False):
                if id(q) not in mine and not q.is_meta and q.requires_grad:
                    saved.append((q, q.data))
                    q.data = torch.empty_like(q)
        try:
            for m in mods:
                self._init(m)
        finally:
            for q, d in saved:
                q.data = d

    def finish(self) -> None:
        """The modules whose frozen params or buffers no bucket's init wrote (they hold no
        trainable param): initialised now (they were left as allocated: garbage)."""
        with torch.no_grad():
            for m in self.rest:
                if id(m) not in self.done:
                    self._init(m)

    def _init(self, m) -> None:
        if self.fn is not None:
            self.fn(m)
        elif hasattr(m, "reset_parameters"):
            m.reset_parameters()
        else:
            raise ValueError(f"zerofuse.zero.parallelize: module {self.names.get(id(m), '?')!r} "
                             f"({type(m).__name__}) holds parameters or buffers on the meta device and has no "
                             "reset_parameters(); pass param_init_fn=callable(module) to initialise them")
        self.done.add(id(m))


def materialize_rest(model, device, dtype) -> list:
    """A meta model's buffers and frozen params, allocated (uninitialised, as ``Module.to_empty``)
    on ``device``; floating ones in the run's dtype; returns the modules holding them (the
    Initializer writes their values). Trainable params are the buckets' business."""
    made = []
    for m in model.modules():
        before = len(made)
        fp32 = getattr(m, "fp32_buffers", ())  # kept fp32 whatever the run's dtype (moe.Router's expert_bias)
        for key, b in m._buffers.items():
            if b is not None and b.is_meta:
                keep = not b.is_floating_point() or key in fp32
                m._buffers[key] = torch.empty_like(b, device=device, dtype=b.dtype if keep else dtype)
                made.append(m)
        for p in m.parameters(recurse=False):
            if p.is_meta and not p.requires_grad:
                t = torch.empty_like(p, device=device, dtype=dtype if p.is_floating_point() else p.dtype)
                swap_keeping_marks(p, t)
                made.append(m)
        del made[before + 1:]  # once each
    return made
