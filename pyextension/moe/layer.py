"""A Mixture-of-Experts MLP: route, permute, grouped expert MLPs, unpermute with the router's
weights (+ an optional shared expert). With ``ep_group`` (expert parallelism) this rank holds
num_experts / ep of the experts (rank r: experts r * E/ep ...) and the rows travel to and from
their experts' ranks by all-to-all (zerofuse.moe.dispatch); the router and a shared expert are
replicated.

    moe = MoE(dim, hidden, num_experts=8, top_k=2, activation="swiglu", aux_loss_coef=1e-2)
    y = moe(x)                       # x [..., dim]; moe.aux_loss: the router's aux + z losses of this call

Expert weights are stacked: w1 [E, dim, hidden] (swiglu: [E, dim, 2 * hidden], gate then up), w2
[E, hidden, dim]. Under expert parallelism each holds this rank's E/ep experts and carries
``param._zf_ep`` (a zerofuse.tp TPSpec: rows r * E/ep.. of the [E, ...] tensor), by which ZeRO
reduces and shards them over the expert-data-parallel group and checkpoints save them as the
whole [E, ...] tensor (loadable at any ep). The grouped GEMM is ``torch._grouped_mm`` over the permuted rows (expert e's
rows are one contiguous group of counts[e]; no host sync) where the installed torch has it and
the rows' strides are 16-byte multiples, else a loop over the experts (one host sync for the
counts).
"""
from __future__ import annotations

import numbers

import torch
import torch.distributed as dist
from torch import Tensor

from zerofuse.comm import Communicator
from zerofuse.moe.dispatch import Dispatch
from zerofuse.moe.router import Router
from zerofuse.nn.mlp import geglu, swiglu
from zerofuse.ops.moe import permute, unpermute
from zerofuse.tp.spec import TPSpec

NAME = "zerofuse.moe.MoE"
_ACTIVATIONS = ("gelu", "swiglu", "geglu")


def expert_spec(p: Tensor) -> TPSpec | None:
    """How an expert-parallel param slices the whole [E, ...] tensor (None: not expert-parallel)."""
    return getattr(p, "_zf_ep", None)


def _aligned(*tensors: Tensor) -> bool:
    return all(t.stride(-2) * t.element_size() % 16 == 0 and t.stride(-1) == 1 for t in tensors)


class _ZeroGradOutside(torch.autograd.Function):
    """x as it is; its gradient zero on the rows where ``inside`` is False."""

    @staticmethod
    def forward(ctx, x, inside):
        ctx.save_for_backward(inside)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        (inside,) = ctx.saved_tensors
        return torch.where(inside, g, 0), None


def grouped_mm(x: Tensor, w: Tensor, counts: Tensor, *, full: bool = False) -> Tensor:
    """x [R, a] whose first counts[0] rows go to w[0], the next counts[1] to w[1], ... (rows past
    sum(counts) are zeros in the output); w [E, a, b] -> [R, b]. full=True: the caller knows
    sum(counts) == R (dropless routing), so no rows are masked."""
    if x.shape[0] == 0:  # no rows (an expert-parallel rank that received none): w still in the graph,
        return (x @ w[0]).to(x.dtype)  # in x's dtype as the other paths (autocast made it bf16 here)
    # fp32: torch's eager CPU kernel takes it, its fake (meta) kernel takes bf16 only, so a compiled
    # model failed to trace ("Expected inputs of BF16 type"): the per-expert loop there
    fp32_ok = x.dtype == torch.float32 and not torch.compiler.is_compiling()
    if hasattr(torch, "_grouped_mm") and (x.dtype == torch.bfloat16 or fp32_ok) and _aligned(x, w):
        offs = counts.cumsum(0).to(torch.int32)
        if full:
            return torch._grouped_mm(x, w, offs=offs)
        inside = (torch.arange(x.shape[0], device=x.device) < offs[-1]).unsqueeze(1)
        # rows past the groups are undefined in _grouped_mm's output and in its input gradient
        # (whatever memory held: x.grad of such rows was garbage, 1e36 or NaN in bf16)
        out = torch._grouped_mm(_ZeroGradOutside.apply(x, inside) if x.requires_grad else x, w, offs=offs)
        return torch.where(inside, out, 0)
    out, start = x.new_zeros(x.shape[0], w.shape[2]), 0
    for e, n in enumerate(counts.tolist()):
        if n:
            out[start:start + n] = x[start:start + n] @ w[e]
        start += n
    return out


