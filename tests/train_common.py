"""What the training job's tests share (tests/test_train*.py): tiny flags, the environment without a
launcher's variables, a run of the job in a subprocess and its outputs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

TIMEOUT = 150
TINY = ["--layers", "2", "--heads", "2", "--dim", "32", "--seq-len", "32", "--batch", "4", "--eval-batches", "3",
        "--lr", "1e-2", "--warmup", "2", "--sample-tokens", "16", "--log-every", "1"]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
               "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID",
               "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS + ("TRITON_INTERPRET",)}
    env["ZEROFUSE_TRITON_ON_CPU"] = "0"  # the session's interpreter mode would make every step slow
    return env


def _cmd(*args) -> list[str]:
    return [sys.executable, "-m", "zerofuse.train", *TINY, *map(str, args)]


def run(*args, timeout=TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(*args), env=_env(), capture_output=True, text=True, timeout=timeout)


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def ckpt_step(out) -> int:
    return torch.load(Path(out) / "ckpt" / "common.pt", weights_only=True)["extra"]["step"]


def _ok(p: subprocess.CompletedProcess, code: int = 0) -> None:
    assert p.returncode == code, f"exit code {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
