"""Packed documents in zerofuse attention ([Note: documents] in kernels/attention.py): a query sees
only the earlier keys of its own document. Against the fp64 reference (reference.attention with
document_ids) by the peer rule of tests/tolerances.py, on the Triton kernels (interpreter on CPU,
or a GPU) and torch's CPU flash kernels; that the kernels skip other documents' key blocks; the op's
checks, opcheck and compile; the face's fallback."""
import pytest
import torch

from zerofuse import kernels, reference
from zerofuse.kernels import attention as K
from zerofuse.nn import functional as zF
from zerofuse.ops import attention as A

from common import HAS_CUDA, assert_compiled_grads_equal, assert_fake_strides
from tolerances import assert_within_peer_rule

DEVICE = "cuda" if HAS_CUDA else "cpu"
pytestmark = [pytest.mark.skipif(not (HAS_CUDA or kernels.interpreted()),
                                 reason="the Triton kernels need a GPU or the interpreter")]
if HAS_CUDA:
    pytestmark.append(pytest.mark.gpu)

CASES = [  # (Hq, Hkv, D, per batch row: document lengths)
    (2, 1, 32, [[5, 65, 1, 26], [97]]),  # grouped-query, a one-token document, N = 97 (odd)
    (2, 2, 16, [[64, 64, 22], [1] * 150]),  # documents on block edges; every token its own document
    (4, 2, 80, [[30, 40, 60], [129, 1]]),  # head_dim 80, a document spanning blocks
]


