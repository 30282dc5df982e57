"""zerofuse.tp where a review (2026-11-27) reproduced behaviour a Megatron / DTensor user would call
wrong (each check failed before its fix), on 2 real gloo ranks: the default vocab_size of an uneven
vocabulary split, ZeRO's clip norm of a custom TP model given no tp_group, padding_idx's row at
init, sequence-parallel inputs without a batch dim, proj_bias_grad=False in ParallelAttention, a
second backward through the vocab-parallel cross-entropy."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zerofuse
from zerofuse import tp
from zerofuse.tp.spec import split_range

from dist_utils import error_text, run_distributed

pytestmark = pytest.mark.usefixtures("native_kernels")
V, D, H = 5, 16, 32  # V = 5 over 2 ranks: shards of 3 and 2


class _Net(torch.nn.Module):
    """A custom model of zerofuse.tp layers (no tp_group attribute)."""

    def __init__(self, parallel: bool, group=None):
        super().__init__()
        self.ln = torch.nn.LayerNorm(D)
        self.fc = tp.ColumnParallelLinear(D, H, group=group) if parallel else torch.nn.Linear(D, H)
        self.proj = tp.RowParallelLinear(H, D, group=group) if parallel else torch.nn.Linear(H, D)

    def forward(self, x):
        return self.proj(torch.relu(self.fc(self.ln(x))))


def _contract_rank(rank, ws):
    out = {}
    g = torch.Generator().manual_seed(0)
    # the default vocab_size of an uneven split (each rank guessed n_local x tp: 6 and 4)
    logits, hidden, weight = torch.randn(2, 4, V, generator=g), torch.randn(2, 4, 8, generator=g), torch.randn(V, 8, generator=g)
    targets = torch.tensor([[0, 1, 2, 3], [4, 2, 4, 0]])
    a, b = split_range(V, ws, rank)
    out["ce"] = (tp.vocab_parallel_cross_entropy(logits[..., a:b].contiguous(), targets).item(),
                 F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1)).item())
    out["lce"] = (tp.vocab_parallel_linear_cross_entropy(hidden, weight[a:b].contiguous(), targets).item(),
                  F.cross_entropy((hidden @ weight.t()).reshape(-1, V), targets.reshape(-1)).item())
    # a second backward through a retained graph
    shard = logits[..., a:b].clone().requires_grad_()
    loss = tp.vocab_parallel_cross_entropy(shard, targets, vocab_size=V)
    loss.backward(retain_graph=True)
    out["twice"] = error_text(lambda: loss.backward())
    # ZeRO's clip norm of a custom TP model, no tp_group given: the unsharded model's
    x = torch.randn(2, 4, D, generator=g)
    torch.manual_seed(0)
    ref = _Net(parallel=False)
    ref(x).square().sum().backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9).item()
    mesh = zerofuse.parallel.init_mesh(dp=1, tp=ws)
    torch.manual_seed(0)
    model = zerofuse.zero.parallelize(_Net(parallel=True, group=mesh.tp_group), stage=1, group=mesh.dp_group)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-3)
    model(x).square().sum().backward()
    out["clip"] = (opt.clip_grad_norm_(1e9).item(), want)
    # padding_idx's row is zero at init, as torch.nn.Embedding's (same seed: the same table)
    torch.manual_seed(0)
    ref_emb = torch.nn.Embedding(8, 4, padding_idx=3)
    torch.manual_seed(0)
    emb = tp.VocabParallelEmbedding(8, 4, padding_idx=3)
    ids = torch.arange(8).view(1, 8)
    out["padding"] = torch.equal(emb(ids), ref_emb(ids))
    # a negative padding_idx counts from the end, as torch.nn.Embedding's (no gradient to that row)
    torch.manual_seed(0)
    ref_emb = torch.nn.Embedding(8, 4, padding_idx=-2)
    torch.manual_seed(0)
    emb = tp.VocabParallelEmbedding(8, 4, padding_idx=-2)
    emb(ids).sum().backward()
    ref_emb(ids).sum().backward()
    full_grad = [torch.zeros_like(emb.weight.grad) for _ in range(ws)]
    torch.distributed.all_gather(full_grad, emb.weight.grad.contiguous())
    out["negative_padding"] = (emb.padding_idx, torch.equal(emb(ids), ref_emb(ids)),
                               torch.equal(torch.cat(full_grad)[:8], ref_emb.weight.grad))
    # sequence parallelism takes (batch, seq, ...) inputs
    out["sp_errors"] = [
        error_text(lambda: tp.VocabParallelEmbedding(10, 8, sequence_parallel=True)(torch.tensor([1, 2, 3, 4]))),
        error_text(lambda: tp.ColumnParallelLinear(8, 6, sequence_parallel=True)(torch.randn(2, 8))),
        error_text(lambda: tp.RowParallelLinear(8, 6, sequence_parallel=True)(torch.randn(4, 8 // ws))),
    ]
    # proj_bias_grad=False: the same output, the bias left for the caller's gradient
    attn = tp.ParallelAttention(16, 4, 2, bias=True)
    h = torch.randn(1, 4, 16, generator=g)
    plain, detached = attn(h), attn(h, proj_bias_grad=False)
    detached.sum().backward()
    out["proj_bias_grad"] = (torch.equal(plain, detached), attn.proj.bias.grad is None, attn.proj.weight.grad is not None)
    return out


def test_tp_surfaces_match_torch_or_refuse_clearly():
    for rank, out in enumerate(run_distributed(_contract_rank, 2, timeout=120)):
        for key in ("ce", "lce", "clip"):
            got, want = out[key]
            assert got == pytest.approx(want, rel=1e-5), (rank, key, got, want)
        assert out["twice"].startswith("RuntimeError: zerofuse.tp.vocab_parallel_cross_entropy: a second backward")
        assert out["padding"], rank
        assert out["negative_padding"] == (6, True, True), (rank, out["negative_padding"])
        embedding, column, row = out["sp_errors"]
        assert "VocabParallelEmbedding: with sequence_parallel=True expected idx of shape (batch, seq), got [4]" \
            in embedding
        assert "ColumnParallelLinear: with sequence_parallel=True expected an input of shape (batch, seq, 8)" in column
        assert "RowParallelLinear: with sequence_parallel=True expected an input of shape (batch, seq, 4)" in row
        assert out["proj_bias_grad"] == (True, True, True), rank


def _groups_rank(rank, ws):
    import torch.distributed as dist

    mesh = zerofuse.parallel.init_mesh(dp=1, tp=ws)
    alone = [dist.new_group([r]) for r in range(ws)][rank]
    model = _Net(parallel=True, group=mesh.tp_group)
    return error_text(lambda: zerofuse.zero.parallelize(model, stage=1, group=alone, tp_group=alone))


def test_a_tp_group_of_another_size_than_the_layers_is_refused():
    for message in run_distributed(_groups_rank, 2, timeout=120):
        assert "holds tensor-parallel slices of a TP size [2], expected tp_group to be a group of that size, " \
               "got a group of 1" in message, message


def _counted_rank(rank, ws):
    import torch.distributed as dist

    from zerofuse.tp.layers import RowParallelLinear
    from zerofuse.train.launches import CountLaunches

    torch.manual_seed(0)
    lin = RowParallelLinear(16, 8, bias=False, group=dist.group.WORLD)
    x = torch.randn(2, 3, 8)
    with CountLaunches() as counted:
        y = lin(x)
    return dict(counted.names), torch.equal(y, lin(x))


def test_the_launch_counter_sees_the_row_parallel_step_as_it_runs():
    """The all-reduce takes a copy under a dispatch mode that may keep the matmul's output (selective
    checkpointing); zerofuse-train's launch counter keeps nothing: it counted a clone no step runs."""
    for names, same in run_distributed(_counted_rank, 2, timeout=60):
        assert names == {"mm": 1} and same, names


