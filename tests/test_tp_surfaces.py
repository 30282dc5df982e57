"""Tensor parallelism on real gloo ranks, the rest of test_tp.py's: checkpoints across TP sizes, the
bytes the TP collectives move vs the analytic count, attention, activation memory and errors, layers
built on meta, training under autocast."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import zerofuse
from zerofuse import tp
from zerofuse.models import GPT, GPTConfig

from dist_utils import run_distributed
from test_tp import B, CFG, GB, LR, N, _batches, _x

pytestmark = pytest.mark.usefixtures("native_kernels")

# ---------------------------------------------------------------------------- checkpoints


def _train_steps(model, opt, batches, dp, dp_rank):
    per = GB // dp
    losses = []
    for b in batches:
        mine = b[dp_rank * per:(dp_rank + 1) * per]
        _, loss = model(mine[:, :-1], mine[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


FROZEN = "blocks.0.attn.qkv.weight"  # a TP-sharded param the checkpoint tests freeze


def _build(dp, tpn, stage, sp=False, seed=0, freeze=None):
    mesh = zerofuse.parallel.init_mesh(dp=dp, tp=tpn)
    model = GPT(GPTConfig(**CFG), seed=seed, tp_group=mesh.tp_group if tpn > 1 else None, sequence_parallel=sp)
    if freeze is not None:
        dict(model.named_parameters())[freeze].requires_grad_(False)
    zerofuse.zero.parallelize(model, stage=stage, group=mesh.dp_group, bucket_mb=0.05)
    return mesh, model, zerofuse.zero.Optimizer(model, "adamw", lr=LR, weight_decay=0.01)


def _ckpt_save_rank(rank, ws, path):
    mesh, model, opt = _build(2, 2, 2, sp=True, freeze=FROZEN)
    bs = _batches(6)
    _train_steps(model, opt, bs[:3], mesh.dp, mesh.dp_rank)
    zerofuse.checkpoint.save(path, model, opt, extra={"step": 3})
    return _train_steps(model, opt, bs[3:], mesh.dp, mesh.dp_rank)


def _ckpt_load_rank(rank, ws, path, dp, tpn, stage):
    mesh, model, opt = _build(dp, tpn, stage, seed=1, freeze=FROZEN)  # (other initial values: all loaded)
    extra = zerofuse.checkpoint.load(path, model, opt)
    return extra, _train_steps(model, opt, _batches(6)[3:], mesh.dp, mesh.dp_rank)


def test_checkpoint_across_tp_sizes(tmp_path):
    """Saved at dp2 × tp2 (ZeRO-2, sequence parallel), resumed at tp2 × dp1 (ZeRO-1, the TP parts
    read directly), at tp1 × dp2 (ZeRO-3, merged and resliced) and as a plain model from
    consolidate(): every continuation has the losses of the run that never stopped. A frozen
    TP-sharded param is saved per TP part with the buffers: each TP rank took TP rank 0's part, and
    consolidate returned that part as the whole tensor (a review's reproduction, 2026-11-28)."""
    path = str(tmp_path / "ckpt")
    cont = run_distributed(_ckpt_save_rank, 4, path, timeout=300)
    assert sorted(os.listdir(path)) == ["meta.json", "tp0", "tp1"]
    assert sorted(os.listdir(os.path.join(path, "tp1"))) == ["common.pt", "meta.json", "rank0.pt", "rank1.pt"]
    # losses are per DP rank (the same on every rank of a TP group): dp rank 0 sees the first half
    # of the batch at dp 2, one rank the whole batch (the mean of the halves) at dp 1
    halves = torch.tensor(cont[0])
    whole = (torch.tensor(cont[0]) + torch.tensor(cont[2])) / 2
    for dp, tpn, stage in ((1, 2, 1), (2, 1, 3)):
        res = run_distributed(_ckpt_load_rank, dp * tpn, path, dp, tpn, stage, timeout=300)
        assert res[0][0] == {"step": 3}
        torch.testing.assert_close(torch.tensor(res[0][1]), halves if dp == 2 else whole, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"dp {dp} tp {tpn}: {m}")
    full = zerofuse.checkpoint.consolidate(path)
    model = GPT(GPTConfig(**CFG), seed=1)
    dict(model.named_parameters())[FROZEN].requires_grad_(False)
    model.load_state_dict(full["model"])
    torch.testing.assert_close(full["model"][FROZEN], dict(GPT(GPTConfig(**CFG), seed=0).named_parameters())[FROZEN],
                               rtol=0, atol=0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    opt.load_state_dict(full["optimizer"])
    losses = []
    for b in _batches(6)[3:]:
        _, loss = model(b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), whole, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- traffic, attention, memory, errors


def _step_traffic(model, idx):
    tp.reset_comm_stats()
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    return tp.comm_stats()


def _column_backward_order(sp):
    """The order of events in one column-parallel backward: collective launches, matmuls, waits."""
    from zerofuse.comm import communicator

    events = []
    col = tp.ColumnParallelLinear(24, 16, sequence_parallel=sp)
    x = _x((B, N // 2 if sp else N, 24)).requires_grad_()
    y = col(x)
    launch = {name: getattr(tp.comm, name) for name in ("all_reduce", "seq_reduce_scatter_start", "seq_all_gather_start")}
    wait, matmul = communicator.Work.wait, torch.Tensor.matmul

    def logged(name, fn):
        def run(*a, **k):
            events.append(name)
            return fn(*a, **k)
        return run

    try:
        for name, fn in launch.items():
            setattr(tp.comm, name, logged("launch", fn))
        communicator.Work.wait = logged("wait", wait)
        torch.Tensor.matmul = logged("matmul", matmul)
        y.sum().backward()
    finally:
        for name, fn in launch.items():
            setattr(tp.comm, name, fn)
        communicator.Work.wait, torch.Tensor.matmul = wait, matmul
    return events


def _misc_rank(rank, ws):
    from common import SavedActivations

    out = {}
    # attention: heads split over the ranks == the unsharded module with the same seed
    torch.manual_seed(5)
    ref = zerofuse.nn.Attention(48, 4, 2, bias=True)
    torch.manual_seed(5)
    att = tp.ParallelAttention(48, 4, 2, bias=True)
    x = _x((B, N, 48), seed=13).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    y, yr = att(x), ref(xr)
    y.square().sum().backward()
    yr.square().sum().backward()
    out["attn"] = [(y.detach(), yr.detach()), (x.grad, xr.grad),
                   (att.qkv.weight.grad, att.qkv.weight._zf_tp.slice(ref.qkv.weight.grad)),
                   (att.proj.weight.grad, att.proj.weight._zf_tp.slice(ref.proj.weight.grad)),
                   (att.proj.bias.grad, ref.proj.bias.grad)]
    # bytes moved by one forward + backward, and the norms' saved activations, with and without SP
    idx = torch.randint(0, 65, (B, N + 1), generator=torch.Generator().manual_seed(3))
    for sp in (False, True):
        model = GPT(GPTConfig(**CFG), seed=0, tp_group=dist.group.WORLD, sequence_parallel=sp)
        norms = [m for n, m in model.named_modules() if n.endswith("norm1") or n.endswith("norm2") or n == "norm"]
        _step_traffic(model, idx)  # (a first step also checks the vocab_size with the group, once)
        model.zero_grad()
        probe = SavedActivations(norms)
        out[("traffic", sp)] = _step_traffic(model, idx)
        out[("norm_bytes", sp)] = probe.bytes
        probe.remove()
        out["num_params"] = (model.num_params(), GPT(GPTConfig(**CFG)).num_params())
    out["overlap"] = {sp: _column_backward_order(sp) for sp in (False, True)}
    # errors
    errors = {}
    for key, fn in {
        "heads": lambda: GPT(GPTConfig(**{**CFG, "n_head": 3, "n_kv_head": 3, "dim": 48}), tp_group=dist.group.WORLD),
        "kv_heads": lambda: GPT(GPTConfig(**{**CFG, "n_head": 4, "n_kv_head": 1}), tp_group=dist.group.WORLD),
        "sp_without_tp": lambda: GPT(GPTConfig(**CFG), sequence_parallel=True),
        "sp_odd_seq": lambda: GPT(GPTConfig(**CFG), tp_group=dist.group.WORLD, sequence_parallel=True)(idx[:, :7]),
        "partition": lambda: tp.ColumnParallelLinear(8, 10, partition_sizes=(4, 4)),
        "ce_vocab": lambda: tp.vocab_parallel_cross_entropy(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long),
                                                            vocab_size=65),
    }.items():
        try:
            fn()
            errors[key] = None
        except ValueError as e:
            errors[key] = str(e)
    out["errors"] = errors
    return out


def test_attention_traffic_activation_memory_and_errors():
    ws = 2
    res = run_distributed(_misc_rank, ws, timeout=180)
    for rank, out in enumerate(res):
        for got, want in out["attn"]:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank} attention: {m}")
    # analytic traffic of one step (forward + backward) at tp=2, b·s·h·4 bytes per activation
    L, h, bs = CFG["n_layer"], CFG["dim"], B * N
    # the fused head + CE: a max and a (sum of exp, target logit, sum of logits) all-reduce, fp32
    a, ce = bs * h * 4, 4 * bs * 4
    without = res[0][("traffic", False)]
    # Megatron: 2 all-reduces per layer forward and 2 backward, + the embedding's forward one and
    # the head's backward one
    assert without == {"all_reduce": (4 * L + 2) * a + ce}, without
    with_sp = res[0][("traffic", True)]
    replicated = ((2 * L + 1) * h + CFG["seq_len"] * h) * 4  # norm weights and position table grads
    # per layer: 2 RS forward (row outputs) + 2 backward (column input grads); AG: 2 forward (column
    # inputs), 2 backward re-gathers, 2 backward row output grads; the embedding (RS / AG back) and
    # the head (the fused head + CE gathers its input once: its gradients are made in the forward, so
    # backward needs no re-gather)
    assert with_sp == {"reduce_scatter": (4 * L + 2) * a, "all_gather": (6 * L + 2) * a,
                       "all_reduce": ce + replicated}, with_sp
    # sequence parallelism keeps 1/tp of the norms' activations
    assert res[0][("norm_bytes", True)] * ws <= res[0][("norm_bytes", False)], res[0]
    # the input gradient's collective is in flight during the weight-gradient matmul: launched
    # after the input-grad matmul, waited after the weight-grad one; with SP the input's re-gather
    # is in flight during the input-grad matmul
    assert res[0]["overlap"][False] == ["matmul", "launch", "matmul", "wait"], res[0]["overlap"]
    assert res[0]["overlap"][True] == ["launch", "matmul", "wait", "launch", "matmul", "wait"], res[0]["overlap"]
    mine, unsharded = res[0]["num_params"]
    assert mine == unsharded  # num_params counts the unsharded model
    errs = res[0]["errors"]
    assert "n_head (3) to divide by the tensor-parallel size 2" in errs["heads"]
    assert "n_kv_head (1) to divide by the tensor-parallel size 2" in errs["kv_heads"]
    assert "sequence_parallel=True needs a tp_group" in errs["sp_without_tp"]
    assert "sequence length (7) to divide by the tensor-parallel size 2" in errs["sp_odd_seq"]
    assert "partition_sizes" in errs["partition"]
    assert "expected vocab_size to be the TP group's vocabulary, its shards [5, 5] summed (10), got 65" \
        in errs["ce_vocab"]



def _meta_then_real_rank(rank, ws):
    """RowParallelLinear (SP) and a TP+SP GPT built on meta, then made real by to_empty + load and
    by load_state_dict(assign=True): specs and replicated-grad sums as the layer built on real tensors."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 5)
    x = torch.randn(2, 4, 8)
    g = torch.randn(2, 4, 5)
    ref(x).backward(g)
    n = 4 // ws
    out = {}
    for how in ("real", "to_empty", "assign"):
        if how == "real":
            r = tp.RowParallelLinear.from_full(ref.weight, ref.bias, input_is_parallel=False, sequence_parallel=True)
        else:
            r = tp.RowParallelLinear(8, 5, input_is_parallel=False, sequence_parallel=True, device="meta")
            full = {"weight": tp.spec_of(r.weight).slice(ref.weight.detach()), "bias": ref.bias.detach().clone()}
            if how == "to_empty":
                r.to_empty(device="cpu")
                r.load_state_dict(full)
            else:
                r.load_state_dict(full, assign=True)
        r(x).backward(g[:, rank * n:(rank + 1) * n])
        out[how] = (tp.spec_of(r.weight) is not None, (r.bias.grad - ref.bias.grad).abs().max().item(),
                    (r.weight.grad - tp.spec_of(r.weight).slice(ref.weight.grad)).abs().max().item())
    cfg = GPTConfig(**{**CFG, "n_layer": 1})
    idx = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(1))
    real = GPT(cfg, seed=0, tp_group=dist.group.WORLD, sequence_parallel=True)
    with torch.device("meta"):
        meta = GPT(cfg, seed=0, tp_group=dist.group.WORLD, sequence_parallel=True)
    meta.to_empty(device="cpu")
    meta.load_state_dict(real.state_dict())
    for m in (real, meta):
        m(idx, idx)[1].backward()
    out["gpt"] = [(n, tp.spec_of(p) is not None, tp.spec_of(q) is not None, torch.equal(p.grad, q.grad))
                  for (n, p), (_, q) in zip(real.named_parameters(), meta.named_parameters())]
    return out


def test_layers_built_on_meta_keep_their_specs_and_grad_sums_through_to_empty_and_assign():
    """to_empty / load_state_dict(assign=True) replace the Parameter objects: the TPSpecs and the
    sequence-parallel hooks summing replicated grads (a row-parallel bias, a GPT's norm weights)
    are carried over (they were lost: the bias grad was this rank's partial sum)."""
    for out in run_distributed(_meta_then_real_rank, 2, timeout=120):
        for how in ("real", "to_empty", "assign"):
            has_spec, bias_err, weight_err = out[how]
            assert has_spec and bias_err < 1e-6 and weight_err < 1e-6, (how, out[how])
        for name, spec_real, spec_meta, same_grad in out["gpt"]:
            assert spec_real == spec_meta and same_grad, name


def _autocast_rank(rank, ws, sp):
    model = GPT(GPTConfig(**CFG), seed=0, tp_group=dist.group.WORLD, sequence_parallel=sp)
    idx = _batches(1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    return loss.item(), [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_layers_train_under_autocast(sp):
    """Column/Row parallel linears under torch.autocast: backward (run without autocast) multiplied
    a bf16 grad by the fp32 weight and failed, so no TP model trained under autocast (a review's
    reproduction, 2026-11-28). The loss is one process's under autocast, within bf16's rule."""
    model = GPT(GPTConfig(**CFG), seed=0)
    idx = _batches(1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, want = model(idx[:, :-1], idx[:, 1:])
    for loss, bad in run_distributed(_autocast_rank, 2, sp, timeout=120):
        from tolerances import tol
        torch.testing.assert_close(torch.tensor(loss), want.detach().float(), **tol(torch.bfloat16))
        assert not bad, bad


class _TPNet(torch.nn.Module):
    def __init__(self, group):
        super().__init__()
        self.emb = tp.VocabParallelEmbedding(11, 8, group=group, padding_idx=10)
        self.fc = tp.ColumnParallelLinear(8, 6, group=group)
        self.proj = tp.RowParallelLinear(6, 8, group=group)

    def forward(self, idx):
        return self.proj(self.fc(self.emb(idx)))


def _meta_tp_rank(rank, ws):
    mesh = zerofuse.parallel.init_mesh(dp=1, tp=2)
    with torch.device("meta"):
        model = _TPNet(mesh.tp_group)
    torch.manual_seed(0)  # the same RNG state on every rank: the same full tensors drawn
    zerofuse.zero.parallelize(model, stage=1, group=mesh.dp_group, tp_group=mesh.tp_group, device="cpu")
    idx = torch.tensor([[1, 2, 10, 7]])
    out = model(idx).detach()
    with zerofuse.zero.full_params(model):
        return {n: (p.detach().clone(), tp.spec_of(p)) for n, p in model.named_parameters()}, out


def test_tp_layers_built_on_meta_materialize_through_reset_parameters():
    """A model of zerofuse.tp layers built on meta: ZeRO materializes each module by its
    reset_parameters(), which the TP layers lacked (refused; torch's layers have one; a review's
    reproduction, 2026-11-28). Each rank writes its slice of torch's initialisation of the full
    tensor; the model computes as one torch model holding the merged tensors."""
    results = run_distributed(_meta_tp_rank, 2, timeout=120)
    full = {}
    for name, (t, spec) in results[0][0].items():
        if spec is None:  # replicated (the row bias): the same on both ranks
            assert torch.equal(t, results[1][0][name][0]), name
            full[name] = t
            continue
        whole = torch.empty(spec.full_shape)
        for r, (params, _) in enumerate(results):
            spec.place(whole, params[name][0], r)
        full[name] = whole
    assert not torch.equal(results[0][0]["fc.weight"][0], results[1][0]["fc.weight"][0])
    assert torch.equal(full["emb.weight"][10], torch.zeros(8))  # padding_idx
    assert full["fc.weight"].abs().max() <= 8 ** -0.5 and full["proj.bias"].abs().max() <= 6 ** -0.5
    plain = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 6), torch.nn.Linear(6, 8))
    plain.load_state_dict({"0.weight": full["emb.weight"], "1.weight": full["fc.weight"], "1.bias": full["fc.bias"],
                           "2.weight": full["proj.weight"], "2.bias": full["proj.bias"]})
    want = plain(torch.tensor([[1, 2, 10, 7]])).detach()
    for _, out in results:
        torch.testing.assert_close(out, want)
