"""Expert-parallel params in ZeRO (a mixin of ZeroEngine, zerofuse/zero/engine.py): params an MoE
layer split over an ep group (``param._zf_ep``: the experts this rank holds) reduce and shard over
the expert-data-parallel group (the ranks holding the same experts) in buckets of their own;
stage 3 keeps a wrapped module's experts in a companion unit gathered and freed with it
(zerofuse/zero/stage3.py). Their grads are divided by the whole DP size all the same: each
already sums the tokens of its ep group."""
from __future__ import annotations

import torch

from zerofuse.comm import Communicator
from zerofuse.zero.buckets import Bucket
from zerofuse.zero.layout import gather_rows, bucket_groups


class ExpertLayout:
    def _init_experts(self, model, expert_group, stage, name) -> None:
        """expert_group default: ``model.edp_group``; refused where not supported. MoE routers whose
        loads no group was given for (aux-loss-free bias, the global aux loss) sum them over this
        data-parallel group: left to themselves (or to their ep group) the ranks' replicated
        biases drifted apart."""
        from zerofuse.moe.router import Router

        for m in model.modules():
            if isinstance(m, Router) and (m.group is None or m.group_is_default) and self.world_size > 1:
                m.group, m.group_is_default = self.comm.group, False
        self.expert = [getattr(p, "_zf_ep", None) is not None for p in self.params]
        self.edp_comm = None
        if not any(self.expert):
            return
        ep = getattr(self.params[self.expert.index(True)], "_zf_ep").tp
        if expert_group is None:
            expert_group = getattr(model, "edp_group", None)
        if expert_group is None:
            raise ValueError(f"{name}: the model holds expert-parallel params (experts split over {ep} ranks): "
                             "expected expert_group, the group of ranks holding the same experts (init_mesh's "
                             "edp_group)")
        self.edp_comm = Communicator(expert_group)
        if self.edp_comm.world_size * ep != self.world_size:
            raise ValueError(f"{name}: expected the expert-data-parallel group ({self.edp_comm.world_size} ranks) "
                             f"times the expert-parallel size ({ep}) to be the data-parallel size {self.world_size}")
        self._check_expert_mesh(ep, name)

    def _check_expert_mesh(self, ep: int, name: str) -> None:
        """Every rank's groups must be laid out as [Note: expert-parallel mesh] (zerofuse/parallel.py)
        says, dp_rank = edp_rank * ep + ep_rank, which checkpoints' tables of pieces assume: groups
        built otherwise (ep groups {0, 2}, {1, 3}) saved and resumed other experts' weights, silently
        (a review's reproduction, 2026-12-07). One all-gather over the DP group, at setup."""
        ep_ranks = {p._zf_ep.rank for p, e in zip(self.params, self.expert) if e}
        mine = torch.tensor([self.rank, self.edp_comm.rank, min(ep_ranks), max(ep_ranks)], dtype=torch.int64)
        rows = gather_rows(mine, self.comm).tolist()
        bad = [f"dp rank {r}: edp rank {e}, ep rank {lo}" + (f"..{hi}" if hi != lo else "")
               for r, e, lo, hi in rows if lo != hi or r != e * ep + lo]
        if bad:
            raise ValueError(f"{name}: expected the expert-parallel groups laid out as zerofuse.parallel.init_mesh "
                             f"makes them (dp_rank = edp_rank * ep + ep_rank, ep={ep}: ep groups of adjacent DP ranks, "
                             f"every MoE layer over the same ep group), got {'; '.join(bad)}")

    def _build_expert_buckets(self, named, bucket_mb, kw) -> None:
        """Stages 0-2: the expert params' buckets, over the expert-DP group."""
        if self.edp_comm is None:
            return
        c = self.edp_comm
        ekw = kw | dict(comm=c, **(dict(rank=c.rank, world_size=c.world_size) if self.stage else {}))
        for group in bucket_groups([x for x, e in zip(named, self.expert) if e], bucket_mb, self.dtype.itemsize):
            self._bucket(f"expert_bucket{len(self.units)}", group, ekw)

    def _stage3_unit(self, name, group, kw) -> Bucket:
        """A stage-3 unit; its expert-parallel params (if any) in a companion unit over the
        expert-DP group, gathered and freed with it (zerofuse/zero/stage3.py)."""
        is_expert = [self.expert[self.param_index[id(p)]] for _, p in group]
        dense = [x for x, e in zip(group, is_expert) if not e]
        experts = [x for x, e in zip(group, is_expert) if e]
        c = self.edp_comm
        ekw = kw | dict(comm=c, rank=c.rank, world_size=c.world_size) if experts else None
        if not dense:
            return self._bucket(name, experts, ekw)
        u = self._bucket(name, dense, kw)
        if experts:
            u.companion = self._bucket(f"{name}/experts", experts, ekw)
        return u