def _ids(rows):
    """Document ids (B, N) from per-row document lengths; ids repeat across rows and restart at 0."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)) % 2, torch.tensor(r)) for r in rows]).to(DEVICE)


def _inputs(b, hq, hkv, n, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype)  # noqa: E731
    return mk(b, hq, n, d), mk(b, hkv, n, d), mk(b, hkv, n, d), mk(b, hq, n, d)


@pytest.fixture(params=["triton", "cpu_kernels"])
def path(request, monkeypatch):
    if request.param == "cpu_kernels" and HAS_CUDA:
        pytest.skip("torch's CPU kernels: CPU tensors only")
    monkeypatch.setattr(kernels, "TRITON_ON_CPU", request.param == "triton" and kernels.interpreted())
    return request.param


def _check_case(case, dtype, seed=0):
    hq, hkv, d, rows = case
    ids = _ids(rows)
    b, n = ids.shape
    q, k, v, dout = _inputs(b, hq, hkv, n, d, dtype, seed)
    scale = 0.7 / d**0.5
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    out = zF.scaled_dot_product_attention(*ours, is_causal=True, scale=scale, enable_gqa=hq != hkv,
                                          document_ids=ids)
    out.backward(dout)
    ref64 = [t.double().requires_grad_() for t in (q, k, v)]
    out64, _ = reference.attention(*ref64, is_causal=True, scale=scale, document_ids=ids)
    out64.backward(dout.double())
    peer = [t.clone().requires_grad_() for t in (q, k, v)]  # torch's unfused result in the dtype
    out_t, _ = reference.attention(*peer, is_causal=True, scale=scale, document_ids=ids)
    out_t.backward(dout)
    assert out.dtype == dtype and out.shape == q.shape
    assert_within_peer_rule(out, out64, out_t, msg="out")
    for name, a, r, p in zip("qkv", ours, ref64, peer):
        assert_within_peer_rule(a.grad, r.grad, p.grad, msg=f"d{name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
def test_documents_match_the_reference(path, case, dtype):
    _check_case(case, dtype)


@pytest.mark.skipif(not kernels.interpreted(), reason="block shapes are forced in the interpreter")
@pytest.mark.parametrize("blocks", sorted({(m, n) for m, n, _, _ in K.GPU_CONFIGS + [K.SMALL_CONFIG]}),
                         ids=lambda b: f"{b[0]}x{b[1]}")
def test_every_gpu_block_shape_is_correct(blocks, monkeypatch):
    """The key ranges [Note: documents] derives (first visible block, wholly visible blocks, the
    dk/dv row bound) depend on BLOCK_M and BLOCK_N: each shape the GPU autotuner may pick."""
    monkeypatch.setattr(K, "INTERPRETER_BLOCKS", blocks)
    monkeypatch.setattr(kernels, "TRITON_ON_CPU", True)
    _check_case(CASES[0], torch.float32)
    _check_case((2, 2, 16, [[3, 90, 40, 17], [150]]), torch.float32, seed=1)


@pytest.mark.skipif(not kernels.interpreted(), reason="block shapes are forced in the interpreter")
def test_other_documents_blocks_are_never_read(monkeypatch):
    """Documents of 128 tokens on 64-token blocks: a query block never loads another document's
    keys, and a key block never loads another document's queries. Poisoned with NaN there (a read
    would reach the results through 0 * NaN), the other document's results stay those of the
    document alone."""
    monkeypatch.setattr(K, "INTERPRETER_BLOCKS", (64, 64))
    monkeypatch.setattr(kernels, "TRITON_ON_CPU", True)
    q, k, v, dout = _inputs(1, 2, 2, 256, 16, torch.float32)
    docs = A.document_bounds(_ids([[128, 128]]))
    alone = [t[:, :, 128:] for t in (q, k, v, dout)]
    want, _ = K.attention_fwd(*alone[:3], True, 0.25)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :128] = float("nan")  # the first document's keys: the second's queries must not read them
    v2[:, :, :128] = float("nan")
    out, lse = K.attention_fwd(q, k2, v2, True, 0.25, docs=docs)
    assert torch.equal(out[:, :, 128:], want)
    want_lse = K.attention_fwd(*alone[:3], True, 0.25)[1]
    want_dq = K.attention_bwd(alone[3], *alone[:3], want, want_lse, True, 0.25)[0]
    dq = K.attention_bwd(dout, q, k2, v2, out, lse, True, 0.25, docs=docs)[0]
    assert torch.equal(dq[:, :, 128:], want_dq)
    # the second document's queries and output grads poisoned: the first's key grads stay its own
    first = [t[:, :, :128] for t in (q, k, v, dout)]
    out1, lse1 = K.attention_fwd(*first[:3], True, 0.25)
    _, want_dk, want_dv = K.attention_bwd(first[3], *first[:3], out1, lse1, True, 0.25)
    q2, d2 = q.clone(), dout.clone()
    q2[:, :, 128:] = float("nan")
    d2[:, :, 128:] = float("nan")
    out, lse = K.attention_fwd(q2, k, v, True, 0.25, docs=docs)
    _, dk, dv = K.attention_bwd(d2, q2, k, v, out, lse, True, 0.25, docs=docs)
    assert torch.equal(dk[:, :, :128], want_dk) and torch.equal(dv[:, :, :128], want_dv)


def test_document_bounds():
    """Runs of equal ids: per token its document's first token and the one past its last; the same
    id in two runs is two documents."""
    ids = torch.tensor([[7, 7, 7, 3, 3, 7, 9], [0, 1, 2, 3, 4, 5, 6]])
    docs = A.document_bounds(ids)
    assert docs.dtype == torch.int32 and docs.shape == (2, 2, 7)
    assert docs[0].tolist() == [[0, 0, 0, 3, 3, 5, 6], [0, 1, 2, 3, 4, 5, 6]]
    assert docs[1].tolist() == [[3, 3, 3, 5, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7]]
    for bad in (torch.zeros(7), torch.zeros(2, 7), torch.zeros(2, 7, dtype=torch.bool), [[0, 1]]):
        with pytest.raises(ValueError, match="document_ids as a \\(batch, sequence\\) integer tensor"):
            A.document_bounds(bad)


def test_one_document_is_causal_attention(path):
    """One document per row: the same bits as causal attention without documents."""
    q, k, v, _ = _inputs(2, 2, 1, 97, 32, torch.float32)
    ids = torch.zeros(2, 97, dtype=torch.long, device=DEVICE)
    want = zF.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if q.is_cuda:  # documents are tuned under a key of their own: the same tile config, or other bits
        from zerofuse.kernels import attention as KA
        for key, meta in list(KA._CHOSEN.items()):
            if key[1:] == (128, 128, 32, True, torch.float32, False):
                KA._CHOSEN[(*key[:-1], True)] = meta
    got = zF.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, document_ids=ids)
    assert torch.equal(got, want) if path == "triton" else torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bad_documents_raise():
    q, k, v, _ = _inputs(1, 2, 2, 20, 16, torch.float32)
    ids = torch.zeros(1, 20, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="document_ids are for causal attention.*is_causal=False"):
        zF.scaled_dot_product_attention(q, k, v, document_ids=ids)
    with pytest.raises(ValueError, match="document_ids are for causal attention.*key \\[1, 2, 19, 16\\]"):
        zF.scaled_dot_product_attention(q, k[:, :, 1:], v[:, :, 1:], is_causal=True, document_ids=ids)
    with pytest.raises(ValueError, match="expected document_ids of shape \\[1, 20\\].*got \\[1, 19\\]"):
        zF.scaled_dot_product_attention(q, k, v, is_causal=True, document_ids=ids[:, 1:])
    docs = A.document_bounds(ids)
    for bad in (docs.long(), docs[:, :, 1:], docs[0]):
        with pytest.raises(ValueError, match="expected document bounds of shape \\[2, 1, 20\\], int32"):
            torch.ops.zerofuse.attention(q, k, v, True, 0.3, bad)
    with pytest.raises(ValueError, match="documents are for causal attention"):
        torch.ops.zerofuse.attention(q, k, v, False, 0.3, docs)


def test_fallback_applies_the_documents():
    """Where the kernel does not apply (here head_dim 300 > 256), torch's sdpa runs with the
    documents as its mask, and with an attn_mask of the caller's on top of them."""
    q, k, v, _ = _inputs(1, 2, 2, 40, 300, torch.float32)
    ids = _ids([[10, 25, 5]])
    with pytest.warns(UserWarning, match="head_dim 300"):
        got = zF.scaled_dot_product_attention(q, k, v, is_causal=True, document_ids=ids)
    want, _ = reference.attention(q.double(), k.double(), v.double(), is_causal=True, document_ids=ids)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    mask = torch.rand(40, 40, device=DEVICE) < 0.9  # and the caller's own mask on top of them
    got = zF.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True, document_ids=ids)
    torch.testing.assert_close(
        got, torch.nn.functional.scaled_dot_product_attention(q, k, v, mask & A.document_mask(A.document_bounds(ids))))


