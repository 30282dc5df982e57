"""zerofuse.kernels.launch ([Note: launch handles]): the key of a handle changes whenever Triton's
own specialization would, and the argument list handed to a compiled launcher is the one the JIT
binds; both checked on CPU against Triton 3.6's binder for the CUDA backend (no GPU needed). On a
GPU: the handles path gives the JIT path's bits."""
import itertools

import pytest
import torch
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from common import HAS_CUDA
from zerofuse import _C
from zerofuse.kernels import launch as L


def _binder(fn):
    """Triton's binder of ``fn`` (a plain function, or a kernel's .fn) for sm_90, as the JIT makes it."""
    jf = JITFunction(fn)
    return jf, create_function_from_signature(jf.signature, jf.params, make_backend(GPUTarget("cuda", 90, 32)))


def _probe(p, n, m, f, b, q, C: tl.constexpr, D: tl.constexpr = 3):
    pass


# every kind of argument the kernels take, with the values where Triton's specialization turns
_TENSORS = [torch.empty(64, dtype=dt)[k:] for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                                     torch.int32, torch.uint8, torch.bool) for k in (0, 1, 2, 4, 8)]
_INTS = [0, 1, 2, 3, 15, 16, 17, 32, 4096, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1,
         2**40, 2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 1]
_FLOATS = [0.0, 1.0, 1e-5, -3.5, 1e300]


def _spec(binder, args, consts):
    _, spec, _ = binder(*args, **consts, debug=False, instrumentation_mode="")
    return spec


@pytest.mark.parametrize("pos,values", [(0, _TENSORS + [None]), (1, _INTS + [None, True, False]),
                                        (2, _INTS), (3, _FLOATS), (4, [True, False]), (5, _TENSORS)])
def test_the_key_changes_whenever_tritons_specialization_does(pos, values):
    """One argument varied over the values of its kinds, the others fixed: any two values with the
    same key have the same Triton specialization (the key may split more finely, never less)."""
    _, binder = _binder(_probe)
    base = [torch.empty(8), 16, 16, 1.0, True, torch.empty(8)]
    seen: dict = {}
    for v in values:
        args = list(base)
        args[pos] = v
        spec = _spec(binder, args, dict(C=4))
        key = _C.launch_key((v,))
        assert seen.setdefault(key, (spec, v))[0] == spec, (key, v, seen[key][1], spec)
    # and the key does split: aligned and unaligned tensors, 1 / 16 / others, i32 / i64
    assert len(seen) >= (3 if pos in (1, 2) else 2 if pos != 3 else 1)


def test_a_constexpr_value_is_part_of_the_key_and_the_tail():
    jf, binder = _binder(_probe)
    args = (torch.empty(8), 16, 16, 1.0, True, torch.empty(8))
    specs = [_spec(binder, args, dict(C=c)) for c in (1, 2)]
    assert specs[0] != specs[1]  # C is specialised: the handles' key has the consts verbatim
    assert L.tail_args(jf, len(args), dict(C=5)) == (5, 3)  # the default of D
    with pytest.raises(TypeError, match="missing argument 'C'"):
        L.tail_args(jf, len(args), {})


def _launch_sites() -> set:
    """The kernels the launchers of kernels/ pass to launch_triton (attention's pass a variable)."""
    import pathlib
    import re

    src = pathlib.Path(L.__file__).parent
    names = set()
    for f in src.glob("*.py"):
        names |= {n.split(".")[-1] for n in re.findall(r"launch_triton\((\w[\w.]*)", f.read_text())}
    return (names - {"kernel"}) | {"_attn_fwd_kernel", "_attn_bwd_dq_kernel", "_attn_bwd_dkdv_kernel"}


def _record_launches(monkeypatch):
    """Every launch of the ops below, as (kernel, grid, args, consts), still run (interpreter)."""
    calls = []

    def record(kernel, grid, *args, **consts):
        calls.append((kernel, grid, args, consts))
        return kernel[grid](*args, **consts)

    monkeypatch.setattr(L, "launch_triton", record)
    for mod in _launcher_modules():
        monkeypatch.setattr(mod, "launch_triton", record)
    return calls


