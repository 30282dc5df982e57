"""Fakes of the C++ CPU norm ops (``zerofuse::norm_fwd_cpu`` / ``norm_bwd_cpu``, csrc/cpu/norms.cpp):
shapes for meta tensors and compiled graphs, with the C++ kernels' own checks, so a meta or traced
call fails as the real one does. Split from ops/norms.py (its custom ops and self-tests)."""
from __future__ import annotations

import torch

from zerofuse.ops.norms import _EMPTY, _KERNEL_DTYPES, _dx_fake, _fake_fwd, _param_grad_fake


def _check_cpu_op(x, weight, bias, rows_like_x: dict, stats: dict) -> None:
    """csrc/cpu/norms.cpp's checks (check_2d, check_param, check_stat), for the fakes of its ops; the
    device asked for is x's (the C++ kernels' is the cpu: only cpu tensors dispatch to them)."""
    fn = "zerofuse::norm_cpu"
    if x.dim() != 2:
        raise RuntimeError(f"{fn}: expected x of 2 dims (rows, hidden), got shape {list(x.shape)}")
    m, n = x.shape
    for name, t in {"x": x, **rows_like_x}.items():
        if t is not None and (t.shape != x.shape or not t.is_contiguous() or t.dtype not in _KERNEL_DTYPES):
            raise RuntimeError(f"{fn}: expected {name} to be a contiguous ({m}, {n}) float32, float16 or bfloat16 "
                               f"tensor, got {t.dtype} {list(t.shape)} with strides {list(t.stride())}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.numel() != n or p.device != x.device or p.dtype not in _KERNEL_DTYPES):
            raise RuntimeError(f"{fn}: expected {name} to be a float32, float16 or bfloat16 {x.device} tensor of {n} "
                               f"elements (the hidden size), got {p.dtype} {list(p.shape)} on {p.device}")
    for name, t in stats.items():
        if t.numel() != m or t.device != x.device or t.dtype != torch.float32 or not t.is_contiguous():
            raise RuntimeError(f"{fn}: expected {name} to be a contiguous float32 {x.device} tensor of {m} elements "
                               f"(one per row), got {t.dtype} {list(t.shape)} on {t.device}")


@torch.library.register_fake("zerofuse::norm_fwd_cpu")
def _(x, weight, bias, residual, eps, rms):
    _check_cpu_op(x, weight, bias, {"residual": residual}, {})
    y, h, stat = _fake_fwd(x, residual)
    return y, h, (x.new_empty(_EMPTY, dtype=torch.float32) if rms else torch.empty_like(stat)), stat


@torch.library.register_fake("zerofuse::norm_bwd_cpu")
def _(dy, dh, x, weight, bias, mean, rstd, rms):
    _check_cpu_op(x, weight, bias, {"dy": dy, "dh": dh}, {"rstd": rstd} if rms else {"rstd": rstd, "mean": mean})
    return _dx_fake(x), _param_grad_fake(x, weight), _param_grad_fake(x, bias)
