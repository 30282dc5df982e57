"""torch's own gradient functions and optimizers on a ZeRO model's params, which a DDP / FSDP2 user
calls out of habit: outside ``zerofuse.zero.full_grads`` those params' ``.grad`` is None (the grads
live in zerofuse's shards), so each saw no gradient and did nothing, silently. Installed at the
first ``parallelize`` (``install_torch_guards``); a param of a ZeRO model carries ``SHARDED``.

- ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` clips: the call is the model's
  ``zerofuse.zero.Optimizer``'s ``clip_grad_norm_`` (the global norm over every shard and rank,
  returned as torch's 0-d tensor; collective, as the DDP user calls it on every rank). It returned 0
  and clipped nothing (a warning once per process). Over a subset of the model's trainable params,
  or before the Optimizer exists, it is refused by name.
- torch's function bound before ``parallelize`` (``from torch.nn.utils import clip_grad_norm_`` at
  import) is not the attribute replaced here; the module global it calls to clip
  (``clip_grad._clip_grads_with_norm_``) is: it refuses a ZeRO model's params, naming the way out.
- ``clip_grad_value_`` is refused by name (torch's own "Expected !nested_tensorlist[0].empty()").
- ``p.grad = None`` for each param (the DDP habit in place of ``opt.zero_grad()``) clears nothing:
  a backward then adds into grads a step already took, which warns once (``stepped_grads_added``).
- An optimizer other than ``zerofuse.zero.Optimizer`` (``torch.optim.AdamW(model.parameters())``,
  ``zerofuse.optim.FusedAdamW``) over a ZeRO model's params is refused at its first step, by a
  global step pre-hook of torch.optim (checked once per optimizer): it stepped no param, silently
  (a review's reproductions, 2026-12-07).

Inside ``full_grads`` every param has its ``.grad``: torch's functions run as torch's.
"""
from __future__ import annotations

import functools
import warnings
import weakref

import torch

SHARDED = "_zerofuse_sharded_grad"  # set on every param of a ZeRO model: its grad lives in a shard
ENGINES: weakref.WeakSet = weakref.WeakSet()  # every ZeroEngine alive
_CHECKED: weakref.WeakSet = weakref.WeakSet()  # optimizers whose params were checked at their first step


def _unseen(params) -> list:
    """The params of a ZeRO model whose gradient torch would not see: trainable, .grad None, their
    model outside full_grads (inside it a param of a unit without grads this step has none too)."""
    out = [p for p in params if getattr(p, SHARDED, False) and p.requires_grad and p.grad is None]
    if out and any(e.grads_out and id(out[0]) in e.param_index for e in list(ENGINES)):
        return []
    return out


def _engine_of(params, who: str):
    """The one ZeRO engine holding every given param of a ZeRO model, all of its trainable params given."""
    ids = {id(p) for p in params}
    engines = [e for e in list(ENGINES) if any(i in e.param_index for i in ids)]
    if len(engines) != 1:
        raise RuntimeError(f"{who}: expected the params of one model made data-parallel by zerofuse.zero.parallelize, "
                           f"got params of {len(engines)}: clip each model with its Optimizer's clip_grad_norm_")
    eng = engines[0]
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
        if not _unseen(params):  # a plain model's, or inside full_grads: torch's
            return torch_norm(params, max_norm, norm_type, error_if_nonfinite, foreach)
        who = "torch.nn.utils.clip_grad_norm_"
        eng = _engine_of(params, who)
        opt = eng.live_optimizer()
        if opt is None:
            _refuse_unseen(who, "build zerofuse.zero.Optimizer(model, ...) first (this call is then its "
                                "clip_grad_norm_), or clip inside zerofuse.zero.full_grads(model)")
        return opt.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach).reshape(())

    @functools.wraps(torch_inner)
    def _clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if _unseen(params):
            _refuse_unseen("torch.nn.utils.clip_grad_norm_ (bound before zerofuse.zero.parallelize ran, e.g. `from "
                           "torch.nn.utils import clip_grad_norm_` at import: torch's own, which saw a norm of 0)",
                           "call torch.nn.utils.clip_grad_norm_ by its module (zerofuse's then clips), or the "
                           "Optimizer's clip_grad_norm_")
        return torch_inner(params, max_norm, total_norm, foreach)

    @functools.wraps(torch_value)
    def clip_grad_value_(parameters, clip_value, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if _unseen(params):
            _refuse_unseen("torch.nn.utils.clip_grad_value_", "call it inside zerofuse.zero.full_grads(model) (every "
                                                              "grad gathered whole), or clip by norm with the "
                                                              "Optimizer's max_grad_norm")
        return torch_value(params, clip_value, foreach)

    clip_grad_norm_._zerofuse_wrapped = True
    clip_grad.clip_grad_norm_ = torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    clip_grad._clip_grads_with_norm_ = _clip_grads_with_norm_
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
    """A backward began adding into grads the last step() took, with no zero_grad between (the
    engine's ``stepped``): torch accumulates too, but a DDP user clearing with ``p.grad = None``
    cleared nothing here, and every later step added up every earlier grad, silently (a review's
    reproduction, 2026-12-07). Warned once per process."""
    global _warned_stepped
    if _warned_stepped:
        return
    _warned_stepped = True
    warnings.warn("zerofuse.zero: a backward is adding into the gradients the last optimizer step already took (no "
                  "zero_grad() since): a ZeRO model's grads live in zerofuse's shards, so `p.grad = None` clears "
                  "nothing; call opt.zero_grad() (or model.zero_grad()) after each step", UserWarning, stacklevel=3)
