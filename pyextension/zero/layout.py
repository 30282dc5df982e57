"""Which params share a bucket: stage 0/1/2 group them, in reverse registration order (the order
their grads become ready in backward), into buckets of about ``bucket_mb``; stage 3 makes one unit
per wrapped module (default: each child of the model's main ModuleList) and a root unit for the
rest, including any param shared by modules of different units (tied weights)."""
from __future__ import annotations

import datetime
import hashlib

import torch
import torch.distributed as dist


def bucket_groups(named, bucket_mb: float, itemsize: int) -> list[list]:
    limit, size, cur, out = bucket_mb * (1 << 20), 0, [], []
    for n, p in reversed(named):
        cur.append((n, p))
        size += p.numel() * itemsize
        if size >= limit:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def unit_groups(model, named, wrap) -> tuple[list, list]:
    """([(wrapped module, its name, its (name, param) list)], the root's (name, param) list)."""
    mods = _wrap_modules(model, wrap)
    mod_names = {id(m): n for n, m in model.named_modules()}
    owner: dict[int, set[int]] = {}  # id(param) -> the units (wrap index, -1 root) of modules holding it
    units_of_mod: dict[int, set[int]] = {}  # a submodule held by several wrapped modules is in each of their
    for i, m in enumerate(mods):  # units (one module object shared across blocks, ALBERT's layers: its params
        for s in m.modules():  # went to the last block's unit, and the earlier blocks read them freed, NaN;
            units_of_mod.setdefault(id(s), set()).add(i)  # a review's reproduction, 2026-12-07)
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owner.setdefault(id(p), set()).update(units_of_mod.get(id(m), {-1}))
    groups: dict[int, list] = {i: [] for i in range(-1, len(mods))}
    for n, p in named:
        units = owner[id(p)]
        # a param shared by modules of different units lives in the root, which stays gathered
        # through forward and backward
        groups[units.pop() if len(units) == 1 else -1].append((n, p))
    units = [(m, mod_names.get(id(m), f"unit{i}"), groups[i]) for i, m in enumerate(mods) if groups[i]]
    return units, groups[-1]


