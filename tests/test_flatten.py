"""zerofuse::flatten_into / unflatten_from against zerofuse.reference, plus errors, opcheck, compile."""
import pytest
import torch

import zerofuse
from common import DEVICES
from zerofuse import reference

SENTINEL = -7.0


def _mixed(device, dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64)):
    """Odd shapes, a 0-dim and an empty tensor, several non-contiguous views, one > 1M elements."""
    shapes = [(123,), (97, 5), (), (0, 3), (4, 1025), (3, 7, 11), (1, 1), (1 << 20) + 3, (33, 65)]
    ts = [torch.randn(s, device=device).to(dtypes[i % len(dtypes)]) for i, s in enumerate(shapes)]
    ts[4] = ts[4].t()  # (1025, 4) transposed
    ts[5] = ts[5][:, ::2, 1:]  # strided slice
    ts.append(torch.randn(5, 8, device=device)[:, 3])  # column
    ts.append(torch.randn(1, device=device).expand(6, 4))  # stride 0 source
    return ts


def _layout(tensors, align, gap=0):
    offsets, pos = [], gap
    for t in tensors:
        offsets.append(pos)
        pos += -(-t.numel() // align) * align + gap
    return offsets, pos


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flat_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("align", [1, 128 * 3])
def test_flatten_into_matches_reference_and_keeps_padding(device, flat_dtype, align):
    ts = _mixed(device)
    offsets, total = _layout(ts, align, gap=5)
    flat = torch.full((total,), SENTINEL, device=device, dtype=flat_dtype)
    expected = flat.clone()
    zerofuse.flatten_into(ts, flat, offsets)
    reference.flatten_into(ts, expected, offsets)
    torch.testing.assert_close(flat, expected, rtol=0, atol=0)  # a cast is exact: same rounding
    written = torch.zeros(total, dtype=torch.bool, device=device)
    for t, o in zip(ts, offsets):
        written[o : o + t.numel()] = True
    assert (flat[~written] == SENTINEL).all(), "padding between ranges was overwritten"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flat_dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_unflatten_from_matches_reference(device, flat_dtype):
    ts = [t for t in _mixed(device) if t.stride() != (0, 0)]  # an expanded view cannot be written
    offsets, total = _layout(ts, align=8, gap=3)
    flat = torch.randn(total, device=device).to(flat_dtype)
    outs = [torch.full_like(t, SENTINEL) for t in ts]
    outs = [o if t.is_contiguous() else o.transpose(0, -1).contiguous().transpose(0, -1) for o, t in zip(outs, ts)]
    expected = [o.clone() for o in outs]
    zerofuse.unflatten_from(flat, outs, offsets)
    reference.unflatten_from(flat, expected, offsets)
    for o, e in zip(outs, expected):
        torch.testing.assert_close(o, e, rtol=0, atol=0)
        assert o.numel() == 0 or not (o == SENTINEL).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pair", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float16), (torch.float16, torch.float32)])
def test_casts_round_like_torch_on_special_values(device, pair):
    """Rounding ties, NaN, +-inf, -0, subnormals and overflow convert exactly as torch's copy_ does."""
    src_dtype, flat_dtype = pair
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x00000001, 0x80000000, 0x7FC00001, 0xFF800000, 0x7F800000, 0x477FF000], dtype=torch.int64)
    special = bits.to(torch.int32).view(torch.float32)
    src = torch.cat([special, torch.randn(3001) * 1e3]).to(device=device, dtype=src_dtype)
    flat = torch.empty(src.numel(), device=device, dtype=flat_dtype)
    zerofuse.flatten_into([src], flat, [0])
    expected = src.to(flat_dtype)
    assert torch.equal(flat.isnan(), expected.isnan())
    assert torch.equal(flat.nan_to_num(), expected.nan_to_num())
    back = torch.empty_like(src)
    zerofuse.unflatten_from(flat, [back], [0])
    assert torch.equal(back.nan_to_num(), flat.to(src_dtype).nan_to_num())


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_and_integer_dtypes(device):
    ts = [torch.randint(-100, 100, (s,), device=device, dtype=d) for s, d in [(17, torch.int32), (1000, torch.int64), (3, torch.int8)]]
    offsets, total = zerofuse.packed_offsets([t.numel() for t in ts], align=4)
    flat = torch.zeros(total, device=device, dtype=torch.int64)
    zerofuse.flatten_into(ts, flat, offsets)
    outs = [torch.empty_like(t) for t in ts]
    zerofuse.unflatten_from(flat, outs, offsets)
    for o, t in zip(outs, ts):
        assert torch.equal(o, t)


