"""Flash attention Triton kernels (kernels/attention.py) vs the fp64 reference, forward (out and
LSE) and backward (dq, dk, dv), in the interpreter on CPU tensors (or on a GPU when present).

The rule (flash-attention's): the kernel's max error vs fp64 is at most 2x the max error of the
same computation done by PyTorch in the input dtype, plus a small absolute floor."""
import pytest
import torch

from zerofuse import kernels, reference
from zerofuse.kernels import attention as K

from common import HAS_CUDA, assert_compiled_grads_equal, assert_fake_strides

DEVICE = "cuda" if HAS_CUDA else "cpu"
# On a GPU machine every test here runs on CUDA, so the module belongs to `-m gpu` there.
pytestmark = [pytest.mark.skipif(not (HAS_CUDA or kernels.interpreted()),
                                 reason="the Triton kernels need a GPU or the interpreter")]
if HAS_CUDA:
    pytestmark.append(pytest.mark.gpu)

CASES = [  # (B, Hq, Hkv, Nq, Nk, D, causal)
    (1, 2, 2, 97, 97, 32, False),
    (1, 2, 2, 97, 97, 32, True),
    (2, 4, 1, 65, 130, 64, False),  # multi-query, Nq != Nk
    (1, 4, 2, 130, 65, 80, True),  # grouped-query, head_dim 80, Nq > Nk
    (1, 2, 1, 33, 33, 128, True),
    (1, 2, 1, 70, 70, 256, True),  # the largest head_dim the face sends to the kernel
    (1, 2, 2, 40, 150, 32, True),  # causal with Nk > Nq: top-left aligned as torch's; keys past Nq unseen
]


def _inputs(b, hq, hkv, nq, nk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype)  # noqa: E731
    return mk(b, hq, nq, d), mk(b, hkv, nk, d), mk(b, hkv, nk, d), mk(b, hq, nq, d)


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_forward_and_backward_vs_float64(case, dtype):
    b, hq, hkv, nq, nk, d, causal = case
    q, k, v, dout = _inputs(b, hq, hkv, nq, nk, d, dtype)
    scale = 0.7 / d**0.5
    out, lse = K.attention_fwd(q, k, v, causal, scale)
    dq, dk, dv = K.attention_bwd(dout, q, k, v, out, lse, causal, scale)

    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    out64, lse64 = reference.attention(*leaves64, is_causal=causal, scale=scale)
    out64.backward(dout.double())
    # torch's own result in the input dtype (the baseline of the 2x rule)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out_t, _ = reference.attention(*leaves, is_causal=causal, scale=scale)
    out_t.backward(dout)

    floor = 1e-5 if dtype == torch.float32 else 1e-3
    assert _max_err(out, out64) <= 2 * _max_err(out_t, out64) + floor
    assert _max_err(lse, lse64) <= 1e-4
    for got, want, theirs in zip((dq, dk, dv), (t.grad for t in leaves64), (t.grad for t in leaves)):
        assert got.dtype == dtype and got.shape == want.shape
        assert _max_err(got, want) <= 2 * _max_err(theirs, want) + floor


@pytest.mark.parametrize("case", [(1, 2, 1, 1025, 1025, 64, True),
                                  (1, 1, 1, 1025, 1023 if HAS_CUDA else 130, 128, False)],  # (the interpreter: shorter)
                         ids=lambda c: "-".join(map(str, c)))
def test_odd_long_sequences(case):
    """Lengths one past a tile multiple (1025: a last block of one row), Nq != Nk and head_dim 64/128
    (issue 24's odd lengths; 97 and head_dim 80/256 are in CASES): fp32 forward and backward."""
    test_forward_and_backward_vs_float64(case, torch.float32)


@pytest.mark.skipif(not kernels.interpreted(), reason="block shapes are forced in the interpreter")
@pytest.mark.parametrize("blocks", sorted({(m, n) for m, n, _, _ in K.GPU_CONFIGS + [K.SMALL_CONFIG]}),
                         ids=lambda b: f"{b[0]}x{b[1]}")