def _documents_rank(rank, ws, differ):
    import zerofuse
    from zerofuse.models import GPT, GPTConfig

    mesh = zerofuse.parallel.init_mesh(dp=1, tp=ws)
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    docs = (torch.arange(16) // 5).expand(2, 16).clone()
    if differ and rank == 1:
        docs.zero_()
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=4, dim=32), seed=0, tp_group=mesh.tp_group,
                sequence_parallel=True)
    return error_text(lambda: model(x[:, :-1], x[:, 1:], document_ids=docs))


@pytest.mark.parametrize("differ", [True, False])
def test_the_checker_names_document_ids_differing_between_tp_ranks(monkeypatch, differ):
    """Document ids differing by TP rank trained each rank's heads on other masks: a loss matching
    neither run, silently (a review's reproduction, 2026-12-06). The collective checker compares them."""
    monkeypatch.setenv("ZEROFUSE_CHECK_COLLECTIVES", "1")
    for err in run_distributed(_documents_rank, 2, differ, timeout=90):
        if differ:
            assert "expected the same ['document_ids'] on every rank of the tensor-parallel group" in err, err
        else:
            assert err == "no error", err


def _lamb_rank(rank, ws):
    import torch.distributed as dist

    from zerofuse.models import GPT, GPTConfig

    mesh = zerofuse.parallel.init_mesh(dp=2, tp=2)
    cfg = GPTConfig(vocab_size=67, seq_len=32, n_layer=2, n_head=4, dim=48, bias=True, tie_embeddings=True)
    model = GPT(cfg, seed=0, tp_group=mesh.tp_group, sequence_parallel=True)
    zerofuse.zero.parallelize(model, stage=3, group=mesh.dp_group, bucket_mb=0.05)
    opt = zerofuse.zero.Optimizer(model, "lamb", lr=1e-2, max_grad_norm=0.5)
    g = torch.Generator().manual_seed(123)
    for _ in range(4):
        b = torch.randint(0, 67, (4, 17), generator=g)[2 * mesh.dp_rank:2 * mesh.dp_rank + 2]
        model(b[:, :-1], b[:, 1:])[1].backward()
        opt.step()
        opt.zero_grad()
    with zerofuse.zero.full_params(model):
        mine = {n: p.detach().clone() for n, p in model.named_parameters() if tp.spec_of(p) is None}
    out = [None] * ws
    dist.all_gather_object(out, (mesh.tp_rank, mine))
    return out