@pytest.mark.parametrize("device", DEVICES)
def test_views_of_flat_at_their_own_offsets_are_left_intact(device):
    """ZeRO keeps parameters as views into the flat buffer: copying them onto themselves is a no-op."""
    flat = torch.randn(300, device=device)
    before = flat.clone()
    offsets = [0, 100, 250]
    views = [flat[0:100].view(10, 10), flat[100:200], flat[250:300].view(5, 10)]
    zerofuse.flatten_into(views, flat, offsets)
    zerofuse.unflatten_from(flat, views, offsets)
    assert torch.equal(flat, before)


def test_tensors_that_require_grad_can_be_flattened():
    params = [torch.randn(4, 5, requires_grad=True), torch.randn(7, requires_grad=True)]
    flat = torch.zeros(27)
    zerofuse.flatten_into(params, flat, [0, 20])
    torch.testing.assert_close(flat, torch.cat([p.detach().reshape(-1) for p in params]))


def test_empty_list_and_empty_flat():
    zerofuse.flatten_into([], torch.empty(0), [])
    zerofuse.unflatten_from(torch.empty(0), [], [])
    zerofuse.flatten_into([torch.empty(0, 3)], torch.empty(0), [0])


def test_packed_offsets():
    assert zerofuse.packed_offsets([3, 0, 5], align=4) == ([0, 4, 4], 12)
    assert zerofuse.packed_offsets([], align=4) == ([], 0)
    with pytest.raises(ValueError, match="align >= 1, got 0"):
        zerofuse.packed_offsets([1], align=0)


# ---- errors: each names the argument, the expectation and the value, and nothing is written ----

ERROR_CASES = [
    # (tensors, flat numel, offsets, exception, message)
    ([(4,), (4,)], 10, [0, 3], ValueError, r"ranges of tensors\[0\] \[0, 4\) and tensors\[1\] \[3, 7\) overlap"),
    ([(4,), (6,)], 10, [0, 5], ValueError, r"offsets\[1\] = 5 with tensors\[1\]\.numel\(\) = 6 runs outside flat of numel 10"),
    ([(4,)], 10, [-1], ValueError, r"offsets\[0\] = -1"),
    # offsets[i] + numel wraps to a negative number in int64: it once passed the check and wrote
    # far outside flat
    ([(4,)], 10, [2**63 - 2], ValueError, r"offsets\[0\] = 9223372036854775806 with tensors\[0\]\.numel\(\) = 4 runs outside flat of numel 10"),
    ([(2,), (4,)], 10, [0, 2**63 - 1], ValueError, r"offsets\[1\] = 9223372036854775807 with tensors\[1\]\.numel\(\) = 4 runs outside"),
    ([(4,)], 10, [-(2**63)], ValueError, r"offsets\[0\] = -9223372036854775808 with"),
    ([(4,), (2,)], 10, [0], ValueError, r"expected len\(offsets\) == len\(tensors\) == 2, got len\(offsets\) == 1"),
]


@pytest.mark.parametrize("shapes,n,offsets,exc,msg", ERROR_CASES)
@pytest.mark.parametrize("op", ["flatten_into", "unflatten_from"])
def test_bad_layout_raises_before_writing(shapes, n, offsets, exc, msg, op):
    ts = [torch.randn(s) for s in shapes]
    flat = torch.full((n,), SENTINEL)
    before = [t.clone() for t in ts]
    with pytest.raises(exc, match=f"zerofuse::{op}: {msg}"):
        if op == "flatten_into":
            zerofuse.flatten_into(ts, flat, offsets)
        else:
            zerofuse.unflatten_from(flat, ts, offsets)
    assert (flat == SENTINEL).all()
    assert all(torch.equal(t, b) for t, b in zip(ts, before))


