"""Bad flags of the training job (issue 22): ``python -m zerofuse.train``'s parser and validate(),
run in process (no job is launched), each flag's message naming it, what was expected and what
came. Tables and runners: tests/bad_input.py."""
from __future__ import annotations

import contextlib
import io
import os
import tempfile
from unittest import mock

import pytest
import torch

from zerofuse import train

from bad_input import TARGET, Case, params, print_census


class ParserExit(Exception):
    """The parser's exit, with its code and what it printed."""


def _flags(*argv, env=None):
    """train's parser and validate() on argv, outside any launcher (env: the launcher's variables),
    on the cpu unless argv names a device (the defaults of --nproc and --precision follow it)."""
    if "--device" not in argv:
        argv = ("--device", "cpu", *argv)
    with mock.patch.dict(os.environ, env or {}):
        for k in {"RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS"} - (env or {}).keys():
            os.environ.pop(k, None)
        printed = io.StringIO()
        try:
            with contextlib.redirect_stderr(printed):
                args = train._parser().parse_args(list(argv))
        except SystemExit as e:
            raise ParserExit(f"exit {e.code}: {printed.getvalue().strip()}") from None
        train.validate(args)
    return args


def _file(text: str) -> str:
    fd, path = tempfile.mkstemp(suffix=".txt", dir=".")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def _out_with(name: str) -> str:
    """A fresh --out folder holding a user's file at ``name`` (a relative path)."""
    out = tempfile.mkdtemp(dir=".")
    path = os.path.join(out, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("mine")
    return out


U = train.UsageError
TRAIN = [
    Case("flag-lr-inf", _flags, lambda: ("--lr", "inf"), U, r"^--lr: expected a finite number, got inf"),
    Case("flag-lr-nan", _flags, lambda: ("--lr", "nan"), U, r"^--lr: expected (> 0|a finite number), got nan"),
    Case("flag-lr-negative", _flags, lambda: ("--lr", "-1"), U, r"^--lr: expected > 0, got -1.0"),
    Case("flag-min-lr-above-lr", _flags, lambda: ("--lr", "0.1", "--min-lr", "1"), U,
         r"^--min-lr: expected between 0 and --lr \(0.1\), got 1.0"),
    Case("flag-weight-decay-inf", _flags, lambda: ("--weight-decay", "inf"), U,
         r"^--weight-decay: expected a finite number, got inf"),
    Case("flag-weight-decay-negative", _flags, lambda: ("--weight-decay", "-1"), U,
         r"^--weight-decay: expected >= 0, got -1.0"),
    Case("flag-clip-inf", _flags, lambda: ("--clip", "inf"), U, r"^--clip: expected a finite number, got inf"),
    Case("flag-clip-negative", _flags, lambda: ("--clip", "-1"), U, r"^--clip: expected >= 0, got -1.0"),
    Case("flag-nproc-0", _flags, lambda: ("--nproc", "0"), U, r"^--nproc: expected >= 1, got 0"),
    Case("flag-nproc-word", _flags, lambda: ("--nproc", "two"), ParserExit,
         r"^exit 2: zerofuse-train: error: argument --nproc: invalid int value: 'two'$"),
    Case("flag-tp-0", _flags, lambda: ("--tp", "0"), U, r"^--tp: expected >= 1, got 0"),
    Case("flag-tp-not-dividing", _flags, lambda: ("--nproc", "2", "--tp", "3"), U,
         r"^--tp: expected a divisor of the number of ranks 2 \(--nproc\), got 3"),
    Case("flag-dp-0", _flags, lambda: ("--dp", "0"), U, r"^--dp: expected >= 1, got 0"),
    Case("flag-dp-times-tp", _flags, lambda: ("--nproc", "2", "--dp", "3"), U,
         r"^--nproc: expected dp × tp = 3 × 1 = 3 ranks, got 2"),
    Case("flag-launcher-world", _flags, lambda: ("--nproc", "2"), U, r"^--nproc: the launcher started 4 ranks, got "
         r"--nproc 2", dict(env={"RANK": "0", "WORLD_SIZE": "4"})),
    Case("flag-launcher-world-tp", _flags, lambda: ("--tp", "3"), U,
         r"^--tp: expected a divisor of the number of ranks 4", dict(env={"RANK": "0", "WORLD_SIZE": "4"})),
    Case("flag-zero-stage", _flags, lambda: ("--zero-stage", "5"), ParserExit,
         r"^exit 2: zerofuse-train: error: argument --zero-stage: invalid choice: 5 \(choose from 0, 1, 2, 3\)$"),
    Case("flag-optimizer", _flags, lambda: ("--optimizer", "sgd"), ParserExit,
         r"^exit 2: zerofuse-train: error: argument --optimizer: invalid choice: 'sgd'"),
    Case("flag-precision-fp16-cpu", _flags, lambda: ("--precision", "fp16", "--device", "cpu"), U,
         r"^--precision fp16: expected --device cuda"),
    Case("flag-batch-0", _flags, lambda: ("--batch", "0"), U, r"^--batch: expected >= 1, got 0"),
    Case("flag-grad-accum-0", _flags, lambda: ("--grad-accum", "0"), U, r"^--grad-accum: expected >= 1, got 0"),
    Case("flag-steps-0", _flags, lambda: ("--steps", "0"), U, r"^--steps: expected >= 1, got 0"),
    Case("flag-eval-batches-0", _flags, lambda: ("--eval-batches", "0"), U, r"^--eval-batches: expected >= 1, got 0"),
    Case("flag-warmup-negative", _flags, lambda: ("--warmup", "-1"), U, r"^--warmup: expected >= 0, got -1"),
    Case("flag-ckpt-every-negative", _flags, lambda: ("--ckpt-every", "-5"), U,
         r"^--ckpt-every: expected >= 0, got -5"),
    Case("flag-sample-tokens-negative", _flags, lambda: ("--sample-tokens", "-1"), U,
         r"^--sample-tokens: expected >= 0, got -1"),
    Case("flag-log-every-0", _flags, lambda: ("--log-every", "0"), U, r"^--log-every: expected >= 1, got 0"),
    Case("flag-layers-0", _flags, lambda: ("--layers", "0"), U, r"^--layers: expected >= 1, got 0"),
    Case("flag-heads-not-dividing-dim", _flags, lambda: ("--heads", "3", "--dim", "32"), U,
         r"^--heads: expected a divisor of the model width 32 \(--dim\), got 3"),
    Case("flag-kv-heads-not-dividing", _flags, lambda: ("--heads", "4", "--kv-heads", "3"), U,
         r"^--kv-heads: expected a divisor of the head count 4 \(--heads\), got 3"),
    Case("flag-tp-not-dividing-heads", _flags, lambda: ("--nproc", "2", "--tp", "2", "--heads", "3", "--dim", "48"),
         U, r"^--tp: expected a divisor of the head count 3 \(--heads\), got 2"),
    Case("flag-sequence-parallel-without-tp", _flags, lambda: ("--sequence-parallel",), U,
         r"^--sequence-parallel: expected --tp > 1, got --tp 1"),
    Case("flag-seq-len-odd-under-sp", _flags,
         lambda: ("--nproc", "2", "--tp", "2", "--sequence-parallel", "--seq-len", "33"), U,
         r"^--seq-len: expected a multiple of --tp \(2\) with --sequence-parallel, got 33"),
    Case("flag-data-missing", _flags, lambda: ("--data", "no-such.txt"), U,
         r"^--data: expected a readable text file, got 'no-such.txt' \(no such file\)"),
    Case("flag-data-directory", _flags, lambda: ("--data", "."), U,
         r"^--data: expected a readable text file, got '.' \(a directory\)"),
    Case("flag-data-too-short", lambda: _flags("--data", _file("abc")), tuple, U,
         r"^--data: expected at least 65 validation tokens .*for --seq-len 64, got 0 validation tokens"),
    Case("flag-data-glob-matches-none", _flags, lambda: ("--data", "shards/none_*.bin"), U,
         r"^--data: expected the pattern 'shards/none_\*.bin' to match token files, matched none"),
    Case("flag-data-bin-missing", _flags, lambda: ("--data", "no-such.bin"), U,
         r"^--data: expected a token file \(.bin\), got 'no-such.bin' \(no such file\)"),
    Case("flag-val-data-with-char-tokens", _flags, lambda: ("--val-data", "v.bin"), U,
         r"^--val-data: expected GPT-2 tokens \(--tokenizer gpt2 or token shards\), got --tokenizer char"),
    Case("flag-tokenizer-char-on-shards", _flags, lambda: ("--data", "t.bin", "--tokenizer", "byte"), U,
         r"^--tokenizer: --data 't.bin' holds GPT-2 token ids, expected --tokenizer gpt2 \(or none\), got byte"),
    Case("flag-out-is-a-file", lambda: _flags("--out", _file("x")), tuple, U,
         r"^--out: expected a directory, got '.*\.txt' \(a file\)"),
    Case("flag-out-inside-a-file", lambda: _flags("--out", os.path.join(_file("x"), "sub")), tuple, U,
         r"^--out: expected a directory, got '.*\.txt/sub' \(inside the file '.*\.txt'\)"),
    # (a review's reproductions, 2026-12-06: a user's ckpt folder deleted at the first save; a ckpt or hf
    # file, a seed past 64 bits, or RANK without MASTER_ADDR: a traceback on every rank after training)
    Case("flag-out-ckpt-is-a-users-folder", lambda: _flags("--out", _out_with("ckpt/notes.txt")), tuple, U,
         r"^--out: expected .*/ckpt to be a zerofuse checkpoint or absent \(the job replaces it\), got a folder "
         r"without meta.json"),
    Case("flag-out-ckpt-is-a-file", lambda: _flags("--out", _out_with("ckpt")), tuple, U,
         r"^--out: expected .*/ckpt to be a zerofuse checkpoint or absent .* got a file"),
    Case("flag-export-hf-is-a-file", lambda: _flags("--export", "--out", _out_with("hf")), tuple, U,
         r"^--export: expected .*/hf to be a folder or absent, got a file"),
    Case("flag-out-empty", _flags, lambda: ("--out", ""), U, r"^--out: expected a directory, got an empty path"),
    Case("flag-seed-past-64-bits", _flags, lambda: ("--seed", str(2 ** 64)), U,
         r"^--seed: expected a 64-bit integer, got 18446744073709551616"),
    Case("env-rank-without-master", lambda: _flags(env={"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "",
                                                        "MASTER_PORT": ""}), tuple, U,
         r"^environment: RANK and WORLD_SIZE are set \(a launcher's\), but not MASTER_ADDR and MASTER_PORT"),
    Case("flag-resume-without-checkpoint", _flags, lambda: ("--resume", "--out", "fresh"), U,
         r"^--resume: expected a complete checkpoint at fresh/ckpt, found none"),
    Case("flag-offload-with-lamb", _flags, lambda: ("--offload", "optimizer", "--optimizer", "lamb"), U,
         r"^--offload optimizer: expected --optimizer adamw \(LAMB/LARS .*got --optimizer lamb"),
    Case("flag-param-offload-without-zero3", _flags, lambda: ("--offload", "optimizer+params"), U,
         r"^--offload optimizer\+params: expected --zero-stage 3 \(the param shards go to host memory\), got "
         r"--zero-stage 2"),
    Case("flag-offload-ratio-out-of-range", _flags, lambda: ("--offload", "optimizer", "--offload-ratio", "2"), U,
         r"^--offload-ratio: expected a number in \[0, 1\] or auto, got 2.0"),
    Case("flag-offload-ratio-not-a-number", _flags, lambda: ("--offload", "optimizer", "--offload-ratio", "half"), ParserExit,
         r"^exit 2: zerofuse-train: error: argument --offload-ratio: invalid ratio value: 'half'$"),
    Case("flag-delayed-update-without-offload", _flags, lambda: ("--offload-delayed-update", "0"), U,
         r"^--offload-delayed-update: expected a warm-up >= 0 with --offload and --offload-ratio 1, got 0 with "
         r"--offload none"),
    Case("flag-delayed-update-with-twin-flow", _flags,
         lambda: ("--offload", "optimizer", "--offload-ratio", "0.5", "--offload-delayed-update", "2"), U,
         r"^--offload-delayed-update: expected .* got 2 with --offload optimizer --offload-ratio 0.5"),
    Case("flag-offload-ratio-without-offload", _flags, lambda: ("--offload-ratio", "0.5"), U,
         r"^--offload-ratio: expected --offload optimizer with a ratio below 1, got --offload none"),
    # mixture of experts
    Case("flag-ep-not-dividing-experts", _flags, lambda: ("--nproc", "3", "--experts", "4", "--ep", "3"), U,
         r"^--ep: expected a divisor of the expert count 4 \(--experts\), got 3"),
    Case("flag-ep-not-dividing-dp", _flags, lambda: ("--nproc", "2", "--experts", "4", "--ep", "4"), U,
         r"^--ep: expected a divisor of the data-parallel size 2 \(--dp\), got 4"),
    Case("flag-top-k-above-experts", _flags, lambda: ("--experts", "4", "--top-k", "5"), U,
         r"^--top-k: expected between 1 and --experts \(4\), got 5"),
    Case("flag-capacity-negative", _flags, lambda: ("--model", "moe-tiny", "--capacity", "-1"), U,
         r"^--capacity: expected a finite number >= 0, got -1.0"),
    Case("flag-ep-without-experts", _flags, lambda: ("--ep", "2"), U,
         r"^--ep/--top-k/.*: expected --experts > 0 \(or an MoE --model such as moe-tiny\)"),
    Case("flag-ep-with-tp-not-dividing-dp", _flags,
         lambda: ("--nproc", "4", "--tp", "2", "--experts", "4", "--ep", "4"), U,
         r"^--ep: expected a divisor of the data-parallel size 2 \(--dp\), got 4"),
    Case("flag-ep-with-lamb", _flags, lambda: ("--model", "moe-tiny", "--ep", "2", "--optimizer", "lamb"), U,
         r"^--optimizer: expected adamw with --ep > 1 .*got lamb"),
]
if not torch.cuda.is_available():
    TRAIN.append(Case("flag-device-cuda", _flags, lambda: ("--device", "cuda"), U,
                      r"^--device cuda: expected a CUDA device, but torch sees none"))

TABLES = {"train flags": TRAIN}


@pytest.mark.parametrize("case", params(TRAIN))
def test_flag(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --data / --out files of the rows are made here
    case.check()


def test_case_count(capsys):
    assert print_census(__name__, capsys) >= TARGET