def test_every_gpu_block_shape_is_correct(blocks, monkeypatch):
    """The GPU autotuner may pick any of GPU_CONFIGS' block shapes: each one gives the fp32 result
    (causal and not, odd lengths, Nq != Nk, grouped-query) in the interpreter."""
    monkeypatch.setattr(K, "INTERPRETER_BLOCKS", blocks)
    for case in (CASES[1], CASES[2], CASES[3], CASES[6]):
        test_forward_and_backward_vs_float64(case, torch.float32)


def test_non_contiguous_inputs():
    """(B, N, H, D) storage viewed as (B, H, N, D): strides are passed through, no copies."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 97, 2, 32, generator=g).to(DEVICE).transpose(1, 2)
    k = torch.randn(1, 50, 2, 32, generator=g).to(DEVICE).transpose(1, 2)
    v = torch.randn(1, 50, 2, 32, generator=g).to(DEVICE).transpose(1, 2)
    out, lse = K.attention_fwd(q, k, v, False, 32**-0.5)
    want, want_lse = reference.attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


def test_backward_takes_an_output_strided_along_head_dim():
    """out with a non-unit stride along D (the kernels read its rows along D for delta): the same
    gradients as from a contiguous out (it was read as if contiguous: wrong dq, dk)."""
    q, k, v, dout = _inputs(1, 2, 2, 33, 33, 16, torch.float32)
    out, lse = K.attention_fwd(q, k, v, True, 0.25)
    want = K.attention_bwd(dout, q, k, v, out, lse, True, 0.25)
    strided = torch.empty(1, 2, 16, 33, device=DEVICE).transpose(-1, -2).copy_(out)
    for a, b in zip(K.attention_bwd(dout, q, k, v, strided, lse, True, 0.25), want):
        assert torch.equal(a, b)


def test_bad_shapes_raise():
    q = torch.randn(1, 3, 8, 16, device=DEVICE)
    k = torch.randn(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"key/value heads \(2\) to divide the query heads \(3\)"):
        K.attention_fwd(q, k, k, False, 1.0)
    with pytest.raises(ValueError, match=r"expected 4-D"):
        K.attention_fwd(q[0], k, k, False, 1.0)


# ---------------------------------------------------------------------------------- op and faces

import zerofuse  # noqa: E402
from zerofuse.nn import Attention  # noqa: E402
from zerofuse.nn.functional import scaled_dot_product_attention as zf_sdpa  # noqa: E402


@pytest.fixture(params=["triton", "cpu_kernels"])
def path(request, monkeypatch):
    """Which kernels CPU tensors take: the Triton kernels (interpreter) or torch's CPU flash path."""
    monkeypatch.setattr(kernels, "TRITON_ON_CPU", request.param == "triton" and kernels.interpreted())
    return request.param


@pytest.mark.parametrize("case", CASES[1:4], ids=lambda c: "-".join(map(str, c)))
def test_face_matches_torch_sdpa_with_gradients(path, case):
    b, hq, hkv, nq, nk, d, causal = case
    q, k, v, dout = _inputs(b, hq, hkv, nq, nk, d, torch.float32, seed=3)
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    theirs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = zf_sdpa(*ours, is_causal=causal, enable_gqa=hq != hkv)
    want = torch.nn.functional.scaled_dot_product_attention(*theirs, is_causal=causal, enable_gqa=hq != hkv)
    out.backward(dout)
    want.backward(dout)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    for a, t in zip(ours, theirs):
        torch.testing.assert_close(a.grad, t.grad, rtol=2e-4, atol=2e-4)


