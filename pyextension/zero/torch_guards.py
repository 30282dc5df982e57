"""torch's own gradient functions and optimizers on a ZeRO model's params, which a DDP / FSDP2 user
calls out of habit: outside ``zerofuse.zero.full_grads`` the grads live in zerofuse's shards and
``.grad`` is None (over one rank it holds autograd's last backward only, until a step or the end of
a ``no_sync()`` takes it into the buckets), so each saw no gradient, or part of it, and did nothing
or the wrong thing, silently. Installed at the first ``parallelize`` (``install_torch_guards``); a
param of a ZeRO model carries ``SHARDED``. Inside ``full_grads`` torch's functions run as torch's.

- ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` clips: the call is the model's
  ``zerofuse.zero.Optimizer``'s ``clip_grad_norm_`` (the global norm over every shard and rank,
  returned as torch's 0-d tensor; collective, as the DDP user calls it on every rank). It returned 0
  and clipped nothing (a warning once per process). A subset of the model's trainable params, or
  other params with them, are refused by name, and so is a call before the Optimizer exists where
  a .grad is None.
- torch's function bound before ``parallelize`` (``from torch.nn.utils import clip_grad_norm_`` at
  import) is not the attribute replaced here; the module global it calls to clip
  (``clip_grad._clip_grads_with_norm_``, public as ``torch.nn.utils.clip_grads_with_norm_``) is: it
  refuses a ZeRO model's params whose .grad is None, or over one rank part of their gradient (a
  no_sync() window's taken into the buckets), naming the way out.
- ``clip_grad_value_`` is refused by name outside full_grads (torch's own "Expected
  !nested_tensorlist[0].empty()", or over one rank the last micro-batch's grads clipped).
- ``p.grad = None`` for each param (the DDP habit in place of ``opt.zero_grad()``) clears nothing:
  a backward then adds into grads a step already took, and the step after it warns once
  (``stepped_grads_added``; the engine's ``backward_began`` marks it: the grad hooks, stage 3's
  pre-backward hook, over one rank the grads taken from .grad). A zero_grad before that step (a
  GAN's discriminator, whose grads the generator's backward adds to) clears the mark.
- An optimizer other than ``zerofuse.zero.Optimizer`` (``torch.optim.AdamW(model.parameters())``,
  ``zerofuse.optim.FusedAdamW``) over a ZeRO model's params is refused at its first step, by a
  global step pre-hook of torch.optim (checked once per optimizer): over several ranks it stepped
  no param, over one rank autograd's last .grad (the micro-batches before a no_sync() window's end
  left out).

(a review's reproductions, 2026-12-07)
"""
from __future__ import annotations

import functools
import warnings
import weakref

import torch

SHARDED = "_zerofuse_sharded_grad"  # set on every param of a ZeRO model: its grad lives in a shard
ENGINES: weakref.WeakSet = weakref.WeakSet()  # every ZeroEngine alive
_CHECKED: weakref.WeakSet = weakref.WeakSet()  # optimizers whose params were checked at their first step


def _holder(p):
    """The ZeRO engine whose buckets hold param p (None: none alive)."""
    return next((e for e in list(ENGINES) if id(p) in e.param_index), None)


def _sharded(params) -> list:
    """The trainable params of ZeRO models among ``params``, their model outside full_grads (inside
    it every one has its whole .grad: torch's functions run as torch's). Their .grad is None, or
    over one rank autograd's last backward only (grads accumulated under no_sync() moved into the
    buckets already): torch's functions see none, or part, of their gradient."""
    out = [p for p in params if getattr(p, SHARDED, False) and p.requires_grad]
    if out and (eng := _holder(out[0])) is not None and eng.grads_out:
        return []
    return out


def _unseen(sharded) -> list:
    """Those of _sharded's params whose .grad is None (what torch's clip saw as no gradient: a norm of 0)."""
    return [p for p in sharded if p.grad is None]


