"""ZeRO-3 (and 2) inside the caller's blocks, where a review (2026-12-07) reproduced silent wrong
values or a crash, each test failing before its fix: nested full_grads zeroed every grad; a step
inside full_params dropped the block's edits; a submodule's state_dict bypassed stage 3's guards
(NaN placeholders, views left without storage); a meta model built under different seeds trained a
patchwork of the ranks' inits; wrap= naming a container trained NaN losses."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_utils import error_text, run_distributed

pytestmark = pytest.mark.usefixtures("native_kernels")


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, h):
        return h + self.fc2(torch.tanh(self.fc1(h)))


class _Net(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


def _x(rank):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))


def _grad_norm(model):
    from zerofuse import zero

    with zero.full_grads(model):
        return float(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm())


def _blocks_rank(rank, ws, stage, precision):
    from zerofuse import zero

    out = {}
    model = _Net()
    zero.parallelize(model, stage=stage, precision=precision)
    opt = zero.Optimizer(model, "adamw", lr=1e-2)
    model(_x(rank).to(torch.bfloat16 if precision == "bf16" else torch.float32)).float().backward()
    before = _grad_norm(model)
    with zero.full_grads(model):
        with zero.full_grads(model):
            pass
    out["nested_grads"] = (before, _grad_norm(model))
    with zero.full_params(model):  # an edit, then a step inside the same block
        with torch.no_grad():
            model.head.weight.fill_(0.1)
        opt.step()
        inside = model.head.weight.detach().float().clone()
    with zero.full_params(model):
        out["edit_then_step"] = (inside.tolist(), model.head.weight.detach().float().tolist())
    if stage == 3:
        out["sub_state_dict"] = error_text(lambda: model.blocks[0].state_dict())
        out["sub_load"] = error_text(lambda: model.blocks[0].load_state_dict(_Block().state_dict()))
        with zero.full_params(model):
            sd = model.blocks[0].state_dict()
            want = model.blocks[0].fc1.weight.detach().clone()
        out["sub_state_dict_after"] = torch.equal(sd["fc1.weight"], want)  # (no storage left before: a crash)
    return out


@pytest.mark.parametrize("stage,precision", [(1, "bf16"), (2, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")])
def test_nested_blocks_steps_and_submodule_state_dicts(stage, precision):
    """(A step inside full_params took the block's edit at stage 1/2 in fp32 only: bf16's masters put
    the old values back; stage 3 dropped it in both.)"""
    outs = run_distributed(_blocks_rank, 2, stage, precision, timeout=120)
    for out in outs:
        before, after = out["nested_grads"]
        assert before > 0 and after == before, out
        inside, after = out["edit_then_step"]  # 0.1 everywhere, moved by one AdamW step of lr 1e-2
        assert inside == after and all(abs(v - 0.1) < 0.0125 for row in after for v in row), out
        if stage == 3:
            assert out["sub_state_dict"].startswith("RuntimeError: zerofuse.zero: model.state_dict() at stage 3 "
                                                    "outside zerofuse.zero.full_params"), out
            assert out["sub_load"].startswith("RuntimeError: zerofuse.zero: model.load_state_dict() at stage 3 "
                                              "outside zerofuse.zero.full_params"), out
            assert out["sub_state_dict_after"], out


def _meta_seed_rank(rank, ws):
    from zerofuse import zero

    torch.manual_seed(100 + rank)  # each rank its own init
    with torch.device("meta"):
        model = _Net(seed=100 + rank)
    return error_text(lambda: zero.parallelize(model, stage=3))


def test_a_meta_model_initialised_apart_on_the_ranks_is_refused():
    for got in run_distributed(_meta_seed_rank, 2, timeout=120):
        assert got.startswith("ValueError: zerofuse.zero.parallelize: expected every rank of the group to start from "
                              "the same weights"), got


def test_wrap_naming_a_container_is_refused(world_of_one):
    from zerofuse import zero

    model = _Net()
    for wrap in ([model.blocks], [nn.ModuleList]):
        with pytest.raises(ValueError, match=r"expected wrap to name modules that run a forward .* got containers "
                                             r"\[\"'blocks' \(ModuleList\)\"\]"):
            zero.parallelize(model, stage=3, wrap=wrap)
    zero.parallelize(model, stage=3, wrap=[_Block])
    outer = nn.Sequential(_Net())  # a policy matching a module and the container inside it: that module's unit
    zero.parallelize(outer, stage=3, wrap=lambda m: isinstance(m, (_Net, nn.ModuleList)))
    assert [u.name for u in outer._zerofuse_zero.units] == ["0"]  # (everything is in it: no root unit)
