"""zerofuse's own checkpoint format: every rank writes its shards, any layout reads them back.

Layout of a checkpoint directory (format 2):
    meta.json    world size, stage, precision, optimizer, param names/shapes, param groups, step
                 counts, loss scale, and the table of which param pieces each rank file holds
                 (name, unit, shard offset, length, offset in the flattened param); written last
    rank{r}.pt   rank r's shards: per unit the param shard (param dtype), the fp32 master and the
                 optimizer states
    common.pt    (rank 0) the buffers, frozen params and the caller's ``extra``
Tensors, numbers, strings, lists and dicts only (read with weights_only=True).

With tensor parallelism each TP rank's ZeRO group writes the layout above into ``tp{t}/`` and the
top-level meta.json holds the TP size and every sharded param's TPSpec. With pipeline parallelism
each stage writes its own params' layout (the above, with its TP parts) into ``pp{s}/`` and the
top-level meta.json holds the number of stages; any pipeline layout loads it (a stage reads the
params it holds from whichever saved stage has them), and ``consolidate`` (sources.py) merges the
stages.

Loading reads, for each piece of this rank's new shards, the overlapping pieces of the saved rank
files that hold them (found from meta.json; the other files are never opened), memory-mapped, on
the CPU, copied into the shards on their device. At another TP size one param at a time is
assembled from the TP parts and sliced: memory while loading stays within this rank's shards and
one full param (+ its TP parts). Saving follows [Note: checkpoint commit protocol] (files.py).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from zerofuse.checkpoint import files
from zerofuse.checkpoint.collective import agree, begin_save, on_one
from zerofuse.checkpoint.optim_checks import check_optimizer, check_owner, plain_options, restore_scale
from zerofuse.checkpoint.sources import FORMAT, VALUE, Full
from zerofuse.moe import expert_spec
from zerofuse.tp.spec import spec_of
from zerofuse.zero.engine import engine_of

NAME = files.NAME


def _ep(eng) -> int:
    """The expert-parallel size (1: no expert-parallel params)."""
    return eng.world_size // eng.edp_comm.world_size if eng.edp_comm is not None else 1


def _saving_ranks(eng) -> int:
    # stage 0: rank 0's copy is the checkpoint (with expert parallelism, ranks 0..ep-1 hold every expert once)
    return _ep(eng) if eng.stage == 0 else eng.world_size


def _table(eng, rank: int) -> list[list]:
    """The pieces rank ``rank``'s shards hold (the bucket layout is the same on every rank). Expert
    params (their own units, sharded over the expert-DP group) are recorded as pieces of the whole
    [E, ...] tensor: rank r holds experts (r % ep) * E/ep.. ([Note: expert-parallel mesh] in
    zerofuse/parallel.py), so any ep reads them back."""
    rows, ep = [], _ep(eng)
    for u in eng.units:
        expert = u.comm is not None
        if not expert and eng.stage == 0 and rank > 0:
            continue
        lo = (rank // ep if expert else rank) * u.shard_numel if eng.stage else 0
        for i, (p, o) in enumerate(zip(u.params, u.offsets)):
            a, b = max(o, lo), min(o + p.numel(), lo + u.shard_numel)
            base = (rank % ep) * p.numel() if expert else 0
            if a < b:
                rows.append([u.names[i], u.index, a - lo, b - a, a - o + base])
    return rows


def _saved_shape(p) -> list[int]:
    spec = expert_spec(p)
    return list(spec.full_shape if spec is not None else p.shape)


def refuse_frozen_experts(eng, model, who: str) -> None:
    """Expert-parallel tensors ZeRO does not manage (frozen experts' weights) are refused: each ep rank
    holds other experts, and the files hold such tensors once, from one rank (ep rank 0's experts
    were saved as every expert, loaded into every ep rank silently: a review's reproduction,
    2026-12-07)."""
    managed = {id(p) for p in eng.params}
    frozen = [n for n, t in model.state_dict(keep_vars=True).items()
              if id(t) not in managed and expert_spec(t) is not None]
    if frozen:
        raise NotImplementedError(f"{who}: expert-parallel params that do not train ({frozen[:3]}"
                                  f"{' ...' if len(frozen) > 3 else ''}: requires_grad=False when the model was "
                                  "made data-parallel) are not saved or loaded yet (each ep rank holds other experts); train "
                                  "them with lr 0 (a param group with lr=0, weight_decay=0), or use ep 1")


def save(path: str, model: torch.nn.Module, optimizer=None, *, extra=None) -> None:
    eng = engine_of(model, f"{NAME}.save")
    check_owner(optimizer, eng, f"{NAME}.save")
    refuse_frozen_experts(eng, model, f"{NAME}.save")
    if eng.stage != 3:
        eng.finish_param_sync()
    eng.flush_full_params()  # (inside full_params: the block's writes so far are what is saved)
    path = os.path.abspath(path)
    files.check_target(path, f"{NAME}.save")
    tp, pp = eng.tp_comm is not None, eng.pp_comm is not None
    # who coordinates: the ZeRO group's rank 0, or with TP / PP the world's (one ZeRO group per
    # TP rank and pipeline stage), with barriers over every rank
    group = None if tp or pp else eng.comm.group
    leader = dist.get_rank() == 0 if group is None else eng.rank == 0
    tmp = path + ".tmp"
    locked = False
    device = eng.units[0].device if eng.units else torch.device("cpu")
    try:
        locked, save_id = begin_save(path, leader, group, device, extra)
        stage_dir = os.path.join(tmp, f"pp{eng.pp_rank}") if pp else tmp  # each pipeline stage's own layout

        def make_stage_dir():
            os.makedirs(stage_dir)
            files.fsync_dir(tmp)

        on_one(pp and eng.rank == 0 and eng.tp_rank == 0, make_stage_dir, group, device,
               "could not make their pipeline stage's directory")
        # every stage's leader writes its meta.json last in _save_stage: all of them before the commit
        _save_stage(stage_dir, eng, model, optimizer, extra, group, device, save_id)

        def commit():
            if pp:
                files.fsync_dir(tmp)
                files.write_json(os.path.join(tmp, files.META), {"format": FORMAT, "pp": eng.pp_size,
                                                                 "save_id": save_id})
            files.commit(path)

        on_one(leader, commit, group, device, "could not commit the checkpoint")
    finally:  # (a save failed mid-way held the path's lock for the process's life: other saves waited forever)
        if locked:
            files.release(path)
    dist.barrier(group=group)


def _save_stage(directory: str, eng, model, optimizer, extra, group, device, save_id: int) -> None:
    """The ZeRO (and TP) layout of ``model``'s params into ``directory``, its meta.json last."""
    tp = eng.tp_comm is not None
    sub = os.path.join(directory, f"tp{eng.tp_rank}") if tp else directory

    def make_sub():
        os.makedirs(sub)
        files.fsync_dir(directory)

    on_one(tp and eng.rank == 0, make_sub, group, device, "could not make their TP rank's directory")
    error = None
    if eng.rank < _saving_ranks(eng):
        try:
            _write_shards(sub, eng, model, optimizer, extra, save_id)
        except Exception as e:  # (a full disk on one rank: the others went on into the next barrier)
            error = e
    agree(group, error, f"{NAME}.save", device, "could not write their part of the checkpoint")
    if error is not None:
        raise error
    def tp_meta():
        files.fsync_dir(sub)
        files.write_json(os.path.join(sub, files.META), _meta(eng, model, optimizer, save_id))
        files.fsync_dir(sub)

    if tp:
        on_one(eng.rank == 0, tp_meta, group, device, "could not write their TP rank's meta.json")

    def top_meta():
        if tp:
            # (and of TP-sharded frozen params, saved per TP part with the buffers in common.pt)
            specs = {n: spec.to_json() for n, p in (*zip(eng.names, eng.params), *model.state_dict(keep_vars=True).items())
                     if (spec := spec_of(p)) is not None}
            top = {"format": FORMAT, "tp": eng.tp_comm.world_size, "specs": specs, "save_id": save_id}
        else:
            top = _meta(eng, model, optimizer, save_id)
        files.fsync_dir(directory)
        files.write_json(os.path.join(directory, files.META), top)

    on_one(eng.rank == 0 and eng.tp_rank == 0, top_meta, group, device, "could not write the meta.json")


def _write_shards(directory: str, eng, model, optimizer, extra, save_id: int) -> None:
    units = []
    for u in eng.units:
        entry = {"param": u.shard}
        if optimizer is not None:
            entry.update(optimizer.unit_states[u.index])
        units.append(entry)
    files.write_tensors(os.path.join(directory, f"rank{eng.rank}.pt"), {"units": units, "save_id": save_id})
    if eng.rank == 0:
        managed = {id(p) for p in eng.params}
        rest = {n: t.detach() for n, t in model.state_dict(keep_vars=True).items() if id(t) not in managed}
        files.write_tensors(os.path.join(directory, "common.pt"), {"rest": rest, "extra": extra, "save_id": save_id})


def _meta(eng, model, optimizer, save_id: int) -> dict:
    return {
        "format": FORMAT, "save_id": save_id, "world_size": eng.world_size, "stage": eng.stage, "precision": eng.precision,
        "names": eng.names, "shapes": [_saved_shape(p) for p in eng.params],
        "tables": [_table(eng, r) for r in range(_saving_ranks(eng))],
        # state_dict names of params shared under another name (tied weights)
        "aliases": {n: eng.names[eng.param_index[id(t)]] for n, t in model.state_dict(keep_vars=True).items()
                    if id(t) in eng.param_index and n not in eng.names}
        | {a: n for a, n in getattr(model, "state_dict_aliases", {}).items() if n in eng.names},  # e.g. a pipeline stage's
        "optimizer": None if optimizer is None else {
            "kind": optimizer.kind,
            "state_keys": sorted(k for k in optimizer.unit_states[0] if k != "master") if optimizer.unit_states else [],
            "param_groups": [plain_options(g) | {
                "params": [eng.names[eng.param_index[id(p)]] for p in g["params"]]} for g in optimizer.param_groups],
            "steps": [float(s.item()) for s in optimizer._steps],
            "scale": float(optimizer.scale.item()),
            "growth_tracker": int(optimizer._growth_tracker.item()),
        },
    }


def check_model(saved: dict, names, shapes, who, everywhere=None) -> None:
    """names/shapes: the model's; everywhere: the names every pipeline stage of it holds (a stage
    holds some of the saved params), None: the model's names."""
    mine = dict(zip(names, (tuple(s) for s in shapes)))
    missing = [n for n in mine if n not in saved]
    unexpected = [n for n in saved if n not in (mine if everywhere is None else everywhere)]
    wrong = [f"{n}: saved {list(saved[n])}, model {list(mine[n])}" for n in mine if n in saved and saved[n] != mine[n]]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing in the checkpoint: {missing}")
        if unexpected:
            parts.append(f"not in the model: {unexpected}")
        if wrong:
            parts.append(f"shape mismatch: {wrong}")
        raise ValueError(f"{who}: the checkpoint is for a different model; " + "; ".join(parts))


@torch.no_grad()
def load(path: str, model: torch.nn.Module, optimizer=None):
    """Load into a ZeRO model (any world size, stage and TP size) and its zero.Optimizer."""
    who = f"{NAME}.load"
    eng = engine_of(model, who)
    refuse_frozen_experts(eng, model, who)
    full = Full(path)
    model_tp = eng.tp_comm.world_size if eng.tp_comm is not None else 1
    same_tp = full.tp == model_tp and full.parts is not None  # the fast path: this rank's own TP part
    src = full.parts[eng.tp_rank] if same_tp else None
    shapes = [_saved_shape(p) if same_tp or (spec := spec_of(p)) is None else spec.full_shape for p in eng.params]
    # a pipeline stage holds some of the saved params and buffers (the other stages load the rest):
    # what no stage holds is checked against the names of every stage (a checkpoint of a deeper
    # model loaded into pipeline stages without a word before: a review's reproduction, 2026-12-06)
    everywhere = _stage_names(model, eng)
    opt_meta = full.meta["optimizer"]
    group = None if eng.tp_comm is not None or eng.pp_comm is not None else eng.comm.group
    try:  # (every check: a stage's mismatch must not leave the other stages waiting in agree)
        try:
            check_model(src.shapes if same_tp else full.shapes, eng.names, shapes, who,
                        None if everywhere is None else everywhere[0])
        except ValueError as e:
            raise ValueError(f"{e}{_frozen_toggles(model, eng, full)}") from None
        match = check_optimizer(optimizer, opt_meta, eng, who)
        first = full.common()
        rest = _my_tp_parts(model, first.get("rest", {}))
        check_rest(model, eng, rest, who, None if everywhere is None else everywhere[1])  # nothing written yet
        keys = [VALUE] + (list(opt_meta["state_keys"]) if optimizer is not None else [])
        if src is not None:  # (the rank files: as the tables say; only those this rank reads)
            src.check(_wanted(eng), keys)
        else:
            full.check(eng.names, keys)
    except Exception as e:  # (any: the other ranks must not wait in a collective this rank never joins)
        agree(group, e, who, eng.units[0].device)
        raise
    agree(group, None, who, eng.units[0].device)  # every rank's files are sound: now each writes
    try:
        _fill_shards(eng, optimizer, opt_meta, full, src)
    except Exception as e:
        agree(group, e, who, eng.units[0].device)
        raise
    agree(group, None, who, eng.units[0].device)
    _finish_load(eng, model, optimizer, opt_meta, rest, full.meta["precision"], match)
    return first.get("extra")


def _my_tp_parts(model, rest: dict) -> dict:
    """The saved buffers and frozen params (TP-sharded ones whole) as this rank's model holds them:
    a TP-sharded frozen param sliced to this rank's part (each TP rank took TP rank 0's part)."""
    mine = model.state_dict(keep_vars=True)
    return {n: spec.slice(t) if n in mine and (spec := spec_of(mine[n])) is not None
            and tuple(t.shape) == tuple(spec.full_shape) else t for n, t in rest.items()}


def _frozen_toggles(model, eng, full) -> str:
    """The params a different model error comes from when their requires_grad changed since the
    save (ZeRO shards what trains; a frozen param is saved whole, with the buffers)."""
    rest = set(full.common().get("rest", {}))
    frozen_now = {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) not in eng.param_index}
    parts = []
    if trained_now := [n for n in eng.names if n in rest]:
        parts.append(f"frozen when saved, trained by this model: {trained_now}")
    if frozen_now := sorted(n for n in frozen_now if n in full.shapes):
        parts.append(f"trained when saved, frozen in this model: {frozen_now}")
    if not parts:
        return ""
    return ("; " + "; ".join(parts) + " (parallelize fixes which params train: to change them, load the weights "
            "into the model before parallelize, model.load_state_dict(zerofuse.checkpoint.consolidate(path)"
            "['model']), or freeze the same params as when saved)")


