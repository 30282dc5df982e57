"""``python -m zerofuse.train`` / ``zerofuse-train``: train a GPT on a text file with ZeRO (stage 0-3)
and tensor parallelism, on CPUs (gloo) or GPUs (NCCL).

Launch (one code path, three ways in):
- ``--nproc N`` with no launcher around it: torch's elastic launcher (torchrun's API: ``elastic_launch``,
  c10d rendezvous on localhost) starts N local ranks, each running this module unchanged; the
  launcher forwards SIGINT/SIGTERM to them. ``--nproc 1``: runs in this process as a world of one.
- ``torchrun ... -m zerofuse.train`` (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR in the environment),
- ``srun python -m zerofuse.train`` (SLURM_PROCID/SLURM_NTASKS/... mapped to torch's variables).
Bad flags are rejected before any process starts (exit code 2, one line naming the flag).

Determinism: a step's batches are a pure function of (seed, step) (the global batch is drawn from one
generator, each DP rank takes its slice), the LR schedule is restored from the checkpoint, so
``--resume`` continues with the losses an uninterrupted run would have had. A signal on any rank
stops every rank at the next step boundary (the stop flags are all-reduced with the step's loss),
which then saves a checkpoint and exits 128 + signal number.

Outputs in --out: metrics.jsonl (one line per step), summary.json, loss.png, TensorBoard events
(when tensorboard is installed), ckpt/ (the latest checkpoint, zerofuse.checkpoint format).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import re
import resource
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

T0 = time.time()  # the job's start for the summary's wall time (before torch's import)

import numpy as np  # noqa: E402
import torch  # noqa: E402

PROG = "zerofuse-train"
EXIT_USAGE = 2
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # the elastic agent's
PRESET_NAMES = ("tiny", "small", "gpt2-124m", "gpt2-350m")
# Without --model: "tiny" widened to 1.26M params with a 64-token context: with --batch 32 it takes the
# validation loss on Tiny Shakespeare from 4.2 to ~2.0 in the default 250 steps on two CPU cores.
DEFAULT_MODEL = ("tiny", dict(dim=160, n_head=4, seq_len=64))
OPT_DEFAULTS = {"adamw": dict(lr=6e-3, weight_decay=0.1), "lamb": dict(lr=1e-2, weight_decay=0.01),
                "lars": dict(lr=1.0, weight_decay=1e-4)}
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 tensor-core peaks
VAL_FRACTION = 0.1


class UsageError(Exception):
    """A bad flag: reported as one line, exit code 2."""


# ---------------------------------------------------------------------------------------------- flags

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as for our own checks
        self.exit(EXIT_USAGE, f"{PROG}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Train a GPT with zerofuse (ZeRO 0-3, tensor/sequence parallel).")
    g = p.add_argument_group("parallelism")
    g.add_argument("--nproc", type=int, help="local ranks to launch (default: 2 on CPU, the GPU count on CUDA); "
                                             "under torchrun/SLURM the launcher's world size")
    g.add_argument("--dp", type=int, help="data-parallel size (default: nproc / tp)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    g.add_argument("--sequence-parallel", action="store_true", help="shard activations along the sequence (tp > 1)")
    g.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=2, help="ZeRO stage (default 2)")
    g.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="default: fp32 on CPU, bf16 on CUDA")
    g.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    g.add_argument("--compile", action="store_true", help="torch.compile each transformer block's forward")
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
    o = p.add_argument_group("optimisation")
    o.add_argument("--optimizer", choices=tuple(OPT_DEFAULTS), default="adamw")
    o.add_argument("--batch", type=int, default=32, help="sequences per DP rank per micro-batch (default 32)")
    o.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (default 1)")
    o.add_argument("--steps", type=int, default=250, help="optimizer steps (default 250)")
    o.add_argument("--lr", type=float, help="peak learning rate (default: adamw 6e-3, lamb 1e-2, lars 1.0)")
    o.add_argument("--min-lr", type=float, help="final learning rate of the cosine decay (default: lr / 10)")
    o.add_argument("--warmup", type=int, default=20, help="linear warmup steps (default 20)")
    o.add_argument("--weight-decay", type=float, help="on matrices only (default: adamw 0.1, lamb 0.01, lars 1e-4)")
    o.add_argument("--clip", type=float, default=1.0, help="max global grad norm, 0 = no clipping (default 1.0)")
    o.add_argument("--seed", type=int, default=0)
    d = p.add_argument_group("data and outputs")
    d.add_argument("--data", help="a text file (default: the Tiny Shakespeare copy shipped in the package)")
    d.add_argument("--tokenizer", choices=("char", "byte"), default="char",
                   help="char: vocab = the file's characters (falls back to byte when the file is not UTF-8)")
    d.add_argument("--out", default="out", help="output directory (default ./out)")
    d.add_argument("--ckpt-every", type=int, default=200, help="checkpoint every N steps (0: only at the end)")
    d.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    d.add_argument("--export", action="store_true",
                   help="at the end, write the model as safetensors + config.json into --out/hf (needs safetensors)")
    d.add_argument("--eval-every", type=int, default=50, help="validate every N steps (0: only at start and end)")
    d.add_argument("--eval-batches", type=int, default=10, help="batches per validation (default 10)")
    d.add_argument("--log-every", type=int,
                   help="without a terminal: a progress line every N steps (default: steps / 20)")
    d.add_argument("--sample-tokens", type=int, default=200, help="tokens sampled at the end (0: none)")
    p.add_argument("--stop-after", type=int, help=argparse.SUPPRESS)  # tests: act as if SIGTERM arrived after step N
    return p


def _data_path(args) -> Path:
    if args.data is not None:
        return Path(args.data)
    import zerofuse
    return Path(zerofuse.__file__).parent / "data" / "tinyshakespeare.txt"


def _launcher_world() -> int | None:
    env = _dist_env()
    return None if env is None else int(env["WORLD_SIZE"])


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


def validate(args) -> None:
    """Check flags and fill in derived defaults (args.world, dp, device, precision, lr, ...) in place.
    Raises UsageError naming the flag, what was expected and what came."""
    cuda = torch.cuda.is_available()
    args.device = args.device or ("cuda" if cuda else "cpu")
    _check(args.device != "cuda" or cuda, "--device cuda: expected a CUDA device, but torch sees none")
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    _check(not (args.precision == "fp16" and args.device == "cpu"),
           "--precision fp16: expected --device cuda (fp16 is not supported on CPU; use bf16 or fp32)")
    world = _launcher_world()
    if world is None:
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
    _check(args.dp is not None or world % args.tp == 0,
           f"--tp: expected a divisor of the number of ranks {world} (--nproc), got {args.tp}")
    args.dp = args.dp if args.dp is not None else max(1, world // args.tp)
    _check(args.dp >= 1, f"--dp: expected >= 1, got {args.dp}")
    _check(args.dp * args.tp == world, f"--nproc: expected dp × tp = {args.dp} × {args.tp} = {args.dp * args.tp} "
                                       f"ranks, got {world}")
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
    _validate_model(args)
    _validate_data(args)
    _validate_out(Path(args.out))
    ckpt = Path(args.out) / "ckpt"
    if args.export:
        import importlib.util
        _check(importlib.util.find_spec("safetensors") is not None,
               "--export: expected the safetensors package to be installed (pip install safetensors), found none")
    _check(not args.resume or any((Path(f"{ckpt}{s}") / "meta.json").is_file() for s in ("", ".tmp", ".old")),
           f"--resume: expected a complete checkpoint at {ckpt}, found none")


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
    args.model_name, args.model_shape = name, shape


def _validate_data(args) -> None:
    path = _data_path(args)
    _check(path.is_file(), f"--data: expected a readable text file, got {str(path)!r} "
                           f"({'a directory' if path.is_dir() else 'no such file'})")
    _check(os.access(path, os.R_OK), f"--data: expected a readable text file, got {str(path)!r} (not readable)")
    args.data = str(path)
    need = args.model_shape["seq_len"] + 2
    size = path.stat().st_size
    if size < 64 * 2 ** 20:  # small enough to tokenise here: check the exact split sizes
        corpus = Corpus.load(path, args.tokenizer)
        ok, got = len(corpus.val) >= need, f"{len(corpus.val)} validation tokens"
    else:
        ok, got = True, ""
    _check(ok, f"--data: expected at least {need} validation tokens (10% of the file) for --seq-len "
               f"{args.model_shape['seq_len']}, got {got}")


# ---------------------------------------------------------------------------------------------- data

@dataclasses.dataclass
class Corpus:
    """Character-level tokens of a UTF-8 text (vocab = its sorted characters), or bytes (vocab 256)
    for a file that is not UTF-8 or with --tokenizer byte. train/val: the first 90% and the rest."""
    kind: str
    chars: list[str] | None
    train: torch.Tensor
    val: torch.Tensor

    @classmethod
    def load(cls, path, tokenizer: str = "char") -> "Corpus":
        raw = Path(path).read_bytes()
        chars = None
        if tokenizer == "char":
            try:
                codes = np.frombuffer(raw.decode("utf-8").encode("utf-32-le"), dtype=np.uint32)
                vocab, ids = np.unique(codes, return_inverse=True)  # sorted by code point
                chars = [chr(c) for c in vocab]
            except UnicodeDecodeError:
                tokenizer = "byte"
        if tokenizer == "byte":
            ids = np.frombuffer(raw, dtype=np.uint8)
        tokens = torch.from_numpy(ids.astype(np.int32))
        split = len(tokens) - int(len(tokens) * VAL_FRACTION)
        return cls(tokenizer, chars, tokens[:split], tokens[split:])

    @property
    def vocab_size(self) -> int:
        return 256 if self.chars is None else len(self.chars)

    def encode(self, text: str) -> list[int]:
        if self.chars is None:
            return list(text.encode("utf-8"))
        index = {c: i for i, c in enumerate(self.chars)}
        return [index[c] for c in text if c in index]

    def decode(self, ids) -> str:
        if self.chars is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return "".join(self.chars[i] for i in ids if i < len(self.chars))

    def identity(self) -> dict:
        return {"kind": self.kind, "chars": self.chars}


def _mix(*parts: int) -> int:
    """A fixed 63-bit seed from integers (Python's hash() is salted per process)."""
    h = 1469598103934665603
    for x in parts:
        h = ((h ^ (x & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0x7FFFFFFFFFFFFFFF
    return h


class Sampler:
    """Batches as a pure function of (seed, step): one generator seeded by (seed, step) draws the
    start offsets of the whole global batch (accum × dp × batch) and DP rank r takes slice r. So
    ranks get distinct data, --resume at step s continues exactly (the sampler state is the step),
    and any layout with the same dp × batch sees the same data."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch: int, accum: int, dp: int, dp_rank: int, seed: int):
        self.tokens, self.seq_len, self.batch, self.accum = tokens, seq_len, batch, accum
        self.dp, self.dp_rank, self.seed = dp, dp_rank, seed
        self._window = torch.arange(seq_len + 1)

    def get(self, step: int, stream: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (accum, batch, seq_len) int64."""
        g = torch.Generator().manual_seed(_mix(self.seed, stream, step))
        high = len(self.tokens) - self.seq_len - 1
        starts = torch.randint(0, high + 1, (self.accum, self.dp, self.batch), generator=g)[:, self.dp_rank]
        chunk = self.tokens[starts[..., None] + self._window].long()
        return chunk[..., :-1], chunk[..., 1:]


# ---------------------------------------------------------------------------------------------- launch

def _slurm_master() -> str:
    nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    first = re.match(r"([^,\[]+)(?:\[([^\],-]+))?", nodes)  # "gpu[03-05,09],cpu1" -> "gpu03"
    return first.group(1) + (first.group(2) or "") if first else "127.0.0.1"


def _dist_env() -> dict | None:
    """torch's launch variables when a launcher started us (torchrun, or SLURM mapped onto them)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return {k: env.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        world = int(env["SLURM_NTASKS"])
        nodes = int(env.get("SLURM_NNODES", "1"))
        return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": str(world), "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
                "LOCAL_WORLD_SIZE": str(max(1, world // nodes))}
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list[str], nproc: int) -> int:
    """Start nproc local ranks with torch's elastic launcher, each running this module with argv;
    return the exit code of the job."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ["ZEROFUSE_TRAIN_LAUNCHED"] = "1"  # the ranks die with us (PR_SET_PDEATHSIG)
    os.environ["ZEROFUSE_TRAIN_T0"] = str(T0)  # the summary's wall time counts the launch
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{_free_port()}", run_id=f"zerofuse-{uuid.uuid4().hex[:8]}",
                          max_restarts=0, monitor_interval=0.1, local_addr="127.0.0.1")
    try:
        elastic_launch(config, sys.executable)("-m", "zerofuse.train", *argv)
    except SignalException as e:  # the launcher got the signal and stopped the ranks with it
        print(f"{PROG}: stopped by {e.sigval.name}", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        stopped = {128 + int(s) for s in STOP_SIGNALS}
        if codes <= stopped:  # every failing rank stopped cleanly on a signal
            return max(codes)
        for rank, f in sorted(e.failures.items()):
            print(f"{PROG}: rank {rank} failed with exit code {f.exitcode}", file=sys.stderr, flush=True)
        return EXIT_USAGE if codes == {EXIT_USAGE} else 1
    return 0


def _die_with_parent() -> None:
    """Ranks started by launch(): SIGTERM (a clean stop) when the launcher dies, however it died."""
    if os.environ.get("ZEROFUSE_TRAIN_LAUNCHED") != "1" or not sys.platform.startswith("linux"):
        return
    import ctypes
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    env = _dist_env()
    try:
        validate(args)
    except UsageError as e:
        if env is None or env["RANK"] == "0":
            print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    if env is None and args.nproc > 1:
        return launch(argv, args.nproc)
    code = Trainer(args, env).run()
    if code and env is not None:
        # Stopped by a signal: leave now. The launcher signals the ranks still running when one exits
        # non-zero, and interpreter shutdown restores the default handlers, which would kill a rank
        # that is still finishing instead of letting it exit with the same code.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


# ---------------------------------------------------------------------------------------------- ranks

class _StopFlag:
    """The signal a rank got (0: none). Signals only set it: the training loop agrees on stopping at
    the next step boundary, so a checkpoint is always saved by every rank together."""

    def __init__(self):
        self.signum = 0
        for s in STOP_SIGNALS:
            signal.signal(s, self._handler)

    def _handler(self, signum, _frame):
        self.signum = self.signum or signum


def _init_distributed(args, env: dict | None):
    import torch.distributed as dist
    local_rank = int(env["LOCAL_RANK"] or 0) if env else 0
    local_world = int(env["LOCAL_WORLD_SIZE"] or args.world) if env else 1
    if args.device == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    backend = "nccl" if args.device == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=args.timeout)  # init_mesh's groups and their Communicators inherit it
    if env is None:  # a world of one in this process: ZeRO still goes through a process group
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        if "SLURM_PROCID" in os.environ and "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = _slurm_master()
            os.environ["MASTER_PORT"] = os.environ.get("MASTER_PORT", str(29500 + int(os.environ.get(
                "SLURM_JOB_ID", "0")) % 1000))
        dist.init_process_group(backend, init_method="env://", rank=int(env["RANK"]),
                                world_size=int(env["WORLD_SIZE"]), timeout=timeout)
    return device


def lr_lambda(args):
    """Multiplier of --lr at a step: linear warmup, then cosine decay to --min-lr at --steps."""
    floor = args.min_lr / args.lr

    def f(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def _fmt_bytes(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2 ** 20:.1f} MiB"


class Trainer:
    """One rank of the job: build, (resume,) train, evaluate, checkpoint, report."""

    def __init__(self, args, env: dict | None):
        self.args, self.env = args, env

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        import torch.distributed as dist
        import zerofuse  # noqa: F401  (loads the extension before the model)
        from zerofuse import zero
        from zerofuse.models import GPT, config
        from zerofuse.parallel import init_mesh

        args = self.args
        self.t_start = float(os.environ.get("ZEROFUSE_TRAIN_T0", T0))
        _die_with_parent()
        self.stop = _StopFlag()
        self.device = _init_distributed(args, self.env)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mesh = init_mesh(dp=args.dp, tp=args.tp)
        self.corpus = Corpus.load(args.data, args.tokenizer)
        # no padding for tp: the vocab-parallel layers split an uneven vocabulary, so the model (and
        # its checkpoints) are the same at every tp
        shape = {**args.model_shape}
        self.cfg = config(args.model_name, **{**shape, "vocab_size": self.corpus.vocab_size})
        kw = {"tp_group": self.mesh.tp_group, "sequence_parallel": args.sequence_parallel} if args.tp > 1 else {}
        if args.zero_stage == 3:  # built on meta, materialized shard by shard: never whole on a rank
            with torch.device("meta"):
                model = GPT(self.cfg, seed=args.seed, **kw)
        else:
            model = GPT(self.cfg, seed=args.seed, **kw).to(self.device)
        self.n_params = model.num_params()  # unsharded
        self.model = zero.parallelize(model, stage=args.zero_stage, group=self.mesh.dp_group,
                                      precision=args.precision, device=self.device)
        if args.compile:
            for block in self.model.blocks:
                block.forward = torch.compile(block.forward)
        self.opt = zero.Optimizer(self.model, args.optimizer, param_groups=self._param_groups(),
                                  max_grad_norm=args.clip or None, **self._hyper())
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(args))
        seq = self.cfg.seq_len
        self.train_data = Sampler(self.corpus.train, seq, args.batch, args.grad_accum, args.dp, self.mesh.dp_rank,
                                  args.seed)
        self.val_data = Sampler(self.corpus.val, seq, args.batch, 1, 1, 0, args.seed)
        self.out = Path(args.out)
        self.ckpt = self.out / "ckpt"
        self.step = self._resume() if args.resume else 0
        self.start_step = self.step
        self.memory = None
        self.stopped = 0  # the signal every rank agreed to stop on
        self.log = RankZeroLog(self) if self.rank == 0 else None

    def _param_groups(self):
        decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() >= 2]
        other = [p for p in self.model.parameters() if p.requires_grad and p.dim() < 2]
        groups = [{"params": decay}]
        if other:
            groups.append({"params": other, "weight_decay": 0.0})
        return groups

    def _hyper(self) -> dict:
        args = self.args
        kw = dict(lr=args.lr, weight_decay=args.weight_decay)
        if args.optimizer in ("adamw", "lamb"):
            kw["betas"] = (0.9, 0.95)
        return kw

    def _resume(self) -> int:
        from zerofuse import checkpoint
        extra = checkpoint.load(str(self.ckpt), self.model, self.opt)
        if extra["tokenizer"] != self.corpus.identity():
            raise ValueError(f"{PROG}: --resume: the checkpoint at {self.ckpt} was trained on a different vocabulary "
                             f"({extra['tokenizer']['kind']} tokenizer) than --data {self.args.data}")
        self.sched.load_state_dict(extra["scheduler"])
        for g, lr in zip(self.opt.param_groups, self.sched.get_last_lr()):
            g["lr"] = lr
        return int(extra["step"])

    # ------------------------------------------------------------------ steps

    def _forward(self, x, y):
        _, loss = self.model(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
        return loss

    def train_step(self) -> dict:
        """One optimizer step; returns this step's metrics, the same on every rank."""
        from zerofuse import comm
        args, opt = self.args, self.opt
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t0, w0 = time.perf_counter(), comm.wait_seconds()
        xs, ys = self.train_data.get(self.step)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for i in range(args.grad_accum):
            sync = i == args.grad_accum - 1
            with contextlib.nullcontext() if sync else self.model.no_sync():
                loss = self._forward(xs[i], ys[i])
                opt.scale_loss(loss / args.grad_accum).backward()
            total += loss.detach()
        lr = opt.param_groups[0]["lr"]
        opt.step()
        if self.memory is None:
            self.memory = self._memory()
        opt.zero_grad()
        self.sched.step()
        self.step += 1
        stop_wanted = args.stop_after is not None and self.step >= args.stop_after
        t1 = time.perf_counter()
        loss, self.stopped = self._agree(total / args.grad_accum, signal.SIGTERM if stop_wanted else 0)
        t2 = time.perf_counter()
        step_time = t2 - t0
        comm_time = comm.wait_seconds() - w0 + (t2 - t1) if self.device.type == "cpu" else None
        norm = opt.last_grad_norm
        tokens = args.dp * args.batch * args.grad_accum * self.cfg.seq_len
        out = {"step": self.step, "loss": loss, "lr": lr, "tokens_per_s": tokens / step_time,
               "step_time": step_time, "comm_time": comm_time,
               "grad_norm": None if norm is None else float(norm.item())}
        if opt.fp16 and opt.last_step_skipped is not None and bool(opt.last_step_skipped.item()):
            out["skipped"] = True
        return out

    def _agree(self, loss: torch.Tensor, extra_signal: int) -> tuple[float, int]:
        """All-reduce the step's loss (mean over the world = over DP: TP ranks agree) together with
        every rank's stop flag; returns (mean loss, the signal to stop on or 0)."""
        import torch.distributed as dist
        mine = self.stop.signum or extra_signal
        vec = torch.zeros(1 + len(STOP_SIGNALS), dtype=torch.float64, device=self.device)
        vec[0] = loss.double()
        if mine:
            vec[1 + STOP_SIGNALS.index(mine)] = 1
        dist.all_reduce(vec)
        vec = vec.cpu()
        flags = [s for s, v in zip(STOP_SIGNALS, vec[1:].tolist()) if v > 0]
        return float(vec[0]) / self.world, int(flags[0]) if flags else 0

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the validation set: --eval-batches fixed batches of --batch sequences (the
        same whatever the layout), dealt round-robin to the DP ranks. Every rank runs the same
        number of forwards (ZeRO-3's forward is collective); a rank's spare ones count zero."""
        import torch.distributed as dist
        args = self.args
        dp, r = args.dp, self.mesh.dp_rank
        acc = torch.zeros(2, dtype=torch.float64, device=self.device)  # (loss sum, batches)
        for k in range(-(-args.eval_batches // dp)):
            i = k * dp + r
            x, y = self.val_data.get(min(i, args.eval_batches - 1), stream=1)
            loss = self._forward(x[0], y[0]).double()
            if i < args.eval_batches:
                acc += torch.stack([loss, torch.ones_like(loss)])
        dist.all_reduce(acc, group=self.mesh.dp_group)
        return float(acc[0] / acc[1])

    def _memory(self) -> dict:
        from zerofuse.zero import memory_report
        rep = memory_report(self.model, self.opt)
        mem = {k: rep[k] for k in ("params", "grads", "optimizer", "total")}
        mem["max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if self.device.type == "cuda":
            mem["cuda_max_allocated"] = torch.cuda.max_memory_allocated(self.device)
        return mem

    def save(self) -> None:
        from zerofuse import checkpoint
        extra = {"step": self.step, "scheduler": self.sched.state_dict(), "tokenizer": self.corpus.identity(),
                 "config": dataclasses.asdict(self.cfg), "seed": self.args.seed}
        checkpoint.save(str(self.ckpt), self.model, self.opt, extra=extra)

    def sample(self) -> str:
        """Every rank generates with the same generator (TP ranks and ZeRO-3 forward together)."""
        args = self.args
        prompt = self.corpus.encode("\n") or [0]
        idx = torch.tensor([prompt], dtype=torch.long, device=self.device)
        g = torch.Generator().manual_seed(args.seed)
        out = self.model.generate(idx, args.sample_tokens, temperature=0.8, top_k=40, generator=g)
        return self.corpus.decode(out[0, len(prompt):].tolist())

    # ------------------------------------------------------------------ the job

    def run(self) -> int:
        import torch.distributed as dist
        self._setup()
        args = self.args
        try:
            val, val_step = self.evaluate(), self.step
            if self.log:
                self.log.start(val)
            t_train = time.perf_counter()
            while self.step < args.steps and not self.stopped:
                m = self.train_step()
                if self.step == args.steps or (args.eval_every and self.step % args.eval_every == 0):
                    m["val_loss"] = val = self.evaluate()
                    val_step = self.step
                if self.log:
                    self.log.step(m)
                if (args.ckpt_every and self.step % args.ckpt_every == 0) or self.step == args.steps or self.stopped:
                    self.save()
            train_s = time.perf_counter() - t_train
            if args.export and not self.stopped and dist.get_rank() == 0:  # the final checkpoint is saved
                from zerofuse.checkpoint import export_hf
                export_hf(str(self.ckpt), str(Path(args.out) / "hf"),
                          config={"model_type": "zerofuse-gpt", **dataclasses.asdict(self.cfg)})
            if self.memory is None:  # resumed at the end: nothing trained
                self.memory = self._memory()
            text = self.sample() if args.sample_tokens and not self.stopped else None
            memory = [None] * self.world
            dist.all_gather_object(memory, self.memory)
            if self.log:
                self.log.finish(memory, text, train_s, (val, val_step), self.stopped)
        finally:
            if self.log:
                self.log.close()
            dist.destroy_process_group()
        return 128 + self.stopped if self.stopped else 0


# ---------------------------------------------------------------------------------------------- rank 0

class RankZeroLog:
    """Progress bar / lines, metrics.jsonl, TensorBoard, summary.json, the summary table, loss.png."""

    def __init__(self, trainer: Trainer):
        self.t, self.args = trainer, trainer.args
        self.out = Path(self.args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out / "metrics.jsonl"
        self._trim_metrics(trainer.step)
        self.metrics = open(self.metrics_path, "a")
        self.history = [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]
        try:
            from tqdm import tqdm
        except ImportError:  # a machine installed with --no-deps: progress lines only
            tqdm = _Lines
        self.tty = sys.stderr.isatty() and tqdm is not _Lines
        self.every = self.args.log_every or max(1, self.args.steps // 20)
        self.bar = tqdm(total=self.args.steps, initial=trainer.step, disable=not self.tty, dynamic_ncols=True,
                        desc="train", unit="step")
        self.tb = _tensorboard(self.out)
        self.initial_val = None

    def _trim_metrics(self, step: int) -> None:
        """Drop lines past the checkpoint we resume from (a stopped run may have logged beyond it)."""
        if not self.metrics_path.exists():
            return
        lines = [ln for ln in self.metrics_path.read_text().splitlines() if ln.strip()]
        keep = [ln for ln in lines if json.loads(ln)["step"] <= step] if self.args.resume else []
        self.metrics_path.write_text("".join(ln + "\n" for ln in keep))

    def write(self, line: str) -> None:
        self.bar.write(line, file=sys.stdout)
        sys.stdout.flush()

    def start(self, val: float) -> None:
        t, a = self.t, self.args
        self.initial_val = val
        sp = ", sequence parallel" if a.sequence_parallel else ""
        self.write(f"{PROG}: {_plural(t.world, 'rank')} (dp {a.dp} × tp {a.tp}{sp}), "
                   f"ZeRO-{a.zero_stage}, {a.precision}, {a.optimizer}, {t.device.type}; model {a.model_name} "
                   f"{t.n_params / 1e6:.2f}M params ({t.cfg.n_layer} layers, {t.cfg.n_head} heads, "
                   f"{t.cfg.n_kv_head} kv heads, dim {t.cfg.dim}, seq {t.cfg.seq_len}, vocab {t.cfg.vocab_size}, "
                   f"{t.corpus.kind} tokens); {a.steps} steps of {a.dp * a.batch * a.grad_accum} sequences")
        where = f"resumed at step {t.step}" if t.step else "step 0"
        self.write(f"{where}: val loss {val:.4f}")
        if self.tb:
            self.tb.add_scalar("loss/val", val, t.step)

    def step(self, m: dict) -> None:
        self.history.append(m)
        self.metrics.write(json.dumps(m) + "\n")
        self.metrics.flush()
        if self.tb:
            for k in ("loss", "lr", "tokens_per_s", "grad_norm"):
                if m.get(k) is not None:
                    self.tb.add_scalar(f"train/{k}", m[k], m["step"])
            if "val_loss" in m:
                self.tb.add_scalar("loss/val", m["val_loss"], m["step"])
        self.bar.set_postfix_str(f"loss {m['loss']:.3f}, {m['tokens_per_s']:,.0f} tok/s, lr {m['lr']:.2e}",
                                 refresh=False)
        self.bar.update(1)
        s = m["step"]
        if not self.tty and (s % self.every == 0 or s == self.args.steps):
            self.write(f"step {s}/{self.args.steps}  loss {m['loss']:.4f}  {m['tokens_per_s']:,.0f} tok/s  "
                       f"lr {m['lr']:.2e}  {m['step_time'] * 1e3:.0f} ms/step")
        if "val_loss" in m:
            self.write(f"step {s}: val loss {m['val_loss']:.4f}")

    def finish(self, memory: list[dict], text: str | None, train_s: float, final_val: tuple[float, int],
               signum: int) -> None:
        self.bar.close()
        summary = self._summary(memory, train_s, final_val, signum)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(_table(summary), flush=True)
        if signum:
            print(f"{PROG}: stopped by {signal.Signals(signum).name} after step {summary['steps_done']}; "
                  f"checkpoint saved at {self.t.ckpt} (continue with --resume)", flush=True)
        if text is not None:
            print(f"--- sample ({self.args.sample_tokens} tokens, temperature 0.8, top-k 40) ---\n{text}\n---",
                  flush=True)
        start = [{"step": 0, "val_loss": self.initial_val}] if self.t.start_step == 0 else []
        _plot(start + self.history, self.out / "loss.png")

    def _summary(self, memory, train_s, final_val, signum) -> dict:
        t, a = self.t, self.args
        runs = [m for m in self.history if m["step"] > t.start_step]
        steady = runs[1:] or runs  # the first step pays for warm-up
        step_time = _mean([m["step_time"] for m in steady])
        comm = _mean([m["comm_time"] for m in steady if m["comm_time"] is not None]) if t.device.type == "cpu" else None
        tokens = a.dp * a.batch * a.grad_accum * t.cfg.seq_len
        tok_s = tokens / step_time if step_time else None
        return {
            "world_size": t.world, "dp": a.dp, "tp": a.tp, "sequence_parallel": a.sequence_parallel,
            "zero_stage": a.zero_stage, "precision": a.precision, "optimizer": a.optimizer, "device": t.device.type,
            "device_name": torch.cuda.get_device_name(t.device) if t.device.type == "cuda" else "cpu",
            "model": {"preset": a.model_name, "params": t.n_params, **dataclasses.asdict(t.cfg)},
            "steps": a.steps, "steps_done": t.step, "start_step": t.start_step, "tokens_per_step": tokens,
            "stopped_by": signal.Signals(signum).name if signum else None,
            "wall_s": time.time() - t.t_start, "train_s": train_s,
            "tokens_per_s": tok_s, "tokens_per_s_per_rank": tok_s / t.world if tok_s else None,
            "step_time_s": step_time, "comm_time_s": comm,
            "compute_time_s": step_time - comm if comm is not None and step_time else None,
            "mfu": _mfu(t, tok_s), "memory_per_rank": memory,
            "initial_val_loss": self.initial_val if t.start_step == 0 else None,
            "final_train_loss": runs[-1]["loss"] if runs else None,
            "final_val_loss": final_val[0], "final_val_step": final_val[1],
        }

    def close(self) -> None:
        self.bar.close()
        self.metrics.close()
        if self.tb:
            self.tb.close()


class _Lines:
    """Stands in for tqdm when it is not installed."""

    def __init__(self, **_):
        pass

    def write(self, line, file=None):
        print(line, file=file or sys.stdout)

    def update(self, n=1):
        pass

    def set_postfix_str(self, s, refresh=True):
        pass

    def close(self):
        pass


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _mfu(t: Trainer, tok_s: float | None) -> float | None:
    """Model FLOPs utilisation on GPU: (6 N + 12 L d S) FLOPs per token (PaLM, appendix B) against
    the bf16 peak of the device; None on CPU or an unknown GPU."""
    if t.device.type != "cuda" or not tok_s:
        return None
    name = torch.cuda.get_device_name(t.device)
    peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    if peak is None:
        return None
    c = t.cfg
    flops_per_token = 6 * t.n_params + 12 * c.n_layer * c.dim * c.seq_len
    return flops_per_token * tok_s / (peak * t.world)


def _table(s: dict) -> str:
    def num(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    gpu_comm = "n/a on CUDA (Work.wait only orders streams; profile for exposed communication)"
    rows = [
        ("layout", f"{_plural(s['world_size'], 'rank')} = dp {s['dp']} × tp {s['tp']}, ZeRO-{s['zero_stage']}, "
                   f"{s['precision']}, {s['optimizer']}, {s['device_name']}"),
        ("model", f"{s['model']['params'] / 1e6:.2f}M params"),
        ("steps", f"{s['steps_done'] - s['start_step']} this run (to step {s['steps_done']} of {s['steps']}), "
                  f"{s['tokens_per_step']:,} tokens/step"),
        ("wall time", f"{s['wall_s']:.1f} s (training loop {s['train_s']:.1f} s)"),
        ("tokens/s", f"{num(s['tokens_per_s'], ',.0f')} total, {num(s['tokens_per_s_per_rank'], ',.0f')} per rank"),
        ("step time", f"{num(s['step_time_s'] and s['step_time_s'] * 1e3, '.1f')} ms = compute "
                      f"{num(s['compute_time_s'] and s['compute_time_s'] * 1e3, '.1f')} ms + exposed comm "
                      f"{num(s['comm_time_s'] and s['comm_time_s'] * 1e3, '.1f')} ms"
         if s["device"] == "cpu" else f"{num(s['step_time_s'] and s['step_time_s'] * 1e3, '.1f')} ms; comm split "
                                      f"{gpu_comm}"),
        ("MFU", "n/a (cpu)" if s["device"] == "cpu" else num(s["mfu"] and 100 * s["mfu"], ".1f") + " % of bf16 peak"),
    ]
    for r, m in enumerate(s["memory_per_rank"]):
        extra = f", CUDA max allocated {_fmt_bytes(m['cuda_max_allocated'])}" if "cuda_max_allocated" in m else ""
        rows.append((f"memory rank {r}", f"params {_fmt_bytes(m['params'])}, grads {_fmt_bytes(m['grads'])}, "
                                         f"optimizer {_fmt_bytes(m['optimizer'])}, max RSS "
                                         f"{_fmt_bytes(m['max_rss'])}{extra}"))
    rows.append(("loss", f"train {num(s['final_train_loss'], '.4f')}, val {s['final_val_loss']:.4f} at step "
                         f"{s['final_val_step']}" + (f" (initial val {s['initial_val_loss']:.4f})"
                                                     if s["initial_val_loss"] is not None else "")))
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"{PROG} summary"] + [f"  {k:<{width}}  {v}" for k, v in rows])


def _tensorboard(out: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # tensorboard not installed: optional
        return None
    return SummaryWriter(str(out / "tensorboard"))


def _plot(history: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{PROG}: matplotlib is not installed, no {path.name}", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    train = [m for m in history if "loss" in m]
    ax.plot([m["step"] for m in train], [m["loss"] for m in train], label="train", linewidth=1)
    val = [(m["step"], m["val_loss"]) for m in history if "val_loss" in m]
    if val:
        ax.plot(*zip(*val), "o-", label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
