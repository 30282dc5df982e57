"""Rank 0's reporting: progress, metrics.jsonl, TensorBoard, summary.json, the summary table, loss.png."""
from __future__ import annotations

import dataclasses
import json
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .cli import PROG
from .table import _plot, _plural, _table

if TYPE_CHECKING:
    from .loop import Trainer

# dense bf16 tensor-core peaks, the first name found in the device's name (PCIe and NVL before SXM:
# "NVIDIA H100 PCIe" matched "H100", 989 for its 756, MFU 1.31x too low; a review, 2026-12-06)
PEAK_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12,
              "A100": 312e12}


class RankZeroLog:
    """Progress bar / lines, metrics.jsonl, TensorBoard, summary.json, the summary table, loss.png."""

    def __init__(self, trainer: Trainer):
        self.t, self.args = trainer, trainer.args
        self.out = Path(self.args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out / "metrics.jsonl"
        # an earlier run's summary and plot go: this run writes its own at its end (a run that failed
        # before left the last one's beside its own metrics; a review's reproduction, 2026-12-07)
        for name in ("summary.json", "loss.png"):
            (self.out / name).unlink(missing_ok=True)
        self.history = self._trim_metrics(trainer.step)
        self.metrics = open(self.metrics_path, "a")
        try:
            from tqdm import tqdm
        except ImportError:  # a machine installed with --no-deps: progress lines only
            tqdm = _Lines
        self.tty = sys.stderr.isatty() and tqdm is not _Lines
        self.every = trainer.log_every
        self.bar = tqdm(total=self.args.steps, initial=trainer.step, disable=not self.tty, dynamic_ncols=True,
                        desc="train", unit="step")
        # (a resumed run's events past the checkpoint's step are the stopped run's: TensorBoard drops
        # them at this run's first event, as metrics.jsonl's are trimmed; they showed twice before)
        self.tb = _tensorboard(self.out, trainer.step + 1 if self.args.resume and trainer.step else None)
        self.resume_val = None  # (step, val loss) at a resume, when the kept records lack it

    def _trim_metrics(self, step: int) -> list[dict]:
        """Drop lines past the checkpoint we resume from (a stopped run may have logged beyond it);
        returns the records kept. A last line cut short (a kill or a full disk during its write) is
        past the checkpoint too: dropped (json.loads of it crashed the resumed job); a line that does
        not parse before the last is refused, by file and line."""
        if not self.metrics_path.exists() or not self.args.resume:
            self.metrics_path.write_text("")
            return []
        lines = [ln for ln in self.metrics_path.read_text().splitlines() if ln.strip()]
        keep = []
        for i, ln in enumerate(lines):
            try:
                rec = json.loads(ln)
                at = rec["step"]
            except (ValueError, TypeError, KeyError) as e:
                if i == len(lines) - 1:
                    break
                raise RuntimeError(f"{PROG}: {self.metrics_path} line {i + 1} is no metrics record ({e}); expected "
                                   "one JSON object with a 'step' per line (as zerofuse-train writes them)") from None
            if at <= step:
                keep.append((ln, rec))
        self.metrics_path.write_text("".join(ln + "\n" for ln, _ in keep))
        return [rec for _, rec in keep]

    def write(self, line: str) -> None:
        self.bar.write(line, file=sys.stdout)
        sys.stdout.flush()

    def start(self, val: float) -> None:
        t, a = self.t, self.args
        if t.step and not any(m["step"] == t.step and "val_loss" in m for m in self.history):
            self.resume_val = {"step": t.step, "val_loss": val}
        sp = ", sequence parallel" if a.sequence_parallel else ""
        pp = f"pp {a.pp} ({a.pp_schedule}, {a.microbatches} micro-batches) × " if a.pp > 1 else ""
        self.write(f"{PROG}: {_plural(t.world, 'rank')} ({pp}dp {a.dp} × tp {a.tp}{sp}), "
                   f"ZeRO-{a.zero_stage}, {a.precision}, {a.optimizer}, {t.device.type}; model {a.model_name} "
                   f"{t.n_params / 1e6:.2f}M params ({t.cfg.n_layer} layers, {t.cfg.n_head} heads, "
                   f"{t.cfg.n_kv_head} kv heads, dim {t.cfg.dim}, seq {t.cfg.seq_len}, vocab {t.cfg.vocab_size}, "
                   f"{t.corpus.kind} tokens); {a.steps} steps of {a.dp * a.batch * a.grad_accum} sequences")
        if t.device.type == "cuda" or a.cuda_graphs:
            self.write(f"cuda graphs: {graphs_state(t)}")
        if t.compiled:
            self.write(f"torch.compile: {t.compiled} (compiled at its first call: the first log window)")
            if a.activation_checkpointing == "selective" and getattr(t, "recompute_compiled", None) == "full":
                # (with --activation-offload the checkpoint stays eager around the compiled forward, where
                # the policy sees inductor's out= matmuls, which it must not cache; recompute.compile_block)
                self.write("activation checkpointing: selective recomputes the matmuls too under per-block "
                           "compile with --activation-offload (full's memory and recompute)")
        if (split := offload_split(t)) is not None:  # (the ratio asked for went unsaid, and whole units
            # may round it to all or nothing: a review's reproduction, 2026-12-07)
            asked, got = split
            self.write(f"offload: {a.offload}, {got:.1%} of this rank's optimizer shard stepped on the host "
                       f"(--offload-ratio {a.offload_ratio}{f', measured {asked:.3f}' if a.offload_ratio == 'auto' else ''}"
                       f"; the units first ready in backward, whole)")
        for note in getattr(t, "notes", []):
            self.write(note)
        where = f"resumed at step {t.step}" if t.step else "step 0"
        self.write(f"{where}: val loss {val:.4f}")
        if self.tb and (t.step == 0 or self.resume_val):
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
        elif self.args.sample_tokens and self.args.pp > 1 and not signum:  # (it was skipped without a word)
            print(f"{PROG}: note: no sample with --pp {self.args.pp} (each stage holds part of the model; "
                  f"zerofuse.checkpoint.consolidate('{self.t.ckpt}') gives the whole one)", flush=True)
        # (the step-0 val and the resume's: a resumed run's plot had neither, 2026-12-07)
        first = self.t.initial_val_loss
        points = ([{"step": 0, "val_loss": first}] if first is not None else []) + self.history
        _plot(points + ([self.resume_val] if self.resume_val else []), self.out / "loss.png")

    def _summary(self, memory, train_s, final_val, signum) -> dict:
        t, a = self.t, self.args
        runs = [m for m in self.history if m["step"] > t.start_step]
        steady = steady_runs(runs)
        step_time = _mean([m["step_time"] for m in steady])
        # (over the step time's records: the launch-counting step was in this mean only, 2026-12-06)
        comm = _mean([m["comm_time"] for m in steady if m["comm_time"] is not None]) if t.device.type == "cpu" else None
        tokens = a.dp * a.batch * a.grad_accum * t.cfg.seq_len
        tok_s = tokens / step_time if step_time else None
        return {
            "world_size": t.world, "pp": a.pp, "dp": a.dp, "tp": a.tp, "sequence_parallel": a.sequence_parallel,
            "zero_stage": a.zero_stage, "offload": a.offload,
            "offload_host_fraction": (offload_split(t) or (None, None))[1], "precision": a.precision, "optimizer": a.optimizer, "device": t.device.type,
            "device_name": torch.cuda.get_device_name(t.device) if t.device.type == "cuda" else "cpu",
            "model": {"preset": a.model_name, "params": t.n_params, "active_params": t.n_active_params,
                      **dataclasses.asdict(t.cfg)},
            "steps": a.steps, "steps_done": t.step, "start_step": t.start_step, "tokens_per_step": tokens,
            "stopped_by": signal.Signals(signum).name if signum else None,
            "wall_s": time.time() - t.t_start, "train_s": train_s,
            "tokens_per_s": tok_s, "tokens_per_s_per_rank": tok_s / t.world if tok_s else None,
            "step_time_s": step_time, "comm_time_s": comm,
            "compute_time_s": step_time - comm if comm is not None and step_time else None,
            "mfu": _mfu(t, tok_s), "memory_per_rank": memory,
            "initial_val_loss": t.initial_val_loss,  # (the step-0 one, a resumed run's too)
            "final_train_loss": runs[-1]["loss"] if runs else None,
            "skipped_steps": sum(1 for m in runs if m.get("skipped")),
            "final_val_loss": final_val[0], "final_val_step": final_val[1],
            "pipeline": getattr(t, "pipeline_report", None), "cuda_graphs": graphs_state(t), "compiled": t.compiled,
            "launches": t.launches, "kernels": _kernel_path(t),
            "moe": _moe_summary(t, runs),
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


def _kernel_path(t: Trainer) -> str:
    """Which kernels the step ran: cuda, triton-interpreter (CPU tensors through the Triton kernels:
    the CUDA path's launches) or cpu."""
    from zerofuse import kernels
    return "cuda" if t.device.type == "cuda" else ("triton-interpreter" if kernels.triton_on_cpu() else "cpu")


def graphs_state(t: Trainer) -> str:
    """--cuda-graphs as it stands: on (and when it was captured), or off and why."""
    return t.graphs.describe() if t.graphs is not None else f"off: {t.graphs_off}"


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def steady_step_time(runs: list[dict]) -> float | None:
    """Mean step time of the steady records (steady_runs)."""
    return _mean([m["step_time"] for m in steady_runs(runs)])


def steady_runs(runs: list[dict]) -> list[dict]:
    """The records without the warm-up (compilation, autotuning, caches): without the first step
    where each step was timed (CPU), without the first log window where a window's wall time was
    shared by its steps (CUDA: records with a log_window), without the step that counted launches
    and the step that captured the CUDA graph (and their windows), unless nothing else was run.
    Every steady figure (step time, its communication part) is a mean over these same records."""
    first = runs[0].get("log_window") if runs else None
    # the launch-counting step (~2.4x slower) and the CUDA-graph capture's are no steady steps; where
    # windows are timed, their window's steps share their time: the window is left out
    odd = [m for m in runs if m.get("instrumented") or m.get("graph_capture")]
    if first is None:
        odd_ids = {id(m) for m in odd}
        steady = [m for m in runs[1:] if id(m) not in odd_ids]
    else:
        left_out = {first} | {m.get("log_window") for m in odd}
        steady = [m for m in runs if m.get("log_window") not in left_out]
    return steady or runs


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
    # MoE: the params a token uses; embeddings that are lookups only are no FLOPs (they inflated MFU
    # by 7% on llama3-8b's untied 0.5B)
    flops_per_token = 6 * t.n_flop_params + 12 * c.n_layer * c.dim * c.seq_len
    return flops_per_token * tok_s / (peak * t.world)


def _moe_summary(t: Trainer, runs: list[dict]) -> dict | None:
    """The routers' figures: load balance, aux and z losses of the last log window, dropped choices
    over the run, the all-to-all time exposed per step (mean over the windows after the first)."""
    from zerofuse.zero.engine import PRECISIONS
    figs = [m["moe"] for m in runs if m.get("moe")]
    if not figs:
        return None
    last = figs[-1]
    counted = [m["moe"] for m in runs if m.get("moe") and not m.get("instrumented")]  # (the launch counting's)
    a2a = [f["a2a_exposed_s_per_step"] for f in counted[1:] or counted if f["a2a_exposed_s_per_step"] is not None]
    c = t.cfg
    return {"experts": c.moe_experts, "top_k": c.moe_top_k, "ep": t.args.ep, "layers": len(last["max_over_mean_load"]),
            "max_over_mean_load": last["max_over_mean_load"], "window_steps": last["steps"],
            "dropped": sum(f["dropped"] for f in figs), "aux_loss": last["aux_loss"], "z_loss": last["z_loss"],
            "a2a_bytes_per_step": last["a2a_bytes_per_step"] if t.args.ep > 1 else 0,
            # dispatch, combine and their backward: every (token, choice) row once each, dropless;
            # activation checkpointing runs the forward's two again in backward (6, not 4); each TP
            # rank that routes the same tokens (Stats.replicas) sends them too
            "a2a_bytes_per_step_analytic": ((4 if t.args.activation_checkpointing == "none" else 6) * t.args.dp
                                            * t.moe.replicas
                                            * t.args.batch * t.args.grad_accum * c.seq_len * c.moe_top_k
                                            * c.dim * PRECISIONS[t.args.precision].itemsize
                                            * len(last["max_over_mean_load"]) if t.args.ep > 1 else 0),
            "a2a_exposed_ms_per_step": 1e3 * _mean(a2a) if a2a else None}


def _tensorboard(out: Path, purge_step: int | None):
    """A SummaryWriter on out/tensorboard; purge_step: TensorBoard drops the events already written at
    or past it (a resume's, past its checkpoint)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # tensorboard not installed: optional
        return None
    return SummaryWriter(str(out / "tensorboard"), purge_step=purge_step)


def offload_split(t) -> tuple[float, float] | None:
    """With --offload: (the ratio the engine used, --offload-ratio or auto's measured one; the
    fraction of this rank's optimizer shard its host units hold: zero/offload.py host_units rounds
    to whole units), else None."""
    eng = getattr(t.model, "_zerofuse_zero", None)
    if eng is None or not eng.offload:
        return None
    total = sum(u.shard_numel for u in eng.units)
    host = sum(u.shard_numel for u in eng.units if u.index in eng.host_units)
    return float(eng.offload_ratio), host / total if total else 0.0

