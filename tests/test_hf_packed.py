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


def _assert_fused_as_stock(patched, stock, ids, pos, **kw):
    """Every layer of the patched model runs fused (kw: its packing kwargs) with the logits and
    gradients of stock sdpa given the packed position_ids; the first row's last document (tokens
    8..18) has the logits of that document run alone."""
    before = zerofuse.hf.attention_calls()
    logits, grads = _loss_and_grads(patched, ids, position_ids=pos, **kw)
    after = zerofuse.hf.attention_calls()
    assert after["fused"] - before["fused"] == LAYERS and after["fallback"] == before["fallback"]
    want, want_grads = _loss_and_grads(stock, ids, position_ids=pos)
    torch.testing.assert_close(logits, want, **tol(torch.float32))
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    alone = stock(ids[:1, 8:], use_cache=False).logits
    torch.testing.assert_close(logits[:1, 8:], alone.detach(), **tol(torch.float32))


@pytest.mark.parametrize("arch,path", [("llama", "cpu"), ("qwen3", "cpu"), ("gpt2", "cpu"), ("llama", "triton")])
def test_packed_batch_runs_fused_and_matches_stock(arch, path, request):
    if path == "cpu":
        request.getfixturevalue("cpu_kernels")
    stock = build(arch)
    patched = zerofuse.patch(copy.deepcopy(stock))
    ids = batch(2, 19)
    pos = _positions([[7, 1, 11], [19]])  # a one-token document; the second row one document
    _assert_fused_as_stock(patched, stock, ids, pos)


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


def _flash(model, name="flash_attention_2"):
    """The model configured for a flash implementation (never called here: the patched attention
    runs the fused kernel, and the fallback tests replace the model's implementation)."""
    model.config._attn_implementation = name
    return model


@pytest.mark.parametrize("form", ["position_ids", "cu_seq_lens"])
def test_a_flash_configured_model_attends_per_document(form, cpu_kernels):
    """With a flash implementation configured, transformers hands a packed batch to the layer with no
    mask: as position_ids restarting in one row, or as cu_seq_lens_q/_k + max_length_q/_k over the
    flattened batch (DataCollatorWithFlattening(return_flash_attn_kwargs=True)). The patched model ran
    plain causal attention across the documents there (second document's logits 0.57 off); now it
    has the documents' logits and gradients (stock sdpa given the same packed position_ids)."""
    stock = build("llama")
    patched = zerofuse.patch(_flash(copy.deepcopy(stock)))
    rows = [[7, 1, 11]] if form == "position_ids" else [[7, 1, 11], [19]]
    ids, pos = batch(len(rows), 19), _positions(rows)
    kw = {}
    if form == "cu_seq_lens":
        cu = torch.tensor([0, 7, 8, 19, 38], dtype=torch.int32)
        kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=19, max_length_k=19)
    _assert_fused_as_stock(patched, stock, ids, pos, **kw)


def _varlen(cu_q, cu_k=None):
    return dict(cu_seq_lens_q=torch.tensor(cu_q), cu_seq_lens_k=torch.tensor(cu_k or cu_q), max_length_q=19,
                max_length_k=19)


@pytest.mark.parametrize("case", [
    "offsets crossing a row", "q and k offsets differ", "offsets short of the batch",
    "position_ids not starting a document", "not causal"])
def test_flash_documents_the_kernel_cannot_reproduce_fall_back(case, monkeypatch, cpu_kernels):
    """Where the flash implementation's documents are not the kernel's (causal, per row, covering
    every token), the model's own implementation runs (here a stand-in that records its call)."""
    from zerofuse.hf import attention as H

    ran = []
    monkeypatch.setattr(H, "_fallback_impl", lambda module, default, kwargs=None: lambda *a, **k: ran.append(case) or ("stock", None))
    attn = _flash(zerofuse.patch(build("llama"))).model.layers[0].self_attn
    b = 1 if case == "position_ids not starting a document" else 2
    q, kv = torch.randn(b, 4, 19, 24), torch.randn(b, 2, 19, 24)
    kw = {"offsets crossing a row": _varlen([0, 10, 38]),
          "q and k offsets differ": _varlen([0, 7, 19, 38], [0, 8, 19, 38]),
          "offsets short of the batch": _varlen([0, 7, 19, 30]),
          "position_ids not starting a document": dict(position_ids=torch.cat([torch.arange(3, 8), torch.arange(14)])[None]),
          "not causal": _varlen([0, 7, 19, 38])}[case]
    if case == "not causal":
        monkeypatch.setattr(attn, "is_causal", False)
    out = H.attention_forward(attn, q, kv, kv, None, scaling=0.2, **kw)
    assert out == ("stock", None) and ran == [case]
    # the same call with offsets the kernel takes runs fused, as the documents of its ids
    if case == "offsets crossing a row":
        docs = torch.tensor([0] * 7 + [1] * 12)[None].expand(2, 19)
        got, _ = H.attention_forward(attn, q, kv, kv, None, scaling=0.2, **_varlen([0, 7, 19, 26, 38]))
        want = zerofuse.nn.functional.scaled_dot_product_attention(
            q, kv, kv, is_causal=True, scale=0.2, enable_gqa=True, document_ids=docs).transpose(1, 2)
        torch.testing.assert_close(got, want, **tol(torch.float32))
        assert ran == [case]


