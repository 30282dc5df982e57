"""Where the per-call time of small zerofuse ops goes (run by bench/run_gpu.sh's `profile` phase).

On the H100 (bench/results/h100-2026-11-23) small problems lost to torch by per-call overhead: a
4096x1024 LayerNorm forward took ~0.2 ms against torch's 0.03 ms, and a FusedAdamW step over 1M
params (91 tensors) 1.2 ms against 0.28 ms, while their kernels need a few microseconds. For each
case this prints the median wall time per call (zerofuse and torch), then torch.profiler's table
of the zerofuse calls sorted by self CPU time (which Python/C++ pieces and launches cost), then
cProfile's top Python functions.

    python bench/profile_host.py [--device cuda|cpu] [--calls N]
    python bench/profile_host.py --stub-kernels   # no GPU needed

--stub-kernels measures, on any machine, the host side of the CUDA path of the norm and attention
faces (tiny shapes, against torch's on the CPU) and of the optimizer steps:
CPU tensors go through the Triton path (ZEROFUSE_TRITON_ON_CPU=1) with every optimizer kernel
launch replaced by a no-op (the step counters' kernel included). What it leaves out: the launches
themselves and CUDA's copies of the tables; the launch path (JITFunction.run against a handle,
[Note: launch handles]) is timed on its own, with the compiled launcher a no-op.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

if "--stub-kernels" in sys.argv:  # before zerofuse is imported: its kernels must be interpreted ones
    os.environ["ZEROFUSE_TRITON_ON_CPU"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import _median_seconds, synchronize  # noqa: E402  (bench/conftest.py's timing)


def _cases(device):
    import torch.nn.functional as F

    import bench_optimizers
    import zerofuse.nn.functional as ZF
    from zerofuse.optim import FusedAdamW

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(4096, 1024, device=device, dtype=dtype)
    w, b = torch.ones(1024, device=device, dtype=dtype), torch.zeros(1024, device=device, dtype=dtype)
    yield "layer_norm fwd 4096x1024", lambda: ZF.layer_norm(x, (1024,), w, b), lambda: F.layer_norm(x, (1024,), w, b)

    q, k, v = (torch.randn(4, 8, 256, 64, device=device, dtype=dtype) for _ in range(3))
    yield ("attention fwd B4 H8 N256 D64", lambda: ZF.scaled_dot_product_attention(q, k, v, is_causal=True),
           lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))

    ours = bench_optimizers._params(device, 1_000_000)
    theirs = bench_optimizers._params(device, 1_000_000)
    opt = FusedAdamW(ours, lr=1e-3, weight_decay=0.01)
    peer = torch.optim.AdamW(theirs, lr=1e-3, weight_decay=0.01,
                             **({"fused": True} if device.type == "cuda" else {"foreach": True}))
    yield f"AdamW step 1M params ({len(ours)} tensors)", opt.step, peer.step


class _NoLaunch:
    """A Triton kernel whose launches do nothing (kernel[grid](...) returns at once)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _stubbed_optimizer_steps(calls: int) -> None:
    from zerofuse import kernels

    if not kernels.interpreted():
        sys.exit("--stub-kernels: set ZEROFUSE_TRITON_ON_CPU=1 before zerofuse is imported (this script does)")
    import bench_optimizers
    from zerofuse.kernels import l2norm, lamb, multi_tensor, optim
    from zerofuse.optim import FusedAdamW, FusedLAMB

    class _CleanClip:  # the clipping kernel's output zeroed: a found flag of 0, so the step is not skipped
        def __getitem__(self, grid):
            return lambda part, nblocks, out, *args, **kwargs: out.zero_()

    for module in (multi_tensor, optim, lamb, l2norm):  # each launcher calls its own module's kernels
        for name in dir(module):
            if name.endswith("_kernel"):
                setattr(module, name, _CleanClip() if name == "_clip_kernel" else _NoLaunch())
    cpu = torch.device("cpu")
    params = bench_optimizers._params(cpu, 1_000_000)
    for label, opt in (("FusedAdamW", FusedAdamW(params, lr=1e-3, weight_decay=0.01)),
                       ("FusedAdamW max_grad_norm=1", FusedAdamW(params, lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)),
                       ("FusedLAMB", FusedLAMB(params, lr=1e-3, weight_decay=0.01))):
        for _ in range(10):
            opt.step()
        print(f"{label} step, {len(params)} tensors, launches stubbed: "
              f"{_median_seconds(opt.step, cpu, calls) * 1e6:.1f} us host time (median of {calls})")


def _time_face(label: str, ours, theirs, calls: int) -> None:
    """Prints the median host time per call of a zerofuse face (its kernel launch stubbed) and of
    torch's CPU function of the same tiny shape (which includes its small compute), after warm-up."""
    cpu = torch.device("cpu")
    for _ in range(200):
        ours()
        theirs()
    z, t = (_median_seconds(fn, cpu, calls) * 1e6 for fn in (ours, theirs))
    print(f"{label}, launch stubbed: zerofuse {z:.1f} us, torch cpu {t:.1f} us per call ({z / t:.2f}x; "
          f"median of {calls})")


