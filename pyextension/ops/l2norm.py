"""``zerofuse::l2norm``: the 2-norm of many tensors taken together, and optionally of each one.

The global gradient norm (clipping, logging, and the inf/NaN check: any inf or NaN makes it
non-finite) in one pass over all grads; per-tensor norms for LARS. Schema in
csrc/registration.cpp; CPU kernel csrc/cpu/l2norm.cpp; CUDA kernels/l2norm.py.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from zerofuse import reference
from zerofuse.kernels import optim as K
from zerofuse.ops import register
from zerofuse.ops._optim import LIB, Prepared, check_param_lists, direct, use_triton


def _check_mult_from(mult_from: int) -> None:
    if mult_from < 0:
        raise RuntimeError(f"zerofuse::l2norm: expected mult_from >= 0, got {mult_from}")


@torch.library.register_fake("zerofuse::l2norm")
def _l2norm_fake(tensors, per_tensor, mult=None, mult_from=0):
    check_param_lists("l2norm", tensors, {}, {}, params_name="tensors")
    _check_mult_from(mult_from)
    if not tensors:  # (as the op: no tensor to dispatch on; it returned CPU results for a traced call the
        # op then refused; zerofuse.ops.l2norm takes an empty list before dispatch)
        raise RuntimeError("zerofuse::l2norm: expected at least one tensor in tensors, got none "
                           "(zerofuse.ops.l2norm takes an empty list: its norm is 0)")
    device = tensors[0].device
    return (torch.empty((), device=device, dtype=torch.float32),
            torch.empty(len(tensors) if per_tensor else 0, device=device, dtype=torch.float32))


def _l2norm_triton(tensors, per_tensor, mult=None, mult_from=0):
    _check_mult_from(mult_from)
    return K.l2norm(_launch(tensors), per_tensor, mult, mult_from)


LIB.impl("l2norm", _l2norm_triton, "CUDA")


def _launch(tensors):
    check_param_lists("l2norm", tensors, {}, {}, params_name="tensors")
    return K.norm_launch(tensors)


def l2norm(tensors: Sequence[torch.Tensor], per_tensor: bool = False, prepared: Prepared | None = None,
           mult: torch.Tensor | None = None, mult_from: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm of all tensors together, 0-dim fp32; (n,) fp32 norms of each, or (0,)), on the
    tensors' device; contiguous fp32/bf16/fp16 tensors. prepared: launch tables kept between
    calls (zerofuse.ops._optim.Prepared). mult: a 1-element tensor on the tensors' device that
    tensors[mult_from:] are multiplied by before they are squared (1 / a loss scale: the unscaled
    norm, where the scaled grads' squares overflow fp32 at |grad| > 1.8e19)."""
    tensors = list(tensors)
    _check_mult_from(mult_from)  # (the Triton paths scaled every tensor at a negative one; C++ refused it)
    if not tensors:  # no tensor to dispatch on
        return torch.zeros((), dtype=torch.float32), torch.empty(0, dtype=torch.float32)
    if prepared is not None and direct(tensors):
        return K.l2norm(prepared.launch("l2norm", tensors, None, lambda: _launch(tensors)), per_tensor, mult,
                        mult_from)
    if use_triton(tensors) and not tensors[0].is_cuda:
        return K.l2norm(_launch(tensors), per_tensor, mult, mult_from)  # (mult_from checked above)
    return torch.ops.zerofuse.l2norm(tensors, per_tensor, mult, mult_from)


def clip_inputs(grads: Sequence[torch.Tensor], max_norm: float, grad_scale: torch.Tensor | None = None,
                found_inf: torch.Tensor | None = None, prepared: Prepared | None = None, eps: float | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What an optimizer step needs to clip the global grad norm to max_norm: (grad multiplier,
    skip flag, norm), 1-element fp32 tensors on the grads' device, without a host sync.

    norm: the 2-norm of all grads divided by grad_scale (the loss scale they carry); skip flag: 1
    when norm is inf or NaN (an inf/NaN grad) or found_inf != 0; multiplier: (1 / grad_scale) *
    max_norm / max(norm, max_norm), what the update multiplies the grads by (with ``eps``: torch's
    clip_grad_norm_ coefficient min(max_norm / (norm + eps), 1) instead). On the Triton path
    with kept tables (prepared) and no tracing: one pass over the grads and one single-program
    kernel; otherwise l2norm and about ten small torch ops."""
    grads = list(grads)
    if not max_norm > 0:
        raise ValueError(f"zerofuse.ops.clip_inputs: expected max_norm > 0, got {max_norm}")
    if grads and prepared is not None and direct(grads):
        return K.clip_inputs(prepared.launch("l2norm", grads, None, lambda: _launch(grads)), max_norm, grad_scale,
                             found_inf, eps)
    mult = None if grad_scale is None else grad_scale.reshape(1).reciprocal()
    norm, _ = l2norm(grads, prepared=prepared, mult=mult)  # (unscaled before the squares)
    norm = norm.reshape(1)
    bad = (~torch.isfinite(norm)).float()  # a non-finite norm means an inf/NaN gradient
    # any found_inf != 0 skips (the kernel's rule): a -1 or 2 was taken as 0 / 2 here
    found = bad if found_inf is None else torch.maximum((found_inf.reshape(1) != 0).float(), bad)
    if eps is None:
        clip = max_norm / torch.clamp(norm, min=max_norm)
    else:
        clip = torch.clamp(max_norm / (norm + eps), max=1.0)
    return (clip if mult is None else mult * clip), found, norm


def _selftest(device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(s, generator=g).to(device) for s in [(37, 5), (1,), (0,), (4099,)]]
    ts.append(torch.randn(300, generator=g).to(device).bfloat16())
    total, each = l2norm(ts, per_tensor=True)
    torch.testing.assert_close(total.double().cpu(), reference.global_norm(ts), rtol=1e-6, atol=0)
    want = torch.stack([reference.global_norm([t]) for t in ts])
    torch.testing.assert_close(each.double().cpu(), want, rtol=1e-6, atol=0)


register("zerofuse::l2norm", "C++ (CPU), Triton (CUDA)", _selftest)
