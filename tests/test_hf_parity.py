"""zerofuse.patch'd Hugging Face models against stock where transformers reads the model itself or
the loss pass could differ (found by a review of 2026-11-27; each test failed before its fix):
the forward's signature (generate's mask and positions, the Trainer's columns), the model's own
loss function, the loss kwargs, an all-ignored batch, the tuple output, logits_to_keep, autocast,
a packed batch with the default KV cache, attention sinks and a v head dim of its own."""
from __future__ import annotations

import copy
import importlib
import inspect
import types

import pytest
import torch
import torch.nn.functional as F

import zerofuse
from hf_models import batch, build
from tolerances import tol

pytestmark = pytest.mark.usefixtures("cpu_kernels")
transformers = pytest.importorskip("transformers")


def _pair(arch, **over):
    stock = build(arch, **over)
    return stock, zerofuse.patch(copy.deepcopy(stock))


def test_the_patched_forward_has_the_stock_signature():
    """transformers inspects model.forward: generate builds the padding mask (from pad_token_id) and
    GPT-2's position_ids only if it takes attention_mask / position_ids, the Trainer keeps only the
    columns it names. Before: (input_ids, *args, ..., **kwargs) - the pad tokens were attended to
    (logits 0.91 off) and a left-padded GPT-2 prompt got unshifted positions (0.56 off)."""
    stock, patched = _pair("llama")
    assert inspect.signature(patched.forward) == inspect.signature(stock.forward)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    prompt = batch(2, 7)
    prompt[0, :3] = 0  # left padding, no mask given
    for (s, p), extra in ((( stock.eval(), patched.eval()), {}),
                          (tuple(m.eval() for m in _pair("gpt2")), {"attention_mask": prompt.ne(0).long()})):
        a, b = s.generate(prompt, **extra, **kw), p.generate(prompt, **extra, **kw)
        assert torch.equal(a.sequences, b.sequences)
        for x, y in zip(a.logits, b.logits):
            torch.testing.assert_close(y, x, **tol(torch.float32))
    from transformers import Trainer  # the Trainer's column filter, as it runs it

    columns = []
    for m in (stock, patched):
        fake = types.SimpleNamespace(model=m, _signature_columns=None, label_names=["labels"])
        Trainer._set_signature_columns_if_needed(fake)
        columns.append(set(fake._signature_columns))
    assert "attention_mask" in columns[1] and columns[0] == columns[1]


def _loss(model, ids, **kw):
    return model(ids, **kw).loss


def test_the_loss_pass_follows_the_models_loss_and_kwargs():
    """A loss_function set on the model (or a loss_type) runs the stock forward; ignore_index passed
    as a kwarg is the stock loss's; a batch with every label ignored is NaN (F.cross_entropy's mean);
    return_dict=False keeps the logits' slot (None) so the tuple's positions are stock's."""
    stock, patched = _pair("llama")
    ids = batch()

    def z_loss_ce(logits, labels, vocab_size, **kw):
        lab = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
        lg = logits.float().view(-1, vocab_size)
        return F.cross_entropy(lg, lab) + 1e-2 * torch.logsumexp(lg, -1).pow(2).mean()

    for m in (stock, patched):
        m.loss_function = z_loss_ce
    torch.testing.assert_close(_loss(patched, ids, labels=ids), _loss(stock, ids, labels=ids), **tol(torch.float32))
    for m in (stock, patched):
        del m._loss_function
    ignored = int(ids[0, 3])
    torch.testing.assert_close(_loss(patched, ids, labels=ids, ignore_index=ignored),
                               _loss(stock, ids, labels=ids, ignore_index=ignored), **tol(torch.float32))
    assert not torch.allclose(_loss(patched, ids, labels=ids, ignore_index=ignored), _loss(patched, ids, labels=ids))
    none = torch.full_like(ids, -100)
    assert torch.isnan(_loss(stock, ids, labels=none)) and torch.isnan(_loss(patched, ids, labels=none))
    a = stock(ids, labels=ids, return_dict=False, output_hidden_states=True)
    b = patched(ids, labels=ids, return_dict=False, output_hidden_states=True)
    assert len(a) == len(b) and b[1] is None
    torch.testing.assert_close(b[0], a[0], **tol(torch.float32))
    for x, y in zip(a[3], b[3]):
        torch.testing.assert_close(y, x, **tol(torch.float32))


