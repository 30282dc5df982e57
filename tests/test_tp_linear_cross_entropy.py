"""zerofuse.tp.vocab_parallel_linear_cross_entropy on real gloo ranks (tp 2, 3, 4; vocabulary 1025:
uneven shards) against the unsharded fused op in one process: loss and every gradient, with and
without sequence parallelism, gradients made in forward or recomputed, each loss option."""
from __future__ import annotations

import pytest
import torch

from zerofuse import tp
from zerofuse.nn.functional import linear_cross_entropy
from zerofuse.tp.spec import split_range

from dist_utils import run_distributed

pytestmark = pytest.mark.usefixtures("native_kernels")

B, N, D, V = 2, 12, 40, 1025
CASES = {
    "plain": dict(),
    "bias-smooth-zloss": dict(bias=True, label_smoothing=0.1, z_loss=1e-3),
    "softcap-sum": dict(softcap=3.0, reduction="sum"),
    "none": dict(bias=True, reduction="none"),
    # chunks chosen from the full vocabulary, the same on every rank (from a rank's shard, dim 256 at
    # tp 2 would give 8-token chunks on the rank of 513 rows, 16 on the one of 512)
    "default-chunks": dict(chunk_size=None, dim=256),
}


def _inputs(bias, d=D):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B, N, d, generator=g)
    w = torch.randn(V, d, generator=g) * 0.3
    b = torch.randn(V, generator=g) if bias else None
    target = torch.randint(0, V, (B, N), generator=g)
    target[0, :2] = -100
    dloss = torch.rand(B, N, generator=g)
    return h, w, b, target, dloss


def _rank(rank, ws, sp, recompute):
    out = {}
    for name, case in CASES.items():
        case = dict(case)
        h, w, b, target, dloss = _inputs(case.pop("bias", False), case.pop("dim", D))
        lo, hi = split_range(V, ws, rank)
        n = N // ws
        mine = (h[:, rank * n:(rank + 1) * n] if sp else h).clone().requires_grad_()
        w_r = w[lo:hi].clone().requires_grad_()
        b_r = b[lo:hi].clone().requires_grad_() if b is not None else None
        kw = dict(chunk_size=5) | case
        loss = tp.vocab_parallel_linear_cross_entropy(mine, w_r, target, bias=b_r, vocab_size=V, sequence_parallel=sp,
                                                      recompute=recompute, **kw)
        g = dloss if case.get("reduction") == "none" else 1.0
        (loss * g).sum().backward()
        ref_h, ref_w = h.clone().requires_grad_(), w.clone().requires_grad_()
        ref_b = b.clone().requires_grad_() if b is not None else None
        ref = linear_cross_entropy(ref_h, ref_w, target, ref_b, **(dict(chunk_size=7) | case))
        (ref * g).sum().backward()
        want_dh = ref_h.grad[:, rank * n:(rank + 1) * n] if sp else ref_h.grad
        out[name] = [(loss.detach(), ref.detach()), (mine.grad, want_dh), (w_r.grad, ref_w.grad[lo:hi])]
        if b is not None:
            out[name].append((b_r.grad, ref_b.grad[lo:hi]))
    return out


@pytest.mark.parametrize("recompute", [False, True], ids=["grad-in-forward", "recompute"])
@pytest.mark.parametrize("ws,sp", [(2, False), (3, False), (4, True), (2, True)])
def test_matches_the_unsharded_fused_loss(ws, sp, recompute):
    for rank, out in enumerate(run_distributed(_rank, ws, sp, recompute, timeout=120)):
        for name, pairs in out.items():
            for what, (got, want) in zip(("loss", "dhidden", "dweight", "dbias"), pairs):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6,
                                           msg=lambda m: f"rank {rank} {name} {what}: {m}")


def _bad_rank(rank, ws):
    h, w, b, target, _ = _inputs(False)
    errors = []
    for kw in (dict(weight=w[:10]), dict(target=target[:, :5]), dict(sequence_parallel=True, target=target[:, :5])):
        args = dict(hidden=h, weight=w[split_range(V, ws, rank)[0]:split_range(V, ws, rank)[1]], target=target) | kw
        try:
            tp.vocab_parallel_linear_cross_entropy(args.pop("hidden"), args.pop("weight"), args.pop("target"),
                                                   vocab_size=V, **args)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_bad_input_names_the_argument():
    errors = run_distributed(_bad_rank, 2, timeout=60)[0]
    assert "expected vocab_size to be the TP group's vocabulary, its shards [10, 10] summed (20), got 1025" \
        in errors[0]
    assert "expected target of shape [2, 12]" in errors[1]
    assert "sequence parallelism takes hidden (b, s/tp, D) and target (b, s)" in errors[2]


def _uneven_vocab_rank(rank, ws):
    """A vocabulary of 10 over 3 ranks (4, 3, 3) given as vocab_size=9 (3, 3, 3): it fits ranks 1
    and 2's shards, not rank 0's. Then the right size, twice (the second call checks nothing more)."""
    n = split_range(10, ws, rank)[1] - split_range(10, ws, rank)[0]
    logits, target = torch.randn(4, n), torch.tensor([0, 1, 2, 3])
    try:
        tp.vocab_parallel_cross_entropy(logits, target, vocab_size=9)
        err = None
    except ValueError as e:
        err = str(e)
    losses = [tp.vocab_parallel_cross_entropy(logits, target, vocab_size=10).item() for _ in range(2)]
    return err, losses


