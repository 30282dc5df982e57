"""Mixture-of-Experts blocks of zerofuse.models.GPT: which blocks' MLPs are MoE layers
(``GPTConfig.moe_*``), the layers built over the expert-parallel groups, and the router losses and
per-step expert loads the training job reports.

``moe_experts=E`` (0: a dense model) replaces the MLP of every ``moe_every``-th block (blocks
moe_every - 1, 2 * moe_every - 1, ...: GShard / Switch's every other layer at 2) by a
zerofuse.moe.MoE of E experts, ``moe_top_k`` per token, experts of the model's MLP kind (SwiGLU
for mlp="swiglu", else GELU) with ``moe_hidden`` units (default: the dense MLP's). The router:
``moe_router`` scores ("softmax" or "sigmoid"), ``moe_capacity`` (a capacity factor: choices past
an expert's capacity are dropped; 0: dropless), ``moe_aux_loss`` / ``moe_z_loss`` coefficients (the
aux loss's load fractions over each rank's tokens, or with ``moe_aux_scope="global"`` over the DP
group's batch) and
``moe_bias_rate`` (aux-loss-free balancing: the job updates the bias before each optimizer step).
"""
from __future__ import annotations

import math

import torch

from zerofuse.kernels.common import upload
from zerofuse.moe import MoE

NAME = "zerofuse.models.GPTConfig"
ROUTERS = ("softmax", "sigmoid")


def check_config(cfg) -> None:
    """The moe_* fields of a GPTConfig (errors name the field, the expectation and the value)."""
    e = cfg.moe_experts
    if not isinstance(e, int) or e < 0:
        raise ValueError(f"{NAME}: expected moe_experts an int >= 0 (0: dense), got {e!r}")
    if e == 0:
        return
    if not 1 <= cfg.moe_top_k <= e:
        raise ValueError(f"{NAME}: expected 1 <= moe_top_k <= moe_experts ({e}), got {cfg.moe_top_k}")
    if not 1 <= cfg.moe_every <= cfg.n_layer:
        raise ValueError(f"{NAME}: expected 1 <= moe_every <= n_layer ({cfg.n_layer}), got {cfg.moe_every}")
    if cfg.moe_aux_scope not in ("local", "global"):
        raise ValueError(f"{NAME}: expected moe_aux_scope 'local' or 'global', got {cfg.moe_aux_scope!r}")
    if cfg.moe_router not in ROUTERS:
        raise ValueError(f"{NAME}: expected moe_router one of {ROUTERS}, got {cfg.moe_router!r}")
    for key in ("moe_capacity", "moe_aux_loss", "moe_z_loss", "moe_bias_rate"):
        v = getattr(cfg, key)
        if isinstance(v, bool) or not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):  # (True as 1.0)
            raise ValueError(f"{NAME}: expected {key} >= 0, got {v!r}")
    if cfg.moe_hidden is not None and cfg.moe_hidden < 1:
        raise ValueError(f"{NAME}: expected moe_hidden >= 1 or None, got {cfg.moe_hidden}")


def is_moe_block(cfg, i: int) -> bool:
    return cfg.moe_experts > 0 and (i + 1) % cfg.moe_every == 0


def build(cfg, ep_group=None, dp_group=None, seq_group=None) -> MoE:
    """One block's MoE layer: experts split over ep_group (None: all here), the routers' loads for
    aux-loss-free balancing summed over dp_group (the ranks whose tokens the model trains on) and
    seq_group (sequence parallelism: the TP group, whose ranks route shards of one sequence)."""
    return MoE(cfg.dim, cfg.moe_hidden or cfg.hidden, cfg.moe_experts, cfg.moe_top_k,
               activation="swiglu" if cfg.mlp == "swiglu" else "gelu", shared_expert=cfg.moe_shared_expert,
               ep_group=ep_group, score=cfg.moe_router, aux_loss_coef=cfg.moe_aux_loss, z_loss_coef=cfg.moe_z_loss,
               bias_update_rate=cfg.moe_bias_rate, capacity_factor=cfg.moe_capacity,
               aux_loss_scope=cfg.moe_aux_scope, seq_group=seq_group,
               **({"group": dp_group} if dp_group is not None else {}))


