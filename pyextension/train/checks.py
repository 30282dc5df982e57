"""The training job's flags that depend on what they describe, checked by cli.validate() before any
process starts: the model shape (preset, sizes, the TP/PP layout rules, MoE), the pipeline's flags,
and the data (text or token shards that exist, parse and hold a window of --seq-len + 1 tokens).
A bad flag raises UsageError: one line naming the flag, what was expected and what came."""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path

from . import tokens as tok
from .data import GPT2_DEFAULT, Corpus, _data_path

# Without --model: "tiny" widened to 1.26M params with a 64-token context: with --batch 32 it takes the
# validation loss on Tiny Shakespeare from 4.2 to ~2.0 in the default 250 steps on two CPU cores.
DEFAULT_MODEL = ("tiny", dict(dim=160, n_head=4, seq_len=64))


class UsageError(Exception):
    """A bad flag: reported as one line, exit code 2."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


def note(message: str) -> None:
    """A one-line note on the flags, printed once a job: by the process that checks them first (the
    --nproc launcher, or one process alone), not again by each rank it starts (a torchrun job: by
    rank 0)."""
    from .launch_env import _dist_env  # (launch_env imports this module's neighbours)

    rank = os.environ.get("RANK") or (_dist_env() or {}).get("RANK", "0")  # torchrun's, or SLURM's (srun sets
    # no RANK: every task printed the note)
    if os.environ.get("ZEROFUSE_TRAIN_LAUNCHED") != "1" and rank == "0":
        print(f"zerofuse-train: note: {message}", file=sys.stderr)


def _validate_pipeline(args) -> None:
    """--pp and its flags: the micro-batches replace --grad-accum; the schedule's own rules."""
    from zerofuse.pipeline.schedules import build_schedule
    v = args.virtual_stages
    _check(v >= 1, f"--virtual-stages: expected >= 1, got {v}")
    if args.pp == 1:  # (a --pp-schedule given at pp 1 was ignored unsaid, and zb's rule refused a run with none)
        _check(args.microbatches is None and v == 1 and args.pp_layout is None and args.pp_schedule is None,
               "--microbatches/--virtual-stages/--pp-layout/--pp-schedule: expected --pp > 1, got --pp 1 "
               "(use --grad-accum)")
        args.pp_schedule = "1f1b"
        return
    args.pp_schedule = args.pp_schedule or "1f1b"
    _check(args.pp_schedule != "zb" or args.activation_checkpointing == "none",
           f"--pp-schedule zb: expected --activation-checkpointing none (its weight-grad pass is a second backward "
           f"through each block: recomputed once per module, or refused by selective), got "
           f"{args.activation_checkpointing}; use --pp-schedule 1f1b or interleaved with checkpointing")
    _check(v == 1 or args.pp_schedule == "interleaved",
           f"--virtual-stages: expected 1 with --pp-schedule {args.pp_schedule} (only interleaved runs several), got {v}")
    _check(args.grad_accum == 1, f"--grad-accum: expected 1 with --pp {args.pp} (--microbatches takes its place), "
                                 f"got {args.grad_accum}")
    args.microbatches = args.microbatches if args.microbatches is not None else 2 * args.pp
    _check(args.microbatches >= 1, f"--microbatches: expected >= 1, got {args.microbatches}")
    _check(v == 1 or args.zero_stage != 3, f"--virtual-stages {v}: expected --zero-stage 0, 1 or 2 (ZeRO-3 shards "
                                           "each stage on its own: one stage per rank)")
    _check(args.pp_schedule != "zb" or args.zero_stage != 3,
           "--pp-schedule zb: expected --zero-stage 0, 1 or 2 (its weight-grad pass needs the weights whole), got 3")
    try:
        build_schedule(args.pp_schedule, args.pp, args.microbatches, v)
    except ValueError as e:
        raise UsageError(f"--microbatches: {e}") from None
    args.grad_accum = args.microbatches  # the data: M micro-batches of --batch sequences per DP rank and step