def _launcher_modules():
    from zerofuse.kernels import (attention, attention_bwd, bias_gelu, colsum, cross_entropy, l2norm, lamb, moe,
                                  multi_tensor, norms, optim, rotary, swiglu)

    return [m for m in (attention, attention_bwd, bias_gelu, colsum, cross_entropy, l2norm, lamb, moe, multi_tensor,
                        norms, optim, rotary, swiglu) if hasattr(m, "launch_triton")]


def _run_ops(monkeypatch):
    """Every launch site of kernels/ at least once (the kernels the test expects are listed there)."""
    import zerofuse.nn.functional as F
    from zerofuse.kernels import colsum, optim
    from zerofuse.nn import rope_tables
    from zerofuse.ops import moe
    from zerofuse.optim import FusedAdamW, FusedLAMB, FusedLARS

    x = torch.randn(3, 5, 48, requires_grad=True)
    w, b = torch.randn(48, requires_grad=True), torch.randn(48, requires_grad=True)
    (F.layer_norm(x, (48,), w, b) * 1.5).sum().backward()
    (F.rms_norm(x[:, 1:], (48,), w) ** 2).sum().backward()  # an unaligned view's copy
    y, h = F.add_layer_norm(x, torch.randn(3, 5, 48), (48,), w, b)
    (y.sum() + h.sum()).backward()
    F.layer_norm(torch.randn(2, 40000), (40000,)).sum()  # the wide-row forward
    xw = torch.randn(2, 40000, requires_grad=True)
    F.rms_norm(xw, (40000,), torch.ones(40000, requires_grad=True)).sum().backward()  # and backward
    q, k, v = (torch.randn(1, 2, 19, 16, requires_grad=True) for _ in range(3))
    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    g, u = torch.randn(4, 24, requires_grad=True), torch.randn(4, 24, requires_grad=True)
    (F.swiglu(g, u).sum() + F.geglu(g, u).sum() + F.bias_gelu(g, u[0]).sum()).backward()
    cos, sin = rope_tables(19, 16)
    F.rotary_embedding(q.detach(), k.detach(), cos, sin)
    hid, wt = torch.randn(6, 16, requires_grad=True), torch.randn(37, 16, requires_grad=True)
    F.linear_cross_entropy(hid, wt, torch.randint(0, 37, (6,))).backward()
    xs = torch.randn(5, 8, requires_grad=True)
    out, pos, src, _ = moe.moe_permute(xs, torch.randint(0, 3, (5, 2)), 3)
    moe.moe_unpermute(out, pos, src, torch.rand(5, 2)).sum().backward()
    p = [torch.nn.Parameter(torch.randn(n)) for n in (5, 300, 4099)]
    opts = [FusedAdamW(p, lr=1e-3, weight_decay=0.01, max_grad_norm=1.0), FusedLAMB(p, lr=1e-3), FusedLARS(p, lr=1e-3)]
    for opt in opts:
        for t in p:
            t.grad = torch.randn_like(t)
        opt.step()
    monkeypatch.setattr(optim, "LAMB_ONE_LAUNCH", True)
    opts[1].step()
    monkeypatch.setattr(colsum, "ONE_LAUNCH_FLOATS", 0)  # the weight grads' sums in a second launch
    F.layer_norm(x, (48,), w, b).sum().backward()


def test_every_launch_is_keyed_and_binds_as_the_jit_does(monkeypatch):
    """The ops' real launches (norms, attention, the optimizers, clipping): each argument has a
    key (none falls back to the JIT), and positional args + tail are the argument list Triton's
    binder builds, in its order, so a handle's launcher receives what the JIT's would."""
    calls = _record_launches(monkeypatch)
    _run_ops(monkeypatch)
    seen = {c[0].fn.__name__ for c in calls}
    assert seen >= _launch_sites(), sorted(_launch_sites() - seen)
    binders = {}
    for kernel, grid, args, consts in calls:
        if kernel.fn not in binders:
            binders[kernel.fn] = _binder(kernel.fn)
        jf, binder = binders[kernel.fn]
        assert len(_C.launch_key(args)) == 2 * len(args)  # TypeError for a kind without a key
        hash(tuple(consts.items()))  # the handle key's constexprs and options
        bound, _, _ = binder(*args, **consts, debug=False, instrumentation_mode="")
        want = list(bound.values())
        got = list(args) + list(L.tail_args(jf, len(args), consts))
        assert len(got) == len(want) and all(g is w for g, w in zip(got, want)), kernel.fn.__name__