def _aliasing_cases():
    """(flat, tensors, offsets, message) where a tensor shares memory with flat other than as the
    view of its own range: copying it would read what the same call writes."""
    msg = r"expected tensors\[{}\] not to share memory with flat, except as the view of its own range flat\[{}\], got a {} of flat"
    flat = torch.arange(12.0)
    yield flat, [flat[2:6]], [0], msg.format(0, "0:4", r"Float tensor of shape \[4\] with strides \[1\] at byte 8")
    flat = torch.arange(12.0)
    yield (flat, [torch.ones(2), flat[0:6].view(2, 3).t()], [8, 0],
           msg.format(1, "0:6", r"Float tensor of shape \[3, 2\] with strides \[1, 3\] at byte 0"))
    flat = torch.arange(12.0)
    yield flat, [flat[4:8].view(torch.int32)], [4], msg.format(0, "4:8", r"Int tensor of shape \[4\] with strides \[1\] at byte 16")
    base = torch.arange(20.0)
    yield base[4:12], [base[0:6]], [0], msg.format(0, "0:6", r"Float tensor of shape \[6\] with strides \[1\] at byte -16")


@pytest.mark.parametrize("case", range(4))
@pytest.mark.parametrize("op", ["flatten_into", "unflatten_from"])
def test_tensors_sharing_memory_with_flat_are_refused_before_writing(case, op):
    """Before this check, unflatten_from(flat, [flat[2:6]], [0]) memcpy'd flat[0:4] onto flat[2:6]:
    overlapping buffers, an undefined result."""
    flat, tensors, offsets, msg = list(_aliasing_cases())[case]
    before = flat.clone()
    with pytest.raises(ValueError, match=f"zerofuse::{op}: {msg}"):
        if op == "flatten_into":
            zerofuse.flatten_into(tensors, flat, offsets)
        else:
            zerofuse.unflatten_from(flat, tensors, offsets)
    assert torch.equal(flat, before)


def test_tensors_in_flats_storage_outside_flat_may_be_copied():
    """Sharing a storage is not sharing memory: a buffer's other part is an ordinary source."""
    base = torch.arange(30.0)
    flat, src = base[0:10], base[20:24]
    zerofuse.flatten_into([src], flat, [3])
    assert torch.equal(flat[3:7], torch.arange(20.0, 24.0))
    zerofuse.unflatten_from(flat, [src], [5])
    assert torch.equal(base[20:24], torch.tensor([22.0, 23.0, 7.0, 8.0]))


def test_fake_impl_refuses_tensors_sharing_memory_with_flat():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for flat, tensors, offsets, msg in _aliasing_cases():  # built as fake tensors
            with pytest.raises(ValueError, match=f"zerofuse::unflatten_from: {msg}"):
                torch.ops.zerofuse.unflatten_from(flat, tensors, offsets)
        flat = torch.empty(12)
        torch.ops.zerofuse.flatten_into([flat[0:4], torch.empty(3)], flat, [0, 6])


@pytest.mark.parametrize(
    "tensors,flat,msg",
    [
        ([torch.randn(3, device="meta")], torch.zeros(4), r"expected tensors\[0\] on the device of flat \(cpu\), got meta"),
        ([torch.randn(3)], torch.zeros(2, 4), r"expected flat to be a 1-D contiguous tensor, got shape \[2, 4\]"),
        ([torch.randn(3)], torch.zeros(8)[::2], r"expected flat to be a 1-D contiguous tensor, got shape \[4\] with strides \[2\]"),
        ([torch.randn(3, dtype=torch.complex64)], torch.zeros(4), r"expected tensors\[0\] to have a real, non-bool dtype, got ComplexFloat"),
        ([torch.ones(3, dtype=torch.bool)], torch.zeros(4), r"expected tensors\[0\] to have a real, non-bool dtype, got Bool"),
    ],
)
def test_bad_tensors_raise(tensors, flat, msg):
    with pytest.raises(RuntimeError, match=f"zerofuse::flatten_into: {msg}"):
        zerofuse.flatten_into(tensors, flat, [0])


