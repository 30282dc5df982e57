"""Host us per call, launches stubbed, for whichever zerofuse tree is on sys.path (old or new)."""
import importlib, os, sys, time, statistics
os.environ["ZEROFUSE_TRITON_ON_CPU"] = "1"
import torch
torch.set_num_threads(1)
import zerofuse
import zerofuse.nn.functional as ZF
sys.path.insert(0, "/work/main/bench")
import bench_optimizers
from zerofuse.optim import FusedAdamW

class NoLaunch:
    def __getitem__(self, grid):
        return lambda *a, **k: None

def med(fn, n):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6

from zerofuse.kernels import attention as KA
KA._attn_fwd_kernel = NoLaunch()
for mod in ("multi_tensor", "optim", "lamb", "l2norm"):
    try:
        m = importlib.import_module("zerofuse.kernels." + mod)
    except ImportError:
        continue
    for name in dir(m):
        if name.endswith("_kernel"):
            setattr(m, name, NoLaunch())
real_foreach = torch._foreach_add_
torch._foreach_add_ = lambda *a, **k: None
out = {}
for grad in (False, True):
    q, k, v = (torch.randn(1, 2, 16, 16).requires_grad_(grad) for _ in range(3))
    f = lambda: ZF.scaled_dot_product_attention(q, k, v, is_causal=True)
    for _ in range(300): f()
    out[f"attention fwd{' grad' if grad else ''}"] = med(f, 3000)
params = bench_optimizers._params(torch.device("cpu"), 1_000_000)
opt = FusedAdamW(params, lr=1e-3, weight_decay=0.01)
for _ in range(10): opt.step()
out["adamw step 1M (91 tensors)"] = med(opt.step, 300)
print(" | ".join(f"{k} {v:.1f}" for k, v in out.items()))
