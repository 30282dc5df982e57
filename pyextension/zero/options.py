"""zerofuse.zero's options: zerofuse.zero.Optimizer's optimizers, their defaults and state keys,
the checks of hyperparameters and loss-scaler settings, and the checks of parallelize's arguments
(before anything is built)."""
from __future__ import annotations

import math
import numbers

import torch

from zerofuse.ops.lamb import TRUST_MODES
from zerofuse.optim._base import check_real

NAME = "zerofuse.zero.Optimizer"
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

DEFAULTS = {
    "adamw": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2),
    "adam": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
    # Apex FusedLAMB's defaults (nvlamb: global grad-norm clipping at 1.0 first)
    "lamb": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True, mode="nvlamb",
                 min_trust=0.0, max_trust=10.0),
    "lars": dict(lr=0.1, momentum=0.9, weight_decay=0.0, trust_coefficient=1e-3, eps=1e-8),
}
STATE_KEYS = {"adamw": ("exp_avg", "exp_avg_sq"), "adam": ("exp_avg", "exp_avg_sq"),
              "lamb": ("exp_avg", "exp_avg_sq"), "lars": ("momentum_buffer",)}


def check_options(opts: dict, where: str) -> None:
    """Hyperparameters (the defaults, where=""; a group's overrides, where="param_groups[i]"):
    values the kernels would turn into NaN or a silently wrong step are refused."""
    def name(arg):
        return f"{where}['{arg}']" if where else arg

    for arg in ("lr", "eps", "weight_decay", "momentum", "trust_coefficient", "min_trust", "max_trust"):
        if arg not in opts or torch.is_tensor(opts[arg]):
            continue
        value = opts[arg]
        check_real(NAME, name(arg), value)  # (numpy floats are numbers: a scheduler's)
        if not value >= 0 or (arg != "max_trust" and not math.isfinite(value)):  # inf: NaN params (lr, wd, ...)
            raise ValueError(f"{NAME}: expected {name(arg)} finite and >= 0, got {value}")
    if "bias_correction" in opts and not isinstance(opts["bias_correction"], bool):  # ("no" was True)
        raise TypeError(f"{NAME}: expected {name('bias_correction')} True or False, got {opts['bias_correction']!r}")
    if "betas" in opts:
        b = opts["betas"]
        if not (isinstance(b, (tuple, list)) and len(b) == 2 and all(isinstance(x, numbers.Real) and 0 <= x < 1
                                                                      for x in b)):
            raise ValueError(f"{NAME}: expected {name('betas')} to be a pair (beta1, beta2) in [0, 1), got {b!r}")
    if "mode" in opts and opts["mode"] not in TRUST_MODES:
        raise ValueError(f"{NAME}: expected {name('mode')} 'nvlamb' or 'paper', got {opts['mode']!r}")
    if opts.get("min_trust", 0) > opts.get("max_trust", float("inf")):
        raise ValueError(f"{NAME}: expected {name('min_trust')} <= {name('max_trust')}, got {opts['min_trust']} > "
                         f"{opts['max_trust']}")


# torch.optim options zerofuse.zero.Optimizer does not implement, with the value it does: a param
# group setting another was silently ignored (maximize=True: a review's reproduction, 2026-11-27);
# other keys a group carries (a name, foreach, ...) stay allowed, as in torch
# (SGD's dampening, Apex's grad_averaging, and Adam's bias_correction likewise: 2026-12-07)
_FIXED = {"maximize": False, "amsgrad": False, "differentiable": False, "nesterov": False, "dampening": 0,
          "grad_averaging": True}


def check_group_keys(group: dict, optimizer: str, where: str) -> None:
    """A param group's torch.optim options other than the ones this optimizer implements."""
    fixed = dict(_FIXED)
    if optimizer in ("adamw", "adam"):
        fixed["decoupled_weight_decay"] = optimizer == "adamw"
        fixed["bias_correction"] = True
    for key, want in fixed.items():
        if key in group and group[key] != want:
            hint = " (choose optimizer='adamw' or 'adam')" if key == "decoupled_weight_decay" else ""
            raise TypeError(f"{NAME}: {where}[{key!r}] = {group[key]!r} is not supported by optimizer "
                            f"{optimizer!r}{hint}")
    if "max_grad_norm" in group:
        raise TypeError(f"{NAME}: {where}['max_grad_norm']: clipping is global, pass max_grad_norm= to the Optimizer")


