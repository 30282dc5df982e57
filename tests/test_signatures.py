"""[Note: call signatures] (zerofuse/ops/signatures.py): the C++ signature, and the norm faces'
plans: a call with a known signature skips the checks and path choices, gives the bits the slow
path gives, and a call whose signature differs in anything the checks read takes the slow path."""
import pytest
import torch

import zerofuse.nn.functional as ZF
from zerofuse import kernels
from zerofuse.nn import functional as face
from zerofuse.ops.signatures import Plans, signature

# Plans are recorded on the Triton path, which CPU tensors take in the interpreter (no GPU)
planned = pytest.mark.skipif(not kernels.triton_on_cpu(), reason="CPU tensors take the C++ kernels: no plans")


def test_signature_differs_in_everything_a_face_reads():
    x = torch.randn(4, 6)
    base = signature(x, None, (6,), 1e-5, True, 3)
    variants = [
        signature(x.double(), None, (6,), 1e-5, True, 3),           # dtype
        signature(x.reshape(6, 4), None, (6,), 1e-5, True, 3),      # sizes
        signature(x.t().contiguous().t(), None, (6,), 1e-5, True, 3),  # strides
        signature(x.clone().requires_grad_(), None, (6,), 1e-5, True, 3),
        signature(x, x, (6,), 1e-5, True, 3),                       # None vs a tensor
        signature(x, None, [6, 1], 1e-5, True, 3),
        signature(x, None, (6,), 1e-6, True, 3),
        signature(x, None, (6,), 1e-5, False, 3),
        signature(x, None, (6,), 1e-5, True, 4),
        signature(x, None, 6, 1e-5, True, 3),                       # an int, not a tuple
        signature(x.to("meta"), None, (6,), 1e-5, True, 3),         # device
    ]
    with torch.no_grad():
        variants.append(signature(x, None, (6,), 1e-5, True, 3))    # grad mode
    assert all(isinstance(v, bytes) for v in variants)
    assert len({base, *variants}) == len(variants) + 1
    assert signature(x.clone(), None, (6,), 1e-5, True, 3) == base  # values and addresses are not in it
    assert signature(torch.nn.Parameter(x), None, (6,), 1e-5, True, 3) == signature(
        x.clone().requires_grad_(), None, (6,), 1e-5, True, 3)


class _Sub(torch.Tensor):
    pass


class _Mode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_no_signature_where_a_plan_could_skip_something_that_matters():
    x = torch.randn(3, 4)
    assert signature(x.as_subclass(_Sub)) is None
    assert signature(torch.randn(2, dtype=torch.complex64).conj()) is None
    assert signature(x.to_sparse()) is None
    assert signature(x, "a string") is None
    assert signature(x, (1, 2.5)) is None
    assert signature(2**70) is None
    nested = torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(3, 8)])
    assert signature(nested) is None  # (its sizes() throws in C++: must not escape)
    with _Mode():
        assert signature(x) is None
    assert signature(x) is not None


def test_plans_are_bounded():
    plans = Plans(limit=2)
    plans.put(b"a", 1)
    plans.put(b"b", 2)
    plans.put(None, 3)  # no signature, no plan
    assert len(plans) == 2
    plans.put(b"c", 3)
    assert dict(plans) == {b"c": 3}


@pytest.fixture
def counted_checks(monkeypatch):
    """The number of times the norm faces ran their argument checks."""
    calls = []
    check = face._check
    monkeypatch.setattr(face, "_check", lambda *a, **k: (calls.append(1), check(*a, **k))[1])
    face._PLANS.clear()
    yield calls
    face._PLANS.clear()


def _norm_call(norm, residual, grad, x, r, w, b, ib):
    if norm == "layer":
        if residual:
            return ZF.add_layer_norm(x, r, (x.shape[-1],), w, b, 1e-5, input_bias=ib)
        return ZF.layer_norm(x, (x.shape[-1],), w, b, 1e-5), x
    if residual:
        return ZF.add_rms_norm(x, r, (x.shape[-1],), w, input_bias=ib)
    return ZF.rms_norm(x, (x.shape[-1],), w), x


