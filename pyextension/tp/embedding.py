"""zerofuse.tp.VocabParallelEmbedding: the embedding table split by rows over the TP group (the
layers' shared machinery in zerofuse/tp/layers.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from zerofuse.ops.ids import check_ids
from zerofuse.tp import comm as C
from zerofuse.tp.layers import _adopt, _sharded, _TPModule
from zerofuse.tp.spec import TPSpec, spec_of, split_range


class VocabParallelEmbedding(_TPModule):
    """torch.nn.Embedding with the table split by rows (vocabulary) over the TP group: each rank
    looks up the ids in its range (zeros elsewhere) and the partial results are all-reduced
    (reduce-scattered along the sequence with sequence_parallel=True)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None, sequence_parallel: bool = False, *,
                 padding_idx: int | None = None, device=None, dtype=None):
        super().__init__()
        self._setup(group, sequence_parallel)
        if padding_idx is not None and not -num_embeddings <= padding_idx < num_embeddings:
            raise ValueError(f"zerofuse.tp.VocabParallelEmbedding: expected padding_idx in [{-num_embeddings}, "
                             f"{num_embeddings}) or None, got {padding_idx}")
        if padding_idx is not None and padding_idx < 0:  # as torch.nn.Embedding: counted from the end
            padding_idx += num_embeddings
        self.padding_idx = padding_idx  # as torch's: that row gets no gradient
        if num_embeddings < self.tp:
            raise ValueError(f"zerofuse.tp.VocabParallelEmbedding: expected num_embeddings >= the TP size {self.tp}, "
                             f"got {num_embeddings}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start, self.vocab_end = split_range(num_embeddings, self.tp, self.tp_rank)
        spec = TPSpec(0, (num_embeddings,), (num_embeddings, embedding_dim), self.tp, self.tp_rank)
        full = torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
        torch.nn.init.normal_(full)
        if padding_idx is not None:  # as torch.nn.Embedding's reset_parameters
            with torch.no_grad():
                full[self.padding_idx].fill_(0)
        self.weight = _sharded(full, spec)

    @classmethod
    def from_full(cls, weight: Tensor, **kwargs):
        """The embedding holding its rows of a given full table (e.g. a loaded torch.nn.Embedding's)."""
        layer = cls(weight.shape[0], weight.shape[1], device="meta", dtype=weight.dtype, **kwargs)
        return _adopt(layer, weight, None, sharded_bias=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """torch.nn.Embedding's initialisation of the full table (the padding row zero), this rank's
        rows written in place (as ColumnParallelLinear.reset_parameters)."""
        full = torch.empty(self.num_embeddings, self.embedding_dim, device=self.weight.device, dtype=self.weight.dtype)
        torch.nn.init.normal_(full)
        if self.padding_idx is not None:
            full[self.padding_idx].fill_(0)
        self.weight.copy_(spec_of(self.weight).slice(full))

    def forward(self, idx: Tensor) -> Tensor:
        check_ids("zerofuse.tp.VocabParallelEmbedding", "idx", idx, self.num_embeddings)
        if self.sequence_parallel and idx.dim() != 2:
            raise ValueError(f"zerofuse.tp.VocabParallelEmbedding: with sequence_parallel=True expected idx of shape "
                             f"(batch, seq), got {list(idx.shape)}")
        if self.sequence_parallel:
            C.check_seq(idx, self.tp, "VocabParallelEmbedding", "idx")
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = (idx - self.vocab_start).masked_fill(outside, 0)
        pad = self.padding_idx
        pad = pad - self.vocab_start if pad is not None and self.vocab_start <= pad < self.vocab_end else None
        out = F.embedding(local, self.weight, pad).masked_fill(outside.unsqueeze(-1), 0.0)
        return C.reduce_scatter_to_seq(out, self.comm) if self.sequence_parallel else C.reduce_from_tp(out, self.comm)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, this rank [{self.vocab_start}, {self.vocab_end}), "
                f"tp={self.tp}")