def test_a_wrong_vocab_size_fails_on_every_rank_at_once():
    """Checked on each rank alone, a wrong vocab_size failed on rank 0 while ranks 1 and 2 waited in
    the loss's all-reduce for the group's timeout: now every rank raises the same error at once."""
    out = run_distributed(_uneven_vocab_rank, 3, timeout=60)
    for err, losses in out:
        assert err is not None and "its shards [4, 3, 3] summed (10), got 9" in err, err
        assert losses[0] == losses[1] == out[0][1][0]


def _neg_inf_rank(rank, ws):
    from zerofuse import kernels

    kernels.TRITON_ON_CPU = False  # (the Triton kernel selects with tl.where: the torch paths multiplied)
    v, d = 6, 4
    g = torch.Generator().manual_seed(0)
    h, w, b = torch.randn(4, d, generator=g), torch.randn(v, d, generator=g), torch.zeros(v)
    b[0] = float("-inf")  # a masked vocabulary entry
    target = torch.tensor([1, 2, 4, 5])
    lo, hi = split_range(v, ws, rank)
    fused = tp.vocab_parallel_linear_cross_entropy(h, w[lo:hi], target, bias=b[lo:hi], vocab_size=v, reduction="none")
    plain = tp.vocab_parallel_cross_entropy((h @ w.t() + b)[:, lo:hi], target, reduction="none")
    return fused, plain


def test_a_minus_inf_logit_gives_torchs_finite_loss():
    """A target on another rank (or ignored) read the local column 0 times 0: a -inf logit there
    (a masked vocabulary entry, a -inf bias) made NaN, spread to every rank by the all-reduce (a
    review's reproduction, 2026-11-28). Torch's cross-entropy is finite."""
    g = torch.Generator().manual_seed(0)
    h, w, b = torch.randn(4, 4, generator=g), torch.randn(6, 4, generator=g), torch.zeros(6)
    b[0] = float("-inf")
    want = torch.nn.functional.cross_entropy(h @ w.t() + b, torch.tensor([1, 2, 4, 5]), reduction="none")
    for fused, plain in run_distributed(_neg_inf_rank, 2, timeout=120):
        torch.testing.assert_close(fused, want)
        torch.testing.assert_close(plain, want)
    ignored = torch.tensor([1, 2, -100, 5])  # one process: an ignored row's NaN was kept by * valid
    torch.testing.assert_close(linear_cross_entropy(h, w, ignored, b),
                               torch.nn.functional.cross_entropy(h @ w.t() + b, ignored))


def _masked_mean(loss, target):
    """Per-sequence mean of reduction='none' losses, 0 for an all-ignored sequence (torch.where's
    backward sends its masked branch's 0/0 = NaN to that sequence's rows)."""
    count = (target != -100).sum(-1)
    total = loss.sum(-1)
    return torch.where(count > 0, total / count, torch.zeros_like(total)).sum()


def _ignored_nan_rank(rank, ws):
    v, d = 7, 4
    g = torch.Generator().manual_seed(0)
    h, w, logits = torch.randn(2, 3, d, generator=g), torch.randn(v, d, generator=g), torch.randn(2, 3, v, generator=g)
    target = torch.tensor([[1, 4, 6], [-100, -100, -100]])
    lo, hi = split_range(v, ws, rank)
    out = []
    shard = logits[..., lo:hi].clone().requires_grad_()
    _masked_mean(tp.vocab_parallel_cross_entropy(shard, target, reduction="none"), target).backward()
    out.append(shard.grad)
    for recompute in (False, True):
        hs, ws_ = h.clone().requires_grad_(), w[lo:hi].clone().requires_grad_()
        _masked_mean(tp.vocab_parallel_linear_cross_entropy(hs, ws_, target, vocab_size=v, reduction="none",
                                                             recompute=recompute), target).backward()
        out += [hs.grad, ws_.grad]
    return out


def test_an_ignored_rows_nan_gradient_stays_out():
    """An ignored row's incoming gradient was multiplied by 0: a NaN there (the masked per-sequence
    mean's 0/0) made every grad NaN where F.cross_entropy gives those rows 0 (a review's reproduction,
    2026-12-07). tp 2 and 3 against torch's grads, and the one-process fused loss."""
    v = 7
    g = torch.Generator().manual_seed(0)
    h, w, logits = torch.randn(2, 3, 4, generator=g), torch.randn(v, 4, generator=g), torch.randn(2, 3, v, generator=g)
    target = torch.tensor([[1, 4, 6], [-100, -100, -100]])
    ce = torch.nn.functional.cross_entropy
    full = logits.clone().requires_grad_()
    _masked_mean(ce(full.flatten(0, 1), target.flatten(), reduction="none").view(2, 3), target).backward()
    hf, wf = h.clone().requires_grad_(), w.clone().requires_grad_()
    _masked_mean(ce((hf @ wf.t()).flatten(0, 1), target.flatten(), reduction="none").view(2, 3), target).backward()
    for ws in (2, 3):
        for rank, got in enumerate(run_distributed(_ignored_nan_rank, ws, timeout=120)):
            lo, hi = split_range(v, ws, rank)
            torch.testing.assert_close(got[0], full.grad[..., lo:hi])
            for dh, dw in (got[1:3], got[3:5]):
                torch.testing.assert_close(dh, hf.grad)
                torch.testing.assert_close(dw, wf.grad[lo:hi])
    for recompute in (False, True):
        h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
        _masked_mean(linear_cross_entropy(h1, w1, target, reduction="none", recompute=recompute), target).backward()
        torch.testing.assert_close(h1.grad, hf.grad)
        torch.testing.assert_close(w1.grad, wf.grad)
