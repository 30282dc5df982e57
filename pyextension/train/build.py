"""What one rank of the training job builds before its first step (Trainer._setup): the process
group and mesh, the corpus, the model (on meta under ZeRO-3 or a pipeline), ZeRO, compilation, the
optimizer and its schedule (resumed from --out's checkpoint with --resume), the samplers, the
step metrics and the log."""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from .cli import PROG
from .data import Corpus, Sampler, Validation, shards_digest, validation_key
from .launch import _init_distributed, _StopFlag
from .metrics import StepMetrics, StopVote
from .report import RankZeroLog


def lr_lambda(args):
    """Multiplier of --lr at a step: linear warmup, then cosine decay to --min-lr at --steps."""
    floor = args.min_lr / args.lr

    def f(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def setup(t) -> None:
    """Trainer._setup: everything one rank builds before its first step, on the Trainer t."""
    import torch.distributed as dist
    import zerofuse  # noqa: F401  (loads the extension before the model)
    from zerofuse import zero
    from zerofuse.models import GPT, config
    from zerofuse.parallel import init_mesh
    from . import T0  # measured when the package was imported

    args = t.args
    t.t_start = float(os.environ.get("ZEROFUSE_TRAIN_T0", T0))
    t.stop = _StopFlag()
    t.device = _init_distributed(args, t.env)
    t.rank, t.world = dist.get_rank(), dist.get_world_size()
    t.mesh = init_mesh(dp=args.dp, tp=args.tp, pp=args.pp, ep=args.ep)
    t.corpus = Corpus.load(args.data, args.tokenizer, args.val_data)
    # a character vocabulary is not padded for tp (the vocab-parallel layers split an uneven one),
    # so the model and its checkpoints are the same at every tp; GPT-2's is padded to 50304
    t.cfg = config(args.model_name, **{**args.model_shape, "vocab_size": t.corpus.model_vocab})
    kw = {"tp_group": t.mesh.tp_group, "sequence_parallel": args.sequence_parallel} if args.tp > 1 else {}
    if t.cfg.moe_experts:
        kw.update(ep_group=t.mesh.ep_group, edp_group=t.mesh.edp_group, dp_group=t.mesh.dp_group)
    t.pp = None
    if args.zero_stage == 3 or args.pp > 1:  # built on meta: never whole on a rank
        with torch.device("meta"):
            model = GPT(t.cfg, seed=args.seed, **kw)
    else:
        model = GPT(t.cfg, seed=args.seed, **kw).to(t.device)
    model.activation_checkpointing = args.activation_checkpointing
    model.activation_offload = args.activation_offload
    t.n_params = model.num_params()  # unsharded
    t.n_active_params = model.num_params(active=True)
    t.n_flop_params = model.num_params(active=True, matmul=True)  # MFU's N (no lookup-only tables)
    if args.pp > 1:  # this rank's stages only, ZeRO over the stage's DP group (train/pipeline.py)
        from .pipeline import PipelineJob
        t.pp = PipelineJob(t, model)
        t.model = t.pp.module
    else:
        # (its GPT reads each param only in the forward of a module holding it: the gathers overlap it)
        t.model = zero.parallelize(model, stage=args.zero_stage, group=t.mesh.dp_group, param_gather="module",
                                   precision=args.precision, device=t.device,
                                   offload=None if args.offload == "none" else args.offload,
                                   **({"offload_ratio": args.offload_ratio} if args.offload != "none" else {}))
        t.model._zerofuse_zero.backwards_end_at_sync_points()  # (loop.py: a no_sync() window per micro-batch)
    t.compiled = None
    if args.compile:  # the whole model where ZeRO has no forward hooks (a world of one), else each block;
        # each block under activation checkpointing too: a whole compiled GPT's "full" recompute held more
        # than no checkpointing (small preset, 8 x 128 tokens: 181.8 against 152.4 MiB; per block 61.7,
        # eager 67.7: a review's measurement, 2026-12-06)
        if t.world == 1 and args.zero_stage != 3 and args.activation_checkpointing == "none":
            t.model.compile()
            t.compiled = "the whole model"
        else:  # (by type: a pipeline stage with the embedding or the head alone has no .blocks; it raised)
            from zerofuse.models import recompute
            from zerofuse.models.gpt import Block
            blocks = [m for m in t.model.modules() if isinstance(m, Block)]
            kept = [recompute.compile_block(block, args.activation_checkpointing, args.activation_offload)
                    for block in blocks]  # (selective: the checkpoint inside the compiled forward; recompute.py)
            t.recompute_compiled = next((k for k in kept if k != "eager"), None)
            if not blocks:
                t.compiled = "nothing (this rank's stage has no transformer block)"
            elif "eager" in kept:  # (MoE blocks under checkpointing: recompute.compile_block)
                t.compiled = ("each dense transformer block (MoE blocks run eagerly under activation checkpointing)"
                              if t.recompute_compiled else "nothing (MoE blocks run eagerly under activation "
                                                           "checkpointing)")
            else:
                t.compiled = "each transformer block"
    t.opt = zero.Optimizer(t.model, args.optimizer, param_groups=param_groups(t.model),
                           max_grad_norm=args.clip, **hyper(args),
                           delayed_update=args.offload_delayed_update is not None,
                           delayed_update_warmup=args.offload_delayed_update or 0)
    t.sched = torch.optim.lr_scheduler.LambdaLR(t.opt, lr_lambda(args))
    from .graphs import StepGraph, reason_not
    t.graphs_off = "--no-cuda-graphs" if args.cuda_graphs is False else reason_not(t)
    t.graphs = StepGraph(t) if t.graphs_off is None else None
    seq = t.cfg.seq_len
    vocab = t.corpus.vocab_size
    t.train_data = Sampler(t.corpus.train, seq, args.batch, args.grad_accum, args.dp, t.mesh.dp_rank, args.seed,
                           vocab=vocab)
    t.val_data = Validation(Sampler(t.corpus.val, seq, args.batch, 1, 1, 0, args.seed, vocab=vocab,
                                    flag="--val-data" if args.val_data else "--data"),
                            args.eval_batches, args.batch, args.dp, t.mesh.dp_rank, args.seed)
    t.out = Path(args.out)
    t.ckpt = t.out / "ckpt"
    t.initial_val_loss = None  # the run's step-0 val loss (a resume carries it in the checkpoint's extra)
    t.step = resume(t) if args.resume else 0
    t.start_step = t.step
    t.memory = None
    t.launches = None  # counted at the second step (train/launches.py)
    t.stopped = 0  # the signal every rank agreed to stop on
    t.log_every = args.log_every or max(1, args.steps // 20)
    tokens = args.dp * args.batch * args.grad_accum * seq
    t.metrics = StepMetrics(t.device, t.world, tokens)
    t.vote = StopVote(t.world, t.device)
    t.moe = None
    t._a2a_last, t._a2a_bytes_last = 0.0, 0  # the all-to-all counters at the last log point
    if t.cfg.moe_experts:
        from zerofuse.models.moe import Stats, layers
        # (the whole GPT's: a pipeline stage records its own; tp without sequence parallelism: every
        # TP rank routes the same tokens)
        t.moe = Stats(model.moe_layers, t.device, replicas=1 if args.sequence_parallel else args.tp)
        t.moe_routers = [m.router for m in layers(t.model)]  # this rank's
        if t.pp is not None:
            t.pp.record_moe(t.moe, model.moe_layers)
    t.log = RankZeroLog(t) if t.rank == 0 else None


def param_groups(model):
    """No weight decay for vectors (norms, biases), as GPT-2 and nanoGPT."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay}]
    if other:
        groups.append({"params": other, "weight_decay": 0.0})
    return groups


def hyper(args) -> dict:
    kw = dict(lr=args.lr, weight_decay=args.weight_decay)
    if args.optimizer in ("adamw", "lamb"):
        kw["betas"] = (0.9, 0.95)
    return kw


def resume(t) -> int:
    """The step to go on from, after loading --out's checkpoint into t's model, optimizer and schedule."""
    from zerofuse import checkpoint
    mine = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in t.opt.param_groups]
    extra = checkpoint.load(str(t.ckpt), t.model, t.opt)
    if extra["tokenizer"] != t.corpus.identity():
        raise ValueError(f"{PROG}: --resume: the checkpoint at {t.ckpt} was trained on a different vocabulary "
                         f"({extra['tokenizer']['kind']} tokenizer) than --data {t.args.data}")
    step, args = int(extra["step"]), t.args
    t.initial_val_loss = extra.get("initial_val_loss")  # (None from a checkpoint saved before it was kept)
    if args.steps < step:  # (== : resumed at the end, nothing to train)
        raise ValueError(f"{PROG}: --steps: expected at least the checkpoint's step {step} to resume, got {args.steps}")
    t.sched.load_state_dict(extra["scheduler"])
    # this run's schedule (--lr, --min-lr, --warmup, --steps) at the resumed step: the loaded state
    # carried the checkpoint's base lr (a new --lr was ignored while --min-lr applied) and its last
    # lr (the old schedule's, for a step); unchanged flags give the same lr bit for bit
    saved_lr = t.sched.base_lrs[0]
    t.sched.base_lrs = [args.lr for _ in t.opt.param_groups]
    lrs = [base * f(t.sched.last_epoch) for base, f in zip(t.sched.base_lrs, t.sched.lr_lambdas)]
    t.sched._last_lr = lrs
    for g, lr in zip(t.opt.param_groups, lrs):
        g["lr"] = lr
    t.notes = []
    # this run's other options (--weight-decay): the load restored the checkpoint's
    for gi, (g, want) in enumerate(zip(t.opt.param_groups, mine)):
        for k, v in want.items():
            if k in g and g[k] != v:
                if k == "weight_decay" and gi == 0:
                    t.notes.append(f"--resume: --weight-decay {v:g} (the checkpoint's run: {g[k]:g}) from step {step}")
                g[k] = v
    if saved_lr != args.lr:
        t.notes.append(f"--resume: --lr {args.lr:g} (the checkpoint's run: {saved_lr:g}) from step {step}")
    if extra.get("seed") is not None and extra["seed"] != args.seed:
        t.notes.append(f"--resume: --seed {args.seed} differs from the checkpoint's run ({extra['seed']}): its "
                       "batches and validation set are not those the run would have had")
    if extra.get("precision") not in (None, args.precision):  # (bf16's rounding from here on: not a resume)
        t.notes.append(f"--resume: --precision {args.precision} (the checkpoint's run: {extra['precision']}) from "
                       f"step {step}")
    was_val, now_val = extra.get("validation"), validation_key(args, t.val_data)
    if was_val is not None and list(was_val) != now_val:
        data = "" if list(was_val[3:]) == now_val[3:] else ", other validation data"
        t.notes.append(f"--resume: the validation set is not the checkpoint's run's (--eval-batches {now_val[0]} x "
                       f"dp x --batch {now_val[1]}, --seed {now_val[2]}; its run: {was_val[0]} x {was_val[1]}, --seed "
                       f"{was_val[2]}{data}): val losses from step {step} compare with its only as other samples, and "
                       "its initial val loss is not reported")
        t.initial_val_loss = None
    # the sampler draws accum x dp x batch window starts per step: the same global batch at any split
    # of that product (it named a --grad-accum 2 on one rank resuming a 2-rank run as other batches)
    was = extra.get("batch")
    if was is not None and was[0] * was[1] * was[2] != args.grad_accum * args.dp * args.batch:
        t.notes.append(f"--resume: --grad-accum {args.grad_accum} x dp {args.dp} x --batch {args.batch} (the "
                       f"checkpoint's run: {was[0]} x {was[1]} x {was[2]}) from step {step}: its batches are not "
                       "those the run would have had")
    if extra.get("train_data") not in (None, shards_digest(t.train_data)):  # (same vocabulary: checked above)
        t.notes.append(f"--resume: --data {args.data} is not the checkpoint's run's training data (another file, or "
                       f"a glob that matches other shards): its batches from step {step} are not those the run would "
                       "have had")
    return step
