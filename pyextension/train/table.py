"""The run's summary as text (the table rank 0 prints at the end of zerofuse-train) and its loss
curve as loss.png; report.py gathers the figures."""
from __future__ import annotations

import sys
from pathlib import Path

from .cli import PROG


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _fmt_bytes(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2 ** 20:.1f} MiB"


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
        per = "no layer on this rank" if lc["per_layer"] is None else f"{lc['per_layer']:.1f} per layer"
        rows.append(("launches", f"{lc['launches']} {what} per step ({per}: {lc['triton']} "
                                 f"Triton, {lc['aten']} aten/C++), {lc['hooks']} Python hooks (step {lc.get('step', 2)})"))
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
    if s.get("skipped_steps"):
        rows.append(("skipped steps", f"{s['skipped_steps']} (fp16 overflow or a non-finite grad norm: the optimizer "
                                      "left the params; metrics.jsonl flags them)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"{PROG} summary"] + [f"  {k:<{width}}  {v}" for k, v in rows])


def _plot(history: list[dict], path: Path) -> None:
    """loss.png through matplotlib's object API: no pyplot, so the caller's backend and figures are
    left alone (matplotlib.use("Agg") here switched a notebook's backend for the whole process)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print(f"{PROG}: matplotlib is not installed, no {path.name}", file=sys.stderr)
        return
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    train = [m for m in history if "loss" in m]
    ax.plot([m["step"] for m in train], [m["loss"] for m in train], label="train", linewidth=1)
    val = sorted((m["step"], m["val_loss"]) for m in history if "val_loss" in m)
    if val:
        ax.plot(*zip(*val), "o-", label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
