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
        if residual is None:
            return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)
        return F.add_layer_norm(input, residual, self.normalized_shape, self.weight, self.bias, self.eps,
                                input_bias=input_bias)


class RMSNorm(torch.nn.RMSNorm):
    def forward(self, input: Tensor, residual: Tensor | None = None, *, input_bias: Tensor | None = None):
        if residual is None:
            return F.rms_norm(input, self.normalized_shape, self.weight, self.eps)
        return F.add_rms_norm(input, residual, self.normalized_shape, self.weight, self.eps, input_bias=input_bias)


def _swap(mod: torch.nn.Module) -> torch.nn.Module | None:
    """The zerofuse twin of a torch LayerNorm/RMSNorm, sharing its Parameter objects (so optimizer
    state and tied references stay valid); None for anything else."""
    if type(mod) is torch.nn.LayerNorm:
        new = LayerNorm(mod.normalized_shape, mod.eps, mod.elementwise_affine, bias=mod.bias is not None, device="meta")
    elif type(mod) is torch.nn.RMSNorm:
        new = RMSNorm(mod.normalized_shape, mod.eps, mod.elementwise_affine, device="meta")
    else:
        return None
    for name, p in mod.named_parameters(recurse=False):
        setattr(new, name, p)
    new.train(mod.training)
    return new


def replace_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Swap every torch.nn.LayerNorm / RMSNorm in ``model`` for zerofuse's, in place, keeping weights.

    Returns the model (a new module only if ``model`` itself is a norm). Subclasses of torch's
    norms are left alone: they may override forward.
    """
    root = _swap(model)
    if root is not None:
        return root
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = _swap(child)
            if new is not None:
                setattr(parent, name, new)
    return model
