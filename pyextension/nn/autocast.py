"""torch.autocast for the faces whose torch counterparts autocast runs in lower precision (F.linear
under the fused loss, F.scaled_dot_product_attention): their floating inputs cast to the autocast
dtype, as torch's would be, before zerofuse's ops run."""
from __future__ import annotations

import torch
from torch import Tensor


def autocast_dtype(t) -> torch.dtype | None:
    """The autocast dtype where autocast is on for t's device type, else None."""
    dev = t.device.type if isinstance(t, Tensor) else None
    try:
        on = dev is not None and torch.is_autocast_enabled(dev)
    except RuntimeError:  # a device type autocast does not know (meta)
        return None
    return torch.get_autocast_dtype(dev) if on else None


def autocast_on(t) -> bool:
    """autocast_dtype(t) is not None, for the faces' call signatures: cheaper (the plans' devices
    are CUDA or the CPU); False for what is not a tensor."""
    return isinstance(t, Tensor) and torch.is_autocast_enabled("cuda" if t.is_cuda else "cpu")


_CAST = (torch.float32, torch.float16, torch.bfloat16)  # what autocast casts (float64 it leaves alone)


def cast_all(dtype: torch.dtype | None, *tensors):
    """Each fp32/fp16/bf16 tensor in dtype (None: as given), as autocast casts an op's inputs."""
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) if isinstance(t, Tensor) and t.dtype in _CAST else t for t in tensors)