def _param_offset(s, p) -> int:
    """Where a segment's elements start in the saved flattened param (an expert-parallel param's
    rank holds a range of the saved [E, ...] tensor)."""
    ex = expert_spec(p)
    return s.param_offset + (ex.rank * p.numel() if ex is not None else 0)


def _wanted(eng) -> dict:
    """{name: [(lo, hi), ...]}: the element ranges of each param this rank's shards take."""
    out: dict[str, list] = {}
    for u in eng.units:
        for s in u.segments:
            lo = _param_offset(s, u.params[s.param])
            out.setdefault(u.names[s.param], []).append((lo, lo + s.length))
    return out


def _fill_shards(eng, optimizer, opt_meta, full, src) -> None:
    """This rank's shards (params, masters, optimizer states) from the checkpoint; ``src``: this
    rank's TP part when the TP size is the same, else None (assembled from ``full``)."""
    keys = [VALUE] + ([k for k in opt_meta["state_keys"]] if optimizer is not None else [])
    # weights only (optimizer=None) into a model whose zero.Optimizer keeps fp32 masters: they take
    # the loaded values too (its next step wrote the old masters back over the loaded weights)
    live = optimizer if optimizer is not None else eng.live_optimizer()
    for u in eng.units:
        states = optimizer.unit_states[u.index] if optimizer is not None else {}
        if live is not None and "master" in live.unit_states[u.index]:
            states = {**states, "master": live.unit_states[u.index]["master"]}
        for s in u.segments:
            name, p = u.names[s.param], u.params[s.param]
            sl = slice(s.shard_offset, s.shard_offset + s.length)
            param_offset = _param_offset(s, p)
            for key in keys:
                dsts = [u.shard[sl]] + ([states["master"][sl]] if "master" in states else []) if key == VALUE \
                    else [states[key][sl]]
                if src is not None:
                    for dst in dsts:
                        src.fill(dst, name, param_offset, key)
                    continue
                # another TP or pipeline layout: this param's full tensor, sliced to this rank's TP part
                # (an expert-parallel param's range of the whole [E, ...]: param_offset; it read the
                # first experts on every ep rank, a checkpoint of pipeline stages, 2026-12-07)
                spec = spec_of(p)
                t = full.get(name, key)
                mine = (spec.slice(t) if spec is not None else t).reshape(-1)[param_offset:param_offset + s.length]
                for dst in dsts:
                    dst.copy_(mine)
                del t, mine  # before the next one is assembled: one full tensor at a time