def _validate_model(args) -> None:
    from zerofuse.models import PRESETS
    name, base = (args.model, {}) if args.model else DEFAULT_MODEL
    shape = {**PRESETS[name], **base}
    for flag, key in (("layers", "n_layer"), ("heads", "n_head"), ("kv_heads", "n_kv_head"), ("dim", "dim"),
                      ("seq_len", "seq_len")):
        value = getattr(args, flag)
        if value is not None:
            _check(value >= 1, f"--{flag.replace('_', '-')}: expected >= 1, got {value}")
            shape[key] = value
    shape.setdefault("n_kv_head", shape["n_head"])
    if args.heads is not None and args.kv_heads is None:
        shape["n_kv_head"] = shape["n_head"]
    heads, kv, dim, tp = shape["n_head"], shape["n_kv_head"], shape["dim"], args.tp
    _check(dim % heads == 0, f"--heads: expected a divisor of the model width {dim} (--dim), got {heads}")
    _check(heads % kv == 0, f"--kv-heads: expected a divisor of the head count {heads} (--heads), got {kv}")
    _check(heads % tp == 0, f"--tp: expected a divisor of the head count {heads} (--heads), got {tp}")
    _check(kv % tp == 0, f"--tp: expected a divisor of the key/value head count {kv} (--kv-heads), got {tp}")
    _check(not args.sequence_parallel or tp > 1, f"--sequence-parallel: expected --tp > 1, got --tp {tp}")
    _check(not args.sequence_parallel or shape["seq_len"] % tp == 0,
           f"--seq-len: expected a multiple of --tp ({tp}) with --sequence-parallel, got {shape['seq_len']}")
    if args.pp > 1:
        stages, layers = args.pp * args.virtual_stages, shape["n_layer"]
        _check(not shape.get("tie_embeddings") or args.zero_stage != 3,
               f"--zero-stage: the {name} model ties its embedding and output layer, whose weight the first "
               f"pipeline stage sends to the last each step whole: expected 0, 1 or 2 with --pp {args.pp}, got 3")
        if args.pp_layout is None:
            _check(stages <= layers + 2, f"--pp: expected at most {layers + 2} stages for {layers} layers (--layers), "
                                         f"got pp × virtual stages = {stages}")
        else:
            from zerofuse.pipeline.stage import parse_layout
            try:
                plan = parse_layout(args.pp_layout, layers)
            except ValueError as e:
                raise UsageError(f"--pp-layout: {e}") from None
            _check(len(plan) == stages, f"--pp-layout: expected {stages} stages (pp × virtual stages), got "
                                        f"{len(plan)} in {args.pp_layout!r}")
            empty = [i for i, (e, n, ell) in enumerate(plan) if not (e or n or ell)]
            # (an empty one passed: ZeRO refused its rank's param-less stage, or its grads were never reduced)
            _check(not empty, f"--pp-layout: expected every stage to hold something (a block, E or L), got "
                              f"stage(s) {empty} empty in {args.pp_layout!r}")
    args.model_name, args.model_shape = name, shape


_MOE_FLAGS = (("experts", "moe_experts"), ("top_k", "moe_top_k"), ("moe_every", "moe_every"),
              ("capacity", "moe_capacity"), ("router", "moe_router"), ("aux_loss", "moe_aux_loss"),
              ("z_loss", "moe_z_loss"), ("bias_rate", "moe_bias_rate"), ("aux_scope", "moe_aux_scope"))


