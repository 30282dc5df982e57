"""zerofuse.nn.LayerNorm / RMSNorm: subclasses of torch's modules, so constructor signatures,
parameters, state_dict keys, init and repr are torch's own; only forward runs zerofuse's kernels.
forward(input, residual=None): with a residual it returns (norm(input + residual), input + residual).
"""
from __future__ import annotations

import torch
from torch import Tensor

from zerofuse.nn import functional as F


class LayerNorm(torch.nn.LayerNorm):
    def forward(self, input: Tensor, residual: Tensor | None = None, *, input_bias: Tensor | None = None):
        """norm(input), or (norm(h), h) with h = input + residual; input_bias: see
        zerofuse.nn.functional.add_layer_norm (with a residual only)."""
        return _layer_norm(input, residual, self.normalized_shape, self.weight, self.bias, self.eps, input_bias)


class RMSNorm(torch.nn.RMSNorm):
    def forward(self, input: Tensor, residual: Tensor | None = None, *, input_bias: Tensor | None = None):
        return _rms_norm(input, residual, self.normalized_shape, self.weight, self.eps, input_bias)


def _layer_norm(input, residual, normalized_shape, weight, bias, eps, input_bias):
    if residual is None:
        return F.layer_norm(input, normalized_shape, weight, bias, eps)
    return F.add_layer_norm(input, residual, normalized_shape, weight, bias, eps, input_bias=input_bias)


def _rms_norm(input, residual, normalized_shape, weight, eps, input_bias):
    if residual is None:
        return F.rms_norm(input, normalized_shape, weight, eps)
    return F.add_rms_norm(input, residual, normalized_shape, weight, eps, input_bias=input_bias)


# torch.fx records the modules' forwards as these calls (residual or not decided when the graph runs):
# a norm traced as the root took its residual=None for a placeholder, and its graph returned
# (norm(h), h) for one input
for _name in ("_layer_norm", "_rms_norm"):
    torch.fx.wrap(_name)
del _name


def _swap(mod: torch.nn.Module) -> None:
    """Make a torch LayerNorm/RMSNorm zerofuse's, in place: its class only changes (the zerofuse
    norms are subclasses with no state of their own), so its Parameter objects, hooks and
    attributes stay (a new module lost the forward hooks and state_dict hooks)."""
    if type(mod) is torch.nn.LayerNorm:
        mod.__class__ = LayerNorm
    elif type(mod) is torch.nn.RMSNorm:
        mod.__class__ = RMSNorm


def replace_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Swap every torch.nn.LayerNorm / RMSNorm in ``model`` for zerofuse's, in place, keeping weights.

    Returns the model (the same object, also when ``model`` itself is a norm). Each norm keeps its
    Parameter objects, hooks and attributes. Subclasses of torch's norms are left alone: they may
    override forward.
    """
    for m in list(model.modules()):
        _swap(m)
    return model
