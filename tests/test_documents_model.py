"""Packed documents through zerofuse's model and training job: GPT(idx, targets, document_ids=)
attends within documents (a RoPE model's document equals that document run alone; the fused path
equals torch's sdpa given the documents as a mask, with and without activation checkpointing), and
zerofuse-train --document-masking splits its batches at <|endoftext|>."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from zerofuse import models
from zerofuse.train import tokens as tok

from common import tiny_job_args
from tolerances import tol


def _model(name, **over):
    torch.manual_seed(0)
    return models.GPT(models.config(name, n_layer=2, dim=64, n_head=4, vocab_size=97, seq_len=64, **over)).train()


def test_a_rope_models_document_equals_the_document_alone(cpu_kernels):
    """RoPE attends by relative position: in a packed row, each document's logits are those of the
    document run alone (positions are not reset, and need not be)."""
    model = _model("llama-tiny", n_kv_head=2, mlp_hidden=96)
    idx = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[0] * 9 + [1] * 20 + [2] * 11, [0] * 40])
    logits, _ = model(idx, document_ids=ids)
    for a, b in ((0, 9), (9, 29), (29, 40)):
        alone, _ = model(idx[:1, a:b])
        torch.testing.assert_close(logits[:1, a:b], alone, **tol(torch.float32))
    torch.testing.assert_close(logits[1:], model(idx[1:])[0], **tol(torch.float32))
    assert not torch.allclose(logits[:1, 9:29], model(idx[:1, :29])[0][:, 9:29], atol=1e-3)  # vs no documents


@pytest.mark.parametrize("checkpointing", ["none", "full"])
@pytest.mark.parametrize("path", ["cpu", "triton"])
def test_fused_documents_equal_torch_sdpa_with_their_mask(path, checkpointing, monkeypatch):
    """GPT-2 style (learned positions, LayerNorm, biases): the fused path with document_ids gives
    the loss and gradients of the same model on torch's sdpa with the documents' mask; activation
    checkpointing recomputes the blocks with the same documents."""
    from zerofuse import kernels

    monkeypatch.setattr(kernels, "TRITON_ON_CPU", path == "triton" and kernels.interpreted())
    idx = torch.randint(0, 97, (2, 33), generator=torch.Generator().manual_seed(2))
    ids = (idx % 7 == 0).cumsum(1)  # a document starts at each multiple of 7
    results = []
    for attention in ("zerofuse", "torch"):
        model = _model("tiny", attention=attention)
        model.activation_checkpointing = checkpointing
        _, loss = model(idx, idx.roll(-1, 1), document_ids=ids)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss, grads), (want, want_grads) = results
    torch.testing.assert_close(loss, want, **tol(torch.float32))
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _shards(tmp_path):
    """GPT-2 token shards whose documents (each starting with <|endoftext|>) are 3 to 12 tokens."""
    rng = np.random.default_rng(0)
    paths = []
    for name, n in (("train", 4000), ("val", 600)):
        ids = rng.integers(0, 1000, n)
        starts = np.cumsum(rng.integers(3, 13, n))
        ids[starts[starts < n]] = tok.GPT2_EOT
        ids[0] = tok.GPT2_EOT
        path = tmp_path / f"{name}.bin"
        np.asarray(ids, dtype=np.uint16).tofile(path)
        paths.append(str(path))
    return paths


@pytest.mark.timeout(300)
def test_job_document_masking_splits_batches_at_end_of_text(tmp_path, monkeypatch, cpu_kernels):
    """--document-masking: every forward of the job gets document ids (x == <|endoftext|>).cumsum(1)
    for its batch, and the run differs from one without them; refused without GPT-2 tokens."""
    from zerofuse import train
    from zerofuse.models import gpt
    from zerofuse.train.loop import Trainer

    train_bin, val_bin = _shards(tmp_path)
    seen = []
    forward = gpt.GPT.forward

    def spy(self, idx, targets=None, **kw):
        seen.append((idx, kw.get("document_ids")))
        return forward(self, idx, targets, **kw)

    monkeypatch.setattr(gpt.GPT, "forward", spy)
    losses = {}
    for masking in (True, False):
        out = tmp_path / str(masking)
        argv = ["--data", train_bin, "--val-data", val_bin, "--steps", "2", "--warmup", "1", "--zero-stage", "3",
                "--log-every", "1"] + (["--document-masking"] if masking else [])
        seen.clear()
        assert Trainer(tiny_job_args(out, *argv), None).run() == 0
        assert seen and all((ids is not None) == masking for _, ids in seen)
        for idx, ids in seen if masking else ():
            assert torch.equal(ids, (idx == tok.GPT2_EOT).cumsum(1)) and ids[:, -1].max() > 1
        losses[masking] = (out / "metrics.jsonl").read_text()
    assert losses[True] != losses[False]
    with pytest.raises(train.UsageError, match=r"^--document-masking: expected GPT-2 tokens .*got --tokenizer char"):
        tiny_job_args(tmp_path / "char", "--document-masking")
