"""Tensor and sequence parallelism (Megatron-style) on zerofuse's Communicator: column/row-parallel
linear layers, a vocabulary-parallel embedding and cross-entropy (also fused with the output layer), a head-parallel attention, and
the autograd collectives they are built from. See zerofuse/tp/layers.py, zerofuse/tp/embedding.py, zerofuse/tp/cross_entropy.py
and zerofuse/tp/comm.py."""
from zerofuse.tp.comm import (comm_stats, copy_to_tp, gather_from_seq, gather_last_dim, reduce_from_tp,
                              reduce_scatter_to_seq, reset_comm_stats, scatter_to_seq, split_last_dim,
                              sync_replicated_grads)
from zerofuse.tp.layers import ColumnParallelLinear, ParallelAttention, RowParallelLinear, tp_modules
from zerofuse.tp.embedding import VocabParallelEmbedding
from zerofuse.tp.cross_entropy import (VocabParallelLinearCrossEntropyHead, vocab_parallel_cross_entropy,
                                       vocab_parallel_linear_cross_entropy)
from zerofuse.tp.spec import TPSpec, spec_of

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelAttention",
           "vocab_parallel_cross_entropy", "vocab_parallel_linear_cross_entropy", "VocabParallelLinearCrossEntropyHead", "copy_to_tp", "reduce_from_tp", "gather_from_seq", "reduce_scatter_to_seq",
           "scatter_to_seq", "gather_last_dim", "split_last_dim", "sync_replicated_grads", "comm_stats",
           "reset_comm_stats", "tp_modules", "TPSpec", "spec_of"]