def _taken(sharded) -> bool:
    """Over one rank (no grad hooks): whether the buckets of _sharded's params' ZeRO model hold grads
    taken from .grad already (the end of a no_sync() window): .grad is then the last backward's only."""
    eng = _holder(sharded[0]) if sharded else None
    return eng is not None and eng.hookless and any(u.dirty or u.has_grad() for u in eng.units)


def _engine_of(params, who: str):
    """The one ZeRO engine holding every given param, all of its trainable params given."""
    ids = {id(p) for p in params}
    engines = [e for e in list(ENGINES) if any(i in e.param_index for i in ids)]
    if len(engines) != 1:
        raise RuntimeError(f"{who}: expected the params of one model made data-parallel by zerofuse.zero.parallelize, "
                           f"got params of {len(engines)}: clip each model with its Optimizer's clip_grad_norm_")
    eng = engines[0]
    others = sum(1 for p in params if id(p) not in eng.param_index and p.grad is not None)  # (frozen ones: none)
    if others:  # (their grads were left out of the norm and unclipped, silently: a review, 2026-12-07)
        raise RuntimeError(f"{who}: expected only the params of the model made data-parallel by "
                           f"zerofuse.zero.parallelize (the norm is its Optimizer's), got {others} other param(s) too: "
                           "clip them apart, or all inside zerofuse.zero.full_grads(model) with torch's function")
    missing = [n for n, p in zip(eng.names, eng.params) if p.requires_grad and id(p) not in ids]
    if missing:
        raise RuntimeError(f"{who}: expected every trainable param of the ZeRO model (its gradients live in "
                           f"zerofuse's shards: the norm is the Optimizer's, over all of them), got a subset without "
                           f"{missing[:3]}{' ...' if len(missing) > 3 else ''}: clip a subset inside "
                           "zerofuse.zero.full_grads(model), where each param has its .grad")
    return eng


def _refuse_unseen(who: str, way: str) -> None:
    raise RuntimeError(f"{who} was called on params of a model made data-parallel by zerofuse.zero.parallelize: their "
                       f"gradients live in zerofuse's shards (.grad is None outside zerofuse.zero.full_grads), so it "
                       f"would see none and do nothing; {way}")


