"""What the norm tests share (tests/test_norms*.py): inputs, one run of the fused norms and its fp64
reference, the check of both, and the kernel path fixture (Triton in the interpreter, or the C++ CPU
kernels)."""
import pytest
import torch

import zerofuse.nn.functional as ZF
from tolerances import assert_close
from zerofuse import reference


def _make(shape, normalized, dtype, device, affine=True, bias=True, residual=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda s: torch.randn(s, generator=g, dtype=torch.float64)  # noqa: E731
    t = {"x": mk(shape) * 2 + 0.5, "dy": mk(shape)}
    if residual:
        t["residual"] = mk(shape)
    if affine:
        t["weight"] = mk(normalized) * 0.5 + 1
        if bias:
            t["bias"] = mk(normalized)
    # round to the test dtype first, so reference and kernel see the same input values
    return {k: v.to(dtype).to(device) for k, v in t.items()}


def _run(norm, t, normalized, eps, grad_keys):
    """Our forward + backward; returns (y, h, grads) with grads keyed like t."""
    leaves = {k: t[k].clone().requires_grad_() for k in grad_keys}
    w, b, r = leaves.get("weight"), leaves.get("bias"), leaves.get("residual")
    if norm == "layer":
        out = ZF.add_layer_norm(leaves["x"], r, normalized, w, b, eps) if r is not None else (ZF.layer_norm(leaves["x"], normalized, w, b, eps), None)
    else:
        out = ZF.add_rms_norm(leaves["x"], r, normalized, w, eps) if r is not None else (ZF.rms_norm(leaves["x"], normalized, w, eps), None)
    y, h = out
    loss = (y.double() * t["dy"].double()).sum()
    if h is not None:  # the residual stream continues: its gradient must be accumulated too
        loss = loss + (h.double() * 0.25).sum()
    loss.backward()
    return y, h, {k: v.grad for k, v in leaves.items()}


def _reference(norm, t, normalized, eps, grad_keys):
    """fp64 reference of the same math. The fused sum h = x + residual is rounded to the input
    dtype, as unfused code would round it, then normalised in fp64; its gradient is both dx and
    dresidual."""
    h_in = t["x"] + t["residual"] if "residual" in t else t["x"]
    base = h_in.double().cpu().requires_grad_()
    params = {k: t[k].double().cpu().requires_grad_() for k in grad_keys if k in ("weight", "bias")}
    kw = dict(weight=params.get("weight"), eps=eps)
    if norm == "layer":
        kw["bias"] = params.get("bias")
    y, h = (reference.layer_norm if norm == "layer" else reference.rms_norm)(base, normalized, **kw)
    loss = (y * t["dy"].double().cpu()).sum()
    if "residual" in t:
        loss = loss + (h * 0.25).sum()
    loss.backward()
    grads = {k: p.grad for k, p in params.items()}
    grads.update({k: base.grad for k in ("x", "residual") if k in grad_keys})
    return y, h, grads


def _check(norm, shape, normalized, dtype, device, eps=1e-5, **kw):
    t = _make(shape, normalized, dtype, device, **kw)
    keys = [k for k in ("x", "residual", "weight", "bias") if k in t and not (norm == "rms" and k == "bias")]
    y, h, grads = _run(norm, t, normalized, eps, keys)
    y_ref, h_ref, grads_ref = _reference(norm, t, normalized, eps, keys)
    assert y.dtype == dtype and y.shape == t["x"].shape
    assert_close(y.cpu(), y_ref)
    if h is not None:
        assert torch.equal(h, t["x"] + t["residual"])  # the sum is rounded exactly as unfused code
    for k in keys:
        assert grads[k].dtype == t[k].dtype, k
        op = "norm_param_grad" if k in ("weight", "bias") else None
        assert_close(grads[k].cpu(), grads_ref[k], op=op, msg=lambda m: f"d{k}: {m}")


PATHS = ["triton", "cpp"]


@pytest.fixture(params=PATHS)
def path(request):
    if request.param == "cpp":
        request.getfixturevalue("cpu_kernels")
    return request.param