def test_head_dim_one_takes_any_stride_along_it(path):
    """A head_dim of 1 has no stride to respect: a transposed (B, H, 8, 1) view (stride 8 along D,
    already 'contiguous' to torch) was refused by the kernels' contiguity check."""
    q, k, v = (torch.randn(1, 2, 1, 8).transpose(-1, -2) for _ in range(3))
    assert q.stride(-1) != 1 and q.is_contiguous()
    torch.testing.assert_close(zf_sdpa(q, k, v, is_causal=True),
                               torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_more_batches_than_the_grid_takes_fall_back():
    """B > 65535 (the kernels' grid y/z limit): torch's result after the warning, not an error."""
    q, k, v = (torch.randn(65536, 1, 2, 8, device=DEVICE) for _ in range(3))
    zerofuse.nn.functional._warned.clear()
    with pytest.warns(UserWarning, match="more than 65535 batches or heads"):
        out = zf_sdpa(q, k, v, is_causal=True)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    qkv = torch.cat([t.transpose(1, 2).reshape(65536, 2, 8) for t in (q, k, v)], -1)  # and from a fused QKV
    got = zerofuse.nn.functional.qkv_attention(qkv, 1, is_causal=True)
    torch.testing.assert_close(got, out.transpose(1, 2).reshape(65536, 2, 8))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_the_op_refuses_what_the_kernels_do_not_take_on_cuda():
    """float64 or head_dim > 256 on CUDA called straight through the op (the face falls back): a
    clear error (it reached torch's cpu-only flash kernels with CUDA tensors)."""
    for q in (torch.randn(1, 2, 8, 16, device="cuda", dtype=torch.float64), torch.randn(1, 2, 8, 264, device="cuda")):
        with pytest.raises(ValueError, match=r"zerofuse::attention: the fused kernels take head_dim <= 256"):
            torch.ops.zerofuse.attention(q, q, q, True, 0.5)


def test_unsupported_arguments_fall_back_with_one_warning():
    q, k, v, _ = _inputs(1, 2, 2, 9, 9, 16, torch.float32)
    mask = torch.rand(9, 9, device=DEVICE) > 0.3
    zerofuse.nn.functional._warned.clear()
    with pytest.warns(UserWarning, match="attn_mask is not supported by the fused kernel"):
        out = zf_sdpa(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zf_sdpa(q, k, v, attn_mask=mask)  # the second time: no warning
    # a single key/value head or query head broadcasts without enable_gqa, as torch's does (it was
    # refused); 2 query heads against 3 key heads do not
    for args in ((q, k[:, :1], v[:, :1]), (q[:, :1], k, v)):
        with pytest.warns(UserWarning, match="heads broadcast without enable_gqa"):
            out = zf_sdpa(*args, is_causal=True)
        torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(*args, is_causal=True))
        zerofuse.nn.functional._warned.clear()
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        zf_sdpa(q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1))


def test_opcheck_and_compile():
    q, k, v, _ = _inputs(1, 4, 2, 33, 17, 32, torch.float32)
    torch.library.opcheck(torch.ops.zerofuse.attention.default, (q, k, v, True, 0.3))
    dout = torch.randn_like(q)
    out, lse = torch.ops.zerofuse.attention(q, k, v, True, 0.3)
    torch.library.opcheck(torch.ops.zerofuse.attention_backward.default, (dout, q, k, v, out, lse, True, 0.3))

    def f(q, k, v):
        return zf_sdpa(q, k, v, is_causal=True, enable_gqa=True).sum()

    assert_compiled_grads_equal(f, q, k, v)