def install_torch_guards() -> None:
    """Replaces torch.nn.utils' clip_grad_norm_ / clip_grad_value_ and the clip's inner global, and
    registers the optimizers' step pre-hook, once per process (see the module's doc)."""
    from torch.nn.utils import clip_grad
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    if getattr(clip_grad.clip_grad_norm_, "_zerofuse_wrapped", False):
        return
    torch_norm, torch_inner, torch_value = (clip_grad.clip_grad_norm_, clip_grad._clip_grads_with_norm_,
                                            clip_grad.clip_grad_value_)

    @functools.wraps(torch_norm)
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        sharded = _sharded(params)
        if not sharded:  # a plain model's, or inside full_grads: torch's
            return torch_norm(params, max_norm, norm_type, error_if_nonfinite, foreach)
        who = "torch.nn.utils.clip_grad_norm_"
        eng = _engine_of(params, who)
        opt = eng.live_optimizer()
        if opt is None:
            if not _unseen(sharded):  # (one rank, every .grad autograd's: nothing in the buckets yet)
                return torch_norm(params, max_norm, norm_type, error_if_nonfinite, foreach)
            _refuse_unseen(who, "build zerofuse.zero.Optimizer(model, ...) first (this call is then its "
                                "clip_grad_norm_), or clip inside zerofuse.zero.full_grads(model)")
        # (over one rank too: torch's clipped the last backward's .grad only where no_sync() had moved
        # the earlier micro-batches' into the buckets; the Optimizer's takes .grad in first)
        return opt.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach).reshape(())

    @functools.wraps(torch_inner)
    def _clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        sharded = _sharded(params)
        if _unseen(sharded) or _taken(sharded):  # (over one rank after no_sync(): the last micro-batch's .grad)
            _refuse_unseen("torch.nn.utils.clip_grad_norm_ (bound before zerofuse.zero.parallelize ran, e.g. `from "
                           "torch.nn.utils import clip_grad_norm_` at import: torch's own, which saw none or part "
                           "of it)",
                           "call torch.nn.utils.clip_grad_norm_ by its module (zerofuse's then clips), or the "
                           "Optimizer's clip_grad_norm_")
        return torch_inner(params, max_norm, total_norm, foreach)

    @functools.wraps(torch_value)
    def clip_grad_value_(parameters, clip_value, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if _sharded(params):  # (over one rank too: the .grad of the last backward only, after no_sync())
            _refuse_unseen("torch.nn.utils.clip_grad_value_", "call it inside zerofuse.zero.full_grads(model) (every "
                                                              "grad gathered whole), or clip by norm with the "
                                                              "Optimizer's max_grad_norm")
        return torch_value(params, clip_value, foreach)

    clip_grad_norm_._zerofuse_wrapped = True
    clip_grad.clip_grad_norm_ = torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    # (the module global torch's clip_grad_norm_ calls, and torch.nn.utils' public name of it)
    clip_grad._clip_grads_with_norm_ = torch.nn.utils.clip_grads_with_norm_ = _clip_grads_with_norm_
    clip_grad.clip_grad_value_ = torch.nn.utils.clip_grad_value_ = clip_grad_value_
    register_optimizer_step_pre_hook(_foreign_optimizer_step)


def _foreign_optimizer_step(optimizer, _args, _kwargs) -> None:
    """torch.optim's global step pre-hook: at an optimizer's first step, one that is not
    zerofuse.zero.Optimizer over a ZeRO model's params is refused (it stepped nothing: every .grad None)."""
    if optimizer in _CHECKED:
        return
    from zerofuse.zero.optimizer import Optimizer  # noqa: PLC0415 - (it imports the engine, which installs this)

    if not isinstance(optimizer, Optimizer):
        for g in optimizer.param_groups:
            if any(getattr(p, SHARDED, False) for p in g["params"]):
                raise RuntimeError(f"{type(optimizer).__name__}.step: its params belong to a model made data-parallel "
                                   "by zerofuse.zero.parallelize, whose gradients live in zerofuse's shards (.grad is "
                                   "None): it would step no param. Build zerofuse.zero.Optimizer(model, 'adamw', lr=..., "
                                   "...) instead (torch's hyperparameters, param groups and lr schedulers)")
    _CHECKED.add(optimizer)


_warned_stepped = False


def stepped_grads_added() -> None:
    """At a step: a backward added into grads the last step() took, with no zero_grad between (the
    engine's ``stale_added``): torch accumulates too, but a DDP user clearing with ``p.grad = None``
    cleared nothing here, and every later step added up every earlier grad, silently (a review's
    reproduction, 2026-12-07). Warned once per process."""
    global _warned_stepped
    if _warned_stepped:
        return
    _warned_stepped = True
    warnings.warn("zerofuse.zero: this step takes gradients a backward added to the ones the last step already took "
                  "(no zero_grad() since): a ZeRO model's grads live in zerofuse's shards, so `p.grad = None` clears "
                  "nothing; call opt.zero_grad() (or model.zero_grad()) after each step", UserWarning, stacklevel=3)


class TorchHabits:
    """The engine's side (a mixin of ZeroEngine, which sets ``stepped``)."""

    def backward_began(self) -> None:
        """A backward's first grads arrive (a hooked one's, stage 3's pre-backward, over one rank
        the grads taken from .grad): into grads a step took, if no zero_grad came between; the
        next step() warns if still so (stepped_grads_added)."""
        if self.stepped:
            self.stale_added = True

    def __reduce_ex__(self, protocol):
        """copy.deepcopy or pickling of a parallelized model (an EMA or teacher copy): refused by name
        (torch's "cannot pickle 'ProcessGroup' object" before)."""
        raise TypeError("zerofuse.zero: a model made data-parallel by zerofuse.zero.parallelize cannot be copied or "
                        "pickled (it holds process groups and shards of the others' params): copy the model before "
                        "parallelize, or load a copy from its state_dict() (stage 3: inside full_params)")