def test_opcheck_and_compile():
    q, k, v, dout = _inputs(2, 4, 2, 40, 32, torch.float32)
    docs = A.document_bounds(_ids([[9, 31], [40]]))
    torch.library.opcheck(torch.ops.zerofuse.attention.default, (q, k, v, True, 0.3, docs))
    out, lse = torch.ops.zerofuse.attention(q, k, v, True, 0.3, docs)
    torch.library.opcheck(torch.ops.zerofuse.attention_backward.default, (dout, q, k, v, out, lse, True, 0.3, docs))
    assert_fake_strides(torch.ops.zerofuse.attention.default, q, k, v, True, 0.3, docs)
    ids = _ids([[9, 31], [40]])

    def f(q, k, v):
        return zF.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, document_ids=ids).sum()

    assert_compiled_grads_equal(f, q, k, v)


@pytest.mark.skipif(not kernels.interpreted(), reason="block shapes are forced in the interpreter")
def test_rows_that_see_no_key_of_a_block_keep_a_running_max_of_minus_infinity(monkeypatch):
    """A document starting at token 40 of a 64-row block over 32-key blocks: its rows see no key of
    the block [0, 32). Their running max must stay -inf there (not a stand-in 0): with every score
    of theirs about -300 (base 2), 2^(s - 0) underflows to 0 and the output would be 0/0."""
    monkeypatch.setattr(K, "INTERPRETER_BLOCKS", (64, 32))
    monkeypatch.setattr(kernels, "TRITON_ON_CPU", True)
    q, k, v, _ = _inputs(1, 1, 1, 64, 16, torch.float32)
    u = torch.ones(16, device=DEVICE)
    k[:, :, 40:] = u
    q[:, :, 40:] = -52.0 * u  # scores -52 * 16 * 0.25 * log2(e) = -300 in base 2
    docs = A.document_bounds(_ids([[40, 24]]))
    out, _ = K.attention_fwd(q, k, v, True, 0.25, docs=docs)
    want, _ = reference.attention(q.double(), k.double(), v.double(), is_causal=True, scale=0.25,
                                  document_ids=_ids([[40, 24]]))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_qkv_attention_takes_documents(path):
    """zerofuse::attention_qkv with documents: the result and the packed qkv gradient of
    scaled_dot_product_attention with the same document_ids on the split heads; opcheck."""
    from zerofuse.ops import attention_qkv as QKV

    hq, hkv, d = 4, 2, 16
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 53, (hq + 2 * hkv) * d, generator=g).to(DEVICE)
    dout = torch.randn(2, 53, hq * d, generator=g).to(DEVICE)
    ids = _ids([[20, 1, 32], [53]])
    mine = qkv.clone().requires_grad_()
    out = zF.qkv_attention(mine, hq, hkv, is_causal=True, document_ids=ids)
    out.backward(dout)
    ref = qkv.clone().requires_grad_()
    q, k, v = QKV.heads(ref, hq, hkv, d)
    want = zF.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, document_ids=ids)
    want = want.transpose(1, 2).reshape(2, 53, hq * d)
    want.backward(dout)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-5, atol=1e-6)
    docs = A.document_bounds(ids)
    torch.library.opcheck(torch.ops.zerofuse.attention_qkv.default, (qkv, hq, hkv, True, 0.25, docs))
    o, lse = torch.ops.zerofuse.attention_qkv(qkv, hq, hkv, True, 0.25, docs)
    torch.library.opcheck(torch.ops.zerofuse.attention_qkv_backward.default,
                          (dout, qkv, o, lse, hq, hkv, True, 0.25, docs))
    with pytest.raises(ValueError, match="qkv_attention: document_ids are for causal attention"):
        zF.qkv_attention(qkv, hq, hkv, document_ids=ids)


