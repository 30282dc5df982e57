"""zerofuse::rotary_embedding (RoPE) against the float64 reference within the peer rule, and against
Hugging Face Llama's formula (rotate_half with duplicated-half cos/sin): every dtype, odd shapes (seq
97, head_dim 80, grouped kv heads), both layouts, partial rotary, positions, in place, both paths."""
import pytest
import torch

from common import assert_fake_strides
from tolerances import assert_close, assert_within_peer_rule
from zerofuse import reference
from zerofuse.nn import RotaryEmbedding, rope_tables
from zerofuse.nn.functional import rotary_embedding


def _inputs(dtype, b=2, hq=3, hk=1, n=97, d=80, strided=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    if strided:  # (B, N, H, D) storage seen as (B, H, N, D), as a fused qkv projection yields
        q = torch.randn(b, n, hq, d, generator=g, dtype=torch.float64).to(dtype).transpose(1, 2)
        k = torch.randn(b, n, hk, d, generator=g, dtype=torch.float64).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(b, hq, n, d, generator=g, dtype=torch.float64).to(dtype)
        k = torch.randn(b, hk, n, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k


def _run(fn, q, k, dq, dk):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k)]
    oq, ok = fn(*leaves)
    (oq * dq + ok * dk).sum().backward()
    return oq.detach(), ok.detach(), leaves[0].grad, leaves[1].grad