def _rest(model, eng) -> dict:
    """The model's buffers and frozen params by name (what ZeRO does not shard)."""
    return {n: t for n, t in model.state_dict(keep_vars=True).items() if id(t) not in eng.param_index}


def _stage_names(model, eng):
    """Collective over the pipeline group: (trained params, buffers and frozen params) of every
    stage, as sets; None without pipeline stages."""
    if eng.pp_comm is None:
        return None
    every = [None] * eng.pp_comm.world_size
    dist.all_gather_object(every, (list(eng.names), list(_rest(model, eng))), group=eng.pp_comm.group)
    return {n for names, _ in every for n in names}, {n for _, rest in every for n in rest}


def check_rest(model, eng, rest: dict, who, everywhere=None) -> None:
    """The buffers and frozen params (``rest``, in common.pt) against the model's: names and shapes
    (a [1] buffer loaded into a [4] one broadcast silently; a wrong size failed halfway through
    the load). everywhere: those of every pipeline stage (a stage holds only some of them)."""
    mine = _rest(model, eng)
    wrong = [f"{n}: saved {list(t.shape)}, model {list(mine[n].shape)}" for n, t in rest.items()
             if n in mine and tuple(t.shape) != tuple(mine[n].shape)]
    parts = [f"shape mismatch: {wrong}"] if wrong else []
    if missing := [n for n in mine if n not in rest]:
        parts.append(f"buffers or frozen params missing in the checkpoint: {missing}")
    if unexpected := [n for n in rest if n not in (mine if everywhere is None else everywhere)]:
        parts.append(f"not buffers or frozen params of the model: {unexpected}")
    if parts:
        raise ValueError(f"{who}: the checkpoint is for a different model; " + "; ".join(parts))


def _finish_load(eng, model, optimizer, opt_meta, rest, saved_precision: str, match: list) -> None:
    if optimizer is not None:
        for g, s, j in zip(optimizer.param_groups, optimizer._steps, match):  # (the saved group of its params)
            if j is None:  # an empty group
                continue
            saved = opt_meta["param_groups"][j]
            g.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items() if k != "params"})
            s.fill_(opt_meta["steps"][j])
        if optimizer.host is not None:  # offload keeps host copies of the counters
            optimizer.host.load_steps()
        restore_scale(optimizer, saved_precision, opt_meta["scale"], opt_meta["growth_tracker"])
    if rest:
        sd = model.state_dict(keep_vars=True)
        for n, t in rest.items():
            if n in sd:
                sd[n].data.copy_(t)
    # the gathered params follow (stage 3 inside full_params: the units gathered, whose old values
    # the block's exit wrote back over the load: a review's reproduction, 2026-12-07)
    eng.params_written()
