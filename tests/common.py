"""Helpers shared by tests and benchmarks (import as ``from common import ...``)."""
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Parametrise with DEVICES to run a test on CPU always and on CUDA when present (the gpu mark
# makes it skip cleanly without one).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def kernel_asm(*flags: str) -> list[dict]:
    """tools/kernel_asm.py's JSON lines (kernels compiled for sm_90 on this machine, outside the
    interpreter: it runs in a child process without TRITON_INTERPRET)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["ZEROFUSE_TRITON_ON_CPU"] = "0"
    tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "kernel_asm.py")
    out = subprocess.run([sys.executable, tool, *flags], env=env, check=True, capture_output=True, text=True,
                         timeout=900).stdout
    return [json.loads(line) for line in out.splitlines()]


def tiny_job_argv(tmp_path, *argv) -> list[str]:
    """zerofuse-train's command line for a tiny job on the CPU (one rank, 2 layers of dim 32, no
    evaluation, samples or checkpoints, outputs in tmp_path); argv adds flags or overrides these
    (the last one given wins)."""
    return ["--device", "cpu", "--nproc", "1", "--layers", "2", "--heads", "2", "--dim", "32", "--seq-len", "16",
            "--batch", "2", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--ckpt-every", "0",
            "--out", str(tmp_path), *map(str, argv)]


def tiny_job_args(tmp_path, *argv):
    """tiny_job_argv's flags, parsed and checked, for an in-process job."""
    from zerofuse import train

    args = train._parser().parse_args(tiny_job_argv(tmp_path, *argv))
    train.validate(args)
    return args


class SavedActivations:
    """Bytes of the activations autograd saves for backward inside the given modules' forwards
    (what stays alive between forward and backward), e.g. the norms'; the modules' own params,
    which autograd saves too, are not activations and not counted."""

    def __init__(self, modules):
        self.bytes = 0
        self._params = {p.data_ptr() for m in modules for p in m.parameters()}
        self._handles = []
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(self._enter))
            self._handles.append(m.register_forward_hook(self._exit))
        self._ctx = []

    def _pack(self, t):
        if t.data_ptr() not in self._params:
            self.bytes += t.numel() * t.element_size()
        return t

    def _enter(self, _mod, _args):
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        ctx.__enter__()
        self._ctx.append(ctx)

    def _exit(self, _mod, _args, _out):
        self._ctx.pop().__exit__(None, None, None)

    def remove(self):
        for h in self._handles:
            h.remove()


def assert_fake_strides(op, *args) -> None:
    """op's real outputs have the strides its fake impl promises for the same arguments (opcheck
    compares shapes and dtypes, not strides; torch.compile asserts them): dims of size 1 excepted."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = op(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    real, fake = (o if isinstance(o, (tuple, list)) else (o,) for o in (real, fake))
    for i, (r, f) in enumerate(zip(real, fake)):
        keep = [d for d in range(r.dim()) if r.shape[d] > 1]
        assert [r.stride(d) for d in keep] == [f.stride(d) for d in keep], (op, i, r.stride(), f.stride())


def assert_compiled_grads_equal(f, *inputs) -> None:
    """f(*inputs).backward() compiled whole (fullgraph, aot_eager) gives the eager call's input grads."""
    import torch

    leaves = [t.clone().requires_grad_() for t in inputs]
    torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves).backward()
    ref = [t.clone().requires_grad_() for t in inputs]
    f(*ref).backward()
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad, b.grad)