def test_unkeyed_arguments_are_refused_by_the_key():
    """A kind Triton's specializer may treat otherwise (here: a tuple, a str, a numpy-like scalar, an
    int beyond 64 bits) has no key: the launch then goes through the JIT."""
    for bad in ((1, 2), "s", torch.float32, 2**64, -2**63 - 1):
        with pytest.raises(TypeError, match="launch_key"):
            _C.launch_key((bad,))


def test_the_second_launch_of_a_key_calls_the_compiled_launcher(monkeypatch):
    """The handles path with the JIT and the CUDA queries stood in for: a key's first launch goes
    through the JIT and keeps its compiled kernel; the next calls its launcher with the JIT's
    arguments (grid padded to 3, the current stream, the binder's argument list, no hooks); an
    unaligned tensor, another constexpr, an equal constexpr of another type, an unhashable one or a
    launch hook goes through the JIT again, and a tensor passed by keyword keeps no handle."""
    from unittest import mock

    from triton import knobs

    jit_calls, runs = [], []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def run(self, *a):
            runs.append(a)

    def getitem(self, grid):
        return lambda *a, **kw: jit_calls.append((grid, a, kw)) or Compiled()

    jf, binder = _binder(_probe)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 77, raising=False)
    L.HANDLES.clear()
    buf = torch.empty(64)
    args = (buf, 16, 32, 1.0, True, buf)
    with mock.patch.object(JITFunction, "__getitem__", getitem):
        for _ in range(3):
            L._launch_handle(jf, (5,), args, dict(C=4, num_warps=2))
        assert len(jit_calls) == 1 and len(runs) == 2
        bound, _, _ = binder(*args, C=4, D=3, debug=False, instrumentation_mode="")
        assert runs[0] == (5, 1, 1, 77, "fn", "meta", None, None, None, *bound.values())
        L._launch_handle(jf, (5, 2), (buf[1:],) + args[1:], dict(C=4, num_warps=2))  # unaligned: a new key
        L._launch_handle(jf, (5,), args, dict(C=5, num_warps=2))  # another constexpr
        assert len(jit_calls) == 3 and len(runs) == 2
        hook = lambda metadata: None  # noqa: E731
        knobs.runtime.launch_enter_hook.add(hook)
        try:
            L._launch_handle(jf, (5,), args, dict(C=4, num_warps=2))  # a profiler's hook: the JIT
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        assert len(jit_calls) == 4 and len(runs) == 2
        L._launch_handle(jf, (5,), args, dict(C=4.0, num_warps=2))  # 4.0 == 4, not the same kernel: the JIT
        assert len(jit_calls) == 5 and len(runs) == 2
        L._launch_handle(jf, (5,), args, dict(C=[4], num_warps=2))  # unhashable: the JIT, no error
        assert len(jit_calls) == 6 and len(runs) == 2
        n = len(L.HANDLES)
        for _ in range(2):  # a tensor by keyword: the JIT each time, no handle kept (it would key by identity)
            L._launch_handle(jf, (5,), args[:-1], dict(q=torch.empty(64), C=4, num_warps=2))
        assert len(jit_calls) == 8 and len(runs) == 2 and len(L.HANDLES) == n
    assert sum(h.hits for h in L.HANDLES.values()) == 2
    L.HANDLES.clear()


def test_the_jobs_launch_count_includes_handle_launches(monkeypatch):
    """zerofuse.train.launches.count_triton counts a launch through a handle as one Triton launch
    (it patched JITFunction.run only, which handles bypass: an H200 job reported 0 Triton launches
    per step on 2026-11-27); the first launch of a key, through the JIT, counts once."""
    from unittest import mock

    from zerofuse.train.launches import count_triton

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def run(self, *a):
            pass

    def getitem(self, grid):
        return lambda *a, **kw: self.run(*a, grid=grid, **kw)

    jf, _ = _binder(_probe)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 77, raising=False)
    L.HANDLES.clear()
    args = (torch.empty(64), 16, 32, 1.0, True, torch.empty(64))
    counter: dict = {}
    with mock.patch.object(JITFunction, "__getitem__", getitem), \
            mock.patch.object(JITFunction, "run", lambda self, *a, **kw: Compiled()):
        L._launch_handle(jf, (5,), args, dict(C=4, num_warps=2))  # before the count: not counted
        with count_triton(counter):
            for _ in range(3):
                L._launch_handle(jf, (5,), args, dict(C=4, num_warps=2))
            L._launch_handle(jf, (5,), args, dict(C=6, num_warps=2))  # a new key: the JIT
    assert counter["triton"] == 4
    assert sum(h.hits for h in L.HANDLES.values()) == 3
    L.HANDLES.clear()