@planned
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_a_planned_call_gives_the_checked_calls_bits(norm, residual, grad, dtype, counted_checks, monkeypatch):
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(s, generator=g).to(dtype) for s in ((2, 5, 33), (2, 5, 33), (33,), (33,), (33,))]

    def run():
        x, r, w, b, ib = (t.clone().requires_grad_(grad) for t in leaves)
        y, h = _norm_call(norm, residual, grad, x, r, w, b, ib)
        got = [y, h]
        if grad:
            (y.float().square().sum() + h.float().sum()).backward()
            got += [t.grad for t in (x, r, w, b, ib)]
        return got

    planned_runs = [run() for _ in range(3)]
    assert len(counted_checks) == 1  # checked once: the later calls ran the signature's plan
    with monkeypatch.context() as m:
        m.setattr(face, "signature", lambda *a: None)  # no signature, no plan: the checked path
        checked = run()
    assert len(counted_checks) == 2
    for got in planned_runs:
        for want, have in zip(checked, got):
            assert (want is None) == (have is None)
            if want is not None:
                assert torch.equal(have, want)


@planned
def test_a_call_of_another_signature_is_checked_and_planned_apart(counted_checks):
    x, w, b = torch.randn(4, 16), torch.randn(16), torch.randn(16)
    want = torch.nn.functional.layer_norm(x, (16,), w, b)
    ZF.layer_norm(x, (16,), w, b)
    ZF.layer_norm(x, (16,), w, b)
    assert len(counted_checks) == 1
    ZF.layer_norm(x, (16,), w, b, eps=1e-3)  # eps
    ZF.layer_norm(x.double(), (16,), w.double(), b.double())  # dtype (and another path: no plan)
    xt = torch.randn(16, 4).t()
    for _ in range(2):  # strided input: the slow path every call (it makes x contiguous)
        torch.testing.assert_close(ZF.layer_norm(xt, (16,), w, b), torch.nn.functional.layer_norm(xt, (16,), w, b))
    with pytest.raises(ValueError, match="weight of shape"):  # a bad weight after a plan exists: still refused
        ZF.layer_norm(x, (16,), torch.randn(15), b)
    assert len(counted_checks) == 6
    torch.testing.assert_close(ZF.layer_norm(x, (16,), w, b), want)
    assert len(counted_checks) == 6


@planned
def test_the_triton_switch_is_in_the_signature(counted_checks, monkeypatch):
    """A plan made for the Triton path must not serve a call routed to the C++ CPU kernels."""
    x, w = torch.randn(3, 8), torch.randn(8)
    ZF.rms_norm(x, (8,), w)
    ran = []
    cpu_op = torch.ops.zerofuse.norm_fwd_cpu
    monkeypatch.setattr(kernels, "TRITON_ON_CPU", False)
    monkeypatch.setattr(face._ops.torch.ops.zerofuse, "norm_fwd_cpu",
                        lambda *a: (ran.append(1), cpu_op(*a))[1], raising=False)
    torch.testing.assert_close(ZF.rms_norm(x, (8,), w), torch.nn.functional.rms_norm(x, (8,), w))
    assert ran == [1]


# ---------------------------------------------------------------- attention's plans (nn/sdpa.py)

@pytest.fixture
def attention_checks(monkeypatch):
    """The number of times the attention faces ran their argument checks (the slow path)."""
    from zerofuse.nn import sdpa

    calls = []
    check, qkv_check = sdpa._check_attention, sdpa._qkv.check
    monkeypatch.setattr(sdpa, "_check_attention", lambda *a: (calls.append(1), check(*a))[1])
    monkeypatch.setattr(sdpa._qkv, "check", lambda *a: (calls.append(1), qkv_check(*a))[1])
    return calls