def _validate_moe(args) -> None:
    """The mixture-of-experts flags into the model shape; --ep's layout rules."""
    shape = args.model_shape
    for flag, key in _MOE_FLAGS:
        if getattr(args, flag) is not None:
            shape[key] = getattr(args, flag)
    experts, ep = shape.get("moe_experts", 0), args.ep
    _check(experts >= 0, f"--experts: expected >= 0, got {experts}")
    if experts == 0:
        _check(ep == 1 and all(getattr(args, f) is None for f, _ in _MOE_FLAGS[1:]),
               "--ep/--top-k/--moe-every/--capacity/--router/--aux-loss/--z-loss/--bias-rate/--aux-scope: expected "
           "--experts > 0 "
               "(or an MoE --model such as moe-tiny)")
        return
    k = shape.get("moe_top_k", 2)
    _check(1 <= k <= experts, f"--top-k: expected between 1 and --experts ({experts}), got {k}")
    every = shape.get("moe_every", 1)
    _check(1 <= every <= shape["n_layer"], f"--moe-every: expected between 1 and the layer count {shape['n_layer']}, "
                                           f"got {every}")
    for flag in ("capacity", "aux_loss", "z_loss", "bias_rate"):
        v = shape.get(f"moe_{flag}", 0.0)
        _check(v >= 0 and math.isfinite(v), f"--{flag.replace('_', '-')}: expected a finite number >= 0, got {v}")
    _check(ep >= 1, f"--ep: expected >= 1, got {ep}")
    _check(args.dp % ep == 0, f"--ep: expected a divisor of the data-parallel size {args.dp} (--dp), got {ep}")
    _check(experts % ep == 0, f"--ep: expected a divisor of the expert count {experts} (--experts), got {ep}")
    _check(ep == 1 or args.optimizer == "adamw", f"--optimizer: expected adamw with --ep > 1 (a trust ratio over a "
                                                 f"rank's experts differs from one process's), got {args.optimizer}")


READ_HERE_BYTES = 64 << 20  # a text below this is tokenized by the checks (split sizes, vocabulary)


def _validate_data(args) -> None:
    gpt2_model = args.model_name.startswith("gpt2-")
    if args.data is None and (args.tokenizer == "gpt2" or (gpt2_model and args.tokenizer is None)):
        # the shipped shards (any model with --tokenizer gpt2 tokenized the shipped text into the package
        # before); a --val-data given stays (it was replaced by the shipped split, unsaid)
        args.data, args.val_data = str(GPT2_DEFAULT[0]), args.val_data or str(GPT2_DEFAULT[1])
    shards = args.data is not None and tok.is_shard_spec(args.data)
    args.tokenizer = args.tokenizer or ("gpt2" if shards or gpt2_model else "char")
    _check(not shards or args.tokenizer == "gpt2",
           f"--tokenizer: --data {args.data!r} " + ("is a glob pattern: it names GPT-2 token shards (.bin)"
                                                    if shards and tok._is_pattern(args.data) else "holds GPT-2 token ids")
           + f", expected --tokenizer gpt2 (or none), got {args.tokenizer} (char and byte read one text file)")
    _check(args.val_data is None or args.tokenizer == "gpt2",
           f"--val-data: expected GPT-2 tokens (--tokenizer gpt2 or token shards), got --tokenizer {args.tokenizer}")
    need = args.model_shape["seq_len"] + 1  # one window of inputs and targets (data.Sampler)
    if args.tokenizer == "gpt2":
        return _validate_tokens(args, shards, need)
    path = _data_path(args)
    _check(path.is_file(), f"--data: expected a readable text file, got {str(path)!r} "
                           f"({'a directory' if path.is_dir() else 'no such file'})")
    _check(os.access(path, os.R_OK), f"--data: expected a readable text file, got {str(path)!r} (not readable)")
    args.data = str(path)
    size = path.stat().st_size
    if size < READ_HERE_BYTES:  # small enough to tokenise here: check the exact split sizes
        corpus = Corpus.load(path, args.tokenizer)
        ok, got = len(corpus.val[0]) >= need, f"{len(corpus.val[0])} validation tokens"
        args.corpus_identity = corpus.identity()
    else:
        ok, got = True, ""
    _check(ok, f"--data: expected at least {need} validation tokens (10% of the file) for --seq-len "
               f"{args.model_shape['seq_len']}, got {got}")


