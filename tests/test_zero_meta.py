"""Models larger than one rank: a model built under ``torch.device("meta")`` is materialized by
``zerofuse.zero.parallelize`` one bucket (stage 3: one unit) at a time, so at stage 3 the full model
never exists on a rank, and the weights equal those of the same seeded model built normally.
"""
from __future__ import annotations

import pytest
import torch

import zerofuse
from zerofuse.models import GPT, GPTConfig

from dist_utils import run_distributed

pytestmark = pytest.mark.usefixtures("native_kernels")

CFG = dict(vocab_size=65, seq_len=32, n_layer=8, n_head=4, n_kv_head=2, dim=96, tie_embeddings=True)
MiB = 1 << 20


def _full(model) -> dict:
    with zerofuse.zero.full_params(model):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _meta_rank(rank, ws, stage, precision):
    with torch.device("meta"):
        model = GPT(GPTConfig(**CFG), seed=3)
    with zerofuse.zero.peak_memory() as mem:
        zerofuse.zero.parallelize(model, stage=stage, precision=precision, bucket_mb=0.05)
    eng = model._zerofuse_zero
    item = eng.dtype.itemsize
    return dict(peak=mem.peak, params=_full(model), device=str(next(model.parameters()).device),
                shard_bytes=sum(u.shard_numel for u in eng.units) * item,
                unit_bytes=max(u.padded for u in eng.units) * (item + (4 if item < 4 else 0)),
                param_bytes=max(p.numel() for p in eng.params) * 4,
                full_fp32_bytes=sum(p.numel() for p in eng.params) * 4)


@pytest.mark.parametrize("ws,stage,precision", [(2, 3, "fp32"), (4, 3, "bf16"), (3, 2, "fp32"), (2, 1, "bf16")])
def test_meta_model_is_materialized_shard_by_shard_with_the_seeded_weights(ws, stage, precision):
    """Bit-identical to GPT(cfg, seed) (cast to the precision), and at stage 3 the peak allocated
    during parallelize stays within this rank's shards + one unit in full (+ its fp32 copy for
    bf16) + the init's temporaries (a drawn value and its scaled copy of the largest param)."""
    want = {n: p.detach().to(zerofuse.zero.engine.PRECISIONS[precision]).float()
            for n, p in GPT(GPTConfig(**CFG), seed=3).named_parameters()}
    for r in run_distributed(_meta_rank, ws, stage, precision, timeout=240):
        assert r["device"] == "cpu"
        assert r["params"].keys() == want.keys()
        for name, w in want.items():
            assert torch.equal(r["params"][name], w), name
        if stage == 3:
            bound = r["shard_bytes"] + r["unit_bytes"] + 2 * r["param_bytes"]
            assert r["peak"] <= bound, (r["peak"] / MiB, bound / MiB)
            assert r["peak"] < r["full_fp32_bytes"], (r["peak"] / MiB, r["full_fp32_bytes"] / MiB)


def _big_rank(rank, ws, steps):
    cfg = GPTConfig(vocab_size=65, seq_len=32, n_layer=32, n_head=4, dim=128)
    with torch.device("meta"):
        model = GPT(cfg, seed=0)
    full_bytes = sum(p.numel() for p in model.parameters()) * 4
    with zerofuse.zero.peak_memory() as mem:
        zerofuse.zero.parallelize(model, stage=3, precision="bf16")
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 65, (4, 33), generator=g)
    losses = []
    for _ in range(steps):
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return full_bytes, mem.peak, losses


def test_a_model_four_times_the_parallelize_peak_trains_at_stage3():
    """The full fp32 params of a 32-layer GPT are >= 4x the peak allocated per rank while
    zerofuse.zero.parallelize builds it at ws 4 (bf16 shards; no rank ever holds the model), and it
    trains: the loss on a repeated batch falls."""
    for full_bytes, peak, losses in run_distributed(_big_rank, 4, 5, timeout=300):
        assert full_bytes >= 4 * peak, (full_bytes / MiB, peak / MiB)
        assert all(map(lambda v: v == v, losses)) and losses[-1] < losses[0] - 0.1, losses


class _NoInit(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(4, 300))
        self.lin = torch.nn.Linear(300, 3)

    def forward(self, x):
        return self.lin(x @ self.w)


def _user_init_rank(rank, ws):
    out = {}
    for stage in (1, 3):
        with torch.device("meta"):
            model = _NoInit()
        try:
            zerofuse.zero.parallelize(model, stage=stage)
        except ValueError as e:
            out[f"error{stage}"] = str(e)
        with torch.device("meta"):
            model = _NoInit()

        def init(m):
            if isinstance(m, _NoInit):
                m.w.fill_(0.5)
            elif isinstance(m, torch.nn.Linear):
                m.weight.fill_(-1.0)
                m.bias.fill_(2.0)

        zerofuse.zero.parallelize(model, stage=stage, param_init_fn=init)
        out[stage] = _full(model)
    return out


