"""The MoE router: which k experts each token goes to, with what weight, and the balancing terms.

Scores in fp32 (Megatron-Core's fp32 router): softmax or sigmoid of x @ W^T. The top k by score
(+ a per-expert bias for aux-loss-free balancing, DeepSeek-V3: the bias steers the choice, never
the weight), weights normalised over the k when asked and k > 1 (a top-1 weight stays the score, as
Switch's: normalised it would be 1 and the router would get no gradient from the output). Balancing:

- aux loss (Switch / GShard): coef * E * sum_e f_e * P_e, f_e the fraction of the T * k choices that
  went to e, P_e the mean score of e (the scores normalised per token for sigmoid);
- z-loss (ST-MoE): coef * mean_t logsumexp(logits_t)^2;
- aux-loss-free bias: ``update_bias()`` (call it before optimizer.step()) moves each expert's bias
  by rate * sign(mean load - its load), the loads summed over ``group`` first;
- capacity: capacity_factor > 0 keeps at most ceil(cf * T * k / E) choices per expert, the first
  in token order, and drops the rest (expert -1: zerofuse.ops.moe skips them); 0: dropless.

Sequence parallelism (``seq_group``, the tensor-parallel group, while ``sequence_parallel``): each
rank routes its shard of the sequence, and the balancing terms are those of the whole sequence
(Megatron-Core's tp-cp reduction of the loads): the loads and token counts sum over seq_group
before f_e and the bias update, P_e and the z-loss's mean divide by the sequence's token count,
so each rank's aux and z losses are its share and their sum over seq_group is one process's.

Per-step statistics stay on the device (``last_load``: choices per expert, ``last_dropped``).
"""
from __future__ import annotations

import fractions
import math
import numbers
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from zerofuse.ops.moe import routing_indices

NAME = "zerofuse.moe.Router"
SUM_EPS = 1e-20  # added to a sum of sigmoid scores before dividing by it (Megatron-Core's)


class Routing(NamedTuple):
    weights: Tensor  # [T, k] fp32
    experts: Tensor  # [T, k] int64, -1 where dropped
    aux_loss: Tensor  # scalar fp32, the coefficients applied (0 when off)
    z_loss: Tensor


