"""``python -m zerofuse.train`` / ``zerofuse-train``: train a GPT on a text file with ZeRO (stage 0-3)
and tensor parallelism, on CPUs (gloo) or GPUs (NCCL).

Launch (one code path, three ways in):
- ``--nproc N`` with no launcher around it: torch's elastic launcher (torchrun's API: ``elastic_launch``,
  c10d rendezvous on localhost) starts N local ranks, each running this module unchanged; the
  launcher forwards SIGINT/SIGTERM to them. ``--nproc 1``: runs in this process as a world of one.
- ``torchrun ... -m zerofuse.train`` (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR in the environment),
- ``srun python -m zerofuse.train`` (SLURM_PROCID/SLURM_STEP_NUM_TASKS/... of the srun step mapped to torch's variables).
Bad flags are rejected before any process starts (exit code 2, one line naming the flag).

Determinism: a step's batches are a pure function of (seed, step) (the global batch is drawn from one
generator, each DP rank takes its slice), the LR schedule is restored from the checkpoint, so
``--resume`` continues with the losses an uninterrupted run would have had (with
--offload-delayed-update: one that checkpointed at the same steps, a checkpoint applying the pending
host update: --ckpt-every is part of that recipe, README's offload section). A signal on any rank
stops every rank at the next step boundary (the stop flags are all-reduced with the step's loss),
which then saves a checkpoint and exits 128 + signal number.

Outputs in --out: metrics.jsonl (one line per step), summary.json, loss.png, TensorBoard events
(when tensorboard is installed), ckpt/ (the latest checkpoint, zerofuse.checkpoint format). One job
at a time: the job holds an exclusive lock on <out>/.zerofuse-train.lock (launch.out_lock); a second
job on the same --out exits 2 before it writes anything.
"""
from __future__ import annotations

import time

T0 = time.time()  # the job's start for the summary's wall time; main() moves it to the process's start

import contextlib  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

# what tests and callers use as zerofuse.train.<name>
from .cli import (DEFAULT_MODEL, EXIT_USAGE, OPT_DEFAULTS, PRESET_NAMES, PROG, UsageError,  # noqa: E402
                  _parser, validate)
from .data import VAL_FRACTION, Corpus, Sampler  # noqa: E402
from .launch import (STOP_SIGNALS, abort_rendezvous, die_with_parent, launch, out_lock,  # noqa: E402, F401
                     rank_lock, takes_out_lock)
from .launch_env import _dist_env, _slurm_master, check_dist_env  # noqa: E402, F401
from .loop import Trainer, lr_lambda  # noqa: E402
from .report import PEAK_FLOPS, RankZeroLog  # noqa: E402

__all__ = ["main", "validate", "launch", "Trainer", "RankZeroLog", "Corpus", "Sampler", "lr_lambda", "UsageError",
           "T0", "PROG", "EXIT_USAGE", "STOP_SIGNALS", "PRESET_NAMES", "DEFAULT_MODEL", "OPT_DEFAULTS",
           "PEAK_FLOPS", "VAL_FRACTION"]


def _process_start() -> float | None:
    """When this process started, on the wall clock (Linux: /proc; None elsewhere). T0, taken when
    this package is imported, came after zerofuse's import of torch and the extension: the summary's
    wall time left out ~2 s of a job's ~7 (a review's measurement, 2026-12-06)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime (clock ticks after boot)
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _abort_peers(env: dict | None) -> None:
    """A rank of a torchrun / SLURM job refused at its start: the others, which would wait for it at
    the rendezvous, are told to exit too (our launcher's agent stops its ranks itself). Only where
    the environment names this rank's place (RANK < WORLD_SIZE, integers)."""
    if env is None or os.environ.get("ZEROFUSE_TRAIN_LAUNCHED") == "1":
        return
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    except (KeyError, TypeError, ValueError):
        return
    if 0 <= rank < world:
        abort_rendezvous(env)


def main(argv: list[str] | None = None) -> int:
    global T0
    if argv is None:  # the command line's job (zerofuse-train, python -m): timed from the process's start
        T0 = min(T0, _process_start() or T0)
    die_with_parent()  # (a rank our launcher started: before anything that waits)
    argv = list(sys.argv[1:] if argv is None else argv)
    env = _dist_env()
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse's usage error (printed): the peers told too, as validate()'s below
        if e.code == EXIT_USAGE:  # (they waited max(--timeout, STARTUP_S) for this rank; a review's
            _abort_peers(env)  # reproduction, 2026-12-07)
        raise
    try:
        check_dist_env(env)
    except UsageError as e:  # (each process's own environment: every one says so)
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        _abort_peers(env)
        return EXIT_USAGE
    with contextlib.ExitStack() as held:
        try:
            validate(args)
            if takes_out_lock(env):
                held.enter_context(out_lock(args.out))
            held.enter_context(rank_lock(args.out))  # (a rank our launcher started: --out's while it lives)
        except UsageError as e:
            if env is None or env.get("RANK") == "0":
                print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
            else:  # (each rank its own: a --data missing on one node was said nowhere)
                print(f"{PROG}: error: rank {env['RANK']}: {e}", file=sys.stderr, flush=True)
            _abort_peers(env)
            return EXIT_USAGE
        if env is None and args.nproc > 1:
            return launch(argv, args.nproc, args.timeout, args.out)
        code = Trainer(args, env).run()
    if code and env is not None:
        # Stopped by a signal: leave now. The launcher signals the ranks still running when one exits
        # non-zero, and interpreter shutdown restores the default handlers, which would kill a rank
        # that is still finishing instead of letting it exit with the same code.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