def _validate_tokens(args, shards: bool, need: int) -> None:
    """GPT-2 tokens: the shards exist and parse, their ids fit the vocabulary, train and validation
    each hold a window of --seq-len + 1 tokens. A text is tokenized here, once, before any rank starts
    (under torchrun every rank gets here: the cache's lock lets one of them tokenize)."""
    if not shards:
        path = _data_path(args)
        _check(path.is_file() and os.access(path, os.R_OK),
               f"--data: expected a readable text file or token shards (.bin), got {str(path)!r}")
        _check(tok.gpt2_available(), f"--tokenizer gpt2: expected the GPT-2 BPE to be installed ({tok.GPT2_INSTALL})")
        try:
            args.data = str(tok.tokenize_cached(path, fallback_dir=args.out))
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.val_data is not None and not tok.is_shard_spec(args.val_data):
        # a --val-data text as --data's: its cache in --out when its folder is not writable (it went to
        # the working directory, and a read-only text given as both was trained and validated on
        # unrefused: the two caches were different files; a review's reproduction, 2026-12-07)
        val = Path(args.val_data)
        _check(val.is_file() and os.access(val, os.R_OK),
               f"--val-data: expected a readable text file or token shards (.bin), got {str(val)!r}")
        _check(tok.gpt2_available(), f"--tokenizer gpt2: expected the GPT-2 BPE to be installed ({tok.GPT2_INSTALL})")
        try:
            cache = tok.tokenize_cached(val, fallback_dir=args.out, flag="--val-data")
        except ValueError as e:
            raise UsageError(str(e)) from None
        if not shards:  # the same text (by content: the caches' names hold its hash) on both flags
            _check(cache.name.rsplit(".gpt2-", 1)[1] != Path(args.data).name.rsplit(".gpt2-", 1)[1],
                   f"--val-data: expected a text that is not --data's, got {str(val)!r} (the same text as --data)")
        args.val_data = str(cache)
    try:
        corpus = Corpus.load(args.data, "gpt2", args.val_data)
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None
    args.corpus_identity = corpus.identity()
    if args.document_masking and not any(tok.GPT2_EOT in a[:1 << 20] for a in corpus.train):
        note(f"--document-masking: no <|endoftext|> ({tok.GPT2_EOT}) in the first 2^20 tokens of any --data shard: "
             "one document each, attention as without the flag (a text tokenized by --tokenizer gpt2 has none: a "
             "literal '<|endoftext|>' is text)")
    seq = args.model_shape["seq_len"]
    for part, flag in (("train", "--data"), ("val", "--val-data" if args.val_data else "--data")):
        for arr in getattr(corpus, part):
            try:
                tok.check_ids(arr, getattr(arr, "filename", None) or args.data, flag=flag)
            except ValueError as e:
                raise UsageError(str(e)) from None
        longest = max(len(a) for a in getattr(corpus, part))
        split = (" (without --val-data, validation is the last 10% of the last --data file in sorted order: "
                 "name a validation file with --val-data)") if part == "val" and not args.val_data else ""
        _check(longest >= need, f"{flag}: expected a {part} shard of at least {need} tokens for --seq-len {seq}, "
                                f"got at most {longest}{split}")


# GPTConfig fields that shape the params, with the flag that sets each (the others: --model's preset)
_SHAPE_FLAGS = {"n_layer": "--layers", "n_head": "--heads", "n_kv_head": "--kv-heads", "dim": "--dim",
                "seq_len": "--seq-len", "moe_experts": "--experts", "moe_every": "--moe-every"}
_SHAPE_FIELDS = (*_SHAPE_FLAGS, "mlp_ratio", "mlp_hidden", "mlp", "norm", "bias", "tie_embeddings", "pos", "rope_base",
                 "rope_scaling")