def _stubbed_norms(calls: int) -> None:
    """The norm faces' CUDA path (Triton in the interpreter) on a tiny shape against torch's CPU
    LayerNorm/RMSNorm, with and without autograd."""
    import torch.nn.functional as F

    import zerofuse.nn.functional as ZF
    from zerofuse.kernels import norms as K

    K._norm_fwd_kernel = _NoLaunch()
    for grad in (False, True):
        x, w, b = (torch.randn(*s).requires_grad_(grad) for s in ((4, 64), (64,), (64,)))
        for name, ours, theirs in (("layer_norm", lambda: ZF.layer_norm(x, (64,), w, b), lambda: F.layer_norm(x, (64,), w, b)),
                                   ("rms_norm", lambda: ZF.rms_norm(x, (64,), w, 1e-5), lambda: F.rms_norm(x, (64,), w, 1e-5))):
            _time_face(f"{name} fwd 4x64{' with grad' if grad else ''}", ours, theirs, calls)


def _stubbed_attention(calls: int) -> None:
    """The attention face's CUDA path (Triton in the interpreter) on a tiny shape against torch's
    CPU sdpa: the forward without autograd and with it, and forward + backward (autograd.grad)."""
    import torch.nn.functional as F

    import zerofuse.nn.functional as ZF
    from zerofuse.kernels import attention as K

    from zerofuse.kernels import attention_bwd as B

    K._attn_fwd_kernel = B._attn_bwd_dq_kernel = B._attn_bwd_dkdv_kernel = _NoLaunch()
    for grad in (False, True):
        q, k, v = (torch.randn(1, 2, 16, 16).requires_grad_(grad) for _ in range(3))
        _time_face(f"attention fwd 1x2x16x16 causal{' with grad' if grad else ''}",
                   lambda: ZF.scaled_dot_product_attention(q, k, v, is_causal=True),
                   lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), calls)
    dout = torch.randn(1, 2, 16, 16)

    def fwd_bwd(sdpa):
        return lambda: torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), dout)

    _time_face("attention fwd+bwd 1x2x16x16 causal", fwd_bwd(ZF.scaled_dot_product_attention),
               fwd_bwd(F.scaled_dot_product_attention), calls)
    # qkv_attention (zerofuse.nn.Attention's, GPT's) against its torch equivalent: heads split from
    # the projection, sdpa, the output transposed back
    for grad in (False, True):
        qkv = torch.randn(1, 16, 3 * 2 * 16).requires_grad_(grad)
        dout = torch.randn(1, 16, 2 * 16)

        def split(qkv):
            q, k, v = qkv.view(1, 16, 3, 2, 16).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, 16, 32)

        ours, theirs = (lambda: ZF.qkv_attention(qkv, 2, is_causal=True)), (lambda: split(qkv))
        if grad:
            ours, theirs = ((lambda f: lambda: torch.autograd.grad(f(), qkv, dout))(f) for f in (ours, theirs))
        _time_face(f"qkv_attention {'fwd+bwd' if grad else 'fwd'} 1x16x(3x2x16) causal", ours, theirs, calls)


def _stubbed_rope(calls: int) -> None:
    """The RoPE face's CUDA path (Triton in the interpreter) on (B, H, N, D) views of (B, N, H, D)
    projections (Hugging Face's layout), forward with and without autograd, against Hugging Face's
    torch formula (rotate_half) on the CPU."""
    import zerofuse.nn.functional as ZF
    from zerofuse.kernels import rotary as K

    K._rope_kernel = _NoLaunch()
    cos, sin = torch.randn(64, 32), torch.randn(64, 32)
    c2, s2 = torch.cat([cos[:32], cos[:32]], -1)[None, None], torch.cat([sin[:32], sin[:32]], -1)[None, None]

    def half(x):  # transformers' rotate_half
        return torch.cat((-x[..., 32:], x[..., :32]), dim=-1)

    def hf(q, k):  # transformers' apply_rotary_pos_emb
        return q * c2 + half(q) * s2, k * c2 + half(k) * s2

    for grad in (False, True):
        q = torch.randn(2, 32, 4, 64).transpose(1, 2).requires_grad_(grad)
        k = torch.randn(2, 32, 2, 64).transpose(1, 2).requires_grad_(grad)
        _time_face(f"rotary_embedding fwd 2x4x32x64 + 2 kv heads{' with grad' if grad else ''}",
                   lambda: ZF.rotary_embedding(q, k, cos, sin), lambda: hf(q, k), calls)