def test_meta_model_takes_a_param_init_fn_and_names_a_module_it_cannot_initialise():
    for r in run_distributed(_user_init_rank, 2, timeout=120):
        for stage in (1, 3):
            assert "module '' (_NoInit) holds parameters or buffers on the meta device and has no reset_parameters(); pass " \
                   "param_init_fn" in r[f"error{stage}"]
            p = r[stage]
            assert torch.equal(p["w"], torch.full((4, 300), 0.5))
            assert torch.equal(p["lin.weight"], torch.full((3, 300), -1.0))
            assert torch.equal(p["lin.bias"], torch.full((3,), 2.0))


class _Scale(torch.nn.Module):  # a buffer and no param: its init sets the buffer
    def __init__(self):
        super().__init__()
        self.register_buffer("s", torch.full((8,), 2.0))

    def reset_parameters(self):
        self.s.fill_(2.0)

    def forward(self, x):
        return x * self.s


class _PartlyFrozen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 8)
        self.lin.weight.requires_grad_(False)  # frozen beside a trainable bias
        self.scale = _Scale()
        self.frozen = torch.nn.Linear(8, 8).requires_grad_(False)  # no trainable param at all
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.frozen(self.scale(self.lin(x))))


def _init_all(m):
    torch.manual_seed(len(list(m.parameters(recurse=False))) * 7 + len(list(m.buffers(recurse=False))))
    if hasattr(m, "reset_parameters"):
        m.reset_parameters()


def _frozen_rank(rank, ws, stage):
    want = _PartlyFrozen()
    for m in want.modules():
        _init_all(m)
    with torch.device("meta"):
        model = _PartlyFrozen()
    zerofuse.zero.parallelize(model, stage=stage, param_init_fn=_init_all)
    with zerofuse.zero.full_params(model):
        got = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    return {n: torch.equal(t, dict([*want.named_parameters(), *want.named_buffers()])[n]) for n, t in got.items()}


@pytest.mark.parametrize("stage", [3, 2])
def test_frozen_params_and_buffers_of_a_meta_model_are_initialised(stage):
    """A meta model's frozen params and buffers are written by the init as its trainable params
    are (they were left as allocated: a frozen weight beside a trainable bias had its init writes
    dropped, a module without trainable params and a buffer-only module were never initialised)."""
    for same in run_distributed(_frozen_rank, 2, stage, timeout=120):
        assert same == dict.fromkeys(same, True) and {"lin.weight", "frozen.weight", "scale.s"} <= set(same), same


def _tp_meta_rank(rank, ws):
    """One SP step of a TP model built on meta (ZeRO-3) and of the same model built whole (ZeRO-2)."""
    from zerofuse import tp

    mesh = zerofuse.parallel.init_mesh(dp=1, tp=ws)
    cfg = GPTConfig(vocab_size=65, seq_len=16, n_layer=2, n_head=4, dim=32, bias=True)
    out = {}
    for how in ("meta", "eager"):
        with torch.device("meta" if how == "meta" else "cpu"):
            model = GPT(cfg, seed=3, tp_group=mesh.tp_group, sequence_parallel=True)
        zerofuse.zero.parallelize(model, stage=3 if how == "meta" else 2, group=mesh.dp_group)
        eng = model._zerofuse_zero
        opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-2, max_grad_norm=1.0)
        idx = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(5))
        model(idx, idx)[1].backward()
        opt.step()
        out[how] = dict(norm=opt.last_grad_norm.item(), params=_full(model),
                        specs={n: tp.spec_of(p) is not None for n, p in zip(eng.names, eng.params)})
    return out


def test_a_tensor_parallel_model_built_on_meta_keeps_its_specs_and_replicated_grad_sums():
    """ZeRO's materialization keeps what zerofuse.tp put on the params (swap_tensors swapped their
    __dict__ and left the hooks on the old tensor): the TPSpecs (a checkpoint held each rank's slice
    as the full tensor) and sequence parallelism's sum of the norm weights' grads over the TP group
    (the grad norm and the step used one rank's partial sums). Equal to the model built whole."""
    for r in run_distributed(_tp_meta_rank, 2, timeout=240):
        meta, eager = r["meta"], r["eager"]
        assert meta["specs"] == eager["specs"] and any(eager["specs"].values())
        assert meta["norm"] == pytest.approx(eager["norm"], rel=1e-5)
        for n, p in eager["params"].items():
            torch.testing.assert_close(meta["params"][n], p, rtol=1e-5, atol=1e-6, msg=n)
