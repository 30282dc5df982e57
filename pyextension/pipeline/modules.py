"""Splitting a model given as an ordered list of modules (``split_modules``): each module called on
the previous one's output, a ``loss_fn(output, targets)`` on the last stage (zerofuse.pipeline.stage
splits zerofuse's GPT and holds the Stage)."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from zerofuse.pipeline.stage import NAME, Stage, _check_ids, _materialize, _release


def split_modules(modules, num_stages: int, stage_ids: Sequence[int], *, loss_fn: Callable | None = None,
                  layout: Sequence[int] | None = None, device=None) -> list[Stage]:
    """Stages of a model given as an ordered list of (name, module) or an ``nn.Sequential``:
    each module takes the previous one's output (a tensor or a tuple of tensors); the last stage
    applies ``loss_fn(output, targets)`` when targets are given. layout: modules per stage
    (default: balanced by parameters, at least one module per stage)."""
    if isinstance(modules, torch.nn.Sequential):  # (named_children() skips a module's second use: it
        modules = list(modules._modules.items())  # trained another model, silently; 2026-12-07)
    modules = list(modules)
    _check_ids(stage_ids, num_stages)
    if not modules or not all(isinstance(m, tuple) and len(m) == 2 and isinstance(m[1], torch.nn.Module)
                              for m in modules):
        raise ValueError(f"{NAME}: expected modules to be an nn.Sequential or a non-empty list of (name, module), got "
                         f"{type(modules).__name__}")
    if layout is None:
        sizes = [sum(p.numel() for p in m.parameters()) or 1 for _, m in modules]
        counts = _balance_counts(sizes, num_stages)
    else:
        counts = [int(c) for c in layout]
        if len(counts) != num_stages or sum(counts) != len(modules) or min(counts) < 1:
            raise ValueError(f"{NAME}: expected layout to give {num_stages} stages of >= 1 module summing to "
                             f"{len(modules)}, got {list(layout)}")
    starts = [sum(counts[:s]) for s in range(num_stages)]
    _check_shared(modules, starts, counts)
    stages, kept = [], set()
    for s in stage_ids:
        parts = modules[starts[s]:starts[s] + counts[s]]
        _materialize([m for _, m in parts], device, None)
        kept.update(id(p) for _, m in parts for p in m.parameters())
        stages.append(Stage(parts, _chain_runner([m for _, m in parts], loss_fn if s == num_stages - 1 else None),
                            s, num_stages))
    _release([m for _, m in modules], kept)
    return stages


def _check_shared(modules, starts, counts) -> None:
    """A param or buffer used by two stages would be two copies on two ranks, each trained on its own
    stage's part of the grad (they drifted apart, silently: a review's reproduction, 2026-12-07); a
    module of neither (an activation, a dropout) may run on several."""
    where: dict[int, tuple[int, str]] = {}
    for s, (start, n) in enumerate(zip(starts, counts)):
        for name, module in modules[start:start + n]:
            for key, what in [(id(t), f"{name}.{tn}") for tn, t in (*module.named_parameters(),
                                                                    *module.named_buffers())]:
                seen = where.setdefault(key, (s, what))
                if seen[0] != s:
                    raise ValueError(f"{NAME}: {what!r} is also {seen[1]!r}, on stage {seen[0]}: expected each param "
                                     f"and buffer on one stage (split_modules keeps no copies in step; split_gpt "
                                     f"ties its embeddings), got it on stages {seen[0]} and {s}; pass a layout "
                                     "that keeps its uses on one stage")


def _balance_counts(sizes: list[int], num_stages: int) -> list[int]:
    n = len(sizes)
    if num_stages > n:
        raise ValueError(f"{NAME}: cannot split {n} modules into {num_stages} stages")
    # binary search on the largest stage size, greedy fill
    lo, hi = max(sizes), sum(sizes)

    def fits(cap):
        counts, acc = [0], 0
        for i, x in enumerate(sizes):
            left_modules, left_stages = n - i, num_stages - len(counts) + 1
            if counts[-1] and (acc + x > cap or left_modules < left_stages):
                counts.append(0)
                acc = 0
            counts[-1] += 1
            acc += x
        return counts if len(counts) <= num_stages else None

    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    counts = fits(lo)
    while len(counts) < num_stages:  # split the largest count to reach num_stages
        i = max(range(len(counts)), key=lambda k: counts[k])
        counts[i:i + 1] = [counts[i] - counts[i] // 2, counts[i] // 2]
    return counts


def _chain_runner(modules: list, loss_fn: Callable | None) -> Callable:
    def run(*inputs, targets=None):
        out = inputs if len(inputs) > 1 else inputs[0]
        for m in modules:
            out = m(*out) if isinstance(out, tuple) else m(out)
        if loss_fn is not None and targets is not None:
            return loss_fn(out, targets)
        return out if isinstance(out, tuple) else (out,)

    return run