def test_lamb_keeps_replicated_params_equal_on_every_tp_rank():
    """vocab 67 over tp 2 cuts the TP ranks' buffers into DP pieces at other places: the per-param
    norms of LAMB's trust ratios, summed over the DP group in another order, moved a replicated
    param (wpe) apart across the TP ranks (a review's reproduction, 2026-12-06)."""
    ranks = run_distributed(_lamb_rank, 4, timeout=240)[0]
    by_tp = {}
    for tp_rank, params in ranks:
        by_tp.setdefault(tp_rank, params)
    assert "wpe.weight" in by_tp[0]
    for n, t in by_tp[0].items():
        assert torch.equal(t, by_tp[1][n]), n


def _seq_scatter_rank(rank, ws):
    import torch.distributed as dist

    from zerofuse.models import recompute
    from zerofuse.tp.comm import comm_for

    comm = comm_for(dist.group.WORLD)
    out = {}
    for b in (1, 2):
        x = torch.full((b, 4, 2), float(rank + 1))
        tp.reduce_scatter_to_seq(x, comm)
        out[f"input kept b={b}"] = torch.equal(x, torch.full((b, 4, 2), float(rank + 1)))
    xs = torch.ones(1, 2, 2, requires_grad=True)  # autograd hands the gather's backward the grad r's takes
    r0 = torch.zeros(1, 4, 2, requires_grad=True)
    r = r0 * 1.0
    ((tp.gather_from_seq(xs, comm) + r) * (rank + 1)).sum().backward()
    out["r0.grad"], out["xs.grad"] = r0.grad.unique().tolist(), xs.grad.unique().tolist()
    torch.manual_seed(0)
    layer = tp.RowParallelLinear(16, 8, sequence_parallel=True)
    block = torch.nn.Sequential(layer, torch.nn.GELU())
    x = torch.randn(1, 4, 16 // ws, generator=torch.Generator().manual_seed(rank))
    grads = {}
    for mode in ("none", "selective"):
        layer.weight.grad = None
        recompute.run(block, mode, x).sum().backward()
        grads[mode] = layer.weight.grad.clone()
    out["selective = none"] = torch.equal(grads["none"], grads["selective"])
    return out


def test_the_sequence_reduce_scatter_never_writes_its_input():
    """At batch 1 the rank-major view of x was x itself, which gloo's reduce-scatter sums in place:
    x held every rank's sum after (a review's reproduction, 2026-12-07), so selective recompute's
    kept matmul output was reduced twice (wrong weight grads) and a grad autograd shared with another
    branch came back summed over the ranks."""
    for rank, got in enumerate(run_distributed(_seq_scatter_rank, 2, timeout=120)):
        assert got["input kept b=1"] and got["input kept b=2"], got
        assert got["r0.grad"] == [rank + 1.0] and got["xs.grad"] == [3.0], got
        assert got["selective = none"], got
