"""zerofuse.zero.Optimizer's options: the optimizers it runs, their defaults and state keys, and
the checks of hyperparameters and loss-scaler settings (before anything is built)."""
from __future__ import annotations

import torch

from zerofuse.ops.lamb import TRUST_MODES

NAME = "zerofuse.zero.Optimizer"

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
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"{NAME}: expected {name(arg)} to be a number, got {type(value).__name__}")
        if not value >= 0:
            raise ValueError(f"{NAME}: expected {name(arg)} >= 0, got {value}")
    if "betas" in opts:
        b = opts["betas"]
        if not (isinstance(b, (tuple, list)) and len(b) == 2 and all(isinstance(x, (int, float)) and 0 <= x < 1
                                                                      for x in b)):
            raise ValueError(f"{NAME}: expected {name('betas')} to be a pair (beta1, beta2) in [0, 1), got {b!r}")
    if "mode" in opts and opts["mode"] not in TRUST_MODES:
        raise ValueError(f"{NAME}: expected {name('mode')} 'nvlamb' or 'paper', got {opts['mode']!r}")
    if opts.get("min_trust", 0) > opts.get("max_trust", float("inf")):
        raise ValueError(f"{NAME}: expected {name('min_trust')} <= {name('max_trust')}, got {opts['min_trust']} > "
                         f"{opts['max_trust']}")


def check_scaler(initial_scale, growth_factor, backoff_factor, growth_interval) -> None:
    """The dynamic loss scale's settings (fp16), as torch.amp.GradScaler takes them."""
    int_interval = isinstance(growth_interval, int) and not isinstance(growth_interval, bool)
    for arg, value, ok, want in (
            ("initial_scale", initial_scale, 0 < initial_scale < float("inf"), "finite and > 0"),
            ("growth_factor", growth_factor, growth_factor >= 1, ">= 1"),
            ("backoff_factor", backoff_factor, 0 < backoff_factor <= 1, "in (0, 1]"),
            ("growth_interval", growth_interval, int_interval and growth_interval >= 1, "an int >= 1")):
        if not ok:
            raise ValueError(f"{NAME}: expected {arg} {want}, got {value!r}")
