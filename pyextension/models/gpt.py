"""A GPT (decoder-only transformer) built from zerofuse's ops: fused attention (zerofuse.nn.Attention,
grouped-query heads), fused LayerNorm/RMSNorm, and trained with zerofuse's fused optimizers.

Pre-norm blocks (x + attn(norm(x)), x + mlp(norm(x)); each residual add fused into the next
norm, zerofuse's add_layer_norm / add_rms_norm), learned position embeddings, GELU MLP, an
optional tied output head. Initialisation is GPT-2's (normal(0, 0.02); the residual projections
scaled by 1/sqrt(2 * n_layer)), each param drawn from its own generator seeded by ``seed`` and the
param's name: the same seed gives the same weights on every rank and machine, whatever the global
RNG state and whatever order (or subset) the params are initialised in. So a GPT built under
``torch.device("meta")`` and materialized unit by unit by ``zerofuse.zero.parallelize`` (which
calls ``param_init_fn`` per module) gets exactly the weights of ``GPT(cfg, seed=seed)``.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as TF
from torch import Tensor

from zerofuse import nn as znn
from zerofuse import tp
from zerofuse.models import moe as zmoe
from zerofuse.models.generation import check_generate, sample
from zerofuse.models import recompute
from zerofuse.models.presets import PRESETS, GPTConfig, config
from zerofuse.models.tied import is_tied, keep_tied_on_load
# (whole-model pickles made before the hooks moved to tied.py name them here)
from zerofuse.models.tied import _note_tied_before_load, _retie_after_load  # noqa: F401
from zerofuse.moe import expert_spec
from zerofuse.ops.ids import check_ids
from zerofuse.tp.spec import KeepsMarks


def _norm(cfg: GPTConfig) -> torch.nn.Module:
    if cfg.norm == "rmsnorm":
        return znn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
    return znn.LayerNorm(cfg.dim, bias=cfg.bias, **({} if cfg.norm_eps is None else {"eps": cfg.norm_eps}))


class MLP(torch.nn.Module):
    """proj(gelu(fc(x))), or with cfg.mlp 'swiglu' proj(silu(gate) * up) where fc yields [gate | up]
    (under TP each rank holds its slice of both halves: partition_sizes)."""

    def __init__(self, cfg: GPTConfig, tp_kw: dict | None = None):
        super().__init__()
        self.gated = cfg.mlp == "swiglu"
        h = cfg.hidden
        fc_out = 2 * h if self.gated else h
        if tp_kw is None:  # GELU: the fc's bias add and GELU in one kernel (zerofuse.nn.LinearGELU)
            self.fc = (torch.nn.Linear if self.gated else znn.LinearGELU)(cfg.dim, fc_out, bias=cfg.bias)
            self.proj = torch.nn.Linear(h, cfg.dim, bias=cfg.bias)
        else:  # column-parallel then row-parallel: one all-reduce forward, one backward
            parts = dict(partition_sizes=(h, h)) if self.gated else {}
            self.fc = tp.ColumnParallelLinear(cfg.dim, fc_out, bias=cfg.bias, **parts, **tp_kw)
            self.proj = tp.RowParallelLinear(h, cfg.dim, bias=cfg.bias, **tp_kw)

    def forward(self, x: Tensor) -> Tensor:
        if self.gated:  # fc(x) is [gate | up] (each rank's slices under TP): read in place, its grad written whole
            return self.proj(znn.functional.swiglu(self.fc(x)))
        if isinstance(self.fc, znn.LinearGELU):
            return self.proj(self.fc(x))
        return self.proj(TF.gelu(self.fc(x), approximate="tanh"))


class Block(torch.nn.Module):
    def __init__(self, cfg: GPTConfig, tp_kw: dict | None = None, rope=None, moe=None):
        super().__init__()
        sdpa = TF.scaled_dot_product_attention if cfg.attention == "torch" else None
        self.norm1 = _norm(cfg)
        kw = dict(bias=cfg.bias, causal=True, sdpa=sdpa, rope=rope)
        if tp_kw is None:
            self.attn = znn.Attention(cfg.dim, cfg.n_head, cfg.n_kv_head, **kw)
        else:
            self.attn = tp.ParallelAttention(cfg.dim, cfg.n_head, cfg.n_kv_head, **kw, **tp_kw)
        self.norm2 = _norm(cfg)
        self.mlp = moe if moe is not None else MLP(cfg, tp_kw)  # moe: a zerofuse.moe.MoE
        # the attention's output bias: added by its projection, its gradient summed by norm2's
        # backward kernel (input_bias), not by a sum of its own (norm2 never reads the bias)
        self.fold_attn_bias = tp_kw is None and cfg.bias

    def forward(self, x: Tensor, delta: Tensor | None = None, document_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x + attn(norm1(x)), then + mlp(norm2(.)), with each residual add fused into the norm
        that follows it (one kernel for add + norm): ``delta`` is the previous block's MLP output
        not yet added to x (None for the first block); returns (x + delta + attn, mlp output), the
        last add left to the next block's norm1 or the model's final norm. document_ids: GPT's."""
        if delta is None:
            h = self.norm1(x)
        else:
            h, x = self.norm1(delta, x)
        kw = {} if document_ids is None else {"document_ids": document_ids}  # (an attn swapped in may not take them)
        if self.fold_attn_bias:
            h, x = self.norm2(self.attn(h, proj_bias_grad=False, **kw), x, input_bias=self.attn.proj.bias)
        else:
            h, x = self.norm2(self.attn(h, **kw), x)
        return x, self.mlp(h)


