"""``zerofuse.parallel.init_mesh``: the data-, tensor- and pipeline-parallel process groups of a
3-D (pp × dp × tp) layout of the ranks, and the expert-parallel split of each DP group.

Layout (Megatron's order: tp innermost, then dp, pp outermost):
``rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank``. Tensor-parallel ranks are adjacent, so a
TP group (the most traffic) sits inside one node when tp divides the GPUs per node; the ranks of
one pipeline stage (dp × tp) are contiguous, and a PP group (every rank with the same dp_rank and
tp_rank, one per stage) spans the nodes: stages exchange only activations, the least traffic.
Every group is created on every rank in the same order (what ``torch.distributed.new_group``
requires). ``mesh.device_mesh()`` gives the same groups as a torch DeviceMesh ("pp", "dp", "tp").

[Note: expert-parallel mesh]
Expert parallelism (``ep``, DeepSpeed-MoE's and Megatron's choice: experts split over data-parallel
ranks) divides each DP group: ``dp_rank = edp_rank * ep + ep_rank``. An EP group (``ep_group``: ep
adjacent DP ranks) holds every expert once, each rank E/ep of them; the expert-data-parallel group
(``edp_group``: the dp / ep ranks with the same ep_rank) holds the same experts, over which their
grads reduce and ZeRO shards them. Non-expert params stay data-parallel over the whole DP group.
"""
from __future__ import annotations

import dataclasses
import datetime

import torch.distributed as dist

from zerofuse.comm import group_timeout

NAME = "zerofuse.parallel.init_mesh"


