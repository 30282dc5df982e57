"""The optimizer side of a checkpoint, for both formats: whose optimizer it is, which update rule it
runs (a plain torch optimizer's too), its param groups, its options as plain values, and fp16's loss
scale. Each check runs before anything is loaded."""
from __future__ import annotations

import torch


def check_owner(optimizer, eng, who) -> None:
    """The optimizer must be the zero.Optimizer built on this model (another one's params are not
    this engine's: a KeyError on an object id before)."""
    if optimizer is not None and getattr(optimizer, "engine", None) is not eng:
        whose = "of a different model" if hasattr(optimizer, "engine") else "(not a zerofuse.zero.Optimizer)"
        raise ValueError(f"{who}: expected optimizer to be the zerofuse.zero.Optimizer built on this model, got a "
                         f"{type(optimizer).__name__} {whose}")


def plain_options(group: dict) -> dict:
    """A param group's options as plain values (a tensor lr, as sync_lr takes, as its float)."""
    return {k: (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v) for k, v in group.items()
            if k != "params"}


def restore_scale(optimizer, saved_precision: str, scale, growth_tracker) -> None:
    """fp16's loss scale and growth tracker, only from an fp16 run into an fp16 run: a bf16/fp32 run
    has no scale (restored from fp16 it kept dividing the grads by 65536), and an fp16 run resumed
    from another precision starts from its own initial_scale (restored, it started from 1)."""
    if optimizer.fp16 and saved_precision == "fp16" and scale is not None:
        optimizer.scale.fill_(scale)
        optimizer._growth_tracker.fill_(growth_tracker)


def kind_of(optimizer) -> str | None:
    """The update rule of a torch-style optimizer, in zerofuse.zero.Optimizer's names ('adamw',
    'adam', 'lamb', 'lars'; another torch.optim class: its name lowercased); None for a class that
    is not a torch.optim.Optimizer (its state is its own business)."""
    from zerofuse.optim import FusedLAMB, FusedLARS  # noqa: PLC0415

    if isinstance(optimizer, FusedLAMB):
        return "lamb"
    if isinstance(optimizer, FusedLARS):
        return "lars"
    if isinstance(optimizer, torch.optim.Adam):  # AdamW is an Adam with decoupled_weight_decay=True
        decoupled = isinstance(optimizer, torch.optim.AdamW) or any(
            g.get("decoupled_weight_decay", False) for g in optimizer.param_groups)
        return "adamw" if decoupled else "adam"
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer).__name__.lower()
    return None


def saved_kind(groups: list[dict]) -> str | None:
    """'adamw' / 'adam' from torch's decoupled_weight_decay option in saved param groups (a DCP
    checkpoint records no optimizer kind); None where the groups do not say."""
    flags = {g["decoupled_weight_decay"] for g in groups if "decoupled_weight_decay" in g}
    return None if len(flags) != 1 else ("adamw" if flags.pop() else "adam")


# torch optimizer options that change the update zerofuse's optimizers do not make
_UNSUPPORTED = ("maximize", "amsgrad", "nesterov")


def check_torch_options(groups: list[dict], who: str, root: str) -> None:
    """A torch optimizer's saved groups with an option zerofuse's optimizer lacks are refused (a run
    saved with maximize=True resumed as gradient descent, amsgrad's max_exp_avg_sq was dropped)."""
    for i, g in enumerate(groups):
        for key in _UNSUPPORTED:
            if g.get(key):
                raise ValueError(f"{who}: the checkpoint at {root!r} was saved by an optimizer with {key}={g[key]!r} "
                                 f"(param group {i}); zerofuse.zero.Optimizer has no {key}: load with optimizer=None "
                                 "to take the weights only")


def check_kind(saved: str | None, mine: str | None, who: str, where: str) -> None:
    """An optimizer given another update rule's state (adamw's moments in an SGD, or in an Adam that
    then applied L2 decay instead of decoupled decay) is refused; unknown on either side passes."""
    if saved is not None and mine is not None and saved != mine:
        raise ValueError(f"{who}: the checkpoint's optimizer is {saved!r}, this one is {mine!r} ({where}); "
                         "load with optimizer=None to take the weights only")