def _attention_run(case, grad, dtype, ids=None):
    """One call of a face from fresh leaves: its output, and with grad the leaves' gradients."""
    g = torch.Generator().manual_seed(1)
    b, n, hq, hkv, d = 2, 19, 4, 2, 16
    if case == "qkv":
        qkv = torch.randn(b, n, (hq + 2 * hkv) * d, generator=g).to(dtype).requires_grad_(grad)
        leaves = [qkv]
        out = ZF.qkv_attention(qkv, hq, hkv, is_causal=True, document_ids=ids)
    else:
        shapes = [(b, hq, n, d), (b, hkv, n, d), (b, hkv, n, d)]
        if case == "bnhd":  # (B, H, N, D) views of (B, N, H, D) projections, as Hugging Face's
            leaves = [torch.randn(s[0], s[2], s[1], s[3], generator=g).to(dtype).requires_grad_(grad) for s in shapes]
            q, k, v = (t.transpose(1, 2) for t in leaves)
        else:
            leaves = [torch.randn(s, generator=g).to(dtype).requires_grad_(grad) for s in shapes]
            q, k, v = leaves
        out = ZF.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True, document_ids=ids)
    got = [out]
    if grad:
        (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        got += [t.grad for t in leaves]
    return got


@planned
@pytest.mark.parametrize("docs", [False, True], ids=["", "documents"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("case", ["bhnd", "bnhd", "qkv"])
def test_a_planned_attention_call_gives_the_checked_calls_bits(case, grad, dtype, docs, attention_checks, monkeypatch):
    from zerofuse.nn import sdpa

    ids = torch.tensor([[0] * 7 + [1] * 12, [3] * 19]) if docs else None
    planned_runs = [_attention_run(case, grad, dtype, ids) for _ in range(3)]
    assert len(attention_checks) == 1  # checked once: the later calls ran the signature's plan
    with monkeypatch.context() as m:
        m.setattr(sdpa, "signature", lambda *a: None)  # no signature, no plan: the checked path
        checked = _attention_run(case, grad, dtype, ids)
    assert len(attention_checks) == 2
    for got in planned_runs:
        assert len(got) == len(checked)
        for want, have in zip(checked, got):
            assert have.stride() == want.stride()
            assert torch.equal(have, want)


@planned
def test_an_attention_plan_bakes_in_no_tensor_value(attention_checks):
    """The signature holds a tensor's metadata, not its value: a scale passed as a tensor, or
    document ids changed in place, must not be served what a plan kept from an earlier call."""
    from zerofuse.ops.attention import document_bounds, document_mask

    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    for s in (0.5, 0.25, 0.125):  # scales as 0-d tensors of one signature
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s)
        torch.testing.assert_close(ZF.scaled_dot_product_attention(q, k, v, is_causal=True, scale=torch.tensor(s)),
                                   want)
    ids = torch.zeros(1, 9, dtype=torch.long)
    for split in (4, 6, 0):
        ids.zero_()
        ids[:, split:] = 1  # the same tensor, new values
        mask = document_mask(document_bounds(ids))
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        for _ in range(2):
            torch.testing.assert_close(ZF.scaled_dot_product_attention(q, k, v, is_causal=True, document_ids=ids),
                                       want)
            qkv = torch.cat([t.transpose(1, 2).reshape(1, 9, 16) for t in (q, k, v)], -1)
            torch.testing.assert_close(ZF.qkv_attention(qkv, 2, is_causal=True, document_ids=ids),
                                       want.transpose(1, 2).reshape(1, 9, 16))


@planned
def test_an_attention_plan_does_not_serve_autocast_or_the_cpu_kernels(monkeypatch):
    from zerofuse.kernels import attention as K

    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    for _ in range(2):
        assert ZF.scaled_dot_product_attention(q, k, v, is_causal=True).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):  # torch's sdpa runs in bf16 there: so must this
        out = ZF.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == torch.bfloat16
    launched = []
    launch = K._launch
    monkeypatch.setattr(K, "_launch", lambda *a, **kw: (launched.append(1), launch(*a, **kw))[1])
    monkeypatch.setattr(kernels, "TRITON_ON_CPU", False)  # CPU tensors now take torch's CPU kernels
    torch.testing.assert_close(ZF.scaled_dot_product_attention(q, k, v, is_causal=True), want)
    assert launched == []


@planned
@pytest.mark.parametrize("case", ["bnhd", "qkv_seq_major", "qkv_slice"])
def test_a_planned_backward_reads_saved_tensors_at_their_own_strides(case):
    """Saved-tensor hooks (torch's save_on_cpu with pinned memory: activation offload) give the saved
    tensors back in other layouts (contiguous copies): a plan's backward must not read them at the forward's strides
    (it did: gradients off by ~10, or an out-of-bounds view of a sliced qkv)."""
    g = torch.Generator().manual_seed(0)
    b, n, h, d = 2, 16, 2, 16
    if case == "bnhd":
        src = [torch.randn(b, n, h, d, generator=g) for _ in range(3)]

        def face(leaves):
            return ZF.scaled_dot_product_attention(*[t.transpose(1, 2) for t in leaves], is_causal=True)
    else:
        w = 3 * h * d
        src = [torch.randn(n, b, w, generator=g) if case == "qkv_seq_major" else torch.randn(b, n, w + 32, generator=g)]

        def face(leaves):
            qkv = leaves[0].transpose(0, 1) if case == "qkv_seq_major" else leaves[0][..., 16:16 + w]
            return ZF.qkv_attention(qkv, h, is_causal=True)
    weight = torch.randn(face(src).shape, generator=g)

    def grads(hooked):
        leaves = [t.clone().requires_grad_() for t in src]
        if hooked:  # as save_on_cpu(pin_memory=True) does: a contiguous copy of each saved tensor
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(memory_format=torch.contiguous_format),
                                                          lambda t: t):
                out = face(leaves)
        else:
            out = face(leaves)
        (out * weight).sum().backward()
        return out.detach(), [t.grad for t in leaves]

    want = grads(False)
    for _ in range(2):  # the first call records the plan, the second runs it
        got = grads(True)
        torch.testing.assert_close(got[0], want[0])
        for a, e in zip(got[1], want[1]):
            torch.testing.assert_close(a, e)


