"""zerofuse::swiglu (SwiGLU / GeGLU) against the float64 reference within the peer rule (torch's own
F.silu(gate) * up in the dtype), every dtype, odd shapes, both paths; the module; op checks."""
import pytest
import torch
import torch.nn.functional as F

from common import assert_fake_strides
from tolerances import assert_close, assert_within_peer_rule
from zerofuse import reference
from zerofuse.nn import GatedMLP
from zerofuse.nn.functional import geglu, swiglu

FACES = {"silu": swiglu, "gelu_tanh": geglu}


def _grads(fn, gate, up, dy):
    leaves = [t.detach().clone().requires_grad_() for t in (gate, up)]
    y = fn(*leaves)
    y.backward(dy)
    return y.detach(), leaves[0].grad, leaves[1].grad


@pytest.mark.parametrize("shape", [(97, 123), (2, 5, 1025), (0, 7), (3,), ()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_matches_float64_reference_within_the_peer_rule(activation, dtype, shape, kernel_path):
    g = torch.Generator().manual_seed(0)
    gate, up, dy = ((torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype) for _ in range(3))
    ours = _grads(FACES[activation], gate, up, dy)
    ref = _grads(lambda a, b: reference.swiglu(a, b, activation), gate.double(), up.double(), dy.double())
    peer = _grads(lambda a, b: reference.swiglu(a, b, activation), gate, up, dy)
    for name, got, want, theirs in zip(("y", "dgate", "dup"), ours, ref, peer):
        assert got.dtype == dtype and got.shape == want.shape, name
        assert_within_peer_rule(got, want, theirs, msg=name)


def test_float64_and_extremes(kernel_path):
    gate = torch.tensor([-1e4, -30.0, -1e-3, 0.0, 1e-3, 30.0, 1e4], dtype=torch.float64)
    up = torch.linspace(-2, 2, 7, dtype=torch.float64)
    for activation in ("silu", "gelu_tanh"):
        ours = _grads(FACES[activation], gate, up, torch.ones(7, dtype=torch.float64))
        ref = _grads(lambda a, b: reference.swiglu(a, b, activation), gate, up, torch.ones(7, dtype=torch.float64))
        for got, want in zip(ours, ref):
            assert_close(got, want)
        f32 = _grads(FACES[activation], gate.float(), up.float(), torch.ones(7))
        for got, want in zip(f32, ref):
            assert torch.isfinite(got).all()
            assert_close(got, want.float(), atol=1e-5, rtol=1e-5)


def test_non_contiguous_inputs(kernel_path):
    x = torch.randn(6, 2 * 33)
    gate, up = x[:, :33], x[:, 33:]  # the halves of one projection
    assert_close(swiglu(gate, up), F.silu(gate) * up, atol=1e-6, rtol=1e-6)


def test_gated_mlp_equals_the_llama_mlp(kernel_path):
    torch.manual_seed(0)
    mlp = GatedMLP(24, 61)
    x = torch.randn(3, 5, 24, requires_grad=True)
    y = mlp(x)
    x2 = x.detach().clone().requires_grad_()
    y2 = mlp.down_proj(F.silu(mlp.gate_proj(x2)) * mlp.up_proj(x2))
    assert_close(y, y2, atol=1e-6, rtol=1e-5)
    y.sum().backward()
    grads = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    y2.sum().backward()
    for a, p in zip(grads, mlp.parameters()):
        assert_close(a, p.grad, atol=1e-5, rtol=1e-5)
    assert_close(x.grad, x2.grad, atol=1e-6, rtol=1e-5)
    assert sorted(mlp.state_dict()) == ["down_proj.weight", "gate_proj.weight", "up_proj.weight"]


def test_backward_keeps_only_the_inputs():
    """The product and the activation are not saved: what autograd keeps is gate and up."""
    saved = []
    gate, up = (torch.randn(8, 16, requires_grad=True) for _ in range(2))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        swiglu(gate * 1, up * 1)
    assert sum(t.numel() for t in saved) == 2 * 8 * 16


@pytest.mark.parametrize("call,exc,msg", [
    (lambda: swiglu(torch.randn(3), torch.randn(4)), ValueError, r"swiglu: expected up of gate's shape"),
    (lambda: geglu(torch.randn(3), torch.randn(3, dtype=torch.float64)), ValueError, r"geglu: expected up of gate's"),
    (lambda: swiglu(torch.ones(3, dtype=torch.long), torch.ones(3)), TypeError, r"expected gate to be a floating"),
    (lambda: GatedMLP(4, 8, activation="relu"), ValueError, r"expected activation 'silu' or 'gelu_tanh', got 'relu'"),
    (lambda: torch.ops.zerofuse.swiglu(torch.randn(3), torch.randn(3), "tanh"), RuntimeError,
     r"zerofuse::swiglu: expected activation 'silu' or 'gelu_tanh', got 'tanh'"),
], ids=["shape", "dtype", "int-gate", "mlp-activation", "op-activation"])
def test_bad_input_errors_name_the_argument(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_packed_op_under_compile_writes_the_gradient_whole(activation, kernel_path):
    """Under torch.compile swiglu(x) of a fused projection traces zerofuse::swiglu_packed: the same
    values and gradient as eagerly, opcheck'd, and the compiled backward makes no cat (the chunked
    two-argument op's backward concatenated the halves' gradients: a copy of the whole gradient)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    x = torch.randn(4, 9, 2 * 24, generator=torch.Generator().manual_seed(2))
    torch.library.opcheck(torch.ops.zerofuse.swiglu_packed.default, (x.clone().requires_grad_(), activation))
    torch.library.opcheck(torch.ops.zerofuse.swiglu_packed_backward.default, (torch.randn(4, 9, 24), x, activation))
    face = FACES[activation]
    eager = x.clone().requires_grad_()
    face(eager).square().sum().backward()
    graphs = []

    def keep(gm, _):  # the forward and backward graphs, run as traced
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    compiled = x.clone().requires_grad_()
    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)
    torch.compile(lambda t: face(t).square().sum(), backend=backend, fullgraph=True)(compiled).backward()
    assert torch.equal(compiled.grad, eager.grad)
    code = "".join(g.code for g in graphs)
    assert "swiglu_packed_backward" in code and "aten.cat" not in code, code


def test_outputs_have_the_fakes_strides(kernel_path):
    """Transposed inputs: the outputs are contiguous on both paths, as the fakes promise (the torch
    path's elementwise ops used to follow gate's layout: torch.compile's stride asserts fail)."""
    gt, ut = (torch.randn(33, 5).t() for _ in range(2))
    for activation in ("silu", "gelu_tanh"):
        assert_fake_strides(torch.ops.zerofuse.swiglu.default, gt, ut, activation)
        assert_fake_strides(torch.ops.zerofuse.swiglu_backward.default, torch.randn(33, 5).t(), gt, ut, activation)


def test_opcheck_and_compile():
    gate, up = (torch.randn(5, 33, requires_grad=True) for _ in range(2))
    for activation in ("silu", "gelu_tanh"):
        torch.library.opcheck(torch.ops.zerofuse.swiglu.default, (gate, up, activation))
        torch.library.opcheck(torch.ops.zerofuse.swiglu_backward.default,
                              (torch.randn(5, 33), gate.detach(), up.detach(), activation))

    def f(g, u):
        return geglu(g * 2, u).sum() + swiglu(g, u).square().sum()

    ours = torch.autograd.grad(torch.compile(f, fullgraph=True)(gate, up), (gate, up))
    eager = torch.autograd.grad(f(gate, up), (gate, up))
    for a, b in zip(ours, eager):
        assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_reference(dtype):
    g = torch.Generator().manual_seed(0)
    gate, up, dy = ((torch.randn(4096, 1375, generator=g) * 3).to(dtype) for _ in range(3))
    for activation in ("silu", "gelu_tanh"):
        ours = _grads(FACES[activation], gate.cuda(), up.cuda(), dy.cuda())
        ref = _grads(lambda a, b: reference.swiglu(a, b, activation), gate.double(), up.double(), dy.double())
        peer = _grads(lambda a, b: reference.swiglu(a, b, activation), gate.cuda(), up.cuda(), dy.cuda())
        for got, want, theirs in zip(ours, ref, peer):
            assert_within_peer_rule(got.cpu(), want, theirs.cpu())


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_projection_is_read_in_place_and_its_gradient_written_whole(activation, dtype, kernel_path):
    """swiglu(x) with x = [gate | up] (zerofuse.models.gpt's SwiGLU MLP: fc(x) holds both): the
    bits of swiglu(gate, up) on contiguous halves, forward and gradient; on the kernels' path the
    halves are read in place and the gradient of x written at once: no aten clone (contiguous
    copies) and no cat (autograd's chunk backward) forward or backward. The two-argument call on
    chunk views reads them in place too."""
    from zerofuse.train.launches import CountLaunches

    fused = torch.randn(5, 37, 2 * 130, generator=torch.Generator().manual_seed(1), dtype=dtype)
    dy = torch.randn(5, 37, 130, dtype=dtype)
    want = _grads(FACES[activation], *(t.contiguous() for t in fused.chunk(2, -1)), dy)
    for packed in (True, False):
        x = fused.clone().requires_grad_()
        with CountLaunches() as c:
            y = FACES[activation](x) if packed else FACES[activation](*x.chunk(2, -1))
            y.backward(dy)
        if kernel_path == "triton":  # one kernel reading the same values: the same bits
            assert torch.equal(y, want[0]) and torch.equal(x.grad, torch.cat(want[1:], -1)), packed
            assert "clone" not in c.names and ("cat" not in c.names or not packed), (packed, c.names)
        else:  # aten's CPU kernels take another (vectorised or not) path on strided views: rounding apart
            assert_close(y, want[0])
            assert_close(x.grad, torch.cat(want[1:], -1))


def test_a_fused_projection_of_odd_width_is_refused():
    with pytest.raises(ValueError, match=r"swiglu: without up, expected gate to hold \[gate \| up\] along an even "
                                         r"last dim, got shape \[3, 5\]"):
        swiglu(torch.randn(3, 5))
    with pytest.raises(TypeError, match="geglu: expected gate to be a floating-point tensor, got torch.int64"):
        geglu(torch.ones(3, 4, dtype=torch.long))


def test_a_fused_projection_compiles_to_the_eager_values():
    x = torch.randn(4, 2 * 48, generator=torch.Generator().manual_seed(3), requires_grad=True)
    want = torch.autograd.grad(swiglu(x).square().sum(), x)[0]
    got = torch.autograd.grad(torch.compile(lambda t: swiglu(t).square().sum(), backend="aot_eager",
                                            fullgraph=True)(x), x)[0]
    assert_close(got, want)
