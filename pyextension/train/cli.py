"""The training job's flags: the parser and validate(), which rejects bad flags before any process
starts (UsageError: one line naming the flag, exit code 2) and fills in the derived defaults; the
checks of the model shape, the pipeline and the data are in checks.py."""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch

from .checks import (DEFAULT_MODEL, UsageError, _check, _validate_data, _validate_model, note,  # noqa: F401  (re-exported)
                     _validate_moe, _validate_pipeline, validate_resume)

PROG = "zerofuse-train"
EXIT_USAGE = 2
PRESET_NAMES = ("tiny", "small", "gpt2-124m", "gpt2-350m", "gpt2-774m", "llama-tiny", "llama3-1b", "llama3-8b",
                "moe-tiny", "moe-1b-8x")
OPT_DEFAULTS = {"adamw": dict(lr=6e-3, weight_decay=0.1), "lamb": dict(lr=1e-2, weight_decay=0.01),
                "lars": dict(lr=1.0, weight_decay=1e-4)}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as for our own checks
        self.exit(EXIT_USAGE, f"{PROG}: error: {message}\n")


def _ratio(value: str) -> float | str:
    return value if value == "auto" else float(value)


_ratio.__name__ = "ratio"  # argparse's message: "invalid ratio value: ..."


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Train a GPT with zerofuse (ZeRO 0-3, tensor/sequence and pipeline parallel).")
    g = p.add_argument_group("parallelism")
    g.add_argument("--nproc", type=int, help="local ranks to launch (default: 2 on CPU, the GPU count on CUDA); "
                                             "under torchrun/SLURM the launcher's world size")
    g.add_argument("--dp", type=int, help="data-parallel size (default: nproc / (tp × pp))")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    g.add_argument("--sequence-parallel", action="store_true", help="shard activations along the sequence (tp > 1)")
    g.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=2, help="ZeRO stage (default 2)")
    g.add_argument("--offload", choices=("none", "optimizer", "optimizer+params"), default="none",
                   help="optimizer: fp32 masters and Adam states in host memory, stepped there by the C++ CPU "
                        "kernel as each bucket's grads arrive (ZeRO-Offload; adamw); optimizer+params: "
                        "also the param shards (--zero-stage 3), copied up for each gather")
    g.add_argument("--offload-ratio", type=_ratio, default=1.0,
                   help="with --offload optimizer: the fraction of the shard stepped on the host, the rest on the "
                        "device (twin flow; default 1); auto: measured so that both take equal time")
    g.add_argument("--offload-delayed-update", type=int, metavar="WARMUP",
                   help="with --offload: apply each host step one step late, overlapping the next forward and "
                        "backward (ZeRO-Offload's DPU), after WARMUP undelayed steps; a checkpoint applies the "
                        "pending update, so --ckpt-every is part of the run's recipe")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    g.add_argument("--pp-schedule", choices=("gpipe", "1f1b", "interleaved", "zb"),
                   help="pipeline schedule (default 1f1b; zb: zero-bubble ZB-H1)")
    g.add_argument("--microbatches", type=int,
                   help="micro-batches per step with --pp > 1 (default 2 x pp); global batch = dp x M x --batch")
    g.add_argument("--virtual-stages", type=int, default=1,
                   help="stages per pipeline rank for --pp-schedule interleaved (default 1)")
    g.add_argument("--pp-layout", help="blocks per stage, e.g. 'E,4,4,4,L' (default: balanced by parameters)")
    g.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="default: fp32 on CPU, bf16 on CUDA")
    g.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the model (one rank, ZeRO 0-2, no activation checkpointing) or else each "
                        "transformer block's forward (with --activation-offload, selective checkpointing then "
                        "recomputes the matmuls too)")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction,
                   help="capture the whole step in a CUDA graph and replay it (default: on where it can be: CUDA, "
                        "one rank, ZeRO 0-2, no offload, MoE, fp16 or activation checkpointing; else the reason is "
                        "logged and the step runs eagerly)")
    g.add_argument("--activation-checkpointing", choices=("none", "full", "selective"), default="none",
                   help="recompute in backward: full: each block from its input; selective: all but the matmul "
                        "outputs (default none)")
    g.add_argument("--activation-offload", action="store_true",
                   help="hold what activation checkpointing keeps in pinned host memory until backward")
    g.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a collective may wait for the other ranks before every rank fails (default 600)")
    m = p.add_argument_group("model")
    m.add_argument("--model", choices=PRESET_NAMES,
                   help=f"preset (default: {DEFAULT_MODEL[0]} with {DEFAULT_MODEL[1]}); the flags below override it")
    m.add_argument("--layers", type=int, help="transformer blocks")
    m.add_argument("--heads", type=int, help="attention heads")
    m.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention; default: --heads)")
    m.add_argument("--dim", type=int, help="model width")
    m.add_argument("--seq-len", type=int, help="context length (default: the preset's)")
    e = p.add_argument_group("mixture of experts")
    e.add_argument("--experts", type=int, help="experts per MoE layer (0: dense; default: the preset's)")
    e.add_argument("--top-k", type=int, help="experts per token (default: the preset's, else 2)")
    e.add_argument("--ep", type=int, default=1, help="expert-parallel size: experts split over --ep of the dp ranks "
                                                    "(default 1)")
    e.add_argument("--moe-every", type=int, help="an MoE layer in every N-th block (default: the preset's, else 1)")
    e.add_argument("--capacity", type=float, help="capacity factor: choices past an expert's capacity (per rank and "
                                                  "micro-batch: results depend on --dp) are dropped (0: dropless, "
                                                  "the default)")
    e.add_argument("--router", choices=("softmax", "sigmoid"), help="router scores (default softmax)")
    e.add_argument("--aux-loss", type=float, help="load-balancing aux loss coefficient (default 1e-2)")
    e.add_argument("--aux-scope", choices=("local", "global"),
                   help="aux loss load fractions over each rank's tokens or the DP group's batch (default local)")
    e.add_argument("--z-loss", type=float, help="router z-loss coefficient (default 1e-3)")
    e.add_argument("--bias-rate", type=float,
                   help="aux-loss-free balancing: per-expert bias step per optimizer step (0: off, the default)")
    o = p.add_argument_group("optimisation")
    o.add_argument("--optimizer", choices=tuple(OPT_DEFAULTS), default="adamw")
    o.add_argument("--batch", type=int, default=32, help="sequences per DP rank per micro-batch (default 32)")
    o.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (default 1)")
    o.add_argument("--steps", type=int, default=250, help="optimizer steps (default 250)")
    o.add_argument("--lr", type=float, help="peak learning rate (default: adamw 6e-3, lamb 1e-2, lars 1.0)")
    o.add_argument("--min-lr", type=float, help="the learning rate the cosine decay reaches at --steps (the last step runs just above "
                   "it; default: lr / 10)")
    o.add_argument("--warmup", type=int, default=20, help="linear warmup steps, then the cosine decay (default 20; with --steps < --warmup the "
                   "learning rate never reaches --lr)")
    o.add_argument("--weight-decay", type=float, help="on matrices only (default: adamw 0.1, lamb 0.01, lars 1e-4)")
    o.add_argument("--clip", type=float, default=1.0, help="max global grad norm, 0 = no clipping (default 1.0)")
    o.add_argument("--seed", type=int, default=0)
    d = p.add_argument_group("data and outputs")
    d.add_argument("--data", help="a text file, or GPT-2 token shards: a .bin file (llm.c or nanoGPT format) or a "
                                  "glob of them (default: Tiny Shakespeare shipped in the package, as GPT-2 "
                                  "tokens for the gpt2-* models)")
    d.add_argument("--val-data", help="validation token shards (.bin or a glob; default: the last 10%% of --data)")
    d.add_argument("--tokenizer", choices=("char", "byte", "gpt2"),
                   help="char: vocab = the text's characters (byte when it is not UTF-8); byte; gpt2: GPT-2's "
                        "BPE, the text tokenized once and cached next to it (default: gpt2 for the gpt2-* models "
                        "and token shards, else char)")
    d.add_argument("--document-masking", action="store_true",
                   help="attention within documents: a token sees only the earlier tokens of its own document, "
                        "documents starting at <|endoftext|> (GPT-2 tokens; positions are not reset)")
    d.add_argument("--out", default="out", help="output directory (default ./out)")
    d.add_argument("--ckpt-every", type=int, default=200, help="checkpoint every N steps (0: only at the end)")
    d.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    d.add_argument("--export", action="store_true",
                   help="at the end, write the model as safetensors + config.json into --out/hf (needs safetensors)")
    d.add_argument("--eval-every", type=int, default=50, help="validate every N steps (0: only at start and end)")
    d.add_argument("--eval-batches", type=int, default=10, help="batches of dp x --batch sequences per validation (default 10; the same set for the "
                   "same dp x --batch)")
    d.add_argument("--log-every", type=int,
                   help="read the steps' metrics from the device every N steps (the only host sync between "
                        "them) and, without a terminal, print a progress line (default: steps / 20)")
    d.add_argument("--sample-tokens", type=int, default=200, help="tokens sampled at the end (0: none)")
    p.add_argument("--stop-after", type=int, help=argparse.SUPPRESS)  # tests: act as if SIGTERM arrived after step N
    return p


