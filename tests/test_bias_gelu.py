"""zerofuse::bias_gelu (GPT-2's bias + GELU after the fc matmul) against the float64 reference within
the peer rule (torch's own F.gelu(x + b) in the dtype), every dtype, odd shapes, both paths; its
backward's bias sum in one launch and two; LinearGELU and the GPT MLP using it; op checks."""
import pytest
import torch
import torch.nn.functional as F

from tolerances import assert_close, assert_within_peer_rule
from zerofuse import kernels, reference
from zerofuse.kernels import colsum
from zerofuse.nn import LinearGELU
from zerofuse.nn.functional import bias_gelu


def _grads(fn, x, b, dy):
    leaves = [t.detach().clone().requires_grad_() for t in (x, b)]
    y = fn(*leaves)
    y.backward(dy)
    return y.detach(), leaves[0].grad, leaves[1].grad


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, dy = ((torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype) for _ in range(2))
    b = torch.randn(shape[-1], generator=g, dtype=torch.float64).to(dtype)
    return x, b, dy


@pytest.mark.parametrize("shape", [(97, 123), (2, 5, 1025), (3,), (0, 7), (7, 0), (1, 3072)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_float64_reference_within_the_peer_rule(dtype, shape, kernel_path):
    x, b, dy = _inputs(shape, dtype)
    ours = _grads(bias_gelu, x, b, dy)
    ref = _grads(reference.bias_gelu, x.double(), b.double(), dy.double())
    peer = _grads(reference.bias_gelu, x, b, dy)
    for name, got, want, theirs in zip(("y", "dx", "db"), ours, ref, peer):
        assert got.dtype == dtype and got.shape == want.shape, name
        assert_within_peer_rule(got, want, theirs, msg=name)


def test_float64_and_extremes(kernel_path):
    x = torch.tensor([[-1e4, -30.0, -1e-3, 0.0, 1e-3, 30.0, 1e4]], dtype=torch.float64).repeat(3, 1)
    b = torch.linspace(-2, 2, 7, dtype=torch.float64)
    dy = torch.ones_like(x)
    ref = _grads(reference.bias_gelu, x, b, dy)
    for got, want in zip(_grads(bias_gelu, x, b, dy), ref):
        assert_close(got, want)
    for got, want in zip(_grads(bias_gelu, x.float(), b.float(), dy.float()), ref):
        assert torch.isfinite(got).all()
        assert_close(got, want.float(), atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not kernels.triton_on_cpu(), reason="interpreter test (ZEROFUSE_TRITON_ON_CPU=1)")
@pytest.mark.parametrize("shape", [(300, 97), (1, 5), (64, 1030)])
def test_backward_bias_sum_in_one_launch_equals_two(monkeypatch, shape):
    from zerofuse.kernels import bias_gelu as K

    x, b, dy = _inputs(shape, torch.float32)
    one = K.bias_gelu_bwd(dy, x, b)
    assert int(colsum.arrival_counter(torch.device("cpu"))) == 0
    monkeypatch.setattr(colsum, "ONE_LAUNCH_FLOATS", 0)
    two = K.bias_gelu_bwd(dy, x, b)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    assert_close(one[1].double(), (dy.double() * torch.ops.aten.gelu_backward(
        torch.ones_like(x.double()), x.double() + b.double(), approximate="tanh")).sum(0), atol=1e-4, rtol=1e-5)


def test_non_contiguous_input(kernel_path):
    x = torch.randn(8, 6).t()  # (6, 8) strided
    b = torch.randn(8)
    assert_close(bias_gelu(x, b), F.gelu(x + b, approximate="tanh"), atol=1e-6, rtol=1e-6)


def test_linear_gelu_is_a_linear_with_gelu(kernel_path):
    torch.manual_seed(0)
    m = LinearGELU(24, 61)
    ref = torch.nn.Linear(24, 61)
    ref.load_state_dict(m.state_dict())
    assert isinstance(m, torch.nn.Linear) and list(m.state_dict()) == ["weight", "bias"]
    x = torch.randn(3, 5, 24)
    y = m(x.requires_grad_())
    y.backward(torch.ones_like(y))
    y_ref = F.gelu(ref(x), approximate="tanh")
    y_ref.backward(torch.ones_like(y_ref))
    assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    assert_close(m.weight.grad, ref.weight.grad, atol=1e-4, rtol=1e-5)
    assert_close(m.bias.grad, ref.bias.grad, atol=1e-4, rtol=1e-5)
    no_bias = LinearGELU(4, 3, bias=False)
    assert_close(no_bias(x[..., :4]), F.gelu(F.linear(x[..., :4], no_bias.weight), approximate="tanh"))


@pytest.mark.skipif(not kernels.triton_on_cpu(), reason="interpreter test (ZEROFUSE_TRITON_ON_CPU=1)")
def test_gpt_mlp_uses_one_bias_gelu_and_no_aten_gelu():
    """GPT-2's MLP on the kernel path: matmul, bias + GELU (one Triton kernel), matmul: no aten gelu
    or gelu_backward, and its backward sums the fc bias gradient in the kernel (no aten sum over the
    fc output). (The CPU path computes with aten's gelu kernels.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    from zerofuse.models import gpt

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    cfg = gpt.config("tiny", dim=32, n_head=2, n_layer=1, bias=True)
    mlp = gpt.MLP(cfg)
    assert isinstance(mlp.fc, LinearGELU)
    x = torch.randn(2, 3, 32, requires_grad=True)
    dy = torch.randn(2, 3, 32)
    with Ops() as ops:
        mlp(x).backward(dy)
    assert "gelu" not in ops.names and "gelu_backward" not in ops.names, ops.names
    assert ops.names.count("sum") == 1, ops.names  # proj's bias grad
    ref = torch.nn.Sequential(torch.nn.Linear(32, cfg.hidden), torch.nn.GELU("tanh"), torch.nn.Linear(cfg.hidden, 32))
    ref[0].load_state_dict(mlp.fc.state_dict())
    ref[2].load_state_dict(mlp.proj.state_dict())
    x2 = x.detach().clone().requires_grad_()
    ref(x2).backward(dy)
    assert_close(x.grad, x2.grad, atol=1e-5, rtol=1e-5)
    assert_close(mlp.fc.bias.grad, ref[0].bias.grad, atol=1e-5, rtol=1e-5)


def test_bad_input_names_the_argument():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="expected bias of shape"):
        bias_gelu(x, torch.randn(7))
    with pytest.raises(ValueError, match="expected bias of shape"):
        bias_gelu(x, torch.randn(8, dtype=torch.float64))
    with pytest.raises(TypeError, match="expected input to be a floating-point tensor"):
        bias_gelu(torch.ones(4, 8, dtype=torch.int64), torch.randn(8))
    with pytest.raises(RuntimeError, match="zerofuse::bias_gelu: expected bias"):
        torch.ops.zerofuse.bias_gelu(x, torch.randn(3))
    with pytest.raises(RuntimeError, match="zerofuse::bias_gelu_backward: expected dy"):
        torch.ops.zerofuse.bias_gelu_backward(torch.randn(4, 7), x, torch.randn(8))


def test_opcheck_and_compile(kernel_path):
    x, b, _ = _inputs((5, 33), torch.float32)
    torch.library.opcheck(torch.ops.zerofuse.bias_gelu.default, (x, b.requires_grad_()))
    torch.library.opcheck(torch.ops.zerofuse.bias_gelu_backward.default, (torch.randn(5, 33), x, b.detach()))
    f = torch.compile(lambda a, c: bias_gelu(a, c) * 2, backend="aot_eager", fullgraph=True)
    assert_close(f(x, b.detach()), bias_gelu(x, b.detach()) * 2)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16384, 3072), (97, 123), (2, 1025, 4097)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_matches_float64_reference_within_the_peer_rule(dtype, shape):
    x, b, dy = (t.to("cuda") for t in _inputs(shape, dtype))
    ours = _grads(bias_gelu, x, b, dy)
    ref = _grads(reference.bias_gelu, x.double(), b.double(), dy.double())
    peer = _grads(reference.bias_gelu, x, b, dy)
    for name, got, want, theirs in zip(("y", "dx", "db"), ours, ref, peer):
        assert_within_peer_rule(got.cpu(), want.cpu(), theirs.cpu(), msg=name)
    again = _grads(bias_gelu, x, b, dy)  # the bias sum in a fixed order: the same bits again
    assert all(torch.equal(a, c) for a, c in zip(ours, again))


def test_kernels_compile_for_an_h100_to_16_byte_accesses():
    """tools/kernel_asm.py --bias-gelu: forward and backward move bf16 tiles in 16-byte accesses (the
    forward once read the bias at a flat index modulo N, which compiled to 2-byte loads), no spills,
    and the one-launch backward draws one acq_rel ticket."""
    from common import kernel_asm

    rows = kernel_asm("--bias-gelu")
    assert len(rows) == 5
    for r in rows:
        assert "b16" not in r["loads"] and r["loads"].get("v4.b32", 0) > 0, r
        assert r["stores"].get("v4.b32", 0) > 0 or r["kernel"] == "column_sum", r  # (it writes no dx)
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["atomics"] == ({"atom.global.gpu.acq_rel.add.u32": 1} if r["one_launch"] else {}), r


@pytest.mark.skipif(not kernels.triton_on_cpu(), reason="interpreter test (ZEROFUSE_TRITON_ON_CPU=1)")
@pytest.mark.parametrize("shape", [(1, 7), (37, 130), (3, 41, 768), (0, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("one_launch", [True, False])
def test_column_sum_is_a_bias_gradient(monkeypatch, shape, dtype, one_launch):
    """kernels/bias_gelu.column_sum (the backward kernel without the GELU): the sums over every
    leading dim against float64, by the peer rule against torch's own sum in the dtype; one launch
    and two give the same bits; no rows give zeros."""
    from zerofuse.kernels.bias_gelu import column_sum

    if not one_launch:
        monkeypatch.setattr(colsum, "ONE_LAUNCH_FLOATS", 0)
    dy = (torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    got = column_sum(dy)
    want = dy.double().reshape(-1, shape[-1]).sum(0)
    assert got.dtype == dtype and got.shape == (shape[-1],)
    assert_within_peer_rule(got, want, dy.reshape(-1, shape[-1]).sum(0), msg="column sums")
    assert column_sum(dy, torch.float32).dtype == torch.float32
    monkeypatch.setattr(colsum, "ONE_LAUNCH_FLOATS", 0 if one_launch else 1 << 18)
    assert torch.equal(column_sum(dy), got)  # the other form, the same order of sums