def _main_module_list(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of the model's largest ModuleList (or ModuleDict: a pipeline stage holds its
    blocks under their indices in the whole model, zerofuse.pipeline.Stage)."""
    best = None
    for mod in model.modules():
        if isinstance(mod, (torch.nn.ModuleList, torch.nn.ModuleDict)) and (best is None or len(mod) > len(best)):
            best = mod
    return list(best.children()) if best is not None else []


def _wrap_modules(model: torch.nn.Module, wrap) -> list[torch.nn.Module]:
    if wrap is None:
        mods = _main_module_list(model)
    elif isinstance(wrap, (list, tuple)) and all(isinstance(w, type) for w in wrap):
        mods = [m for m in model.modules() if isinstance(m, tuple(wrap)) and m is not model]
    elif isinstance(wrap, (list, tuple)) and all(isinstance(w, torch.nn.Module) for w in wrap):
        mods = list(wrap)
    elif callable(wrap):
        mods = [m for m in model.modules() if m is not model and wrap(m)]
    else:
        raise TypeError("zerofuse.zero.parallelize: expected wrap to be None, a list of module classes, a list of "
                        f"submodules or a callable(module) -> bool, got {type(wrap).__name__}")
    inside = set()  # drop modules nested in an earlier one: units do not nest
    out = []
    for m in mods:
        if id(m) in inside:
            continue
        out.append(m)
        inside.update(id(s) for s in m.modules())
    if wrap is not None:  # a unit is gathered by its module's forward: a container's never runs (its unit
        # stayed NaN placeholders and trained NaN losses, silently: a review's reproduction, 2026-12-07);
        # one nested in a unit is that unit's
        names = {id(m): n for n, m in model.named_modules()}
        idle = [f"{names.get(id(m), '?')!r} ({type(m).__name__})" for m in out
                if type(m).forward is torch.nn.Module.forward]
        if idle:
            raise ValueError(f"zerofuse.zero.parallelize: expected wrap to name modules that run a forward (each "
                             f"unit is gathered by its module's forward), got containers {idle[:3]}: wrap the "
                             "modules inside them (e.g. wrap=[Block])")
    return out


def check_same_layout(units, comm, settings: tuple, who: str) -> None:
    """Every rank of the group must lay out the same units (param names, padded sizes) with the
    same settings (stage, precision, the params' shapes): ranks that wrapped different models (or
    passed another bucket_mb, wrap, stage...) would otherwise reduce unrelated gradients without an
    error whenever the padded sizes agree, or fail inside the collective library when they do not.
    One all-gather of a digest, at setup."""
    if comm.world_size == 1:
        return
    sig = repr(([(u.names, u.padded) for u in units], settings)).encode()
    digest = int.from_bytes(hashlib.blake2b(sig, digest_size=7).digest(), "little")  # exact in int64
    numel = sum(u.padded for u in units)
    rows = gather_rows(torch.tensor([digest, len(units), numel], dtype=torch.int64), comm).tolist()
    if any(row != rows[0] for row in rows):
        seen = "; ".join(f"rank {r}: {n} units of {e} elements, digest {d:014x}" for r, (d, n, e) in enumerate(rows))
        raise ValueError(f"{who}: expected the same model and settings on every rank of the group, got layouts that "
                         f"differ ({seen})")


def gather_rows(mine: torch.Tensor, comm) -> torch.Tensor:
    """Every rank's int64 tensor ``mine`` (the same shape on each) over comm's group: (world, *shape)
    on the CPU; one all-gather on the group's device (NCCL's: the current CUDA device)."""
    nccl = str(dist.get_backend(comm.group)) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    every = torch.empty(comm.world_size * mine.numel(), dtype=torch.int64, device=device)
    work = dist.all_gather_into_tensor(every, mine.reshape(-1).to(device), group=comm.group, async_op=True)
    work.wait(timeout=datetime.timedelta(seconds=comm.timeout))
    return every.cpu().view(comm.world_size, *mine.shape)


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# elements per int64 conversion: the digest's temporaries (an int64 copy and its squares, 16 bytes per
# element) stay within 64 MiB and, in 8+ chunks per param, within 2 bytes per element of it (half an
# fp32 param's bytes: a meta model's materialization stays within one unit and two param copies)
_CHUNK = 1 << 22


def _bits_digest(p: torch.Tensor) -> torch.Tensor:
    """[sum of the bit patterns, sum of their squares], int64 wrapping: integer sums do not depend
    on the order (float sums did, with the CPU's thread count: identical weights read as different)."""
    flat = p.detach().reshape(-1)
    bits = flat.view(_BITS[flat.element_size()]) if flat.element_size() in _BITS and not flat.is_complex() else None
    if bits is None:  # (no integer view: the raw bytes)
        bits = flat.contiguous().view(torch.uint8)
    out = torch.zeros(2, dtype=torch.int64, device=p.device)
    for chunk in bits.split(min(_CHUNK, max(1 << 12, -(-bits.numel() // 8)))):
        c = chunk.to(torch.int64)
        out += torch.stack([c.sum(), (c * c).sum()])
    return out


def values_digest(params, skip) -> torch.Tensor:
    """(params, 2) int64: each param's bit patterns summed (and their squares), zeros for the params
    ``skip`` flags (meta, expert-parallel: those differ by rank by design)."""
    rows = [None if s or p.is_meta else _bits_digest(p) for p, s in zip(params, skip)]
    device = next((r.device for r in rows if r is not None), torch.device("cpu"))
    out = [r.to(device) if r is not None else torch.zeros(2, dtype=torch.int64, device=device) for r in rows]
    return torch.stack(out).cpu() if out else torch.zeros(0, 2, dtype=torch.int64)  # (one host read)


def check_same_values(digest: torch.Tensor, names, comm, who: str) -> None:
    """Every rank of the group starts from the same values (values_digest's, taken before the params
    were sharded): ranks that built the model under different seeds trained apart, silently (stage
    0 replicas forever; stages 1-3 from a first step whose grads came from other weights; a
    review's reproduction, 2026-12-07). DDP broadcasts rank 0's at construction; ZeRO refuses, naming
    the params. One all-gather, at setup."""
    if comm.world_size == 1 or digest.numel() == 0:
        return
    every = gather_rows(digest, comm)
    same = every == every[0]
    differ = [names[i] for i in range(len(names)) if not bool(same[:, i].all())]
    if differ:
        ranks = [r for r in range(comm.world_size) if not bool(same[r].all())]
        raise ValueError(f"{who}: expected every rank of the group to start from the same weights, got params "
                         f"{differ[:5]}{' ...' if len(differ) > 5 else ''} ({len(differ)} of {len(names)}) whose values "
                         f"differ between rank 0 and rank(s) {ranks}: build the model under the same seed on every "
                         "rank (torch.manual_seed before constructing it), or load the same weights, before "
                         "zerofuse.zero.parallelize (torch DDP copies rank 0's; ZeRO does not)")


def check_groups_disjoint(who: str, group, others: dict) -> None:
    """ZeRO's group (data-parallel) shares no rank but this one with the model's tensor- or
    pipeline-parallel group: the whole world as ZeRO's group of a TP model failed later with
    'layouts that differ', never saying why (a review, 2026-12-06)."""
    mine = set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    me = dist.get_rank()
    for arg, other in others.items():
        if other is None:
            continue
        shared = sorted((mine & set(dist.get_process_group_ranks(other))) - {me})
        if shared:
            raise ValueError(f"{who}: expected group (ZeRO's data-parallel group) to share no rank but this one with "
                             f"{arg}, got rank(s) {shared} in both (with zerofuse.parallel.init_mesh: "
                             "group=mesh.dp_group)")