def _launch_paths(calls: int) -> None:
    """[Note: launch handles] offline: the LayerNorm forward's launch (4096 x 1024 fp32, weight and
    bias) through JITFunction.run and through a handle, each whole but for the compiled launcher
    (no GPU here): a no-op in its place that calls the launch hooks as Triton's C launcher does, a
    driver answering device 0 / stream 0 / sm_90, the kernel compiled by neither (a stand-in
    CompiledKernel in the JIT's cache and in the handle)."""
    from unittest import mock

    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from zerofuse.kernels import launch as L
    from zerofuse.kernels import norms as K

    class Driver:
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 0)
        get_current_target = staticmethod(lambda: GPUTarget("cuda", 90, 32))

    class Compiled:  # what the JIT's cache holds once compiled: CompiledKernel's launch-time face
        function, packed_metadata, name = 0, (), "norm_fwd"

        @staticmethod
        def run(g0, g1, g2, stream, function, packed, metadata, enter, leave, *args):
            if enter is not None:
                enter(metadata)
            if leave is not None:
                leave(metadata)

        def launch_metadata(self, grid, stream, *args):  # CompiledKernel's, less _init_handles
            if knobs.runtime.launch_enter_hook is None:
                return None
            from triton.compiler.compiler import LazyDict
            return LazyDict({"name": self.name, "function": self.function, "stream": stream})

    jf = JITFunction(K._norm_fwd_kernel.fn)
    x = torch.randn(4096, 1024)
    w, b, y, mean, rstd = torch.randn(1024), torch.randn(1024), torch.empty_like(x), torch.empty(4096), torch.empty(4096)
    args = (x, None, None, y, w, b, mean, rstd, 4096, 1024, 1e-5)
    consts = dict(BLOCK_M=4, BLOCK_N=1024, num_warps=4, HAS_RES=False, HAS_W=True, HAS_B=True, IS_RMS=False,
                  EMULATE_RNE=False)

    def compile_(self, key, *a, **kw):
        self.device_caches[0][0][key] = Compiled()
        return self.device_caches[0][0][key]

    cpu = torch.device("cpu")
    driver.set_active(Driver())
    try:
        with mock.patch.object(JITFunction, "_do_compile", compile_), \
                mock.patch.object(torch._C, "_cuda_getDevice", lambda: 0, create=True), \
                mock.patch.object(torch._C, "_cuda_getCurrentRawStream", lambda d: 0, create=True):
            key = L.handle_key(jf, 0, args, consts)
            L.HANDLES[key] = L.Handle(jf, Compiled(), L.tail_args(jf, len(args), consts))
            jit = lambda: jf[(1024,)](*args, **consts)  # noqa: E731
            handle = lambda: L._launch_handle(jf, (1024,), args, consts)  # noqa: E731
            for _ in range(200):
                jit()
                handle()
            assert L.HANDLES[key].hits >= 200  # the handle launched, not the JIT
            j, h = (_median_seconds(fn, cpu, calls) * 1e6 for fn in (jit, handle))
            del L.HANDLES[key]
    finally:
        driver.reset_active() if driver._default is not None else driver.set_active(None)
    print(f"launch of the LayerNorm forward (11 args, 8 constexprs/options), the compiled launcher a no-op: "
          f"JITFunction.run {j:.1f} us, handle {h:.1f} us per call ({j / h:.1f}x; median of {calls})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--stub-kernels", action="store_true",
                        help="host time of the optimizers' CUDA path on this machine, launches stubbed")
    args = parser.parse_args(argv)
    if args.stub_kernels:
        torch.set_num_threads(1)
        _launch_paths(max(args.calls, 2000))  # first: the others stub the kernels out
        _stubbed_norms(max(args.calls, 2000))
        _stubbed_attention(max(args.calls, 2000))
        _stubbed_rope(max(args.calls, 2000))
        _stubbed_optimizer_steps(args.calls)
        return 0
    device = torch.device(args.device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    from zerofuse.kernels import launch as L

    handles = L.MODE == "handles"  # not when ZEROFUSE_TRITON_LAUNCH=jit (run_gpu.sh: the handles failed the doctor)
    for name, ours, theirs in _cases(device):
        for _ in range(10):  # warm-up: compilation, autotuning, state allocation
            ours()
            theirs()
        L.MODE = "jit"  # [Note: launch handles]: every launch through JITFunction.run, then through handles
        zj = _median_seconds(ours, device, args.calls) * 1e6
        L.MODE = "handles" if handles else "jit"
        z, t = (_median_seconds(fn, device, args.calls) * 1e6 for fn in (ours, theirs))
        via = f"launches through handles; through the JIT: {zj:.1f} us" if handles else "launches through the JIT"
        print(f"\n=== {name}: zerofuse {z:.1f} us ({via}), torch {t:.1f} us per call "
              f"(median of {args.calls}, synchronised)")
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(20):
                ours()
            synchronize(device)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
        stats = io.StringIO()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.calls):
            ours()
        synchronize(device)
        pr.disable()
        pstats.Stats(pr, stream=stats).sort_stats("tottime").print_stats(15)
        print("\n".join(stats.getvalue().splitlines()[:32]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
