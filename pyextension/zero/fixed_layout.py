"""What parallelize fixes when it lays out its buckets: each param's dtype and device, and which
params train.

Module conversions after parallelize. A parallelized model's params are views into zerofuse's
buckets (zero/buckets.py); ``Module.to()``, ``.float()``, ``.half()``, ``.bfloat16()``, ``.cuda()``
and the like replace a param's ``.data`` with a converted copy, after which the model reads tensors
that no bucket, hook or optimizer sees: training silently stopped (stages 0-2: the same loss step
after step) or failed inside a kernel with a dtype error (stage 3). ``guard_conversions`` shadows
``_apply`` (the one method every conversion goes through) on each module holding a parallelized
param: a conversion that would replace one raises before anything is converted (a module checks
every param below it, so no buffer of a sibling is converted first), naming the param and what to
do instead; conversions that change nothing (``model.to`` its own device and dtype, as trainers
call it) pass.

requires_grad changed after parallelize: a param frozen then was never stepped once unfrozen, and one
frozen since was still stepped (on zero grads: weight decay and momentum moved it) where torch.optim
skips a param without a grad. ``TrainableCheck`` (each ``zero.Optimizer.step``: one pass over the
params' flags) raises naming the param.
"""
from __future__ import annotations

import operator

import torch

_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def guard_conversions(model: torch.nn.Module, managed) -> None:
    for prefix, mod in model.named_modules():
        mine = [(f"{prefix}.{n}" if prefix else n, p) for n, p in mod.named_parameters()
                if id(p) in managed]
        if mine:
            mod._apply = _guarded(mod._apply, mine)  # an instance attribute: shadows Module._apply


def _guarded(apply, mine):
    def _apply(fn, recurse=True):
        for name, p in mine:
            if fn(p) is not p:
                raise RuntimeError(
                    f"zerofuse.zero: a module conversion (to / float / half / bfloat16 / cuda / ...) after "
                    f"parallelize would replace {name}'s data ({p.dtype}, {p.device}), a view into zerofuse's "
                    f"buckets, with a copy no optimizer steps; convert the model before zerofuse.zero.parallelize "
                    f"(its precision= sets the params' dtype; a model built on the meta device materializes on device=)")
        return apply(fn, recurse)

    return _apply


class TrainableCheck:
    def __init__(self, model: torch.nn.Module, managed):  # (ids of the params parallelize took)
        self.named = list(model.named_parameters())
        self.params = [p for _, p in self.named]
        self.flags = [id(p) in managed for p in self.params]

    def __call__(self) -> None:
        if list(map(_REQUIRES_GRAD, self.params)) == self.flags:  # (GPT-2 124M, 148 params: 23 us here)
            return
        name, was = next((n, f) for (n, p), f in zip(self.named, self.flags) if p.requires_grad != f)
        raise RuntimeError(
            f"zerofuse.zero: {name}.requires_grad changed after parallelize (was {was}, now {not was}): the params "
            f"that train are fixed when parallelize lays out its buckets (a param unfrozen since is never stepped, "
            f"one frozen since would still be stepped on zero grads); set requires_grad before "
            f"zerofuse.zero.parallelize")
