"""--compile: a world of one compiles the whole model (ZeRO installs no forward hook there: over one
rank every parameter gather is a no-op), a larger world (or activation checkpointing) each transformer block; the compiled job
trains as the eager one. torch.compile runs with the aot_eager backend here (inductor's C++
compilation of a whole GPT takes minutes on two cores); the graphs it traces are the same."""
from __future__ import annotations

import json

import pytest
import torch

from zerofuse.train.loop import Trainer

from common import tiny_job_args

# the job's plumbing on the C++ CPU kernels (the Triton interpreter made each in-process job 10-30 s)
pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _args(tmp_path, *argv):
    return tiny_job_args(tmp_path, "--steps", "4", "--log-every", "1", *argv)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [0, 2])
def test_compile_takes_the_whole_model_in_a_world_of_one(tmp_path, monkeypatch, capsys, stage):
    compiled = []
    real = torch.nn.Module.compile

    def compile_(self, *args, **kwargs):
        compiled.append(self)
        return real(self, backend="aot_eager")

    monkeypatch.setattr(torch.nn.Module, "compile", compile_)
    eager_out, comp_out = tmp_path / "eager", tmp_path / "compiled"
    assert Trainer(_args(eager_out, "--zero-stage", str(stage)), None).run() == 0
    t = Trainer(_args(comp_out, "--zero-stage", str(stage), "--compile"), None)
    assert t.run() == 0
    assert compiled == [t.model] and t.compiled == "the whole model"
    assert not any(m._forward_pre_hooks for m in t.model.modules())  # nothing for dynamo to break on
    assert "torch.compile: the whole model" in capsys.readouterr().out
    rows = [[json.loads(line)["loss"] for line in (p / "metrics.jsonl").read_text().splitlines()]
            for p in (eager_out, comp_out)]
    torch.testing.assert_close(rows[1], rows[0], rtol=1e-5, atol=1e-6)
    assert json.loads((comp_out / "summary.json").read_text())["compiled"] == "the whole model"


