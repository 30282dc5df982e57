"""What the ZeRO tests share (tests/test_zero*.py, the checkpoint tests): the model, data and
hyperparameters, the single-process reference runs and a rank's training loop."""
from __future__ import annotations

import torch
import torch.distributed as dist

import zerofuse
from zerofuse.models import GPT, GPTConfig
from zerofuse.optim import FusedAdamW, FusedLAMB, FusedLARS

from tolerances import assert_close_training

CFG = dict(vocab_size=65, seq_len=32, n_layer=3, n_head=4, n_kv_head=2, dim=64)
GLOBAL_BATCH, SEQ = 12, 16  # divisible by world sizes 2, 3 and 4
STAGES = (0, 1, 2, 3)
LR, WD, MAX_NORM = 1e-3, 0.01, 0.5


def make_model(precision="fp32", **over):
    model = GPT(GPTConfig(**{**CFG, **over}), seed=0)
    return model.to(zerofuse.zero.engine.PRECISIONS[precision])


def batches(steps, gb=GLOBAL_BATCH, seed=123):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 65, (gb, SEQ + 1), generator=g) for _ in range(steps)]


def mean_over_ranks(x: torch.Tensor) -> float:
    t = x.detach().float().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def full_state(model) -> dict:
    with zerofuse.zero.full_params(model):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def clip_now(i: int) -> bool:
    return i % 2 == 1  # clipping on odd steps: both the clipped and the plain step are covered


# ---------------------------------------------------------------------------- single process


def reference_run(steps, precision="fp32", kind="adamw", param_groups=None, micro=1, model_over=None, clip=True, **hp):
    """Losses (mean over the global batch), clip norms and final params of single-process training."""
    model = make_model(precision, **(model_over or {}))
    params = list(model.parameters())
    if param_groups is not None:
        params = param_groups(model)
    if kind == "adamw" and precision == "fp32":
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    elif kind == "adamw":
        opt = FusedAdamW(params, lr=LR, weight_decay=WD, master_weights=True)
    elif kind == "lamb":
        opt = FusedLAMB(params, lr=LR, weight_decay=WD, **hp)
    else:
        opt = FusedLARS(params, lr=0.1, momentum=0.9, weight_decay=1e-4)
    losses, norms = [], []
    for i, b in enumerate(batches(steps)):
        total = 0.0
        for part in b.chunk(micro):
            _, loss = model(part[:, :-1], part[:, 1:])
            (loss / micro).backward()
            total += loss.item() / micro
        losses.append(total)
        if clip and kind == "adamw" and clip_now(i):
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    return losses, norms, {n: p.detach().float().clone() for n, p in model.named_parameters()}


def reference_pair(steps, micro, **kw):
    """reference_run of the whole batch, and the params of the same run with the batch split into
    ``micro`` micro-batches (how the ranks split it) and 2, 3 and 4 ways (how ranks of the other
    world sizes split it): the reorderings assert_close_params allows."""
    ref = reference_run(steps, **kw)
    alts = [reference_run(steps, **{**kw, "micro": m})[2] for m in sorted({micro, 2, 3, 4})]
    return (*ref, alts)


def assert_close_params(got: dict, ref: dict, alts: list[dict], what="") -> None:
    for name, want in ref.items():
        assert_close_training(got[name], want, [alt[name] for alt in alts], msg=f"{what} {name}")


# ---------------------------------------------------------------------------- ranks


def _train(rank, ws, model, opt, steps, *, micro=1, clip=True, no_sync=True, set_to_none=True):
    per = GLOBAL_BATCH // ws
    losses, norms = [], []
    for i, b in enumerate(batches(steps)):
        mine = b[rank * per:(rank + 1) * per]
        total = 0.0
        parts = mine.chunk(micro)
        for j, part in enumerate(parts):
            ctx = model.no_sync() if (no_sync and j < len(parts) - 1) else _null()
            with ctx:
                _, loss = model(part[:, :-1], part[:, 1:])
                (loss / micro).backward()
            total += mean_over_ranks(loss) / micro
        losses.append(total)
        if clip and clip_now(i):
            norms.append(opt.clip_grad_norm_(MAX_NORM).item())
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return losses, norms


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _zero_adamw(ws, **parallelize_kw):
    """(model, engine, AdamW, sequences per rank) for a fresh model parallelized with the kwargs."""
    model = make_model()
    zerofuse.zero.parallelize(model, **parallelize_kw)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=WD)
    return model, model._zerofuse_zero, opt, GLOBAL_BATCH // ws