@pytest.mark.parametrize("rotary_dim", [80, 32], ids=["full", "partial"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_float64_reference_within_the_peer_rule(dtype, interleaved, rotary_dim, kernel_path):
    q, k = _inputs(dtype, n=37, strided=rotary_dim == 32)
    dq, dk = _inputs(dtype, n=37, seed=1)
    cos, sin = rope_tables(128, rotary_dim, base=500.0)
    pos = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(2))
    for positions in (None, pos):
        ours = _run(lambda a, b: rotary_embedding(a, b, cos, sin, positions, interleaved=interleaved), q, k, dq, dk)

        def ref_fn(a, b, cos=cos, sin=sin):
            return (reference.rotary_embedding(a, cos, sin, positions, interleaved),
                    reference.rotary_embedding(b, cos, sin, positions, interleaved))

        ref = _run(lambda a, b: ref_fn(a, b, cos.double(), sin.double()), q.double(), k.double(), dq.double(),
                   dk.double())
        peer = _run(ref_fn, q, k, dq, dk)
        for name, got, want, theirs in zip(("q", "k", "dq", "dk"), ours, ref, peer):
            assert got.dtype == dtype and got.shape == want.shape, name
            assert_within_peer_rule(got, want, theirs, msg=name)
        if rotary_dim < 80:
            assert torch.equal(ours[0][..., rotary_dim:], q[..., rotary_dim:])


def _hf_llama(q, k, cos, sin, positions):
    """Hugging Face Llama's apply_rotary_pos_emb: cos/sin of the full head_dim (halves duplicated),
    gathered by position, x * cos + rotate_half(x) * sin."""
    def rotate_half(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    c = torch.cat([cos, cos], dim=-1)[positions].unsqueeze(1)
    s = torch.cat([sin, sin], dim=-1)[positions].unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def test_equals_hugging_face_llama(kernel_path):
    q, k = _inputs(torch.float32, hq=4, hk=2, n=33, d=64)
    cos, sin = rope_tables(64, 64)
    positions = torch.arange(5, 38).expand(2, 33)  # an offset: a continued sequence
    ours = rotary_embedding(q, k, cos, sin, positions[0])
    theirs = _hf_llama(q, k, cos, sin, positions)
    for a, b in zip(ours, theirs):
        assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_in_place_equals_out_of_place_and_refuses_autograd(kernel_path):
    q, k = _inputs(torch.bfloat16, n=37, strided=True)
    cos, sin = rope_tables(37, 80)
    want = rotary_embedding(q, k, cos, sin, interleaved=True)
    q2, k2 = q.clone(), k.clone()
    got = rotary_embedding(q2, k2, cos, sin, interleaved=True, inplace=True)
    assert got[0] is q2 and got[1] is k2
    assert torch.equal(q2, want[0]) and torch.equal(k2, want[1])
    with pytest.raises(ValueError, match="inplace=True has no autograd"):
        rotary_embedding(q.requires_grad_(), k, cos, sin, inplace=True)


def test_module_makes_fp32_tables_per_device_outside_the_state_dict():
    rope = RotaryEmbedding(16, 40, base=100.0, rotary_dim=8)
    assert list(rope.state_dict()) == [] and list(rope.buffers()) == []
    q, k = _inputs(torch.float32, n=10, d=16)
    out = rope(q, k)[0]
    cos, sin = rope.tables("cpu")
    assert cos.shape == (40, 4) and cos.dtype == torch.float32 and rope.tables("cpu")[0] is cos
    assert_close(out, reference.rotary_embedding(q, cos, sin))
    with torch.device("meta"):
        meta = RotaryEmbedding(16, 40)
    assert not meta.tables("cpu")[0].is_meta  # made where used, not where built
    # a longer context or a rescaled base after construction: new tables (the old ones were kept)
    rope.max_positions, rope.base = 64, 500000.0
    cos2, sin2 = rope.tables("cpu")
    want = rope_tables(64, 8, 500000.0)
    assert torch.equal(cos2, want[0]) and torch.equal(sin2, want[1])


def test_tables_first_made_under_inference_mode_still_train(kernel_path):
    """The module's first call under inference_mode cached inference tensors as its tables: every
    later forward with autograd raised "Inference tensors cannot be saved for backward"."""
    rope = RotaryEmbedding(16, 40)
    q, k = _inputs(torch.float32, n=10, d=16)
    with torch.inference_mode():
        want = rope(q, k)
    assert not rope.tables("cpu")[0].is_inference()
    qg = q.clone().requires_grad_()
    got = rope(qg, k)
    got[0].sum().backward()
    assert torch.equal(got[0].detach(), want[0]) and qg.grad is not None
    packed = torch.randn(2, 10, 3 * 16, requires_grad=True)
    rope.rotate_packed(packed, 2, 16).sum().backward()
    assert packed.grad is not None


@pytest.mark.parametrize("call,exc,msg", [
    (lambda q, k, c, s: rotary_embedding(q, k[:, :, :5], c, s), RuntimeError, r"expected k of q's batch, seq"),
    (lambda q, k, c, s: rotary_embedding(q, k, c[:, :3], s), RuntimeError, r"expected cos and sin to be"),
    (lambda q, k, c, s: rotary_embedding(q, k, c[:50], s[:50]), RuntimeError, r"sequence length 97 exceeds the 50"),
    (lambda q, k, c, s: rotary_embedding(q, k, c, s, torch.full((97,), 200)), IndexError,
     r"expected positions in \[0, 128\), got 200"),
    (lambda q, k, c, s: rotary_embedding(q[0], k[0], c, s), RuntimeError, r"expected q to be a floating-point \(batch"),
    (lambda q, k, c, s: rotary_embedding(q, k, c.requires_grad_(), s), ValueError, r"tables get no gradient"),
    (lambda q, k, c, s: rope_tables(10, 7), ValueError, r"expected an even rotary_dim"),
    (lambda q, k, c, s: rope_tables(torch.arange(10), 8), TypeError,  # (positions is a count, not the positions)
     r"rope_tables: expected positions to be an int \(the number of positions in the table\), got a tensor"),
], ids=["k-shape", "table-shapes", "too-long", "positions-range", "q-3d", "table-grad", "odd-dim", "positions-tensor"])
def test_bad_input_errors_name_the_argument(call, exc, msg):
    q, k = _inputs(torch.float32)
    cos, sin = rope_tables(128, 80)
    with pytest.raises(exc, match=msg):
        call(q, k, cos, sin)


def test_outputs_and_gradients_follow_the_inputs_layout(monkeypatch):
    """[Note: outputs follow their inputs' layout]: RoPE of (B, H, N, D) views of (B, N, H, D) buffers
    comes back in (B, N, H, D) memory, and so do their gradients (Hugging Face's view/transpose
    around it stay views); the same values as contiguous inputs give, on both paths; the fake
    promises the same strides."""
    from zerofuse import kernels

    cos, sin = rope_tables(40, 16)
    for triton in (False, True):
        monkeypatch.setattr(kernels, "TRITON_ON_CPU", triton and kernels.interpreted())
        q, k = _inputs(torch.float32, n=33, d=16, strided=True)
        assert not q.is_contiguous()
        oq, ok = torch.ops.zerofuse.rotary_embedding(q, k, cos, sin, None, False, False)
        cq, ck = torch.ops.zerofuse.rotary_embedding(q.contiguous(), k.contiguous(), cos, sin, None, False, False)
        assert cq.is_contiguous() and ck.is_contiguous()
        for got, want in ((oq, cq), (ok, ck)):
            assert got.transpose(1, 2).is_contiguous(), got.stride()
            assert torch.equal(got, want)
        torch.library.opcheck(torch.ops.zerofuse.rotary_embedding.default, (q, k, cos, sin, None, False, False))
        for args in ((q, k), (q.contiguous(), k.contiguous())):
            assert_fake_strides(torch.ops.zerofuse.rotary_embedding.default, *args, cos, sin, None, False, False)
        leaf = q.transpose(1, 2).detach().clone().requires_grad_()  # (B, N, H, D)
        x = leaf.transpose(1, 2)
        seen = []
        x.register_hook(seen.append)  # the gradient RoPE's backward hands the transpose
        rq, _ = rotary_embedding(x, k, cos, sin)
        rq.backward(torch.randn(rq.shape).transpose(1, 2).contiguous().transpose(1, 2))
        assert seen[0].transpose(1, 2).is_contiguous(), seen[0].stride()


def test_eager_path_is_the_op_and_checks_positions_once(monkeypatch):
    """The face's eager autograd (ops.rotary.EagerRope) gives the op's outputs and gradients bit for
    bit; it checks the positions in forward only (the op checked them again in its backward: on a
    GPU a few launches per layer); positions modified between forward and backward are refused."""
    from zerofuse.ops import ids, rotary

    cos, sin = rope_tables(40, 16)
    pos = torch.randint(0, 40, (2, 33), generator=torch.Generator().manual_seed(3))
    q, k = _inputs(torch.float32, n=33, d=16, strided=True)
    dq, dk = torch.randn(q.shape), torch.randn(k.shape)
    calls = []
    real = ids.check_ids
    monkeypatch.setattr(ids, "check_ids", lambda *a, **kw: (calls.append(1), real(*a, **kw)))
    eager = _run(lambda a, b: rotary_embedding(a, b, cos, sin, pos), q, k, dq, dk)
    assert len(calls) == 1
    op = _run(lambda a, b: rotary.rotary_embedding(a, b, cos, sin, pos, False, False), q, k, dq, dk)
    assert len(calls) == 3  # the op: forward and backward
    for a, b in zip(eager, op):
        assert torch.equal(a, b)
    p2 = pos.clone()
    oq, _ = rotary_embedding(q.detach().requires_grad_(), k, cos, sin, p2)
    p2.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        oq.sum().backward()


def test_opcheck_and_compile():
    q, k = (t.requires_grad_() for t in _inputs(torch.float32, n=9, d=16))
    cos, sin = rope_tables(12, 16)
    pos = torch.randint(0, 12, (2, 9))
    torch.library.opcheck(torch.ops.zerofuse.rotary_embedding.default, (q, k, cos, sin, pos, False, False))
    torch.library.opcheck(torch.ops.zerofuse.rotary_embedding.default, (q, k, cos, sin, None, True, True))
    torch.library.opcheck(torch.ops.zerofuse.rotary_embedding_.default,
                          (q.detach().clone(), k.detach().clone(), cos, sin, pos, False, False))

    def f(a, b):
        oq, ok = rotary_embedding(a * 2, b, cos, sin, pos)
        return (oq.square().sum() + ok.sum())

    ours = torch.autograd.grad(torch.compile(f, fullgraph=True)(q, k), (q, k))
    eager = torch.autograd.grad(f(q, k), (q, k))
    for a, b in zip(ours, eager):
        assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_reference(dtype):
    q, k = _inputs(dtype, b=2, hq=32, hk=8, n=2048, d=128, strided=True)
    cos, sin = rope_tables(4096, 128, base=500000.0)
    for interleaved in (False, True):
        ours = rotary_embedding(q.cuda(), k.cuda(), cos.cuda(), sin.cuda(), interleaved=interleaved)
        for got, x in zip(ours, (q, k)):
            want = reference.rotary_embedding(x.double(), cos.double(), sin.double(), None, interleaved)
            peer = reference.rotary_embedding(x.cuda(), cos.cuda(), sin.cuda(), None, interleaved)
            assert_within_peer_rule(got.cpu(), want, peer.cpu())


def test_the_module_keeps_to_its_head_dim_and_base(kernel_path):
    """A RotaryEmbedding of another head_dim rotated across heads (V's too) in Attention's packed path
    and the rest of a wider head left unrotated in forward, silently; a base <= 0 or NaN made NaN
    tables; max_positions 0 or 16.5 was refused at the first forward only, under another name
    (a review's reproductions, 2026-12-07)."""
    from zerofuse.nn import Attention, RotaryEmbedding

    with pytest.raises(ValueError, match=r"Attention: expected rope for head_dim 8 \(embed_dim 32 / num_heads 4\), "
                                         r"got a RotaryEmbedding of head_dim 16"):
        Attention(32, 4, rope=RotaryEmbedding(16, 64))
    rope = RotaryEmbedding(8, 16)
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match=r"RotaryEmbedding: expected q of head_dim 8 .*got head_dim 16"):
        rope(q, q)
    with pytest.raises(ValueError, match=r"RotaryEmbedding: expected an attention of head_dim 8 .*got head_dim 16"):
        rope.rotate_packed(torch.randn(1, 4, 48), 2, 16)
    for base in (0.0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match=r"rope_tables: expected base to be a finite number > 0, got"):
            RotaryEmbedding(8, 16, base=base)
    with pytest.raises(ValueError, match=r"RotaryEmbedding: expected max_positions >= 1, got 0"):
        RotaryEmbedding(8, 0)
    with pytest.raises(TypeError, match=r"RotaryEmbedding: expected max_positions to be an int .*got 16.5"):
        RotaryEmbedding(8, 16.5)
    import numpy as np  # (numpy's numbers pass, as before the checks)

    assert torch.equal(RotaryEmbedding(8, 16, base=np.float32(500.0)).tables("cpu")[0],
                       RotaryEmbedding(8, 16, base=500.0).tables("cpu")[0])


def test_hugging_face_positions_and_a_strided_head_dim(kernel_path):
    """position_ids (1, seq) as Hugging Face passes them (refused: expected (batch, seq)), and q/k whose
    head_dim is not the unit-stride dim (refused; sdpa's face copies such inputs): the rotation of
    (batch, seq) positions and of contiguous copies."""
    cos, sin = rope_tables(16, 8)
    q, k = torch.randn(2, 3, 9, 8), torch.randn(2, 1, 9, 8)
    pos = torch.arange(3, 12)
    want = rotary_embedding(q, k, cos, sin, pos.expand(2, 9))
    for got, w in zip(rotary_embedding(q, k, cos, sin, pos[None]), want):
        assert torch.equal(got, w)
    qs, ks = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k))
    assert qs.stride(-1) != 1
    for got, w in zip(rotary_embedding(qs, ks, cos, sin, pos[None]), want):
        assert torch.equal(got, w)