def test_modes(monkeypatch):
    """In the interpreter (either mode): the JIT's call itself; a bad mode is refused by name."""
    seen = []

    class K:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((grid, a, kw))

    L.launch_triton(K(), (3,), 1, 2, X=4)
    assert seen == [((3,), (1, 2), {"X": 4})]
    monkeypatch.setenv("ZEROFUSE_TRITON_LAUNCH", "fast")
    import importlib

    with pytest.raises(ValueError, match=r"ZEROFUSE_TRITON_LAUNCH must be 'jit' \(.*\) or 'handles' \(.*\), got 'fast'"):
        importlib.reload(L)
    monkeypatch.delenv("ZEROFUSE_TRITON_LAUNCH")
    importlib.reload(L)
    assert L.MODE == "handles"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_handles_give_the_jits_bits(monkeypatch):
    """The ops run twice per mode on CUDA: under 'handles' the second run launches through handles
    (hits counted) and every output and gradient equals the 'jit' run's bit for bit."""
    def run(mode):
        monkeypatch.setattr(L, "MODE", mode)
        torch.manual_seed(0)
        outs = []
        for _ in range(2):
            outs.append(_gpu_ops())
        return outs[-1]

    want = run("jit")
    L.HANDLES.clear()
    got = run("handles")
    assert sum(h.hits for h in L.HANDLES.values()) > 0
    for a, b in itertools.zip_longest(want, got):
        assert torch.equal(a, b)


def _gpu_ops():
    import zerofuse.nn.functional as F
    from zerofuse.optim import FusedAdamW

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(4, 33, 768, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(768, device="cuda", generator=g, requires_grad=True)
    b = torch.randn(768, device="cuda", generator=g, requires_grad=True)
    y = F.layer_norm(x, (768,), w, b)
    q, k, v = (torch.randn(2, 4, 97, 64, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (y.float().sum() + o.float().sum()).backward()
    p = [torch.nn.Parameter(torch.randn(n, device="cuda", generator=g)) for n in (5, 4099)]
    for t in p:
        t.grad = torch.randn(t.shape, device="cuda", generator=g)
    FusedAdamW(p, lr=1e-3, max_grad_norm=1.0).step()
    return [y, o, x.grad, w.grad, b.grad, q.grad, k.grad, v.grad, *p]


class _OnCuda1(torch.Tensor):
    """A CPU tensor that says it is on cuda:1 (get_device), for the device guard's simulation."""

    def get_device(self):
        return 1


def test_a_launch_runs_on_its_tensors_device(monkeypatch):
    """Launches went to the current device's stream whatever the tensors' device: a patched HF
    model over several GPUs (device_map) ran cuda:1's ops on cuda:0's stream (found by reading,
    2026-12-07). Simulated: the current device 0, a tensor on 1; the launch runs under device 1,
    and a tensor on the current device takes no guard."""
    import contextlib

    seen, current = [], [0]

    @contextlib.contextmanager
    def device(i):
        before, current[0] = current[0], i
        try:
            yield
        finally:
            current[0] = before

    monkeypatch.setattr(L, "_INTERPRETED", False)
    monkeypatch.setattr(L, "MODE", "jit")
    monkeypatch.setattr(L, "_MULTI_GPU", True)  # (two devices visible)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current[0], raising=False)
    monkeypatch.setattr(torch.cuda, "device", device)

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **consts: seen.append(current[0])

    L.launch_triton(Kernel(), (1,), torch.empty(2).as_subclass(_OnCuda1), 3)
    L.launch_triton(Kernel(), (1,), 3, torch.empty(2))  # (CPU: get_device -1, no guard)
    assert seen == [1, 0] and current == [0]