def _faces():
    import zerofuse.nn.functional as F

    qkv = torch.randn(1, 5, 3 * 2 * 8)
    k, v = _kv()
    return {"sdpa": (torch.randn(1, 2, 5, 8), lambda x: F.scaled_dot_product_attention(x, k, v, is_causal=True)),
            "qkv_attention": (qkv, lambda x: F.qkv_attention(x, 2, is_causal=True)),
            "layer_norm": (torch.randn(3, 8), lambda x: F.layer_norm(x, (8,))),
            "rms_norm": (torch.randn(3, 8), lambda x: F.rms_norm(x, (8,), torch.ones(8))),
            "linear_cross_entropy": (torch.randn(3, 8), lambda x: F.linear_cross_entropy(x, torch.randn(11, 8),
                                                                                         torch.tensor([1, 2, 10])))}


def _kv():
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)


def _torch_faces():
    TF = torch.nn.functional
    k, v = _kv()
    return {"sdpa": lambda x: TF.scaled_dot_product_attention(x, k, v, is_causal=True),
            "qkv_attention": lambda x: TF.scaled_dot_product_attention(
                *(t.view(1, 5, 2, 8).transpose(1, 2) for t in x.split(16, -1)), is_causal=True
            ).transpose(1, 2).reshape(1, 5, 16),
            "layer_norm": lambda x: TF.layer_norm(x, (8,)),
            "rms_norm": lambda x: TF.rms_norm(x, (8,), torch.ones(8))}


@pytest.mark.parametrize("name", ["sdpa", "qkv_attention", "layer_norm", "rms_norm", "linear_cross_entropy"])
def test_forward_ad_is_torchs_or_refused_never_dropped(name):
    """Under forward AD the kernels alone would return outputs without tangents (a silently wrong
    jvp): the faces compute with torch's ops there, whose tangents (or refusal: torch's CPU sdpa has
    no forward AD) are torch's own, also when a plan was recorded for the same tensors outside the
    dual level (the Functions raised torch's generic "implement the jvp" error, naming no face,
    where torch's norms take forward AD: a review's reproduction, 2026-12-07); the fused loss,
    which has no torch op to fall back on, refuses by name."""
    import torch.autograd.forward_ad as fwad

    x, face = _faces()[name]
    face(x), face(x)  # (a plan, where one applies, for x without forward AD)
    t = torch.randn_like(x)
    if name == "linear_cross_entropy":
        with fwad.dual_level(), pytest.raises(NotImplementedError, match="linear_cross_entropy: forward-mode AD"):
            face(fwad.make_dual(x, t))
        return
    ref = _torch_faces()[name]
    with fwad.dual_level():  # (torch's CPU flash sdpa refuses forward AD: the faces as torch)
        try:
            ref(fwad.make_dual(x, t))
        except NotImplementedError as e:
            with pytest.raises(NotImplementedError, match=str(e).splitlines()[0][:40]):
                face(fwad.make_dual(x, t))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with fwad.dual_level(), sdpa_kernel(SDPBackend.MATH):  # (the math backend takes it: the tangents compared)
        want = fwad.unpack_dual(ref(fwad.make_dual(x, t))).tangent
        got = fwad.unpack_dual(face(fwad.make_dual(x, t))).tangent
    assert got is not None and want is not None
    torch.testing.assert_close(got, want)