def validate(args) -> None:
    """Check flags and fill in derived defaults (args.world, dp, device, precision, lr, ...) in place.
    Raises UsageError naming the flag, what was expected and what came."""
    from .launch_env import _launcher_world, slurm_without_srun  # launch_env imports this module's UsageError
    cuda = torch.cuda.is_available()
    args.device = args.device or ("cuda" if cuda else "cpu")
    _check(args.device != "cuda" or cuda, "--device cuda: expected a CUDA device, but torch sees none")
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    _check(not (args.precision == "fp16" and args.device == "cpu"),
           "--precision fp16: expected --device cuda (fp16 is not supported on CPU; use bf16 or fp32)")
    world = _launcher_world()
    if world is None:
        if (batch := slurm_without_srun()) is not None:
            note(batch)
        args.nproc = args.nproc if args.nproc is not None else (torch.cuda.device_count() if args.device == "cuda"
                                                                else 2)
        _check(args.nproc >= 1, f"--nproc: expected >= 1, got {args.nproc}")
        _check(args.device != "cuda" or args.nproc <= torch.cuda.device_count(),
               f"--nproc: expected at most {torch.cuda.device_count()} ranks (one per GPU), got {args.nproc}")
        world = args.nproc
    else:
        _check(args.nproc in (None, world), f"--nproc: the launcher started {world} ranks, got --nproc {args.nproc}")
    args.world = world
    _check(args.tp >= 1, f"--tp: expected >= 1, got {args.tp}")
    _check(args.pp >= 1, f"--pp: expected >= 1, got {args.pp}")
    pp = args.pp
    _check(args.dp is not None or world % (args.tp * pp) == 0,
           f"--tp: expected a divisor of the number of ranks {world} (--nproc), got {args.tp}" if pp == 1 else
           f"--tp/--pp: expected tp × pp ({args.tp} × {pp}) to divide the number of ranks {world} (--nproc)")
    args.dp = args.dp if args.dp is not None else max(1, world // (args.tp * pp))
    _check(args.dp >= 1, f"--dp: expected >= 1, got {args.dp}")
    _check(pp * args.dp * args.tp == world,
           f"--nproc: expected {'' if pp == 1 else 'pp × '}dp × tp = {'' if pp == 1 else f'{pp} × '}{args.dp} × "
           f"{args.tp} = {pp * args.dp * args.tp} ranks, got {world}")
    _validate_pipeline(args)
    for flag in ("batch", "grad_accum", "steps", "eval_batches"):
        _check(getattr(args, flag) >= 1, f"--{flag.replace('_', '-')}: expected >= 1, got {getattr(args, flag)}")
    for flag in ("warmup", "ckpt_every", "eval_every", "sample_tokens", "clip"):
        _check(getattr(args, flag) >= 0, f"--{flag.replace('_', '-')}: expected >= 0, got {getattr(args, flag)}")
    _check(args.log_every is None or args.log_every >= 1, f"--log-every: expected >= 1, got {args.log_every}")
    _check(args.timeout > 0 and math.isfinite(args.timeout), f"--timeout: expected seconds > 0, got {args.timeout}")
    for flag in ("lr", "min_lr", "weight_decay", "clip"):  # inf passes the range checks; the run would be NaN
        value = getattr(args, flag)
        _check(value is None or math.isfinite(value),
               f"--{flag.replace('_', '-')}: expected a finite number, got {value}")
    _validate_optimizer(args)
    _check(args.offload == "none" or args.optimizer == "adamw",  # (the host steps run unit by unit: no trust
           f"--offload {args.offload}: expected --optimizer adamw (LAMB/LARS trust ratios need every unit's "  # ratios;
           f"norms), got --optimizer {args.optimizer}")  # --pp was refused too before 2026-12-07)
    _check(args.offload_ratio == "auto" or 0.0 <= args.offload_ratio <= 1.0,
           f"--offload-ratio: expected a number in [0, 1] or auto, got {args.offload_ratio}")
    dpu = args.offload_delayed_update
    _check(dpu is None or (args.offload != "none" and args.offload_ratio == 1.0 and dpu >= 0),
           f"--offload-delayed-update: expected a warm-up >= 0 with --offload and --offload-ratio 1, got {dpu} with "
           f"--offload {args.offload} --offload-ratio {args.offload_ratio}")
    _check(args.offload_ratio == 1.0 or args.offload == "optimizer",
           f"--offload-ratio: expected --offload optimizer with a ratio below 1, got --offload {args.offload}")
    _check(args.offload != "optimizer+params" or args.zero_stage == 3,
           f"--offload optimizer+params: expected --zero-stage 3 (the param shards go to host memory), got "
           f"--zero-stage {args.zero_stage}")
    _check(not args.activation_offload or args.activation_checkpointing != "none",
           "--activation-offload: expected --activation-checkpointing full or selective, got none")
    _validate_model(args)
    _validate_moe(args)
    _validate_data(args)
    _check(not args.document_masking or args.tokenizer == "gpt2",
           f"--document-masking: expected GPT-2 tokens (--tokenizer gpt2 or token shards: documents start at "
           f"<|endoftext|>), got --tokenizer {args.tokenizer}")
    _check(-2 ** 63 <= args.seed < 2 ** 63, f"--seed: expected a 64-bit integer, got {args.seed}")
    _check(str(args.out).strip() != "", "--out: expected a directory, got an empty path")
    _validate_out(Path(args.out))
    ckpt = Path(args.out) / "ckpt"
    # what the job replaces there must be its own: a user's file or folder at <out>/ckpt was renamed
    # and deleted at the first save (a file: after training, a traceback on every rank; a review,
    # 2026-12-06)
    for path in (Path(f"{ckpt}{s}") for s in ("", ".tmp", ".old")):
        _check(not path.exists() or (path.is_dir() and (not any(path.iterdir()) or (path / "meta.json").is_file()
                                                         or path.name != "ckpt")),
               f"--out: expected {path} to be a zerofuse checkpoint or absent (the job replaces it), got "
               f"{'a file' if not path.is_dir() else 'a folder without meta.json'}; move it or choose another --out")
    if args.export:
        import importlib.util
        _check(importlib.util.find_spec("safetensors") is not None,
               "--export: expected the safetensors package to be installed (pip install safetensors), found none")
        hf = Path(args.out) / "hf"
        _check(not hf.exists() or hf.is_dir(), f"--export: expected {hf} to be a folder or absent, got a file")
        from zerofuse.models import config as model_config
        from zerofuse.models.hf_names import representable
        why = representable(model_config(args.model_name, **args.model_shape))
        if why:  # (GPT-2 and Llama shapes are written as transformers' GPT2LMHeadModel / LlamaForCausalLM)
            note(f"--export: no transformers model computes this model ({why}): {hf} keeps zerofuse's parameter "
                 "names under model_type 'zerofuse-gpt'")
    saved = any((Path(f"{ckpt}{s}") / "meta.json").is_file() for s in ("", ".tmp", ".old"))
    _check(not args.resume or saved, f"--resume: expected a complete checkpoint at {ckpt}, found none")
    if args.resume:
        validate_resume(args, ckpt)
    if saved and not args.resume:  # (its metrics.jsonl was emptied without a word before)
        note(f"--out {args.out} holds a checkpoint: this run starts over, replacing it and its metrics (--resume "
             "continues it)")
    # RANK and WORLD_SIZE (a launcher's) without the rendezvous address: torch's env:// raised its own
    # traceback on every rank (a review's reproduction, 2026-12-06); SLURM's are filled in by launch.py
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT")
               if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "SLURM_PROCID" not in os.environ
               and not os.environ.get(v)]
    _check(not missing, f"environment: RANK and WORLD_SIZE are set (a launcher's), but not {' and '.join(missing)}; "
                        "set them, or unset RANK/WORLD_SIZE and let --nproc launch the ranks here")


def _validate_out(out: Path) -> None:
    """--out: a directory, or a path one can be made at (checked before any rank starts)."""
    _check(not out.exists() or out.is_dir(), f"--out: expected a directory, got {str(out)!r} (a file)")
    parent = out
    while not parent.exists():
        parent = parent.parent
    _check(parent.is_dir(), f"--out: expected a directory, got {str(out)!r} (inside the file {str(parent)!r})")
    _check(os.access(parent, os.W_OK), f"--out: expected a writable directory, got {str(out)!r} "
                                       f"({str(parent)!r} is not writable)")


def _validate_optimizer(args) -> None:
    defaults = OPT_DEFAULTS[args.optimizer]
    args.lr = defaults["lr"] if args.lr is None else args.lr
    _check(args.lr > 0, f"--lr: expected > 0, got {args.lr}")
    args.min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    _check(0 <= args.min_lr <= args.lr, f"--min-lr: expected between 0 and --lr ({args.lr}), got {args.min_lr}")
    args.weight_decay = defaults["weight_decay"] if args.weight_decay is None else args.weight_decay
    _check(args.weight_decay >= 0, f"--weight-decay: expected >= 0, got {args.weight_decay}")