class GPT(KeepsMarks, torch.nn.Module):
    """forward(idx (B, N) int64, targets (B, N) or None) -> (logits (B, N, vocab), loss or None);
    the loss is the mean cross-entropy in fp32 whatever the model's dtype (the fused loss: fp64 for
    an fp64 model), over the targets not ignored (-100; every one ignored: the fused loss is 0,
    the unfused one NaN as torch's cross_entropy, 0 with tp_group, as
    zerofuse.tp.vocab_parallel_cross_entropy documents). With targets and
    ``cfg.fused_loss`` (the default) the loss comes from zerofuse's fused output layer +
    cross-entropy, which never forms the logits: (None, loss).

    Tensor parallelism (``tp_group``): attention heads (and kv heads) and the MLP are split over
    the group (column- then row-parallel), the embedding and the output head over the vocabulary;
    the logits returned are this rank's vocabulary shard (B, N, V_r) and the loss is the
    vocabulary-parallel cross-entropy (the full logits are never gathered). Every param holds
    exactly its slice of the unsharded model's param of the same name and seed.
    ``sequence_parallel=True`` also shards the norms' activations (and the residual stream) along
    the sequence between the TP layers; N must divide by the TP size.

    Mixture of Experts (``cfg.moe_experts``, zerofuse/models/moe.py): with ``ep_group`` each MoE
    layer holds its share of the experts (their slices of the unsharded model's, as TP's), tokens
    travel by all-to-all; ``edp_group`` (the ranks holding the same experts) is what ZeRO reduces
    expert grads over; ``dp_group`` sums the routers' loads for aux-loss-free balancing. With
    targets, the loss returned under autograd includes the routers' aux and z losses
    (``self.router_losses``: [aux, z] of that forward); under no_grad it is the cross-entropy.
    With ``tp_group`` the MoE layers are whole on every TP rank (experts split over ep_group only,
    Megatron's expert-tensor-parallel size 1): without sequence parallelism every TP rank runs them
    on the same tokens; with it each routes its shard of the sequence, the routers balance over the
    whole sequence (zerofuse.moe.Router's seq_group) and the MoE params' grads sum over the TP group
    as the norms'. The losses are one process's either way."""

    def __init__(self, cfg: GPTConfig, *, seed: int = 0, device=None, tp_group=None, sequence_parallel: bool = False,
                 ep_group=None, edp_group=None, dp_group=None):
        super().__init__()
        # (the seed is formatted into the init's streams: None or True took weights of their own)
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"zerofuse.models.GPT: expected seed to be an int, got {seed!r}")
        self._keep_marks_on_load()  # TP specs and SP's grad hooks survive to_empty / load(assign=True)
        keep_tied_on_load(self)
        self.edp_group = edp_group
        self.config = cfg
        self.tp_group = tp_group
        self.tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
        if sequence_parallel and tp_group is None:
            raise ValueError("zerofuse.models.GPT: sequence_parallel=True needs a tp_group")
        if tp_group is None:
            tp_kw = None
            self.wte = torch.nn.Embedding(cfg.vocab_size, cfg.dim)
        else:
            for key in ("n_head", "n_kv_head"):
                if getattr(cfg, key) % self.tp_size:
                    raise ValueError(f"zerofuse.models.GPT: expected {key} ({getattr(cfg, key)}) to divide by the "
                                     f"tensor-parallel size {self.tp_size}")
            tp_kw = dict(group=tp_group, sequence_parallel=sequence_parallel)
            self.wte = tp.VocabParallelEmbedding(cfg.vocab_size, cfg.dim, **tp_kw)
        # learned positions, or one rotary module shared by every layer's attention (no params, no
        # buffers: its fp32 tables are made per device on first use)
        self.wpe = torch.nn.Embedding(cfg.seq_len, cfg.dim) if cfg.pos == "learned" else None
        rope = None
        if cfg.pos == "rope":
            rope = znn.RotaryEmbedding(cfg.dim // cfg.n_head, cfg.seq_len, base=cfg.rope_base, scaling=cfg.rope_scaling)
        self.blocks = torch.nn.ModuleList(
            Block(cfg, tp_kw, rope, zmoe.build(cfg, ep_group, dp_group, tp_group if sequence_parallel else None)
                  if zmoe.is_moe_block(cfg, i) else None)
            for i in range(cfg.n_layer))
        self.moe_layers = zmoe.layers(self.blocks)
        self.router_losses: Tensor | None = None
        self.norm = _norm(cfg)
        if tp_group is None:
            self.head = znn.LinearCrossEntropyHead(cfg.dim, cfg.vocab_size, bias=False)
        else:
            self.head = tp.VocabParallelLinearCrossEntropyHead(cfg.dim, cfg.vocab_size, bias=False, **tp_kw)
            self._tp_comm = tp.comm.comm_for(tp_group)
            # replicated params applied to a sequence shard: grads summed over the TP group (MoE
            # layers: whole on every TP rank, each routing its shard of the sequence)
            norms = [self.norm] + [n for b in self.blocks for n in (b.norm1, b.norm2)]
            replicated = [p for m in [self.wpe] + norms + self.moe_layers if m is not None for p in m.parameters()]
            tp.sync_replicated_grads(replicated, self._tp_comm, when=lambda: self.sequence_parallel)
        self.sequence_parallel = sequence_parallel
        if cfg.tie_embeddings:
            self.head.weight = self.wte.weight
        # "none" / "full" / "selective" (or False / True); offload: what it keeps waits in host memory
        # (refused with "none" when the model runs): zerofuse/models/recompute.py
        self.activation_checkpointing = False
        self.activation_offload = False
        # names as named_parameters gives them (a shared param keeps its first name)
        self._param_names = {id(p): n for n, p in self.named_parameters()}
        self.seed = seed
        if not any(p.is_meta for p in self.parameters()):  # a meta model is initialised where it is materialized
            self.reset_parameters(seed)
        if device is not None:
            self.to(device)

    def _tied(self) -> bool:
        return is_tied(self)

    def _apply(self, fn, recurse=True):
        # torch's _apply gives each module a Parameter of its own where it cannot convert in place
        # (to_empty from meta): the tied output layer came apart from the embedding (and trained as
        # a second matrix); load_state_dict(assign=True) likewise (the hooks in __init__)
        tied = self._tied()
        out = super()._apply(fn, recurse)
        if tied and not self._tied():
            self.head.weight = self.wte.weight
        return out

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        if seed is not None:
            self.seed = seed
        for m in self.modules():
            self.param_init_fn(m)

    @torch.no_grad()
    def param_init_fn(self, module: torch.nn.Module) -> None:
        """Initialise ``module``'s own params (not its children's) as the GPT-2 scheme above."""
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        if any(id(p) not in self._param_names for p in module.parameters(recurse=False)):
            # params replaced since __init__ (to_empty from meta, load_state_dict(assign=True)): a
            # bare KeyError(<address>) before
            self._param_names = {id(p): n for n, p in self.named_parameters()}
        for p in module.parameters(recurse=False):
            name = self._param_names.get(id(p))
            if name is None:
                raise ValueError(f"zerofuse.models.GPT.param_init_fn: expected a module of this model, got "
                                 f"{type(module).__name__} whose params are not the model's")
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "norm.weight":
                value = torch.ones(p.shape)
            elif name.endswith(".bias"):
                value = torch.zeros(p.shape)
            else:
                resid = ("attn.proj.weight", "mlp.proj.weight", "mlp.w2", "mlp.shared.down_proj.weight")
                std = resid_std if name.endswith(resid) else 0.02
                gen = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}/{name}".encode()))  # CPU generators keep 32 bits
                spec = tp.spec_of(p) or expert_spec(p)  # TP / EP: draw the full tensor, keep this rank's slice
                value = torch.randn(spec.full_shape if spec else p.shape, generator=gen) * std
                if spec is not None:
                    value = spec.slice(value)
            p.copy_(value)
        if hasattr(module, "reset_buffers"):  # a router's aux-free bias starts at zero (a meta model's
            module.reset_buffers()  # materialized by ZeRO-3 kept it as allocated)

    def num_params(self, active: bool = False, matmul: bool = False) -> int:
        """Parameters of the model (the unsharded count under tensor / expert parallelism);
        active=True: those one token uses (top_k of the E experts of each MoE layer); matmul=True:
        without the lookup-only tables (the position embedding, and the token embedding unless tied
        to the output layer), the N of MFU's 6 N FLOPs per token, as nanoGPT's."""
        def count(p):
            spec = tp.spec_of(p) or expert_spec(p)
            n = math.prod(spec.full_shape) if spec is not None else p.numel()
            if active and p.dim() == 3 and any(p is m.w1 or p is m.w2 for m in self.moe_layers):
                n = n * self.config.moe_top_k // self.config.moe_experts
            return n
        lookup = set()
        if matmul:
            lookup = {id(p) for m in (self.wpe,) if m is not None for p in m.parameters()}
            if self.wte.weight is not self.head.weight:
                lookup.add(id(self.wte.weight))
        return sum(count(p) for p in self.parameters() if id(p) not in lookup)

    def forward(self, idx: Tensor, targets: Tensor | None = None, *,
                document_ids: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """document_ids (B, N): packed documents (each a run of equal ids, e.g. (idx == EOT).cumsum(1)):
        a token attends only to the earlier tokens of its own document; positions are not reset."""
        if targets is not None and (not isinstance(targets, Tensor) or tuple(targets.shape) != tuple(idx.shape)):
            # (the fused loss's own check named its inputs: "hidden", under sequence parallelism this
            # rank's shard, which the caller never passed)
            got = list(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__
            raise ValueError(f"zerofuse.models.GPT: expected targets of idx's shape {list(idx.shape)}, got {got}")
        if self.tp_group is not None:  # (under ZEROFUSE_CHECK_COLLECTIVES=1 only)
            tp.comm.check_same_inputs(self._tp_comm, "zerofuse.models.GPT", idx=idx, targets=targets,
                                      document_ids=document_ids)
        x, delta = self.embed(idx), None
        for block in self.blocks:
            x, delta = self.run_block(block, x, delta, document_ids)
        return self.final(x, delta, targets)

    # The three parts of forward, also run one by one by the stages of zerofuse.pipeline.

    def embed(self, idx: Tensor) -> Tensor:
        """Token (+ learned position) embeddings of idx (B, N): x (B, N, dim) (sequence
        parallelism: this rank's positions)."""
        if idx.dim() != 2:
            raise ValueError(f"zerofuse.models.GPT: expected idx of shape (batch, sequence), got {list(idx.shape)}")
        if idx.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"zerofuse.models.GPT: expected idx of int64 or int32 token ids, got {idx.dtype}")
        n = idx.shape[1]
        if n > self.config.seq_len:
            raise ValueError(f"zerofuse.models.GPT: sequence length {n} exceeds the model's seq_len "
                             f"{self.config.seq_len}")
        pos = torch.arange(n, device=idx.device)
        if self.sequence_parallel:  # the embedding reduce-scatters: this rank's positions only
            if n % self.tp_size:
                raise ValueError(f"zerofuse.models.GPT: sequence parallelism needs the sequence length ({n}) to "
                                 f"divide by the tensor-parallel size {self.tp_size}")
            r, m = self._tp_comm.rank, n // self.tp_size
            pos = pos[r * m:(r + 1) * m]
        try:
            tok = self.wte(idx)
        except IndexError:  # an id out of range (torch's CPU embedding: a bare "index out of range in self"),
            # named once it failed: the check on every forward read the device (a step's host syncs)
            check_ids("zerofuse.models.GPT", "idx", idx, self.config.vocab_size)
            raise
        return tok if self.wpe is None else tok + self.wpe(pos)

    def run_block(self, block: torch.nn.Module, x: Tensor, delta: Tensor | None,
                  document_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One block (recomputed in backward under activation checkpointing): (x, pending delta)."""
        args = (x, delta) if document_ids is None else (x, delta, document_ids)
        return recompute.run(block, recompute.mode_of(self.activation_checkpointing), *args,
                             offload=self.activation_offload)

    def final(self, x: Tensor, delta: Tensor | None, targets: Tensor | None,
              router_losses: bool = True) -> tuple[Tensor | None, Tensor | None]:
        """The final norm of x + delta, then the head: (logits, loss) as forward returns them;
        router_losses=False: the cross-entropy alone (a pipeline stage trains its MoE layers' router
        losses itself: zerofuse.pipeline.split_gpt)."""
        h = self.norm(delta, x)[0] if delta is not None else self.norm(x)
        logits, loss = self._head(h, targets)
        if self.moe_layers and loss is not None and router_losses:
            losses = zmoe.router_losses(self.moe_layers)
            if self.sequence_parallel:  # each rank's share of the sequence's: summed (backward: its own)
                losses = tp.reduce_from_tp(losses, self._tp_comm)
            self.router_losses = losses.detach()
            if torch.is_grad_enabled():
                loss = loss + losses.sum()
        return logits, loss

    def _head(self, h: Tensor, targets: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        if targets is not None and self.config.fused_loss:
            return None, self.head(h, targets)  # in the head's forward: ZeRO's hooks for its weight run first
        logits = self.head(h)
        loss = None
        if targets is not None:
            if tuple(targets.shape) != tuple(logits.shape[:-1]):  # (the reshape below would mix rows up)
                raise ValueError(f"zerofuse.models.GPT: expected targets of idx's shape {list(logits.shape[:-1])}, got "
                                 f"{list(targets.shape)}")
            b, n = targets.shape
            if self.tp_group is None:  # (int32 targets, which the other paths take, were refused here)
                t = targets.reshape(b * n)
                loss = TF.cross_entropy(logits.float().reshape(b * n, -1),
                                        t if t.is_floating_point() or t.dtype == torch.bool else t.long())
            else:
                loss = tp.vocab_parallel_cross_entropy(logits, targets, self.tp_group, vocab_size=self.config.vocab_size)
        return logits, loss

    def gather_logits(self, logits: Tensor) -> Tensor:
        """The full-vocabulary logits from this rank's shard (tensor parallelism; collective over the
        TP group); logits unchanged otherwise."""
        if self.tp_group is None:
            return logits
        return tp.gather_last_dim(logits.contiguous(), self._tp_comm, self.head.out_per_rank)

    @contextlib.contextmanager
    def _sequence_parallel_off(self):
        mods = [self] + tp.tp_modules(self) + [m.router for m in self.moe_layers]
        saved = [m.sequence_parallel for m in mods]
        for m in mods:
            m.sequence_parallel = False
        try:
            yield
        finally:
            for m, s in zip(mods, saved):
                m.sequence_parallel = s

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None, vocab_size: int | None = None) -> Tensor:
        """Sample max_new_tokens tokens after idx (B, N); returns (B, N + max_new_tokens). temperature 0:
        greedy (the argmax; no random numbers drawn). vocab_size: draw only ids below it (a padded
        vocabulary's real size, GPT-2's 50257 of 50304). With tensor parallelism every TP rank calls it
        with the same idx and generator state."""
        check_generate(idx, max_new_tokens, temperature, top_k, vocab_size, self.config.vocab_size)
        with self._sequence_parallel_off():  # any length: the sequence is not sharded here
            return sample(self, idx, max_new_tokens, temperature, top_k, generator, vocab_size)


# GPTConfig, PRESETS and config live in presets.py; importable from here as before
__all__ = ["GPT", "GPTConfig", "PRESETS", "config", "Block", "MLP"]