def test_documents_in_inference_mode_and_broadcast_over_the_batch(path):
    """Inference tensors (no version counter: the face's bounds cache skips them) and (1, N) ids
    shared by every row of the batch."""
    q, k, v, _ = _inputs(2, 2, 2, 30, 16, torch.float32)
    ids = _ids([[10, 20]])
    want = zF.scaled_dot_product_attention(q, k, v, is_causal=True, document_ids=ids.expand(2, 30).clone())
    with torch.inference_mode():
        got = zF.scaled_dot_product_attention(q, k, v, is_causal=True, document_ids=_ids([[10, 20]]))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(zF.scaled_dot_product_attention(q, k, v, is_causal=True, document_ids=ids), want,
                               rtol=0, atol=0)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_a_captured_graph_replays_over_new_document_ids():
    """The face's bounds cache is skipped under capture: a graph captured over a static ids tensor
    applies the ids copied into it before each replay (not the warm-up's)."""
    q, k, v, _ = _inputs(1, 2, 2, 64, 16, torch.bfloat16)
    static = _ids([[64]])
    zF.scaled_dot_product_attention(q, k, v, is_causal=True, document_ids=static)  # warm-up: cached
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = zF.scaled_dot_product_attention(q, k, v, is_causal=True, document_ids=static)
    new = _ids([[20, 44]])
    static.copy_(new)
    graph.replay()
    torch.testing.assert_close(out, zF.scaled_dot_product_attention(q, k, v, is_causal=True, document_ids=new.clone()))
