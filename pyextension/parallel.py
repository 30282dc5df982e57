"""``zerofuse.parallel.init_mesh``: the data-parallel and tensor-parallel process groups of a 2-D
(dp × tp) layout of the ranks.

Layout (Megatron's): tensor-parallel ranks are adjacent, ``rank = dp_rank * tp + tp_rank``, so a TP
group sits inside one node (NVLink) when tp divides the GPUs per node; rank r's DP group is every
rank with its tp_rank. Every group is created on every rank in the same order (what
``torch.distributed.new_group`` requires).
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


def _is_int(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool)  # True would pass as a size of 1


def init_mesh(dp: int | None = None, tp: int = 1, *, backend: str | None = None) -> Mesh:
    """Split the default group into dp × tp (dp=None: world_size // tp). Collective: every rank
    calls it with the same arguments."""
    if not dist.is_initialized():
        raise RuntimeError(f"{NAME}: torch.distributed is not initialized (call init_process_group first)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if not _is_int(tp) or tp < 1:
        raise ValueError(f"{NAME}: expected tp to be an int >= 1, got {tp!r}")
    if dp is None:
        if world % tp:
            raise ValueError(f"{NAME}: expected tp ({tp}) to divide the world size ({world})")
        dp = world // tp
    if not _is_int(dp) or dp < 1:
        raise ValueError(f"{NAME}: expected dp to be an int >= 1, got {dp!r}")
    if dp * tp != world:
        raise ValueError(f"{NAME}: expected dp × tp == world size, got dp={dp} × tp={tp} = {dp * tp} for "
                         f"world size {world}")
    mine_dp = mine_tp = None
    # new_group's default is torch's, not the one init_process_group was given: pass that on, so it
    # bounds the collectives of the subgroups (and of the Communicators built on them) too
    timeout = datetime.timedelta(seconds=group_timeout(dist.group.WORLD))
    for t in range(tp):  # DP groups: ranks with the same tp_rank
        ranks = [d * tp + t for d in range(dp)]
        g = dist.new_group(ranks, backend=backend, timeout=timeout)
        if rank in ranks:
            mine_dp = (g, tuple(ranks))
    for d in range(dp):  # TP groups: adjacent ranks
        ranks = [d * tp + t for t in range(tp)]
        g = dist.new_group(ranks, backend=backend, timeout=timeout)
        if rank in ranks:
            mine_tp = (g, tuple(ranks))
    return Mesh(dp=dp, tp=tp, dp_rank=rank // tp, tp_rank=rank % tp, dp_group=mine_dp[0], tp_group=mine_tp[0],
                dp_ranks=mine_dp[1], tp_ranks=mine_tp[1])
