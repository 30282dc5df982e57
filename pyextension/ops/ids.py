"""Range checks of integer ids (token ids, targets) without a host sync on GPUs."""
from __future__ import annotations

import torch
from torch import Tensor


def check_ids(who: str, name: str, ids: Tensor, n: int, allowed: int | None = None) -> None:
    """ids in [0, n) (or == allowed). An id outside the range would silently read as zeros (a
    vocabulary-parallel embedding looks up only its own range) or as a logit of 0 (a target of a
    chunked or sharded cross-entropy). On the cpu the check raises; on a GPU it is a device-side
    assert, as torch's embedding (no host sync). ``who``: the qualified name of the caller."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{who}: expected {name} to be an integer tensor, got {ids.dtype}")
    bad = (ids < 0) | (ids >= n)
    if allowed is not None:
        bad &= ids != allowed
    if ids.device.type == "cpu":
        if bool(bad.any()):
            first = int(ids[bad][0])
            extra = f" or {allowed}" if allowed is not None else ""
            raise IndexError(f"{who}: expected {name} in [0, {n}){extra}, got {first}")
    else:
        torch._assert_async(~bad.any(), f"{who}: {name} out of range [0, {n})")