def test_zerofuses_own_implementation_reads_the_offsets_or_says_why_not(cpu_kernels):
    """attn_implementation="zerofuse" takes cu_seq_lens_q/_k as documents too (with the flash
    model's result), also in inference mode (no sync allowed to check them there); offsets it cannot
    take raise naming them (its fallback, sdpa, would ignore them: a silently different result)."""
    from zerofuse.hf import attention as H

    stock = build("llama")
    zf = _flash(zerofuse.patch(copy.deepcopy(stock)), "zerofuse")
    fa = _flash(zerofuse.patch(copy.deepcopy(stock)))
    ids, kw = batch(2, 19), _varlen([0, 7, 8, 19, 38])
    got = zf(ids, use_cache=False, **kw).logits  # no position_ids: only the offsets say where documents are
    want = fa(ids, use_cache=False, **kw).logits
    torch.testing.assert_close(got, want, **tol(torch.float32))
    alone = stock(ids[:1, 8:], position_ids=torch.arange(8, 19)[None], use_cache=False).logits
    torch.testing.assert_close(got[:1, 8:], alone, **tol(torch.float32))
    with torch.inference_mode():
        torch.testing.assert_close(zf(ids, use_cache=False, **kw).logits, got, **tol(torch.float32))
    with pytest.raises(ValueError, match=r"cu_seq_lens_q and cu_seq_lens_k to be the same offsets .*\[0, 10, 38\]"):
        zf(ids, use_cache=False, **_varlen([0, 10, 38]))
    attn = zf.model.layers[0].self_attn
    q, kv = torch.randn(2, 4, 19, 24), torch.randn(2, 2, 19, 24)
    with pytest.raises(ValueError, match="are for causal attention"):
        H.attention_forward(attn, q, kv, kv, None, scaling=0.2, is_causal=False, **kw)
    # a call the kernel cannot run (a window shorter than the sequence): sdpa would drop the offsets
    with pytest.raises(ValueError, match=r"cu_seq_lens_q/_k \(packed documents\) given to a call the fused kernel"):
        H.attention_forward(attn, q, kv, kv, None, scaling=0.2, sliding_window=5, **kw)


@pytest.mark.parametrize("arch, over", [("gemma2", {}), ("mistral", {"sliding_window": 6})])
def test_a_layer_that_cannot_fuse_falls_back_on_the_collators_packed_mask(arch, over, cpu_kernels):
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True) sends position_ids beside the offsets,
    from which transformers builds the packed block-diagonal mask: a layer the kernel cannot run
    (Gemma 2's softcap, a window shorter than the batch) falls back exact on it; it was refused as if
    the fallback ignored the documents (a review, 2026-12-06). The stock model's loss and grads."""
    from transformers import DataCollatorWithFlattening

    from hf_models import VOCAB

    g = torch.Generator().manual_seed(3)
    feats = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=g).tolist()} for n in (5, 9, 4)]
    b = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)(feats)
    b = {k: torch.as_tensor(v) for k, v in b.items()}
    stock = build(arch, **over)
    zf = zerofuse.patch(copy.deepcopy(stock))
    zf.config._attn_implementation = "zerofuse"
    losses = []
    for m in (stock, zf):
        loss = m(**b, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for (n, p), q in zip(stock.named_parameters(), zf.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **tol(torch.float32), msg=n)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_an_eager_configured_model_runs_fused(arch, cpu_kernels):
    """attn_implementation="eager" hands every layer an additive float mask (0 seen, the minimum
    elsewhere), padding or not: such a model never ran the fused kernel (a review's reproduction,
    2026-12-07). A causal batch and a packed one run fused with stock eager's logits and gradients."""
    stock = build(arch, _attn_implementation="eager")
    patched = zerofuse.patch(copy.deepcopy(stock))
    ids = batch(2, 19)
    _assert_fused_as_stock(patched, stock, ids, _positions([[7, 1, 11], [19]]))
    before = zerofuse.hf.attention_calls()
    logits, grads = _loss_and_grads(patched, ids)  # one causal sequence a row
    assert zerofuse.hf.attention_calls()["fused"] - before["fused"] == LAYERS
    want, want_grads = _loss_and_grads(stock, ids)
    torch.testing.assert_close(logits, want, **tol(torch.float32))
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_an_additive_mask_with_values_besides_its_two_falls_back(cpu_kernels):
    """An additive mask that adds anything but 0 where a query sees a key (a bias) is no mask of
    documents: the model's implementation runs."""
    from zerofuse.hf import attention as H

    patched = zerofuse.patch(build("llama", _attn_implementation="eager"))
    attn = patched.model.layers[0].self_attn
    q, kv = torch.randn(1, 4, 9, 24), torch.randn(1, 2, 9, 24)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    mask = torch.zeros(9, 9).masked_fill(~causal, torch.finfo(torch.float32).min)[None, None]
    before = zerofuse.hf.attention_calls()
    H.attention_forward(attn, q, kv, kv, mask, scaling=0.2, position_ids=torch.arange(9)[None])
    mid = zerofuse.hf.attention_calls()
    assert mid["fused"] == before["fused"] + 1
    H.attention_forward(attn, q, kv, kv, mask + 0.5 * causal, scaling=0.2, position_ids=torch.arange(9)[None])
    assert zerofuse.hf.attention_calls()["fallback"] == mid["fallback"] + 1
