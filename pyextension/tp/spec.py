"""How a tensor-parallel parameter relates to the full (unsharded) parameter.

A ``TPSpec`` sits on each sharded parameter as ``param._zf_tp``. The full tensor is cut along
``dim`` into ``parts`` (one part for a plain layer; q, k and v for a fused QKV projection), and
every part is split over the ``tp`` ranks as ``torch.tensor_split`` does (the first ``n % tp``
ranks get one more row): rank r holds, concatenated, its piece of every part. The same spec slices
a full tensor (construction from full weights, loading a checkpoint saved at another TP size) and
merges the ranks' shards back (consolidation).
"""
from __future__ import annotations

import dataclasses

import torch


def split_sizes(n: int, tp: int) -> list[int]:
    return [n // tp + (1 if r < n % tp else 0) for r in range(tp)]


def split_range(n: int, tp: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's piece of n rows."""
    sizes = split_sizes(n, tp)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


@dataclasses.dataclass(frozen=True)
class TPSpec:
    dim: int
    parts: tuple[int, ...]  # sizes along dim of the full tensor's parts
    full_shape: tuple[int, ...]
    tp: int
    rank: int

    def local_size(self, rank: int | None = None) -> int:
        r = self.rank if rank is None else rank
        return sum(split_sizes(n, self.tp)[r] for n in self.parts)

    def slice(self, full: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """This rank's (or ``rank``'s) shard of ``full`` (a new contiguous tensor)."""
        r = self.rank if rank is None else rank
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"zerofuse.tp: expected a full tensor of shape {list(self.full_shape)}, got "
                             f"{list(full.shape)}")
        out, off = [], 0
        for n in self.parts:
            a, b = split_range(n, self.tp, r)
            out.append(full.narrow(self.dim, off + a, b - a))
            off += n
        return torch.cat(out, dim=self.dim).contiguous()

    def place(self, full: torch.Tensor, shard: torch.Tensor, rank: int) -> None:
        """Copy rank's shard into its regions of ``full`` (merge, one shard at a time: a loader
        holds the full tensor and one shard, not every shard)."""
        off = local = 0
        for n in self.parts:
            a, b = split_range(n, self.tp, rank)
            full.narrow(self.dim, off + a, b - a).copy_(shard.narrow(self.dim, local, b - a))
            local += b - a
            off += n

    def merge(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard (in rank order)."""
        if len(shards) != self.tp:
            raise ValueError(f"zerofuse.tp: expected {self.tp} shards to merge, got {len(shards)}")
        pieces = []
        local_off = [0] * self.tp
        for n in self.parts:
            sizes = split_sizes(n, self.tp)
            for r, s in enumerate(shards):
                pieces.append(s.narrow(self.dim, local_off[r], sizes[r]))
                local_off[r] += sizes[r]
        return torch.cat(pieces, dim=self.dim)

    def to_json(self) -> dict:
        return {"dim": self.dim, "parts": list(self.parts), "full_shape": list(self.full_shape)}

    @staticmethod
    def from_json(d: dict, tp: int, rank: int) -> "TPSpec":
        return TPSpec(d["dim"], tuple(d["parts"]), tuple(d["full_shape"]), tp, rank)


def spec_of(p: torch.Tensor) -> TPSpec | None:
    return getattr(p, "_zf_tp", None)
