"""Packed sequences in zerofuse-patched Hugging Face models ([Note: packed sequences in transformers]
in zerofuse/hf/attention.py): a packed batch (position_ids restarting per document, no padding)
runs the fused kernel with document ids, with the stock model's logits and gradients; a mask that is
not exactly the packed one (padding on top) falls back to the model's implementation."""
from __future__ import annotations

import copy

import pytest
import torch

import zerofuse
from hf_models import batch, build
from tolerances import tol

LAYERS = 3  # hf_models' configs


def _positions(rows):
    """position_ids (B, N): each row's documents of the given lengths, positions restarting at 0."""
    return torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])


def _loss_and_grads(model, ids, **kw):
    model.zero_grad(set_to_none=True)
    out = model(ids, use_cache=False, **kw)
    loss = out.logits.float().pow(2).mean()  # every logit's gradient, not only the targets'
    loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch,path", [("llama", "cpu"), ("qwen3", "cpu"), ("gpt2", "cpu"), ("llama", "triton")])
def test_packed_batch_runs_fused_and_matches_stock(arch, path, request):
    if path == "cpu":
        request.getfixturevalue("cpu_kernels")
    stock = build(arch)
    patched = zerofuse.patch(copy.deepcopy(stock))
    ids = batch(2, 19)
    pos = _positions([[7, 1, 11], [19]])  # a one-token document; the second row one document
    before = zerofuse.hf.attention_calls()
    logits, grads = _loss_and_grads(patched, ids, position_ids=pos)
    after = zerofuse.hf.attention_calls()
    assert after["fused"] - before["fused"] == LAYERS and after["fallback"] == before["fallback"]
    want, want_grads = _loss_and_grads(stock, ids, position_ids=pos)
    torch.testing.assert_close(logits, want, **tol(torch.float32))
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    # the documents are attended to separately: the first row's last document alone gives its logits
    alone = stock(ids[:1, 8:], use_cache=False).logits
    torch.testing.assert_close(logits[:1, 8:], alone.detach(), **tol(torch.float32))


def test_packed_batch_with_padding_falls_back(cpu_kernels):
    """A 2-D padding mask with packed position_ids: transformers makes a causal mask with padding
    (no packing detected), which is not the documents' mask: the model's sdpa runs."""
    stock = build("mistral")
    patched = zerofuse.patch(copy.deepcopy(stock))
    ids, mask = batch(2, 19), torch.ones(2, 19, dtype=torch.long)
    mask[1, :4] = 0
    pos = _positions([[7, 12], [19]])
    before = zerofuse.hf.attention_calls()
    got = patched(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    after = zerofuse.hf.attention_calls()
    assert after["fallback"] - before["fallback"] == LAYERS and after["fused"] == before["fused"]
    want = stock(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(got, want, **tol(torch.float32))


def test_a_mask_other_than_the_positions_documents_falls_back(cpu_kernels):
    """The layer's mask is compared with the documents of its position_ids, never assumed: a
    packed mask handed with other position_ids (here: one document) runs the model's sdpa."""
    from zerofuse.hf import attention as H

    patched = zerofuse.patch(build("llama"))
    attn = patched.model.layers[0].self_attn
    q = torch.randn(1, 4, 9, 24)
    kv = torch.randn(1, 2, 9, 24)
    runs = torch.tensor([0] * 4 + [1] * 5)
    packed = ((runs[:, None] == runs[None, :]) & torch.ones(9, 9, dtype=torch.bool).tril())[None, None]
    before = zerofuse.hf.attention_calls()
    other, _ = H.attention_forward(attn, q, kv, kv, packed, scaling=0.2, position_ids=torch.arange(9)[None])
    mid = zerofuse.hf.attention_calls()
    assert mid["fallback"] == before["fallback"] + 1 and mid["fused"] == before["fused"]
    same, _ = H.attention_forward(attn, q, kv, kv, packed, scaling=0.2,
                                  position_ids=torch.cat([torch.arange(4), torch.arange(5)])[None])
    assert zerofuse.hf.attention_calls()["fused"] == mid["fused"] + 1
    torch.testing.assert_close(same, other, **tol(torch.float32))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_packed_batch_in_inference_mode_falls_back(arch, cpu_kernels):
    """Inference mode (no version counters to key the mask check or the RoPE tables' cache on): the
    model's sdpa runs, with stock's result (both raised there before)."""
    stock = build(arch)
    patched = zerofuse.patch(copy.deepcopy(stock))
    ids, pos = batch(2, 19), _positions([[7, 12], [19]])
    with torch.inference_mode():
        before = zerofuse.hf.attention_calls()
        got = patched(ids, position_ids=pos, use_cache=False).logits
        assert zerofuse.hf.attention_calls()["fallback"] == before["fallback"] + LAYERS
        want = stock(ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(got, want, **tol(torch.float32))