@pytest.mark.timeout(600)
def test_compile_takes_each_block_under_activation_checkpointing(tmp_path, monkeypatch, capsys):
    """A whole compiled GPT's "full" recompute held more memory than no checkpointing (a review's
    measurement, 2026-12-06: 181.8 against 152.4 MiB; per block 61.7): with checkpointing a world of
    one compiles each block and trains as the eager job; selective stays selective (the checkpoint
    inside the compiled forward: recompute.compile_block), but not with --activation-offload, which says so."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend="aot_eager"))
    eager_out, comp_out = tmp_path / "eager", tmp_path / "compiled"
    flags = ("--activation-checkpointing", "selective")
    assert Trainer(_args(eager_out, *flags), None).run() == 0
    t = Trainer(_args(comp_out, *flags, "--compile"), None)
    assert t.run() == 0 and t.compiled == "each transformer block" and t.recompute_compiled == "selective"
    assert "selective recomputes the matmuls too" not in capsys.readouterr().out
    rows = [[json.loads(line)["loss"] for line in (p / "metrics.jsonl").read_text().splitlines()]
            for p in (eager_out, comp_out)]
    torch.testing.assert_close(rows[1], rows[0], rtol=1e-5, atol=1e-6)
    t = Trainer(_args(tmp_path / "offload", *flags, "--activation-offload", "--compile"), None)
    assert t.run() == 0 and t.recompute_compiled == "full"
    assert "selective recomputes the matmuls too under per-block compile with --activation-offload" in \
        capsys.readouterr().out


@pytest.mark.timeout(600)
def test_compile_leaves_moe_blocks_eager_under_checkpointing(tmp_path, monkeypatch):
    """--compile --activation-checkpointing full on an MoE model raised CheckpointError in the first
    backward (the MoE dispatch breaks the graph: the recomputed forward traced other graphs; a
    review's reproduction, 2026-12-07): MoE blocks stay eager, said so, and the job trains as eager."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend="aot_eager"))
    eager_out, comp_out = tmp_path / "eager", tmp_path / "compiled"
    flags = ("--model", "moe-tiny", "--layers", "2", "--activation-checkpointing", "full")
    assert Trainer(_args(eager_out, *flags), None).run() == 0
    t = Trainer(_args(comp_out, *flags, "--compile"), None)
    assert t.run() == 0
    assert t.compiled == "each dense transformer block (MoE blocks run eagerly under activation checkpointing)"
    rows = [[json.loads(line)["loss"] for line in (p / "metrics.jsonl").read_text().splitlines()]
            for p in (eager_out, comp_out)]
    torch.testing.assert_close(rows[1], rows[0], rtol=1e-5, atol=1e-6)


def _compiled_zero_rank(rank, ws, stage, backend):
    import zerofuse
    from zerofuse.models import GPT, GPTConfig

    model = zerofuse.zero.parallelize(GPT(GPTConfig(vocab_size=61, seq_len=32, n_layer=2, n_head=2, dim=32), seed=1),
                                      stage=stage)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-2)
    fwd = torch.compile(model, backend=backend) if backend else model
    losses = []
    for step in range(3):
        idx = torch.randint(0, 61, (2, 17), generator=torch.Generator().manual_seed(10 * step + rank))
        _, loss = fwd(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.timeout(600)
def test_a_user_compiled_zero3_model_trains_as_the_eager_one(native_kernels):
    """torch.compile(model) over a ZeRO-3 model of 2 ranks: the unit hooks' param swaps, traced, bumped
    the params' versions inside the compiled forward and its first backward failed ("modified by an
    inplace operation"); the hooks run opaque to dynamo now (a review's reproduction, 2026-12-06)."""
    from dist_utils import run_distributed

    eager = run_distributed(_compiled_zero_rank, 2, 3, None, timeout=300)
    compiled = run_distributed(_compiled_zero_rank, 2, 3, "aot_eager", timeout=300)
    assert compiled == eager


def _pp_job_rank(rank, ws, out, compile_):
    """The job's Trainer on this rank at --pp 2 with the embedding alone on stage 0 (layout E,2L)."""
    import os
    import socket

    import torch.distributed as dist

    port = [None]
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    dist.broadcast_object_list(port)
    dist.destroy_process_group()  # (the job makes its own)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port[0]))
    real = torch.compile
    torch.compile = lambda fn, **kw: real(fn, backend="aot_eager")
    argv = ["--nproc", "2", "--pp", "2", "--pp-layout", "E,2L", "--microbatches", "2", "--steps", "3",
            "--log-every", "1", *(["--compile"] if compile_ else [])]
    t = Trainer(tiny_job_args(out, *argv), {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                                           "LOCAL_WORLD_SIZE": "2"})
    code = t.run()
    return code, t.compiled


@pytest.mark.timeout(600)
def test_compile_with_a_stage_holding_no_block(tmp_path):
    """--compile --pp with a stage holding the embedding (or the head) alone raised AttributeError
    ('Stage' object has no attribute 'blocks') on that rank (a review's reproduction, 2026-12-07;
    --pp 4 on 2 layers does it with the default layout): the blocks are found by type."""
    from dist_utils import run_distributed

    eager = run_distributed(_pp_job_rank, 2, str(tmp_path / "eager"), False, timeout=300)
    compiled = run_distributed(_pp_job_rank, 2, str(tmp_path / "compiled"), True, timeout=300)
    assert [c for c, _ in eager] == [c for c, _ in compiled] == [0, 0]
    assert [w for _, w in compiled] == ["nothing (this rank's stage has no transformer block)",
                                        "each transformer block"]
    rows = [[json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in ("eager", "compiled")]
    torch.testing.assert_close(rows[1], rows[0], rtol=1e-5, atol=1e-6)
