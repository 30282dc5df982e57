"""Peak bytes of one forward + backward per activation-checkpointing mode (the README's figures):
zerofuse.zero.peak_memory around the step of a fresh model per mode, the collector run before each
(a model of the last mode freed inside the region made it err high). CPU by default.

    python bench/recompute_memory.py [--preset small] [--batch 8] [--seq 128] [--device cpu] [--compile]

--compile: each block compiled by zerofuse.models.recompute.compile_block (inductor; what
zerofuse-train --compile does under checkpointing), one warm-up step before the measured one.
"""
from __future__ import annotations

import argparse
import gc

import torch

import zerofuse
from zerofuse.models import GPT, recompute
from zerofuse.models.presets import config

MiB = 2 ** 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    cfg = config(args.preset, vocab_size=65)
    x = torch.randint(0, 65, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0)).to(args.device)
    print(f"{args.preset}: {cfg.n_layer} layers, dim {cfg.dim}, vocab 65, {args.batch}x{args.seq} tokens, "
          f"{args.device}, torch {torch.__version__}" + (", blocks compiled (inductor)" if args.compile else ""))
    for mode in ("none", "selective", "full"):
        gc.collect()
        model = GPT(cfg, seed=0).to(args.device)
        model.activation_checkpointing = mode
        if args.compile:
            for block in model.blocks:
                recompute.compile_block(block, mode)
            model(x[:, :-1], x[:, 1:])[1].backward()  # compiled here, outside the measured region
            model.zero_grad(set_to_none=True)
            gc.collect()
        grads = sum(p.numel() * p.element_size() for p in model.parameters())
        with zerofuse.zero.peak_memory(args.device) as peak:
            model(x[:, :-1], x[:, 1:])[1].backward()
        print(f"{mode:9s} peak {peak.peak / MiB:7.1f} MiB  (the grads made in it: {grads / MiB:.1f} MiB; "
              f"activations and transients: {(peak.peak - grads) / MiB:.1f} MiB)")
        del model


if __name__ == "__main__":
    main()