def test_forward_ad_through_packed_documents_is_torchs_with_their_mask():
    """document_ids under forward AD: the documents as torch's mask (refused, as under torch.func,
    once forward AD took torch's ops: a review's reproduction, 2026-12-07)."""
    import torch.autograd.forward_ad as fwad
    import zerofuse.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator().manual_seed(0)
    q, k, v, t = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(4))
    ids = torch.tensor([[0, 0, 0, 1, 1, 1]])
    same = (ids[:, None, :, None] == ids[:, None, None, :]) & torch.ones(6, 6, dtype=torch.bool).tril()
    with fwad.dual_level(), sdpa_kernel(SDPBackend.MATH):
        got = F.scaled_dot_product_attention(fwad.make_dual(q, t), k, v, is_causal=True, document_ids=ids)
        want = torch.nn.functional.scaled_dot_product_attention(fwad.make_dual(q, t), k, v, attn_mask=same)
        torch.testing.assert_close(fwad.unpack_dual(got).primal, fwad.unpack_dual(want).primal)
        torch.testing.assert_close(fwad.unpack_dual(got).tangent, fwad.unpack_dual(want).tangent)


@pytest.mark.parametrize("name", ["sdpa", "qkv_attention", "layer_norm", "rms_norm"])
def test_inference_mode_under_enable_grad_records_no_graph(name):
    """torch records no graph in inference mode, even under enable_grad: an inference tensor out,
    not an error from saving inference tensors for a backward (the faces' Functions did)."""
    x, face = _faces()[name]
    leaf = x.clone().requires_grad_()
    want = face(x)
    face(leaf), face(leaf)  # (a plan with autograd, where one applies)
    with torch.inference_mode(), torch.enable_grad():
        for _ in range(2):
            out = face(leaf)
            assert out.is_inference() and not out.requires_grad
            torch.testing.assert_close(out, want)


def test_qkv_attention_runs_in_the_autocast_dtype():
    """As scaled_dot_product_attention (and torch's sdpa): under autocast the inputs are cast."""
    qkv = torch.randn(1, 5, 3 * 2 * 8)
    for _ in range(2):
        assert ZF.qkv_attention(qkv, 2, is_causal=True).dtype == torch.float32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ZF.qkv_attention(qkv, 2, is_causal=True)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, ZF.qkv_attention(qkv.bfloat16(), 2, is_causal=True))


@pytest.mark.parametrize("which", ["q", "k", "both"])
def test_rotary_embedding_forward_ad_gives_the_rotated_tangent(kernel_path, which):
    """RoPE is linear in q and k: its jvp is the tangents rotated. The face sent a dual tensor that
    did not require grad to the kernels alone (Triton path), which dropped the tangent silently."""
    import torch.autograd.forward_ad as fwad
    import zerofuse.nn.functional as F
    from zerofuse.nn import rope_tables

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 1, 5, 8, generator=g)
    tq, tk = torch.randn(q.shape, generator=g), torch.randn(k.shape, generator=g)
    cos, sin = rope_tables(5, 8)
    F.rotary_embedding(q, k, cos, sin)  # (a plan, where one applies, outside the dual level)
    with fwad.dual_level():
        dq = fwad.make_dual(q, tq) if which != "k" else q
        dk = fwad.make_dual(k, tk) if which != "q" else k
        oq, ok = F.rotary_embedding(dq, dk, cos, sin)
        got = fwad.unpack_dual(oq).tangent, fwad.unpack_dual(ok).tangent
    want = F.rotary_embedding(tq if which != "k" else torch.zeros_like(q), tk if which != "q" else torch.zeros_like(k),
                              cos, sin)
    for a, e, dual in zip(got, want, (which != "k", which != "q")):
        assert a is not None or not dual  # (torch's ops give an input without a tangent none: zeros)
        torch.testing.assert_close(a if a is not None else torch.zeros_like(e), e)
