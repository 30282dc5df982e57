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

if TYPE_CHECKING:
    from .loop import Trainer

PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 tensor-core peaks


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
        self.every = trainer.log_every
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
        step_time = steady_step_time(runs)
        comm = _mean([m["comm_time"] for m in runs[1:] or runs if m["comm_time"] is not None]) if t.device.type == "cpu" else None
        tokens = a.dp * a.batch * a.grad_accum * t.cfg.seq_len
        tok_s = tokens / step_time if step_time else None
        return {
            "world_size": t.world, "pp": a.pp, "dp": a.dp, "tp": a.tp, "sequence_parallel": a.sequence_parallel,
            "zero_stage": a.zero_stage, "offload": a.offload, "precision": a.precision, "optimizer": a.optimizer, "device": t.device.type,
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
            "initial_val_loss": self.initial_val if t.start_step == 0 else None,
            "final_train_loss": runs[-1]["loss"] if runs else None,
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


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _fmt_bytes(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2 ** 20:.1f} MiB"


def steady_step_time(runs: list[dict]) -> float | None:
    """Mean step time without the warm-up (compilation, autotuning, caches): without the first step
    where each step was timed (CPU), without the first log window where a window's wall time was
    shared by its steps (CUDA: records with a log_window), unless nothing else was run."""
    first = runs[0].get("log_window") if runs else None
    if first is None:
        steady = runs[1:] or runs
    else:
        steady = [m for m in runs if m.get("log_window") != first] or runs
    return _mean([m["step_time"] for m in steady])


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
    flops_per_token = 6 * t.n_active_params + 12 * c.n_layer * c.dim * c.seq_len  # MoE: the params a token uses
    return flops_per_token * tok_s / (peak * t.world)


def _table(s: dict) -> str:
    def num(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    gpu_comm = "n/a on CUDA (Work.wait only orders streams; profile for exposed communication)"
    rows = [
        ("layout", f"{_plural(s['world_size'], 'rank')} = {'pp %d × ' % s['pipeline']['pp'] if s['pipeline'] else ''}"
                   f"dp {s['dp']} × tp {s['tp']}{' (ep %d)' % s['moe']['ep'] if s['moe'] else ''}, "
                   f"ZeRO-{s['zero_stage']}{' (offload ' + s['offload'] + ')' if s['offload'] != 'none' else ''}, "
                   f"{s['precision']}, {s['optimizer']}, {s['device_name']}"),
        ("model", f"{s['model']['params'] / 1e6:.2f}M params"
                  + (f" ({s['model']['active_params'] / 1e6:.2f}M active per token)" if s["moe"] else "")),
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
    if (lc := s["launches"]) is not None:
        what = "kernel launches" if s["kernels"] != "cpu" else "kernel calls (the CPU kernels)"
        rows.append(("launches", f"{lc['launches']} {what} per step ({lc['per_layer']:.1f} per layer: {lc['triton']} "
                                 f"Triton, {lc['aten']} aten/C++), {lc['hooks']} Python hooks (step 2)"))
    if s["device"] == "cuda":
        rows.append(("cuda graphs", s["cuda_graphs"]))
    for r, m in enumerate(s["memory_per_rank"]):
        extra = f", CUDA max allocated {_fmt_bytes(m['cuda_max_allocated'])}" if "cuda_max_allocated" in m else ""
        for key, what in (("optimizer_host", "optimizer"), ("params_host", "param shards")):
            if key in m:
                extra += f", {what} offloaded to host {_fmt_bytes(m[key])}"
        rows.append((f"memory rank {r}", f"params {_fmt_bytes(m['params'])}, grads {_fmt_bytes(m['grads'])}, "
                                         f"optimizer {_fmt_bytes(m['optimizer'])}, max RSS "
                                         f"{_fmt_bytes(m['max_rss'])}{extra}"))
    if (pl := s["pipeline"]) is not None:
        measured = ", ".join(num(x, ".3f") for x in pl["bubble_measured_per_rank"])
        rows.append(("pipeline", f"{pl['schedule']}, {pl['microbatches']} micro-batches"
                                 f"{', %d virtual stages' % pl['virtual_stages'] if pl['virtual_stages'] > 1 else ''}; "
                                 f"bubble (idle fraction) per rank {measured}, formula {pl['bubble_formula']:.3f}"))
    if (mo := s["moe"]) is not None:
        a2a = mo["a2a_exposed_ms_per_step"]
        rows.append(("experts", f"{mo['experts']} per MoE layer, top-{mo['top_k']}, ep {mo['ep']}; max/mean load per "
                                f"layer (last {_plural(mo['window_steps'], 'step')}) "
                                f"{', '.join(format(x, '.2f') for x in mo['max_over_mean_load'])}; dropped "
                                f"{mo['dropped']:,} choices; aux {mo['aux_loss']:.4f}, z {mo['z_loss']:.4f}; "
                                f"all-to-all {mo['a2a_bytes_per_step'] / 2 ** 20:.2f} MiB/step (dropless count "
                                f"{mo['a2a_bytes_per_step_analytic'] / 2 ** 20:.2f}), exposed {num(a2a, '.1f')} ms/step"))
    rows.append(("loss", f"train {num(s['final_train_loss'], '.4f')}, val {s['final_val_loss']:.4f} at step "
                         f"{s['final_val_step']}" + (f" (initial val {s['initial_val_loss']:.4f})"
                                                     if s["initial_val_loss"] is not None else "")))
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"{PROG} summary"] + [f"  {k:<{width}}  {v}" for k, v in rows])


def _moe_summary(t: Trainer, runs: list[dict]) -> dict | None:
    """The routers' figures: load balance, aux and z losses of the last log window, dropped choices
    over the run, the all-to-all time exposed per step (mean over the windows after the first)."""
    from zerofuse.zero.engine import PRECISIONS
    figs = [m["moe"] for m in runs if m.get("moe")]
    if not figs:
        return None
    last = figs[-1]
    a2a = [f["a2a_exposed_s_per_step"] for f in figs[1:] or figs if f["a2a_exposed_s_per_step"] is not None]
    c = t.cfg
    return {"experts": c.moe_experts, "top_k": c.moe_top_k, "ep": t.args.ep, "layers": len(last["max_over_mean_load"]),
            "max_over_mean_load": last["max_over_mean_load"], "window_steps": last["steps"],
            "dropped": sum(f["dropped"] for f in figs), "aux_loss": last["aux_loss"], "z_loss": last["z_loss"],
            "a2a_bytes_per_step": last["a2a_bytes_per_step"] if t.args.ep > 1 else 0,
            # dispatch, combine and their backward: every (token, choice) row once each, dropless
            "a2a_bytes_per_step_analytic": (4 * t.args.dp * t.args.batch * t.args.grad_accum * c.seq_len * c.moe_top_k
                                            * c.dim * PRECISIONS[t.args.precision].itemsize
                                            * len(last["max_over_mean_load"]) if t.args.ep > 1 else 0),
            "a2a_exposed_ms_per_step": 1e3 * _mean(a2a) if a2a else None}


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