def _bnhd(t):
    """t's values in (B, N, H, D) memory seen as (B, H, N, D): a Hugging Face projection's heads."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def test_outputs_and_gradients_follow_the_inputs_layout(path):
    """[Note: outputs follow their inputs' layout]: (B, H, N, D) views of (B, N, H, D) buffers give an
    output and gradients in (B, N, H, D) memory (the transposes around a Hugging Face attention stay
    views: no copy), the same values as contiguous inputs give; contiguous inputs contiguous ones;
    the fake impls promise the same strides."""
    q, k, v, dout = _inputs(2, 4, 2, 33, 33, 16, torch.float32)
    out, lse = torch.ops.zerofuse.attention(q, k, v, True, 0.3)
    grads = torch.ops.zerofuse.attention_backward(dout, q, k, v, out, lse, True, 0.3)
    assert out.is_contiguous() and all(g.is_contiguous() for g in grads)
    tq, tk, tv, tdout = map(_bnhd, (q, k, v, dout))
    out2, lse2 = torch.ops.zerofuse.attention(tq, tk, tv, True, 0.3)
    grads2 = torch.ops.zerofuse.attention_backward(_bnhd(dout), tq, tk, tv, out2, lse2, True, 0.3)
    for a, b in zip((out, lse, *grads), (out2, lse2, *grads2)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for t in (out2, *grads2):
        assert t.transpose(1, 2).is_contiguous(), t.stride()
    torch.library.opcheck(torch.ops.zerofuse.attention.default, (tq, tk, tv, True, 0.3))
    torch.library.opcheck(torch.ops.zerofuse.attention_backward.default, (tdout, tq, tk, tv, out2, lse2, True, 0.3))
    for args in ((q, k, v), (tq, tk, tv)):
        assert_fake_strides(torch.ops.zerofuse.attention.default, *args, True, 0.3)
    assert_fake_strides(torch.ops.zerofuse.attention_backward.default, tdout, tq, tk, tv, out2, lse2, True, 0.3)
    # the face's output, and the gradients autograd hands the (B, N, H, D) leaves
    leaves = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    views, seen = [t.transpose(1, 2) for t in leaves], []
    for t in views:
        t.register_hook(seen.append)  # the gradients attention's backward hands the transposes
    o = zf_sdpa(*views, is_causal=True, scale=0.3, enable_gqa=True)
    assert o.transpose(1, 2).is_contiguous()
    o.backward(_bnhd(dout))
    assert len(seen) == 3 and all(g.transpose(1, 2).is_contiguous() for g in seen), [g.stride() for g in seen]
    for leaf, g in zip(leaves, grads):
        torch.testing.assert_close(leaf.grad, g.transpose(1, 2), rtol=1e-6, atol=1e-6)


def test_attention_module_matches_a_plain_implementation(path):
    torch.manual_seed(0)
    m = Attention(96, num_heads=6, num_kv_heads=2).to(DEVICE)
    x = torch.randn(2, 37, 96, device=DEVICE, requires_grad=True)
    out = m(x)
    qkv = m.qkv(x)
    q = qkv[..., :96].view(2, 37, 6, 16).transpose(1, 2)
    k = qkv[..., 96:128].view(2, 37, 2, 16).transpose(1, 2)
    v = qkv[..., 128:].view(2, 37, 2, 16).transpose(1, 2)
    want = m.proj(reference.attention(q, k, v, is_causal=True)[0].transpose(1, 2).reshape(2, 37, 96))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert m.qkv.weight.grad is not None and x.grad.shape == x.shape
    with pytest.raises(ValueError, match=r"num_kv_heads \(4\) to divide num_heads \(6\)"):
        Attention(96, num_heads=6, num_kv_heads=4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_long_sequence_has_no_quadratic_buffer(dtype):
    """N = 16384: an N x N fp32 score matrix per head would be 1 GiB; peak extra memory stays O(N)."""
    b, h, n, d = 1, 4, 16384, 64
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    # autotuning (first call of a shape) benchmarks with a 256 MB cache-flush buffer: not the op's memory
    zf_sdpa(q, k, v, is_causal=True).backward(torch.ones_like(q))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = zf_sdpa(q, k, v, is_causal=True)
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 16 * b * h * n * d * q.element_size(), extra


def test_tiles_compile_to_16_byte_accesses_for_an_h100():
    """Compiled for sm_90 on this CPU machine as a launch specialises them (tools/kernel_asm.py
    --attention): with head_dim a multiple of 16 (64, 80) every q/o/do tile moves in 16-byte
    accesses and the k/v tiles by pipelined 16-byte cp.async copies into shared memory, no 2-byte
    load left, in every kernel, causal or not, with packed documents or not ([Note: documents]).
    (head_dim 72 compiles to 2-byte loads: its tile mask cannot be proven uniform over 8 elements;
    correct, not fast: listed in the tool's output.)"""
    from common import kernel_asm

    rows = kernel_asm("--attention")
    assert len(rows) == 18 and sum(r["documents"] for r in rows) == 6
    for r in rows:
        if r["head_dim"] % 16 == 0:
            assert "b16" not in r["loads"] and "b16" not in r["stores"], r
            assert r["async_copies"].get("16B", 0) > 0 and r["stores"].get("v4.b32", 0) > 0, r


def test_a_new_length_of_a_seen_class_launches_the_chosen_config_without_tuning(monkeypatch):
    """[Note: tuned configs by length class] in kernels/attention.py, with the GPU path's kernel and
    autotuner replaced by recorders: the first length of a class is autotuned (once per kernel),
    a later length of the same class (1000 -> 1020: both 1024) launches the JIT kernel with the
    config the tuner chose, a length of another class (1025: 2048), another head_dim or the other
    causality is tuned again."""
    from zerofuse.kernels import attention as A

    calls = []

    class Recorder:
        def __init__(self, name):
            self.name = name
            self.best_config = type("Cfg", (), {"all_kwargs": lambda self: {"BLOCK_M": 64, "BLOCK_N": 32,
                                                                            "num_warps": 4, "num_stages": 3}})()

        def __getitem__(self, grid):
            # the JIT kernel gets its grid evaluated; the tuner a function of each config's meta
            return lambda *args, **kw: calls.append((self.name, grid if isinstance(grid, tuple) else None, kw))

    kernel, tuned = Recorder("jit"), Recorder("tuner")
    monkeypatch.setattr(A, "interpreted", lambda: False)
    monkeypatch.setattr(A, "_CHOSEN", {})
    q = torch.empty(1, 2, 4, 64, dtype=torch.bfloat16)  # (the launcher only reads its dtype)

    def launch(n, d=64, causal=True):
        A._launch(kernel, tuned, lambda meta: (-(-n // meta["BLOCK_M"]), 2, 1), "args", CAUSAL=causal, BLOCK_D=d,
                  tune_key=(A.length_class(n), A.length_class(n), d, causal, q.dtype))
        return calls[-1]

    assert launch(1000)[0] == "tuner"
    name, grid, kw = launch(1020)
    assert name == "jit" and grid == (16, 2, 1) and kw == {"UPCAST": False, "BLOCK_M": 64, "BLOCK_N": 32,
                                                          "num_warps": 4, "num_stages": 3, "CAUSAL": True,
                                                          "BLOCK_D": 64}
    assert launch(1025)[0] == "tuner" and launch(2048)[0] == "jit"
    assert launch(1000, d=128)[0] == "tuner" and launch(1000, causal=False)[0] == "tuner"
    assert [A.length_class(n) for n in (1, 64, 65, 97, 1024, 1025)] == [64, 64, 128, 128, 1024, 2048]
    # pinned_config (the doctor's): every launch takes the config, none tunes or is kept
    chosen = dict(A._CHOSEN)
    with A.pinned_config():
        for n, causal in ((4096, True), (1000, True), (77, False)):
            name, grid, kw = launch(n, causal=causal)
            assert name == "jit" and grid == (-(-n // 32), 2, 1) and kw == {
                "UPCAST": False, "BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_ctas": 1, "num_stages": 1,
                "CAUSAL": causal, "BLOCK_D": 64}
    assert A._CHOSEN == chosen and A._PINNED == [None] and launch(4096)[0] == "tuner"


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=lambda c: "-".join(map(str, c)))
def test_face_runs_eagerly_without_the_custom_op_and_equals_it(path, case):
    """The face's eager path (EagerAttention, as the norms': no custom_op dispatch) gives the op's
    bits, forward and backward; without grad it runs no autograd at all; the dispatcher sees no
    zerofuse::attention call either way (only under torch.compile, where the op is traced)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    b, hq, hkv, nq, nk, d, causal = case
    q, k, v, dout = _inputs(b, hq, hkv, nq, nk, d, torch.float32, seed=5)
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    theirs = [t.clone().requires_grad_() for t in (q, k, v)]
    with Ops() as seen:
        out = zf_sdpa(*ours, is_causal=causal, enable_gqa=hq != hkv)
        out.backward(dout)
    assert not any("zerofuse" in n for n in seen.names), seen.names
    want, _ = torch.ops.zerofuse.attention(*theirs, causal, d ** -0.5)
    want.backward(dout)
    assert torch.equal(out, want)
    for a, t in zip(ours, theirs):
        assert torch.equal(a.grad, t.grad)
    with torch.no_grad():
        quiet = zf_sdpa(*ours, is_causal=causal, enable_gqa=hq != hkv)
    assert quiet.grad_fn is None and torch.equal(quiet, want)