def layers(model: torch.nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def router_losses(moes: list[MoE]) -> torch.Tensor:
    """[aux, z]: the last forward's router losses summed over the layers (with their graph)."""
    return torch.stack([torch.stack(m.router_losses) for m in moes]).sum(0)


class _AttachLoss(torch.autograd.Function):
    """x unchanged; its backward also starts ``loss``'s, from ``weight`` (None: x's own incoming
    gradient, for a scalar x that is itself a loss)."""

    @staticmethod
    def forward(ctx, x, loss, weight):
        ctx.weight, ctx.dtype = weight, loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        w = grad if ctx.weight is None else ctx.weight
        if isinstance(w, torch.Tensor):  # (a copy: never one tensor handed to two inputs)
            return grad, w.detach().to(ctx.dtype, copy=True).reshape(()), None
        return grad, torch.full((), w, dtype=ctx.dtype, device=grad.device), None


def attach_loss(x: torch.Tensor, loss: torch.Tensor, weight=None) -> torch.Tensor:
    """x, through whose backward ``loss`` (a scalar) is trained too, at gradient ``weight`` (a float or a
    device scalar; None: x's incoming gradient, x a scalar loss). A pipeline stage's MoE layers'
    router losses ride on the activations it sends (Megatron-Core's MoEAuxLossAutoScaler): the
    last stage's loss cannot add them, they are computed on other ranks."""
    if loss.dim() != 0 or (weight is None and x.dim() != 0):
        raise ValueError(f"zerofuse.models.moe.attach_loss: expected a scalar loss (and a scalar x without a weight), "
                         f"got loss of shape {list(loss.shape)}, x of shape {list(x.shape)}")
    return _AttachLoss.apply(x, loss, weight)


class Stats:
    """The routers' per-step figures, kept on the device and read at the job's log points: expert
    loads (choices per expert, before dropping) summed over the steps, dropped choices, aux and z
    losses; ``read()`` gives max/mean load per layer (1.0: perfectly balanced), summed over the
    data-parallel group. Under pipeline parallelism each rank records the layers of its stages
    (``record(only=...)``) and ``read`` sums over every rank: the other layers' rows are zero here.
    Under tensor parallelism ``read`` sums over every rank too (sequence parallelism: each TP rank
    routed its shard); ``replicas``: the TP ranks that route the same tokens (tp without sequence
    parallelism, else 1), whose loads and drops count once."""

    def __init__(self, moes: list[MoE], device=None, replicas: int = 1):
        self.moes = moes
        self.device = device  # where a rank that recorded nothing builds its zeros for read()
        self.replicas = replicas
        self.load = None  # [layers, E] int64
        self.dropped = None
        self.losses = None  # [aux, z] summed over the steps' forwards
        self.forwards = 0  # the forwards whose losses were recorded (grad accumulation: several a step)
        self.steps = 0
        self._index: dict[tuple, torch.Tensor] = {}  # record(only=...)'s rows on the device

    def record(self, losses: torch.Tensor | None = None, only: list[int] | None = None, forward: bool = True) -> None:
        """After a step's forward(s): the routers' last loads (every micro-batch's, when the job
        calls it per micro-batch) and the losses (detached). only: the indices (into the layers
        given) of the layers that forward ran (a pipeline stage's), else all; forward: count it as
        one forward of the model (a pipeline's stages: False, and the first stage counts each
        micro-batch's forward with count_forward())."""
        layers = [self.moes[i] for i in only] if only is not None else self.moes
        load = torch.stack([m.router.last_load for m in layers])
        dropped = torch.stack([m.router.last_dropped for m in layers]).sum()
        if only is not None:
            rows = self._index.get(tuple(only))
            if rows is None:
                rows = self._index[tuple(only)] = upload(torch.tensor(only), load.device)
            load = load.new_zeros((len(self.moes), load.shape[1])).index_add_(0, rows, load)
        self.load = load if self.load is None else self.load + load
        self.dropped = dropped if self.dropped is None else self.dropped + dropped
        if losses is not None:
            self.losses = losses.detach() if self.losses is None else self.losses + losses.detach()
            self.forwards += forward

    def count_forward(self) -> None:
        self.forwards += 1

    def end_step(self) -> None:
        self.steps += 1

    def read(self, group=None, sent_bytes: float = 0.0) -> dict | None:
        """Collective over ``group`` (None: the default group) once a step has ended: the figures
        since the last read; ``sent_bytes``: this rank's all-to-all bytes since then (summed over the
        group, per step). The aux and z losses: their sum over the group's forwards over the count."""
        import torch.distributed as dist
        if self.steps == 0:  # (the same on every rank: each ends every step)
            return None
        device = self.load.device if self.load is not None else self.device
        n, e = len(self.moes), self.moes[0].router.num_experts
        zeros = (lambda *shape: torch.zeros(shape, dtype=torch.float64, device=device))
        flat = torch.cat([self.load.double().reshape(-1) if self.load is not None else zeros(n * e),
                          self.dropped.double().reshape(1) if self.dropped is not None else zeros(1),
                          torch.tensor([float(sent_bytes), float(self.forwards)], dtype=torch.float64, device=device),
                          self.losses.double() if self.losses is not None else zeros(2)])
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
        if self.replicas > 1:  # (integers times replicas: exact)
            flat[:n * e + 1] /= self.replicas
        load = flat[:n * e].view(n, e)
        vals = flat.cpu().tolist()
        forwards = max(vals[n * e + 2], 1)
        out = {"max_over_mean_load": (load.max(1).values / load.mean(1).clamp_min(1e-12)).cpu().tolist(),
               "dropped": int(vals[n * e]), "a2a_bytes_per_step": vals[n * e + 1] / self.steps,
               "aux_loss": vals[-2] / forwards,  # the mean over forwards: what a step trained on
               "z_loss": vals[-1] / forwards, "steps": self.steps}
        self.load = self.dropped = self.losses = None
        self.steps = self.forwards = 0
        return out