def test_fake_impl_raises_the_same_errors():
    """Under torch.compile the fake impl checks the layout at trace time."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        ts, flat = [torch.randn(4), torch.randn(4)], torch.empty(10)
        with pytest.raises(ValueError, match=r"ranges of tensors\[0\] \[0, 4\) and tensors\[1\] \[3, 7\) overlap"):
            torch.ops.zerofuse.flatten_into(ts, flat, [0, 3])
        with pytest.raises(ValueError, match=r"offsets\[1\] = 8 with tensors\[1\]\.numel\(\) = 4 runs outside"):
            torch.ops.zerofuse.unflatten_from(flat, ts, [0, 8])
        torch.ops.zerofuse.flatten_into(ts, flat, [0, 6])


# ---- torch.library: opcheck and torch.compile ----


def _opcheck_samples(device):
    ts = [torch.randn(5, 3, device=device), torch.randn(7, device=device).to(torch.bfloat16), torch.randn(4, 6, device=device).t()]
    offsets = [0, 16, 24]
    return ts, torch.zeros(48, device=device), offsets


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    ts, flat, offsets = _opcheck_samples(device)
    torch.library.opcheck(torch.ops.zerofuse.flatten_into.default, (ts, flat, offsets))
    flat = torch.randn(48, device=device)
    outs = [torch.zeros(5, 3, device=device), torch.zeros(7, device=device, dtype=torch.bfloat16), torch.zeros(4, 6, device=device)]
    torch.library.opcheck(torch.ops.zerofuse.unflatten_from.default, (flat, outs, offsets))


def _scale_through_bucket(grads, scale):
    offsets, total = zerofuse.packed_offsets([g.numel() for g in grads], align=128)
    flat = torch.zeros(total, dtype=torch.float32, device=grads[0].device)
    torch.ops.zerofuse.flatten_into(grads, flat, offsets)
    flat.mul_(scale)
    outs = [torch.empty_like(g) for g in grads]
    torch.ops.zerofuse.unflatten_from(flat, outs, offsets)
    return outs


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device):
    grads = [torch.randn(33, 7, device=device), torch.randn(5, device=device).to(torch.bfloat16), torch.randn(3, 4, device=device).t()]
    compiled = torch.compile(_scale_through_bucket, fullgraph=True, backend="inductor")
    got = compiled(grads, 0.5)
    want = _scale_through_bucket(grads, 0.5)
    for g, w, src in zip(got, want, grads):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
        torch.testing.assert_close(g, (src.float() * 0.5).to(src.dtype), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("warm", [True, False], ids=["table_made_eagerly", "table_made_while_capturing"])
def test_flatten_and_unflatten_in_a_captured_cuda_graph(warm):
    """[Note: device tables kept by content]: flatten_into / unflatten_from captured in a CUDA graph
    replay with the values the sources hold at each replay, whether the table was made by an eager
    call first (the capture copies nothing) or during the capture (written by kernels carrying it in
    their parameters: no host memory in the graph); and an eager call with the same tensors (a
    table hit) gives the same values."""
    # sizes of their own per case: the other case's table (kept by content) is never this one's
    ts = [torch.randn(n + (0 if warm else 16), device="cuda").to(dt)
          for n, dt in ((5000, torch.float32), (77, torch.bfloat16), (3, torch.float16))]
    offsets, total = _layout(ts, 128)
    flat, back = torch.zeros(total, device="cuda"), [torch.empty_like(t) for t in ts]
    if warm:
        zerofuse.flatten_into(ts, flat, offsets)
        zerofuse.unflatten_from(flat, back, offsets)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        zerofuse.flatten_into(ts, flat, offsets)
        zerofuse.unflatten_from(flat * 2, back, offsets)
    for step in range(3):
        for t in ts:
            t.copy_(torch.randn(t.shape, device="cuda"))
        torch.empty(1 << 20, device="cuda", dtype=torch.uint8).fill_(step)  # churn the caching allocators
        torch.empty(1 << 16, dtype=torch.uint8).pin_memory()
        g.replay()
        torch.cuda.synchronize()
        want = torch.zeros(total, device="cuda")
        reference.flatten_into(ts, want, offsets)
        assert torch.equal(flat, want), step
        for b, t in zip(back, ts):
            assert torch.equal(b, (t.float() * 2).to(t.dtype)), step
    eager = torch.zeros(total, device="cuda")
    zerofuse.flatten_into(ts, eager, offsets)
    assert torch.equal(eager, flat)


# ---- what a review reproduced (each failed before its fix) ----


def test_writes_bump_version_counters_so_autograd_sees_them():
    """unflatten_from into a tensor saved for backward: backward refuses, as after torch's copy_ (the
    op bumped no version: the gradient silently used the new values); flatten_into bumps flat's."""
    x = torch.randn(5, requires_grad=True)
    y = x * 1.0
    z = y.sin()  # saves y
    zerofuse.unflatten_from(torch.randn(8), [y], [0])
    assert y._version == 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()
    flat = torch.zeros(8)
    zerofuse.flatten_into([torch.ones(3)], flat, [2])
    assert flat._version == 1


