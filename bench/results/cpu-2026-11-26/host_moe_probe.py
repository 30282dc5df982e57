import time, statistics, os
os.environ.setdefault("ZEROFUSE_TRITON_ON_CPU", "0")
import torch
torch.set_num_threads(1)
from zerofuse.moe import MoE
from zerofuse.ops.moe import moe_permute, moe_unpermute
import zerofuse.ops.moe as M
torch.manual_seed(0)
m = MoE(16, 32, num_experts=4, top_k=2)
x = torch.randn(8, 16, requires_grad=True)
def med(fn, n=1000):
    for _ in range(100): fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter_ns(); fn(); ts.append(time.perf_counter_ns() - t)
    return statistics.median(ts) / 1000
def layer():
    m(x).sum().backward()
experts = torch.randint(0, 4, (8, 2)); w = torch.rand(8, 2, requires_grad=True)
def ops_pair(p, u):
    rows, pos, src, counts = p(x, experts, 4)
    z = u(rows, pos, src, w)
    z.sum().backward()
print("layer fwd+bwd us", round(med(layer), 1))
print("permute+unpermute fwd+bwd (face) us", round(med(lambda: ops_pair(getattr(M, "permute", moe_permute), getattr(M, "unpermute", moe_unpermute))), 1))