def test_rotate_packed_refuses_what_it_cannot_rotate():
    from zerofuse.nn import RotaryEmbedding

    rope = RotaryEmbedding(16, 8)
    with pytest.raises(ValueError, match=r"rotate_packed: sequence length 9 exceeds the 8 positions"):
        rope.rotate_packed(torch.randn(1, 9, 48), 2, 16)
    with pytest.raises(ValueError, match=r"rotate_packed: expected qkv \(batch, seq, heads \* 16\) of at least 4 heads"):
        rope.rotate_packed(torch.randn(1, 4, 48), 4, 16)


@pytest.mark.parametrize("shape", [(0, 8, 32), (2, 0, 32)], ids=["empty-batch", "empty-sequence"])
def test_attention_with_rope_takes_an_empty_batch_or_sequence(shape, kernel_path):
    """As its twin on torch's sdpa (view(b, n, -1, head_dim) of 0 elements was ambiguous: a rank's
    empty micro-batch raised), forward and backward."""
    import torch.nn.functional as TF

    from zerofuse.nn import Attention

    torch.manual_seed(0)
    ours = Attention(32, 4, 2, rope=RotaryEmbedding(8, 16))
    twin = Attention(32, 4, 2, rope=RotaryEmbedding(8, 16), sdpa=TF.scaled_dot_product_attention)
    twin.load_state_dict(ours.state_dict())
    x = torch.randn(shape, requires_grad=True)
    y, want = ours(x), twin(x)
    assert y.shape == want.shape == shape
    y.sum().backward()
    assert x.grad.shape == shape