def test_unflatten_from_refuses_outputs_that_share_memory():
    """Two outputs over the same memory (a tied weight listed twice; w and w.t()) were written by two
    threads at once or in another order than sequential copy_s: refused, naming both. Interleaved
    strided views (disjoint elements) still pass."""
    w = torch.zeros(4, 4)
    for outs in ([w.t(), w], [w, w]):
        with pytest.raises(ValueError, match=r"expected tensors\[0\] and tensors\[1\] not to share memory"):
            zerofuse.unflatten_from(torch.arange(32.0), outs, [0, 16])
    base = torch.zeros(8)
    zerofuse.unflatten_from(torch.arange(8.0), [base[0::2], base[1::2]], [0, 4])
    assert base.tolist() == [0.0, 4.0, 1.0, 5.0, 2.0, 6.0, 3.0, 7.0]


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_dtypes_convert_as_copy_does(dtype):
    """A uint16/32/64 tensor into an fp32 flat and back (the converting loop has none of them: it
    raised "not implemented")."""
    t = torch.tensor([0, 1, 7, 200], dtype=dtype)
    flat = torch.full((6,), -1.0)
    zerofuse.flatten_into([t], flat, [1])
    assert flat.tolist() == [-1.0, 0.0, 1.0, 7.0, 200.0, -1.0]
    back = torch.zeros(4, dtype=dtype)
    zerofuse.unflatten_from(flat, [back], [1])
    assert back.tolist() == [0, 1, 7, 200]


def test_offsets_must_be_ints():
    """A float offset was truncated (3.9 wrote at 3): refused, naming it."""
    for bad in (3.9, True):
        with pytest.raises(TypeError, match=r"expected offsets\[1\] to be an int, got"):
            zerofuse.flatten_into([torch.ones(2), torch.ones(3)], torch.zeros(8), [0, bad])
    zerofuse.flatten_into([torch.ones(2), torch.ones(3)], torch.zeros(8), [0, torch.tensor(3)])


def test_real_and_fake_name_overlapping_ranges_in_one_order():
    """Ranges tied on their offset: the fake impl and the kernel name the two tensors in one order."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = lambda: ([torch.ones(4), torch.ones(2)], torch.zeros(8), [0, 0])  # noqa: E731
    with pytest.raises(ValueError) as real:
        torch.ops.zerofuse.flatten_into(*args())
    with FakeTensorMode(), pytest.raises(ValueError) as fake:
        torch.ops.zerofuse.flatten_into(*args())
    assert str(real.value) == str(fake.value) and "tensors[0] [0, 4) and tensors[1] [0, 2)" in str(real.value)