@dataclasses.dataclass(frozen=True)
class Mesh:
    dp: int
    tp: int
    dp_rank: int
    tp_rank: int
    dp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    dp_ranks: tuple[int, ...]  # global ranks of this rank's DP group
    tp_ranks: tuple[int, ...]  # global ranks of this rank's TP group
    pp: int = 1
    pp_rank: int = 0
    pp_group: dist.ProcessGroup | None = None
    pp_ranks: tuple[int, ...] = ()  # global ranks of this rank's PP group, stage order
    ep: int = 1
    ep_rank: int = 0
    ep_group: dist.ProcessGroup | None = None  # None when ep == 1
    edp_group: dist.ProcessGroup | None = None  # None when ep == 1 (the DP group then)
    ep_ranks: tuple[int, ...] = ()
    edp_ranks: tuple[int, ...] = ()

    def device_mesh(self, device_type: str = "cpu"):
        """A torch DeviceMesh over the same groups, dims ("pp", "dp", "tp") (for DTensor /
        torch.distributed interop); built on first call, collective like init_mesh."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        if getattr(self, "_device_mesh", None) is None:
            layout = torch.arange(self.pp * self.dp * self.tp).reshape(self.pp, self.dp, self.tp)
            mesh = DeviceMesh.from_group([self.pp_group, self.dp_group, self.tp_group], device_type, mesh=layout,
                                         mesh_dim_names=("pp", "dp", "tp"))
            object.__setattr__(self, "_device_mesh", mesh)
        return self._device_mesh


def _is_int(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool)  # True would pass as a size of 1


def _is_backend(backend) -> bool:
    """None, a backend name torch knows (registered ones too) or 'cpu:gloo,cuda:nccl' pairs."""
    if backend is None:
        return True
    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    return isinstance(backend, str) and bool(backend) and all(
        part.rpartition(":")[2].lower() in known for part in backend.split(","))


def init_mesh(dp: int | None = None, tp: int = 1, pp: int = 1, *, ep: int = 1, backend: str | None = None) -> Mesh:
    """Split the default group into pp × dp × tp (dp=None: world_size // (tp * pp)), each DP group
    into dp / ep expert-parallel groups of ep ranks. Collective: every rank calls it with the same
    arguments."""
    if not dist.is_initialized():
        raise RuntimeError(f"{NAME}: torch.distributed is not initialized (call init_process_group first)")
    world, rank = dist.get_world_size(), dist.get_rank()
    # first, before any check that could fail on some ranks only: the ranks agree on the arguments
    # (different ones made different groups: one rank got a mesh its peers did not share, the other
    # a bare "Wait timeout" in new_group)
    args = f"dp={dp!r}, tp={tp!r}, pp={pp!r}, ep={ep!r}, backend={backend!r}"
    every = [None] * world
    dist.all_gather_object(every, args)
    if any(a != args for a in every):
        differ = "; ".join(f"rank {r}: {a}" for r, a in enumerate(every) if a != every[0])
        raise ValueError(f"{NAME}: expected every rank to pass the same arguments, got rank 0: {every[0]}; {differ}")
    for key, n in (("tp", tp), ("pp", pp), ("ep", ep)):
        if not _is_int(n) or n < 1:
            raise ValueError(f"{NAME}: expected {key} to be an int >= 1, got {n!r}")
    if not _is_backend(backend):  # (torch's bare "Unknown backend type" AssertionError at new_group)
        raise ValueError(f"{NAME}: expected backend None (the default group's) or one of "
                         f"{[b for b in dist.Backend.backend_list if b != 'undefined']} (or 'device:backend,...'), "
                         f"got {backend!r}")
    if dp is None:
        if world % (tp * pp):
            raise ValueError(f"{NAME}: expected tp × pp ({tp} × {pp}) to divide the world size ({world})")
        dp = world // (tp * pp)
    if not _is_int(dp) or dp < 1:
        raise ValueError(f"{NAME}: expected dp to be an int >= 1, got {dp!r}")
    if pp * dp * tp != world:
        raise ValueError(f"{NAME}: expected pp × dp × tp == world size, got pp={pp} × dp={dp} × tp={tp} = "
                         f"{pp * dp * tp} for world size {world}")
    if dp % ep:
        raise ValueError(f"{NAME}: expected ep ({ep}) to divide the data-parallel size dp ({dp})")
    # new_group's default is torch's, not the one init_process_group was given: pass that on, so it
    # bounds the collectives of the subgroups (and of the Communicators built on them) too
    timeout = datetime.timedelta(seconds=group_timeout(dist.group.WORLD))
    at = lambda s, d, t: s * dp * tp + d * tp + t  # noqa: E731 - the layout, in one place
    mine = {}
    families = {
        "dp": [[at(s, d, t) for d in range(dp)] for s in range(pp) for t in range(tp)],
        "tp": [[at(s, d, t) for t in range(tp)] for s in range(pp) for d in range(dp)],
        "pp": [[at(s, d, t) for s in range(pp)] for d in range(dp) for t in range(tp)],
    }
    if ep > 1:  # inside each DP group: dp index d = edp * ep + e
        dps = families["dp"]
        families["ep"] = [[g[x * ep + e] for e in range(ep)] for g in dps for x in range(dp // ep)]
        families["edp"] = [[g[x * ep + e] for x in range(dp // ep)] for g in dps for e in range(ep)]
    for key, groups in families.items():
        for ranks in groups:
            g = dist.new_group(ranks, backend=backend, timeout=timeout)
            if rank in ranks:
                mine[key] = (g, tuple(ranks))
    dp_rank = (rank // tp) % dp
    expert = dict(ep=ep, ep_rank=dp_rank % ep, ep_group=mine["ep"][0], edp_group=mine["edp"][0],
                  ep_ranks=mine["ep"][1], edp_ranks=mine["edp"][1]) if ep > 1 else {}
    return Mesh(dp=dp, tp=tp, dp_rank=dp_rank, tp_rank=rank % tp, dp_group=mine["dp"][0],
                tp_group=mine["tp"][0], dp_ranks=mine["dp"][1], tp_ranks=mine["tp"][1], pp=pp,
                pp_rank=rank // (dp * tp), pp_group=mine["pp"][0], pp_ranks=mine["pp"][1], **expert)