class MoE(torch.nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, *, activation: str = "gelu",
                 shared_expert: bool = False, ep_group=None, **router_options):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"{NAME}: expected activation one of {_ACTIVATIONS}, got {activation!r}")
        for name, v in (("dim", dim), ("hidden", hidden), ("num_experts", num_experts), ("top_k", top_k)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):  # (a float failed deep in torch, unnamed)
                raise TypeError(f"{NAME}: expected {name} to be an int, got {v!r}")
        if dim < 1 or hidden < 1:
            raise ValueError(f"{NAME}: expected dim and hidden >= 1, got {dim}, {hidden}")
        # the router's loads (aux-loss-free bias, the global aux loss) sum over the expert-parallel
        # group unless told another (the GPT passes its DP group): left unset, each rank balanced
        # its own loads and its replicated bias drifted from the others'
        defaulted = "group" not in router_options
        router_options.setdefault("group", ep_group)
        self.router = Router(dim, num_experts, top_k, **router_options)
        self.router.group_is_default = defaulted
        self.activation, self.hidden = activation, hidden
        self.ep_comm = None
        local = num_experts
        if ep_group is not None and dist.get_world_size(ep_group) > 1:
            ep = dist.get_world_size(ep_group)
            if num_experts % ep:
                raise ValueError(f"{NAME}: expected num_experts ({num_experts}) to divide by the expert-parallel "
                                 f"size {ep}")
            self.ep_comm, local = Communicator(ep_group), num_experts // ep
        gated = activation != "gelu"
        self.w1 = torch.nn.Parameter(torch.empty(local, dim, hidden * (2 if gated else 1)))
        self.w2 = torch.nn.Parameter(torch.empty(local, hidden, dim))
        self.reset_parameters()
        if self.ep_comm is not None:
            for p in (self.w1, self.w2):
                p._zf_ep = TPSpec(0, (num_experts,), (num_experts, *p.shape[1:]), self.ep_comm.world_size,
                                  self.ep_comm.rank)
        self.shared = None
        if shared_expert:
            from zerofuse.nn import GatedMLP

            self.shared = GatedMLP(dim, hidden, activation="gelu_tanh" if activation == "geglu" else "silu")
        self.aux_loss: Tensor | None = None  # the router's aux + z losses of the last call
        self.router_losses: tuple[Tensor, Tensor] | None = None  # (aux, z) of the last call

    def expert_mlp(self, rows: Tensor, counts: Tensor, full: bool = False) -> Tensor:
        """full: every row of ``rows`` is routed (dropless, or the rows an expert-parallel rank got)."""
        h = grouped_mm(rows, self.w1.to(rows.dtype), counts, full=full)
        if self.activation == "gelu":
            h = torch.nn.functional.gelu(h, approximate="tanh")
        else:
            gate, up = h.split(self.hidden, dim=1)  # backward: one cat (slices would zero-fill twice)
            h = (swiglu if self.activation == "swiglu" else geglu)(gate, up)
        return grouped_mm(h.contiguous(), self.w2.to(rows.dtype), counts, full=full)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The experts' weights N(0, 0.02) (this rank's, as built); the router and a shared expert have
        their own (ZeRO-3 materializing a meta model calls each module's: MoE had none, refused)."""
        for p in (self.w1, self.w2):
            if not p.is_meta:
                torch.nn.init.normal_(p, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        if x.dim() < 1 or shape[-1] != self.router.weight.shape[1]:  # (a 0-d x: a bare IndexError)
            raise ValueError(f"{NAME}: expected x [..., {self.router.weight.shape[1]}], got {list(shape)}")
        flat = x.reshape(-1, shape[-1])
        r = self.router(flat)
        self.aux_loss = r.aux_loss + r.z_loss
        self.router_losses = (r.aux_loss, r.z_loss)
        rows, pos, src, counts = permute(flat, r.experts, self.router.num_experts)
        if self.ep_comm is None:
            out = self.expert_mlp(rows, counts, full=self.router.capacity_factor == 0)
        else:
            d = Dispatch(self.ep_comm, counts)
            out = d.receive(self.expert_mlp(d.send(rows), d.local_counts, full=True), rows.shape[0])
        y = unpermute(out, pos, src, r.weights).to(x.dtype)
        if self.shared is not None:
            y = y + self.shared(flat)
        return y.reshape(shape)