def test_a_head_resized_after_the_patch_is_fused_again():
    """resize_token_embeddings puts a new nn.Linear head in (the patched loss pass called it with
    the loss's arguments: TypeError); the next loss pass fuses it again, with stock's loss."""
    stock, patched = _pair("llama")
    for m in (stock, patched):
        torch.manual_seed(5)  # the new rows' initialisation
        m.resize_token_embeddings(140)
    ids = batch()
    got = _loss(patched, ids, labels=ids)
    assert isinstance(patched.lm_head, zerofuse.nn.LinearCrossEntropyHead) and patched.lm_head.out_features == 140
    torch.testing.assert_close(got, _loss(stock, ids, labels=ids), **tol(torch.float32))


def test_logits_to_keep_and_autocast_in_the_loss_pass():
    """logits_to_keep=k with labels of the last k positions (the stock loss is over those logits:
    it raised); a loss pass under CPU autocast (bf16) computes as the unfused head would (it raised
    'Expected out tensor to have dtype BFloat16')."""
    stock, patched = _pair("llama")
    ids = batch()
    k = 6
    want = _loss(stock, ids, labels=ids[:, -k:], logits_to_keep=k)
    torch.testing.assert_close(_loss(patched, ids, labels=ids[:, -k:], logits_to_keep=k), want, **tol(torch.float32))
    # transformers' 2-D forms: (batch, k) positions per sample; a bool (batch, seq) mask, flattened
    # (indexed as 1-D positions before: a (B, B, K, D) tensor refused; an IndexError)
    if hasattr(importlib.import_module("transformers.modeling_utils"), "slice_logits_to_keep"):
        at = torch.stack([torch.randperm(ids.shape[1], generator=torch.Generator().manual_seed(r))[:3]
                          for r in range(ids.shape[0])])
        mask = torch.zeros(ids.shape, dtype=torch.bool)
        mask[0, [2, 4, 8]] = mask[-1, [1, 6, 7]] = True
        for keep, labels in ((at, torch.gather(ids, 1, at)), (mask, ids[mask])):
            torch.testing.assert_close(_loss(patched, ids, labels=labels, logits_to_keep=keep),
                                       _loss(stock, ids, labels=labels, logits_to_keep=keep), **tol(torch.float32))
    ref = _loss(copy.deepcopy(stock).double(), ids, labels=ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = _loss(stock, ids, labels=ids), _loss(patched, ids, labels=ids)
        b.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in patched.parameters() if p.requires_grad)
    bound = 4 * (a.double() - ref).abs().item() + tol(torch.bfloat16)["atol"]  # bf16 GEMMs: stock's own error sets it
    assert (b.double() - ref).abs().item() <= bound, (a.item(), b.item(), ref.item())


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_packed_loss_pass_with_the_default_cache_is_stocks(arch):
    """The loss pass runs the decoder as stock does, KV cache included (config.use_cache): with one,
    transformers detects no packing, so a packed batch attends across documents in both (before,
    the loss pass turned the cache off: loss 0.007 and grads 0.2 off stock's)."""
    stock, patched = _pair(arch)
    ids = batch(1, 19)
    pos = torch.cat([torch.arange(7), torch.arange(12)])[None]
    for use_cache in (None, False):
        kw = {} if use_cache is None else {"use_cache": use_cache}
        for m in (stock, patched):
            m.zero_grad(set_to_none=True)
        a, b = _loss(stock, ids, labels=ids, position_ids=pos, **kw), _loss(patched, ids, labels=ids, position_ids=pos, **kw)
        a.backward()
        b.backward()
        torch.testing.assert_close(b, a, **tol(torch.float32))
        for (name, x), y in zip(stock.named_parameters(), patched.parameters()):
            torch.testing.assert_close(y.grad, x.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_attention_sinks_and_a_v_head_dim_of_its_own_do_not_run_fused(monkeypatch):
    """The kernel has no attention sinks (GPT-OSS's s_aux) and one head dim for q, k and v: those run
    the model's implementation - its eager function for sinks under attn_implementation="zerofuse"
    (sdpa would drop them), or a clear error where the model handed none (before: fused, sinks
    ignored, logits 0.36 off)."""
    from zerofuse.hf import attention as H

    attn = zerofuse.patch(build("llama")).model.layers[0].self_attn
    q, k = torch.randn(1, 4, 9, 24), torch.randn(1, 2, 9, 24)
    eager = []

    def default(module, *a, **kw):
        eager.append(kw.get("s_aux") is not None)
        return "eager", None

    sinks = torch.randn(4)
    attn.config._attn_implementation = H.NAME
    assert H.attention_forward(attn, q, k, k, None, scaling=0.2, s_aux=sinks, default=default) == ("eager", None)
    assert eager == [True]
    with pytest.raises(ValueError, match=r"attention sinks \(s_aux\) need the model's eager attention"):
        H.attention_forward(attn, q, k, k, None, scaling=0.2, s_aux=sinks)
    before = zerofuse.hf.attention_calls()
    v = torch.randn(1, 2, 9, 16)
    out, _ = H.attention_forward(attn, q, k, v, None, scaling=0.2)  # sdpa, as zerofuse's fallback
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, want, **tol(torch.float32))
    assert zerofuse.hf.attention_calls()["fallback"] == before["fallback"] + 1