def _vocab_text(identity: dict | None) -> str:
    chars = (identity or {}).get("chars")
    return f"{(identity or {}).get('kind')} tokens" + (f", {len(chars)} symbols" if chars else "")


def validate_resume(args, ckpt) -> None:
    """--resume: the checkpoint's model has the shape these flags build and --steps reaches its step
    (each rank's load refused them with a traceback of its own). Read from the checkpoint's ``extra`` (the job's config); the
    sequence length only with learned positions (rotary ones take any). Anything unreadable is left
    to the ranks' load, which reports it."""
    from zerofuse.checkpoint.sources import Full
    from zerofuse.models import config
    try:
        extra = Full(str(ckpt)).common().get("extra") or {}
    except (ValueError, OSError, KeyError):
        return
    step = extra.get("step")
    _check(not isinstance(step, int) or args.steps >= step,
           f"--steps: expected at least the checkpoint's step {step} to resume, got {args.steps}")
    try:  # (each rank's load refused another update rule with a traceback, exit code 1)
        kind = (Full(str(ckpt)).meta.get("optimizer") or {}).get("kind")
    except (ValueError, OSError, KeyError, AttributeError):
        kind = None
    _check(kind is None or kind == args.optimizer,
           f"--optimizer: the checkpoint at {ckpt} was trained with {kind}, got {args.optimizer}; expected the "
           "optimizer of the run that wrote it")
    saved = extra.get("config")
    if not isinstance(saved, dict):
        return
    # a config saved before GPTConfig had rope_scaling (2026-12-06) had none: compared as None (a plain
    # llama3-1b run resumed silently under the scaled frequencies the preset now has; a review's reproduction)
    saved = {"rope_scaling": None, **saved}
    vocab, want = getattr(args, "corpus_identity", None), extra.get("tokenizer")
    # a text too large to read here: its kind alone (--tokenizer char reads a text that is not UTF-8 as
    # bytes); the rank's load failed on the embedding's shape with a traceback, exit code 1, before
    kinds = {"char": ("char", "byte")}.get(args.tokenizer, (args.tokenizer,))
    if vocab is None and isinstance(want, dict) and want.get("kind") not in kinds:
        vocab = {"kind": args.tokenizer, "chars": None}
    _check(vocab is None or want is None or vocab == want,
           f"--resume: the checkpoint at {ckpt} was trained on another vocabulary ({_vocab_text(want)}) than "
           f"--data {args.data} ({_vocab_text(vocab)}); expected the data of the run that wrote it")
    shape = {**args.model_shape, "vocab_size": saved.get("vocab_size", 0)}
    mine = dataclasses.asdict(config(args.model_name, **shape))
    rope = saved.get("pos") == mine["pos"] == "rope"
    diff = [f for f in _SHAPE_FIELDS if f in saved and saved[f] != mine[f] and not (f == "seq_len" and rope)]
    _check(not diff, f"--resume: the checkpoint at {ckpt} holds another model: " + ", ".join(
        f"{_SHAPE_FLAGS[f]} {mine[f]} (the checkpoint's: {saved[f]})" if f in _SHAPE_FLAGS
        else f"{f} {mine[f]!r} (the checkpoint's: {saved[f]!r}; --model {args.model_name})" for f in diff)
        + "; expected the flags of the run that wrote it")
    # the router's balancing bias is a buffer of the model only with --bias-rate > 0: switched on or off
    # at a resume, each rank's load failed on a missing or unexpected buffer (a review's reproduction)
    if mine.get("moe_experts") and "moe_bias_rate" in saved:
        had, has = saved["moe_bias_rate"] > 0, mine["moe_bias_rate"] > 0
        _check(had == has, f"--bias-rate: the checkpoint at {ckpt} was trained {'with' if had else 'without'} "
               f"aux-loss-free balancing (--bias-rate {saved['moe_bias_rate']:g}), got {mine['moe_bias_rate']:g}; "
               "expected a rate > 0 on both or on neither (the bias is saved only when it is updated)")