def check_scaler(initial_scale, growth_factor, backoff_factor, growth_interval, min_scale=1.0) -> None:
    """The dynamic loss scale's settings (fp16), as torch.amp.GradScaler takes them."""
    from zerofuse.optim._base import check_real  # noqa: PLC0415

    for arg, value in (("initial_scale", initial_scale), ("growth_factor", growth_factor),
                       ("backoff_factor", backoff_factor), ("min_scale", min_scale)):
        check_real(NAME, arg, value)
    int_interval = isinstance(growth_interval, int) and not isinstance(growth_interval, bool)
    for arg, value, ok, want in (
            ("initial_scale", initial_scale, 0 < initial_scale < float("inf"), "finite and > 0"),
            ("growth_factor", growth_factor, growth_factor >= 1, ">= 1"),
            ("backoff_factor", backoff_factor, 0 < backoff_factor <= 1, "in (0, 1]"),
            ("growth_interval", growth_interval, int_interval and growth_interval >= 1, "an int >= 1"),
            ("min_scale", min_scale, 0 < min_scale <= initial_scale, f"in (0, initial_scale={initial_scale!r}]")):
        if not ok:
            raise ValueError(f"{NAME}: expected {arg} {want}, got {value!r}")


def check_args(name, *, stage, precision, reduce_dtype, bucket_mb, prefetch, max_inflight, param_init_fn, offload,
               offload_ratio, param_gather="step") -> None:
    """parallelize's arguments, checked before anything is built (each error names the argument,
    the expectation and the value)."""
    from zerofuse.zero.offload import OFFLOAD_MODES  # (offload.py imports this module)

    if offload not in OFFLOAD_MODES:
        raise ValueError(f"{name}: expected offload None, 'optimizer' or 'optimizer+params', got {offload!r}")
    if offload == "optimizer+params" and stage != 3:
        raise ValueError(f"{name}: offload='optimizer+params' keeps the param shards in host memory: expected "
                         f"stage 3, got {stage}")
    auto = offload_ratio == "auto"
    if not (auto or isinstance(offload_ratio, (int, float)) and not isinstance(offload_ratio, bool)
            and 0.0 <= offload_ratio <= 1.0):  # (False ran as ratio 0: nothing offloaded, unsaid)
        raise ValueError(f"{name}: expected offload_ratio in [0, 1] or 'auto', got {offload_ratio!r}")
    if (auto or offload_ratio < 1.0) and offload != "optimizer":
        raise ValueError(f"{name}: offload_ratio < 1 splits the optimizer step between host and device: expected "
                         f"offload='optimizer', got {offload!r}")
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):  # (True ran as stage 1)
        raise ValueError(f"{name}: expected stage 0, 1, 2 or 3, got {stage!r}")
    if param_gather not in ("step", "module"):
        raise ValueError(f"{name}: expected param_gather 'step' or 'module', got {param_gather!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"{name}: expected precision 'fp32', 'bf16' or 'fp16', got {precision!r}")
    if reduce_dtype is not None and reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(f"{name}: expected reduce_dtype None, torch.float32, torch.bfloat16 or torch.float16, got "
                         f"{reduce_dtype!r}")
    if not bucket_mb > 0:
        raise ValueError(f"{name}: expected bucket_mb > 0, got {bucket_mb}")
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"{name}: expected prefetch to be an int >= 0, got {prefetch!r}")
    if not isinstance(max_inflight, int) or isinstance(max_inflight, bool) or max_inflight < 1:
        raise ValueError(f"{name}: expected max_inflight to be an int >= 1, got {max_inflight!r}")
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(f"{name}: expected param_init_fn to be None or a callable(module), got "
                        f"{type(param_init_fn).__name__}")
