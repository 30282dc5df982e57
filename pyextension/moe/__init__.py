"""Mixture-of-Experts: the router (top-k, aux / z losses, aux-loss-free bias, capacity), the
MoE MLP layer over zerofuse's moe_permute / moe_unpermute ops and grouped expert GEMMs."""
from zerofuse.moe.layer import MoE, expert_spec, grouped_mm
from zerofuse.moe.router import Router, Routing

__all__ = ["MoE", "Router", "Routing", "expert_spec", "grouped_mm"]