class Router(torch.nn.Module):
    fp32_buffers = ("expert_bias",)  # (zero/materialize.py keeps it fp32 as _apply does)

    def __init__(self, dim: int, num_experts: int, top_k: int, *, score: str = "softmax", normalize: bool = True,
                 aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, bias_update_rate: float = 0.0,
                 capacity_factor: float = 0.0, group=None, aux_loss_scope: str = "local", seq_group=None):
        super().__init__()
        for name, v in (("dim", dim), ("num_experts", num_experts), ("top_k", top_k)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):  # (a float top_k failed in torch.topk)
                raise TypeError(f"{NAME}: expected {name} to be an int, got {v!r}")
        for name, v in (("dim", dim), ("num_experts", num_experts)):
            if v < 1:  # (dim -1 failed inside torch, naming no argument; dim 0 was taken)
                raise ValueError(f"{NAME}: expected {name} >= 1, got {v}")
        if not isinstance(normalize, bool):  # ("no" was taken as true)
            raise TypeError(f"{NAME}: expected normalize to be a bool, got {normalize!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"{NAME}: expected 1 <= top_k <= num_experts ({num_experts}), got {top_k}")
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"{NAME}: expected score 'softmax' or 'sigmoid', got {score!r}")
        if aux_loss_scope not in ("local", "global"):
            raise ValueError(f"{NAME}: expected aux_loss_scope 'local' or 'global', got {aux_loss_scope!r}")
        self.aux_loss_scope = aux_loss_scope
        for name, v in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef),
                        ("bias_update_rate", bias_update_rate), ("capacity_factor", capacity_factor)):
            if isinstance(v, bool) or not isinstance(v, numbers.Real):  # (True was taken as 1.0; numpy's
                raise TypeError(f"{NAME}: expected {name} to be a number, got {v!r}")  # floats refused as < 0)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{NAME}: expected {name} >= 0, got {v!r}")
        self.num_experts, self.top_k, self.score, self.normalize = num_experts, top_k, score, normalize
        self.aux_loss_coef, self.z_loss_coef = float(aux_loss_coef), float(z_loss_coef)
        self.bias_update_rate, self.capacity_factor, self.group = float(bias_update_rate), float(capacity_factor), group
        self.weight = torch.nn.Parameter(torch.empty(num_experts, dim))
        # fp32 whatever the default dtype (built under torch.set_default_dtype(torch.bfloat16), the
        # rate-sized steps were rounded away)
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32),
                             persistent=bias_update_rate > 0)
        self.reset_parameters()
        self.last_load: Tensor | None = None  # choices per expert in the last forward (before dropping)
        self.last_dropped: Tensor | None = None
        # the loads of the forwards since the last update_bias(): a list, so that a forward adds no
        # op that depends on it (a recomputed forward, activation checkpointing, must dispatch the
        # ops of the first; it appends the same load again: every load twice, the same bias step)
        self._loads: list[Tensor] = []
        self.group_is_default = False  # group taken by default (MoE: its ep group): ZeRO gives its DP group
        self.seq_group = seq_group  # the ranks holding shards of one sequence (sequence parallelism)
        self.sequence_parallel = seq_group is not None  # (off while a TP model generates: whole sequences)

    def _seq_world(self) -> int:
        on = self.sequence_parallel and self.seq_group is not None
        return dist.get_world_size(self.seq_group) if on else 1

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The gate's weight N(0, 0.02) and the aux-free bias zero (a model built on meta and
        materialized by ZeRO-3 left the bias as allocated: 4e9 routed every token to two experts)."""
        if not self.weight.is_meta:
            torch.nn.init.normal_(self.weight, std=0.02)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """The aux-free bias zero (also what a model's own param_init_fn calls: zerofuse.models.GPT's)."""
        if not self.expert_bias.is_meta:
            self.expert_bias.zero_()

    def _apply(self, fn, recurse=True):
        """expert_bias stays fp32 through model.to(bf16) (ZeRO's precision="bf16"): rate-sized steps
        of a bias near 0.5 were rounded away in bf16, as DeepSeek-V3's and Megatron's keep it."""
        before = self.expert_bias
        out = super()._apply(fn, recurse)
        if self.expert_bias.is_floating_point() and self.expert_bias.dtype != torch.float32:
            # from the values before the cast (the cast's rounded ones, made fp32 again, lost them)
            self.expert_bias = before.to(self.expert_bias.device, torch.float32)
        return out

    def forward(self, x: Tensor) -> Routing:
        """x [T, dim] -> Routing."""
        if x.dim() != 2 or x.shape[1] != self.weight.shape[1]:
            raise ValueError(f"{NAME}: expected x [tokens, {self.weight.shape[1]}], got {list(x.shape)}")
        dev = x.device.type
        if dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev):  # fp32 scores under autocast too
            with torch.autocast(dev, enabled=False):                   # (autocast ran the matmul in bf16)
                logits = x.float() @ self.weight.float().t()
        else:
            logits = x.float() @ self.weight.float().t()
        scores = torch.softmax(logits, -1) if self.score == "softmax" else torch.sigmoid(logits)
        choice = scores + self.expert_bias if self.bias_update_rate > 0 else scores
        experts = torch.topk(choice.detach(), self.top_k, dim=-1, sorted=True).indices
        weights = scores.gather(1, experts)
        if self.normalize and self.top_k > 1:  # (+ SUM_EPS: sigmoid scores underflowing to 0 gave 0/0, NaN)
            weights = weights / (weights.sum(-1, keepdim=True) + SUM_EPS)
        e = self.num_experts
        load = torch.bincount(experts.reshape(-1), minlength=e)
        zero = logits.new_zeros(())
        aux = zero
        tokens = x.shape[0]
        if self.aux_loss_coef > 0:
            p = scores if self.score == "softmax" else scores / (scores.sum(-1, keepdim=True) + SUM_EPS)
            # f_e counts the router's own choices, without the balancing bias (Megatron-Core's
            # compute_routing_scores_for_aux_loss, DeepSeek-V3 eq. 18): counted after the bias,
            # the loss pushed against it (a review's reproduction, 2026-12-06)
            own = load if self.bias_update_rate <= 0 else torch.bincount(
                torch.topk(scores.detach(), self.top_k, dim=-1).indices.reshape(-1), minlength=e)
            frac, per_token = self._load_fraction(own, tokens)
            aux = self.aux_loss_coef * e * (frac * p.sum(0) * per_token).sum()
        # (sums over max(T, 1): a rank given no tokens has losses of 0, not NaN; sequence parallel:
        # over the sequence's tokens, every shard holding as many)
        z = self.z_loss_coef * torch.logsumexp(logits, -1).pow(2).sum() / max(tokens * self._seq_world(), 1) \
            if self.z_loss_coef > 0 else zero
        dropped = torch.zeros((), dtype=torch.int64, device=x.device)
        if self.capacity_factor > 0:
            experts, dropped = self._drop(experts)
        self.last_load, self.last_dropped = load, dropped
        if self.training and self.bias_update_rate > 0 and torch.is_grad_enabled():  # not evaluation's loads
            self._loads.append(load)
        return Routing(weights, experts, aux, z)

    def _load_fraction(self, load: Tensor, tokens: int) -> tuple[Tensor, Tensor | float]:
        """(f_e, the factor making P_e of a sum of this rank's token scores). f_e: this forward's
        fraction of the choices per expert, P_e the mean score; aux_loss_scope 'global': both over
        the whole batch of ``group`` (Megatron's global-batch balancing: an all-reduce of E + 1
        counts per layer call), P_e as this rank's share (world / all tokens, not 1 / its tokens:
        ranks given other token counts weighed as one process does), so the mean of the ranks' aux
        losses is one process's over the batch. Sequence parallel: the counts sum over seq_group
        first and P_e divides by the sequence's tokens (this rank's share of the sequence's loss)."""
        choices = tokens * self.top_k
        seq = self._seq_world() > 1  # (every rank of a sequence runs this forward, grad or not)
        # without grad (an evaluation, maybe on one rank only: it waited in this all-reduce for ranks
        # that never came, or paired it with their training's collectives) no backward reads the
        # loss: the global scope's figures are this rank's, no collective over ``group``
        scope_group = self.aux_loss_scope == "global" and self.group is not None \
            and dist.get_world_size(self.group) > 1 and torch.is_grad_enabled()
        if not (seq or scope_group):
            return load.float() / max(choices, 1), 1.0 / max(tokens, 1)
        counts = torch.cat([load, load.new_full((1,), choices)]).float()
        if seq:  # the whole sequence's loads first
            dist.all_reduce(counts, group=self.seq_group)
        if scope_group:
            dist.all_reduce(counts, group=self.group)
        all_tokens = counts[-1] / self.top_k
        share = dist.get_world_size(self.group) if scope_group else 1
        return counts[:-1] / counts[-1].clamp_min(1), share / all_tokens.clamp_min(1)

    @property
    def capacity_factor(self) -> float:
        return self._capacity_factor

    @capacity_factor.setter
    def capacity_factor(self, value: float) -> None:
        # the factor as the decimal it prints as, an integer ratio (1.1 is 11/10: in floats 1.1 * 50 / 5
        # is 11.000000000000002, and the ceiling kept 12 where 11 was asked for; Megatron's float
        # formula does so too); computed here, not per call: capacity() stays integer arithmetic,
        # which torch.compile traces over symbolic token counts
        self._capacity_factor = float(value)
        self._capacity_ratio = fractions.Fraction(repr(self._capacity_factor)).as_integer_ratio()

    def capacity(self, tokens: int) -> int:
        """ceil(capacity_factor * tokens * top_k / num_experts), exactly."""
        num, den = self._capacity_ratio
        return -(-(num * tokens * self.top_k) // (den * self.num_experts))

    def _drop(self, experts: Tensor) -> tuple[Tensor, Tensor]:
        """Choices past an expert's capacity in (token, slot) order become -1. A choice's place among
        its expert's is its row in the stable grouping by expert less the expert's first row: O(T k)
        memory (a (T k, E) one-hot's cumsum took three int64 T k E tensors, 3.2 GB per MoE layer at
        65536 tokens, top 8 of 256 experts: a review, 2026-12-07)."""
        t, k = experts.shape
        flat = experts.reshape(-1)
        pos, _, counts = routing_indices(experts, self.num_experts)
        rank = pos.reshape(-1) - (counts.cumsum(0) - counts)[flat]  # this choice's place among its expert's
        keep = rank < self.capacity(t)
        return torch.where(keep, flat, -1).view(t, k), (~keep).sum()

    @torch.no_grad()
    def update_bias(self) -> None:
        """Aux-loss-free balancing: each expert's bias moves by rate * sign(mean load - its load),
        the loads of the forwards since the last call summed over ``group``; call it once per step
        before the optimizer step."""
        if self.bias_update_rate <= 0 or not self._loads:
            return
        load = torch.stack(self._loads).sum(0).float()
        if self._seq_world() > 1:  # the whole sequence's loads: the same bias on every shard's rank
            dist.all_reduce(load, group=self.seq_group)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(load, group=self.group)
        self.expert_bias.add_(self.bias_update_rate * torch.sign(load.mean() - load))
        self._loads = []
