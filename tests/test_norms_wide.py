"""kernels/norms_wide.py: LayerNorm / RMSNorm over wide rows in column chunks give the whole-row
kernels' results (the same formulas; sums in another order) and the float64 reference's within the
peer rule, forward and backward, with residual, dh, dr, any params; and they compile for sm_90
without register spills where the whole-row kernels spill. Interpreter tests force the chunked
kernels onto small odd rows (several chunks, a ragged last one)."""
from __future__ import annotations

import pytest
import torch

from tolerances import assert_close
from zerofuse import kernels
from zerofuse.kernels import norms as KN
from zerofuse.kernels import norms_wide as KW

interp = pytest.mark.skipif(not kernels.triton_on_cpu(), reason="interpreter tests (ZEROFUSE_TRITON_ON_CPU=1)")


def _run(x, w, b, r, dy, dh, is_rms, dr_dtype):
    y, h, mean, rstd = KN.norm_fwd(x, w, b, r, 1e-5, is_rms)
    xin = h if r is not None else x
    return (y, h, mean, rstd), KN.norm_bwd(dy, dh, xin, w, b, mean, rstd, is_rms, dr_dtype)


def _case(rows, n, dtype, is_rms, res, params, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = lambda *s: (torch.randn(*s, generator=g) * 2 + 0.5).to(dtype)  # noqa: E731
    x, dy = t(rows, n), t(rows, n)
    w = t(n) if params else None
    b = t(n) if params and not is_rms else None
    r, dh = (t(rows, n), t(rows, n)) if res else (None, None)
    return x, w, b, r, dy, dh, is_rms, (torch.float32 if res else None)


@interp
@pytest.mark.parametrize("rows,n", [(5, 97), (3, 130), (9, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_rms,res,params", [(False, True, True), (True, True, True), (False, False, False),
                                               (True, False, True)])
def test_chunked_rows_equal_whole_rows(monkeypatch, rows, n, dtype, is_rms, res, params):
    args = _case(rows, n, dtype, is_rms, res, params)
    whole = _run(*args)
    with monkeypatch.context() as m:  # every row in chunks of 32 columns
        m.setattr(KW, "FWD_MIN_BLOCK", 1)
        m.setattr(KW, "BWD_MIN_BLOCK", 1)
        m.setattr(KW, "CHUNK", 32)
        calls = []
        for name in ("_norm_fwd_wide_kernel", "_norm_bwd_wide_kernel"):
            real = getattr(KW, name)
            m.setattr(KW, name, _Spy(real, calls, name))
        chunked = _run(*args)
    assert sorted(set(calls)) == ["_norm_bwd_wide_kernel", "_norm_fwd_wide_kernel"]
    (yw, hw, mw, rw), bw = whole
    (yc, hc, mc, rc), bc = chunked
    if hw is not None:
        assert torch.equal(hc, hw)  # h: one rounded add either way
    for got, want in ((mc, mw), (rc, rw)):
        if want is not None:
            assert_close(got, want, atol=1e-5, rtol=1e-5)
    ulps = 2 if dtype != torch.float32 else 1  # a last-bit flip of the rounded outputs
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2 ** -7 * ulps * 4, rtol=2 ** -7 * ulps)
    assert_close(yc, yw, **tol)
    for name, got, want in zip(("dx", "dw", "db", "dr"), bc, bw):
        assert (got is None) == (want is None), name
        if want is not None:
            scale = 1.0 if name == "dx" else rows  # column sums: rows terms
            assert_close(got.float(), want.float(), atol=tol["atol"] * scale * 4, rtol=tol["rtol"] * 4, msg=name)


class _Spy:
    def __init__(self, real, calls, name):
        self.real, self.calls, self.name = real, calls, name

    def __getitem__(self, grid):
        self.calls.append(self.name)
        return self.real[grid]


@interp
@pytest.mark.parametrize("is_rms", [False, True])
def test_a_real_wide_row_against_float64(is_rms):
    """20000 columns (next power of two 32768: both kernels chunked at the shipped thresholds)."""
    x, w, b, r, dy, dh, _, dr = _case(3, 20000, torch.float32, is_rms, True, True)
    (y, h, _, _), (dx, dw, db, dsum) = _run(x, w, b, r, dy, dh, is_rms, dr)
    leaves = [t.double().requires_grad_() for t in (x, r, w)] + ([b.double().requires_grad_()] if b is not None else [])
    h64 = leaves[0] + leaves[1]
    if is_rms:
        y64 = torch.nn.functional.rms_norm(h64, (20000,), leaves[2], 1e-5)
    else:
        y64 = torch.nn.functional.layer_norm(h64, (20000,), leaves[2], leaves[3], 1e-5)
    torch.autograd.backward([y64, h64], [dy.double(), dh.double()])
    assert_close(y.double(), y64.detach(), atol=1e-5, rtol=1e-5)
    assert_close(dx.double(), leaves[0].grad, atol=1e-4, rtol=1e-5)
    assert_close(dw.double(), leaves[2].grad, atol=1e-4, rtol=1e-5)
    if b is not None:
        assert_close(db.double(), leaves[3].grad, atol=1e-4, rtol=1e-5)
    assert_close(dsum.double(), leaves[0].grad.sum(0), atol=1e-3, rtol=1e-5)


def test_chunked_kernels_compile_for_an_h100_without_spills():
    """tools/kernel_asm.py --norms: at 16384 / 65536 columns the whole-row backward spills and the
    chunked one does not; the chunked forward does not spill at 65536."""
    from common import kernel_asm

    rows = {(r["kernel"], r["n"]): r for r in kernel_asm("--norms-wide")}
    assert rows[("norm_bwd_whole_row", 16384)]["spill_stores"] > 0  # what the chunked kernels avoid
    for key in (("norm_bwd_chunked", 16384), ("norm_bwd_chunked", 65536), ("norm_fwd_chunked", 65536)):
        assert rows[key]["spill_stores"] == 0 and rows[key]["spill_loads"] == 0, rows[key]


@interp
@pytest.mark.parametrize("wide", [False, True], ids=["whole_rows", "chunked"])
@pytest.mark.parametrize("is_rms", [False, True])
def test_a_forward_without_backward_stores_no_statistics(monkeypatch, wide, is_rms):
    """norm_fwd(stats=False), the faces' path when nothing requires grad: no mean/rstd allocated or
    stored (STATS=False), the same y and h as with them."""
    x, w, b, r, *_ = _case(6, 97, torch.bfloat16, is_rms, True, True)
    if wide:
        monkeypatch.setattr(KW, "FWD_MIN_BLOCK", 1)
        monkeypatch.setattr(KW, "CHUNK", 32)
    y, h, mean, rstd = KN.norm_fwd(x, w, b, r, 1e-5, is_rms)
    y0, h0, mean0, rstd0 = KN.norm_fwd(x, w, b, r, 1e-5, is_rms, stats=False)
    assert rstd is not None and mean0 is None and rstd0 is None
    assert torch.equal(y0, y) and torch.equal(h0, h)

    import zerofuse.nn.functional as ZF

    seen = []
    real = KN.launch_triton
    monkeypatch.setattr(KN, "launch_triton", lambda *a, **k: seen.append(k["STATS"]) or real(*a, **k))
    face = (lambda: ZF.rms_norm(x, (97,), w)) if is_rms else (lambda: ZF.layer_norm(x, (97,), w, b))
    face()  # nothing requires grad
    w.requires_grad_()
    with torch.no_grad():
        face()
    face()  # w's gradient to come: the statistics are stored
    assert seen == [False, False, True]
