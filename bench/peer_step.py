"""The torch-native peer of zerofuse-train's GPT-2 step (issue: "the same config with torch-native
modules as the peer measured in the same call"): GPT-2 small written with nn.Linear, nn.LayerNorm,
F.scaled_dot_product_attention (causal), tied embeddings, GELU(tanh), bf16 autocast over fp32
params (nanoGPT's recipe), torch.optim.AdamW(fused=True) with the job's hyperparameters (betas 0.9 /
0.95, weight decay 0.1 on matrices), grad-norm clipping at 1.0; optionally torch.compile'd whole.
Random tokens (the step's cost does not depend on them). Prints one JSON line: tokens/s and ms/step
(the timed steps as one block between two synchronisations, as the job times its log windows), MFU
by the job's rule ((6 N + 12 L d S) FLOPs per token against the device's bf16 peak; N every
parameter, the tied embedding once, as GPT.num_params), peak memory.

    python bench/peer_step.py [--compile] [--batch 16] [--steps 30] [--warmup 10] [--device cuda]
    python bench/peer_step.py --device cpu --dim 64 --layers 2 --heads 2 --seq 32 --vocab 128 --batch 2  # dry run
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.h, d // self.h).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, layers: int, heads: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


# zerofuse/train/report.py's PEAK_FLOPS (this peer imports nothing of zerofuse): the first name found
# in the device's name, PCIe and NVL before SXM
PEAK_BF16 = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    torch.manual_seed(0)
    model = GPT(a.vocab, a.seq, a.dim, a.layers, a.heads).to(dev)
    # (tied: once) without the position table, a lookup: as zerofuse's GPT.num_params(matmul=True), MFU's N
    n_params = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), **({"fused": True} if dev.type == "cuda" else {}))
    fwd = torch.compile(model) if a.compile else model
    amp = torch.autocast(dev.type, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, a.vocab, (a.warmup + a.steps, 2, a.batch, a.seq), generator=g)
    if dev.type == "cuda":  # as zerofuse-train's batches: a copy from pageable memory makes the host wait
        data = data.pin_memory()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step(i):
        x, y = data[i].to(dev, non_blocking=True)
        with amp:
            loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    for i in range(a.warmup):
        step(i)
    sync()
    warm_s = time.perf_counter() - t0
    print(f"peer_step: warm-up of {a.warmup} steps{' (with compilation)' if a.compile else ''} took {warm_s:.1f} s",
          flush=True)  # something comes back should the timed steps be cut
    t0 = time.perf_counter()
    for i in range(a.warmup, a.warmup + a.steps):
        loss = step(i)
    sync()
    per_step = (time.perf_counter() - t0) / a.steps
    tok_s = a.batch * a.seq / per_step
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    flops = 6 * n_params + 12 * a.layers * a.dim * a.seq
    res = {"peer": "torch-native GPT-2" + (" + torch.compile" if a.compile else ""), "device": name,
           "torch": torch.__version__, "params": n_params, "batch": a.batch, "seq": a.seq,
           "ms_per_step": per_step * 1e3, "tokens_per_s": tok_s, "mfu": flops * tok_s / peak if peak else None,
           "warmup_s": warm_s, "final_loss": float(loss.detach()),
           "max_memory_allocated_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None}
    assert math.isfinite(res["final_loss"])
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