def check_optimizer(optimizer, opt_meta, eng, who) -> list[int] | None:
    if optimizer is None:
        return
    check_owner(optimizer, eng, who)
    if opt_meta is None:
        raise ValueError(f"{who}: the checkpoint holds no optimizer state (saved without an optimizer)")
    check_kind(opt_meta["kind"], optimizer.kind, who, "zerofuse.zero.Optimizer")
    return group_match(optimizer, opt_meta["param_groups"], eng, who)


def group_match(optimizer, saved_groups: list[dict], eng, who) -> list[int]:
    """For each of the optimizer's param groups, the saved group holding the same params (by name;
    the saved group may hold other pipeline stages' params too: a stage without norms has no
    no-decay group, the others have, so the groups are matched by their params, not their
    position - by position one stage's checkpoint could not be resumed, a review's reproduction,
    2026-12-06)."""
    known = set(eng.names)
    where = {n: j for j, saved in enumerate(saved_groups) for n in saved["params"] if n in known}
    match = []
    for i, g in enumerate(optimizer.param_groups):
        mine = {eng.names[eng.param_index[id(p)]] for p in g["params"]}
        js = {where.get(n) for n in mine}
        j = next(iter(js)) if len(js) == 1 else None
        theirs = {n for n in saved_groups[j]["params"] if n in known} if j is not None else set()
        if None in js:
            raise ValueError(f"{who}: the optimizer's param group {i} holds params in no param group of the "
                             f"checkpoint: {sorted(n for n in mine if n not in where)[:5]}")
        if len(js) > 1:
            raise ValueError(f"{who}: the optimizer's param group {i} holds params of the checkpoint's param groups "
                             f"{sorted(js)} (one group each saved): a checkpoint of other param groups")
        if mine != theirs:  # (named: it said only that the groups differ)
            raise ValueError(f"{who}: the checkpoint's param group {j} holds other params than the optimizer's param "
                             f"group {i}: only saved {sorted(theirs - mine)[:5]}, only in the optimizer "
                             f"{sorted(mine - theirs)[:5]}")
        match.append(j)
    left = set(where.values()) - set(match)
    if left:
        j = min(left)
        names = sorted(n for n in saved_groups[j]["params"] if n in known)
        raise ValueError(f"{who}: the checkpoint's param group {j} holds params {names[:5]} in no param group of "
                         f"the optimizer")
    return match


def by_name(model, optimizer, full: dict, who: str, path: str) -> dict:
    """The consolidated optimizer state renumbered for ``optimizer``'s own param order, matched by
    name (torch's load_state_dict hands saved states out by position: an optimizer listing the
    same params in another order got other params' moments, silently where shapes agreed; a
    review's reproduction, 2026-12-06). Each group must hold the params of the saved group at its
    position (its options go with it)."""
    names = full.get("optimizer_names")
    saved = full["optimizer"]
    if names is None:
        return saved
    mine: dict[int, set[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        mine.setdefault(id(p), set()).add(n)
    state, groups, k = {}, [], 0
    for gi, (g, s) in enumerate(zip(optimizer.param_groups, saved["param_groups"])):
        index = {names[i]: i for i in s["params"]}
        params = []
        for p in g["params"]:
            hit = sorted(mine.get(id(p), set()) & index.keys())
            if not hit:
                got = sorted(mine.get(id(p), ())) or ["a tensor that is not a param of the model"]
                raise ValueError(f"{who}: param group {gi} of the optimizer holds {got[0]!r}, which the checkpoint at "
                                 f"{path!r} has in no param group {gi} (it holds {sorted(index)[:4]}"
                                 f"{' ...' if len(index) > 4 else ''}); expected the groups of the run that saved it")
            if index[hit[0]] in saved["state"]:
                state[k] = saved["state"][index[hit[0]]]
            params.append(k)
            k += 1
        groups.append({**s, "params": params})
    return {**saved, "state": state, "param_groups": groups}