def test_gemma2_under_the_zerofuse_implementation_is_eagers():
    """Gemma 2's logit softcap made every forward under attn_implementation="zerofuse" fall back to
    sdpa, which refuses a softcap; the model's eager function takes it, but this implementation's
    masks are sdpa's (bool, None for a causal batch): made the additive ones eager reads (added as
    they were, a causal batch attended to the future). Sliding-window layers (window 8 < 19) and
    left padding included."""
    zerofuse.hf.register_attention()
    eager = build("gemma2").eval()
    ours = copy.deepcopy(eager)
    ours.config._attn_implementation = "zerofuse"
    zerofuse.patch(ours)
    ids = batch()
    pad = torch.ones_like(ids)
    pad[0, :5] = 0
    for mask in (None, pad):
        want = eager(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
        keep = mask.bool() if mask is not None else torch.ones(ids.shape, dtype=torch.bool)
        torch.testing.assert_close(got[keep], want[keep], **tol(torch.float32))
    unpatched = copy.deepcopy(eager)
    unpatched.config._attn_implementation = "zerofuse"
    with pytest.raises(ValueError, match=r"a logit softcap needs the model's eager attention, which Gemma2Attention "
                                         r"did not hand over"):
        unpatched(ids)


def test_eval_mode_with_labels_returns_the_logits_and_the_loss():
    """The Trainer's evaluate() calls model.eval() then the forward with labels, and compute_metrics
    needs the logits: the fused pass returned None for them (training mode keeps the fused pass)."""
    stock, patched = _pair("llama")
    ids = batch()
    stock.eval(), patched.eval()
    want, got = stock(ids, labels=ids), patched(ids, labels=ids)
    assert got.logits is not None
    torch.testing.assert_close(got.logits, want.logits, **tol(torch.float32))
    torch.testing.assert_close(got.loss, want.loss, **tol(torch.float32))
    patched.train()
    assert patched(ids, labels=ids).logits is None
