"""zerofuse.models.GPT: deterministic init, zerofuse's attention as a drop-in for torch's, errors."""
from __future__ import annotations

import pytest
import torch

from zerofuse.models import GPT, GPTConfig, config

SMALL = dict(vocab_size=65, seq_len=64, n_layer=2, n_head=4, n_kv_head=2, dim=128)


def test_init_is_deterministic_from_the_seed():
    torch.manual_seed(1)
    a = GPT(GPTConfig(**SMALL), seed=3)
    torch.manual_seed(2)  # the global RNG plays no part
    b = GPT(GPTConfig(**SMALL), seed=3)
    c = GPT(GPTConfig(**SMALL), seed=4)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), n
        if p.dim() == 2:
            assert not torch.equal(p, r), n
    assert a.blocks[0].norm1.weight.eq(1).all()
    std = a.blocks[0].mlp.proj.weight.std().item()
    assert abs(std - 0.02 / (2 * SMALL["n_layer"]) ** 0.5) < 2e-3  # GPT-2's scaled residual init


@pytest.mark.parametrize("n", [33, 64])
def test_zerofuse_attention_is_a_drop_in_for_torch_sdpa(n):
    """The same GPT with torch's scaled_dot_product_attention and with zerofuse's (here the Triton
    kernels in the interpreter): same loss and gradients."""
    ours = GPT(GPTConfig(**SMALL), seed=0)
    theirs = GPT(GPTConfig(**SMALL, attention="torch"), seed=0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 65, (2, n + 1), generator=g)
    _, loss_a = ours(x[:, :-1], x[:, 1:])
    _, loss_b = theirs(x[:, :-1], x[:, 1:])
    loss_a.backward()
    loss_b.backward()
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_tied_embeddings_and_generate():
    model = GPT(GPTConfig(**SMALL, tie_embeddings=True), seed=0)
    assert model.head.weight is model.wte.weight
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    # MFU's N: no lookup-only table (the learned positions; the token embedding only when untied:
    # tied, it is the output layer's matmul too)
    pos = model.wpe.weight.numel() if model.wpe is not None else 0
    assert model.num_params(matmul=True) == model.num_params() - pos
    untied = GPT(GPTConfig(**SMALL, tie_embeddings=False), seed=0)
    assert untied.num_params(matmul=True) == untied.num_params() - pos - untied.wte.weight.numel()
    out = model.generate(torch.zeros((2, 1), dtype=torch.long), 5, top_k=10,
                         generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 6) and out.dtype == torch.long and int(out.max()) < 65


def test_config_errors():
    with pytest.raises(ValueError, match="n_head \\(3\\) to divide dim \\(128\\)"):
        GPTConfig(**{**SMALL, "n_head": 3})
    with pytest.raises(ValueError, match="n_kv_head \\(3\\) to divide n_head \\(4\\)"):
        GPTConfig(**{**SMALL, "n_kv_head": 3})
    with pytest.raises(ValueError, match="unknown model 'huge'"):
        config("huge")
    with pytest.raises(ValueError, match="sequence length 65 exceeds the model's seq_len 64"):
        GPT(GPTConfig(**SMALL))(torch.zeros((1, 65), dtype=torch.long))
    assert config("tiny").dim == 128
    # an MLP of no width and NaN rope tables were built silently; a negative width failed inside torch
    for bad, msg in ((dict(mlp_hidden=0), r"expected mlp_hidden >= 1 or None \(mlp_ratio \* dim\), got 0"),
                     (dict(mlp_hidden=-3), r"expected mlp_hidden >= 1 or None"),
                     (dict(mlp_ratio=0.001), r"expected mlp_ratio \* dim >= 1 .*got mlp_ratio 0.001 x dim 128 = 0"),
                     (dict(pos="rope", rope_base=0.0), r"expected a finite rope_base > 0, got 0.0"),
                     (dict(rope_base=-5.0), r"expected a finite rope_base > 0, got -5.0"),
                     (dict(rope_base="10000"), r"expected a finite rope_base > 0, got '10000'"),  # (a bare TypeError,
                     (dict(rope_base=True), r"expected a finite rope_base > 0, got True"),  # True as 1: 2026-12-07)
                     (dict(moe_experts=4, moe_aux_loss=True), r"expected moe_aux_loss >= 0, got True")):
        with pytest.raises(ValueError, match=msg):
            GPTConfig(**{**SMALL, **bad})
    # wrongly typed fields (a review's reproductions, 2026-12-07): dim=128.0 failed in torch.empty at
    # build, moe_every=1.5 made one block of four MoE, bias="no" was True, norm_eps -1 failed at the
    # first forward naming rms_norm's eps
    for bad, exc, msg in ((dict(dim=128.0), TypeError, r"expected dim to be an int, got 128.0"),
                          (dict(mlp_hidden=10.5), TypeError, r"expected mlp_hidden to be an int, got 10.5"),
                          (dict(moe_experts=4, moe_every=1.5), TypeError, r"expected moe_every to be an int, got 1.5"),
                          (dict(moe_experts=True), TypeError, r"expected moe_experts to be an int, got True"),
                          (dict(bias="no"), TypeError, r"expected bias to be True or False, got 'no'"),
                          (dict(norm_eps=-1.0), ValueError, r"expected norm_eps to be a finite number >= 0 or None"),
                          (dict(norm_eps=float("nan")), ValueError, r"expected norm_eps to be a finite number"),
                          (dict(mlp_ratio=float("nan")), ValueError, r"expected mlp_ratio to be a finite number")):
        with pytest.raises(exc, match=msg):
            GPTConfig(**{**SMALL, **bad})
    import numpy as np  # numpy's numbers are numbers (a review: the type checks refused them at first)

    cfg = GPTConfig(**{**SMALL, "dim": np.int64(128), "mlp_ratio": np.float32(4.0), "norm_eps": np.float32(1e-5)})
    assert type(cfg.dim) is int and cfg.hidden == 512 and type(cfg.norm_eps) is float


def test_generate_greedy_and_its_arguments():
    """temperature=0 divided the logits by 1e-6: a coin flip between logits a few ulps apart, not the
    argmax; bad arguments failed deep in torch (top_k=0, an empty prompt) or ran silently
    (temperature=-1 as greedy, max_new_tokens=-3 as 0; a review's reproductions, 2026-12-07)."""
    model = GPT(GPTConfig(**SMALL), seed=0)
    idx = torch.randint(0, 65, (3, 4), generator=torch.Generator().manual_seed(1))
    out = model.generate(idx, 6, temperature=0.0)
    want = idx
    for _ in range(6):
        want = torch.cat([want, model(want)[0][:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, want)
    assert torch.equal(model.generate(idx, 6, temperature=0.0, generator=torch.Generator().manual_seed(5)), want)
    one = torch.tensor(1.0)
    near = torch.zeros(1, 1, 65)
    near[..., 3], near[..., 7] = one, torch.nextafter(torch.nextafter(one, one + 1), one + 1)  # 2 ulps apart
    model.forward = lambda i, *a, **k: (near.expand(i.shape[0], i.shape[1], 65), None)
    picks = {int(model.generate(idx[:1], 1, temperature=0.0, generator=torch.Generator().manual_seed(s))[0, -1])
             for s in range(40)}
    assert picks == {7}
    del model.forward
    import numpy as np

    assert model.generate(idx, np.int64(2), temperature=np.float32(0.5), top_k=np.int64(5)).shape == (3, 6)
    for bad, msg in ((dict(temperature=-1.0), r"expected temperature to be a finite number >= 0 \(0: greedy\), got -1.0"),
                     (dict(temperature=float("nan")), r"expected temperature .*got nan"),
                     (dict(top_k=0), r"expected top_k to be an int >= 1 or None, got 0"),
                     (dict(max_new_tokens=-3), r"expected max_new_tokens to be an int >= 0, got -3"),
                     (dict(idx=idx[:, :0]), r"expected idx to be token ids \(batch, seq >= 1\), got torch.int64 \[3, 0\]"),
                     (dict(idx=idx[0]), r"expected idx to be token ids \(batch, seq >= 1\), got torch.int64 \[4\]")):
        kw = {"idx": idx, "max_new_tokens": 2, **bad}
        with pytest.raises(ValueError, match=msg):
            model.generate(kw.pop("idx"), kw.pop("max_new_tokens"), **kw)


def test_generate_draws_only_ids_below_vocab_size():
    """A padded vocabulary (GPT-2's 50257 of 50304): its padding ids were drawn and fed back, and the
    job's sample dropped them silently (a review's reproduction, 2026-12-07). vocab_size=60 of 65
    with the padding's logits the largest: none drawn, greedy or sampled; bad values named."""
    model = GPT(GPTConfig(**SMALL), seed=0)
    forward = model.forward
    def loud_padding(i, *a, **k):
        logits, loss = forward(i, *a, **k)
        return logits.index_fill(-1, torch.arange(60, 65), 50.0), loss
    model.forward = loud_padding
    idx = torch.randint(0, 60, (4, 3), generator=torch.Generator().manual_seed(2))
    for t in (0.0, 1.0):
        out = model.generate(idx, 8, temperature=t, vocab_size=60, generator=torch.Generator().manual_seed(3))
        assert out.shape == (4, 11) and int(out[:, 3:].max()) < 60, out
    assert int(model.generate(idx, 4, temperature=0.0)[:, 3:].min()) >= 60  # (without it: the padding wins)
    for bad in (0, 66, True, 60.0):
        with pytest.raises(ValueError, match=r"expected vocab_size to be an int in \[1, 65\] \(the model's "
                                             rf"vocabulary\) or None, got {bad!r}"):
            model.generate(idx, 1, vocab_size=bad)


@pytest.mark.parametrize("fused", [True, False], ids=["fused_loss", "unfused_loss"])
def test_targets_and_idx_of_other_shapes_are_refused(fused):
    """The unfused loss reshaped the logits by the targets' shape: targets (2, 5) for idx (2, 10)
    gave a loss over 74 made-up classes instead of an error."""
    model = GPT(GPTConfig(**{**SMALL, "fused_loss": fused}))
    idx = torch.randint(0, SMALL["vocab_size"], (2, 10))
    for bad in ((2, 5), (1, 10)):
        with pytest.raises(ValueError, match=r"expected target"):
            model(idx, torch.randint(0, SMALL["vocab_size"], bad))
    with pytest.raises(ValueError, match=r"expected idx of shape \(batch, sequence\), got \[10\]"):
        model(idx[0])


@pytest.mark.parametrize("tied", [False, True])
def test_a_meta_model_materialized_the_torch_way_equals_the_eager_one(tied):
    """to_empty + reset_parameters (torch's / FSDP's way) raised a bare KeyError(<address>) (the
    init looked params up by the ids of __init__'s), and to_empty untied the output layer from
    the embedding (two matrices trained); load_state_dict(assign=True) likewise."""
    cfg = config("tiny", n_layer=2, n_head=2, dim=16, seq_len=8, vocab_size=11, tie_embeddings=tied)
    want = GPT(cfg, seed=3).state_dict()
    with torch.device("meta"):
        model = GPT(cfg, seed=3)
    model.to_empty(device="cpu")
    assert (model.head.weight is model.wte.weight) == tied
    model.reset_parameters()
    got = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    other = GPT(cfg, seed=0)
    other.load_state_dict(GPT(cfg, seed=1).state_dict(), assign=True)
    assert (other.head.weight is other.wte.weight) == tied
    other.reset_parameters(seed=3)
    assert all(torch.equal(other.state_dict()[k], want[k]) for k in want)
    assert len(list(other.parameters())) == len(list(GPT(cfg, seed=3).parameters()))


def test_a_whole_model_saves_and_loads_with_torch_save():
    """torch.save(model) (the whole module pickled, as users of nanoGPT-style scripts do) failed on
    the load hooks, local functions ("Can't pickle local object"); the loaded model gives the same
    loss, keeps its tie, and its hooks still re-tie after a load_state_dict."""
    import io

    for cfg in (GPTConfig(n_layer=1), GPTConfig(n_layer=2, moe_experts=4, moe_bias_rate=1e-3, tie_embeddings=True,
                                                pos="rope", mlp="swiglu")):
        model = GPT(cfg, seed=3)
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        x = torch.randint(0, 65, (2, 9), generator=torch.Generator().manual_seed(0))
        assert torch.equal(loaded(x[:, :-1], x[:, 1:])[1], model(x[:, :-1], x[:, 1:])[1])
        assert loaded._tied() == cfg.tie_embeddings
        loaded.load_state_dict(model.state_dict(), assign=True)
        assert loaded._tied() == cfg.tie_embeddings
    # a pickle made before the hooks moved to models/tied.py names them in models.gpt: still there
    # (its load failed with "Can't get attribute '_note_tied_before_load'"; a review's reproduction)
    import pickle

    from zerofuse.models import gpt, tied
    for fn in (tied._note_tied_before_load, tied._retie_after_load):
        assert pickle.loads(pickle.dumps(fn, protocol=0).replace(b"zerofuse.models.tied", b"zerofuse.models.gpt")) is fn


def test_api_edges_a_review_found(capsys):
    """Each failed before 2026-12-07 (a review's reproductions): a tied model loading a lone
    head.weight kept the old embedding under assign=True (and loaded it under assign=False), and
    two different matrices loaded silently; int32 targets refused by the unfused loss only; token
    ids out of range or of another dtype a bare IndexError / embedding error; generate's int32
    prompt came back int64, and a tiny temperature NaN; seed=None or True accepted (other weights)."""
    import torch.nn.functional as F

    cfg = GPTConfig(**SMALL, tie_embeddings=True)
    new = torch.randn(65, 128)
    for assign in (False, True):
        m = GPT(cfg, seed=0)
        m.load_state_dict({"head.weight": new}, strict=False, assign=assign)
        assert m._tied() and torch.equal(m.wte.weight, new), assign
    with pytest.raises(ValueError, match=r"ties wte.weight and head.weight \(one matrix\); expected them equal"):
        GPT(cfg, seed=0).load_state_dict({**GPT(cfg, seed=0).state_dict(), "head.weight": new})
    m = GPT(cfg, seed=0)
    m.load_state_dict(GPT(cfg, seed=1).state_dict())  # (a tied model's own state_dict: both names, one matrix)
    assert torch.equal(m.wte.weight, GPT(cfg, seed=1).wte.weight) and m._tied()

    idx = torch.randint(0, 65, (2, 8), generator=torch.Generator().manual_seed(0))
    unfused = GPT(GPTConfig(**SMALL, fused_loss=False), seed=0)
    logits, loss = unfused(idx, idx.int())
    assert loss.item() == F.cross_entropy(logits.float().reshape(16, -1), idx.reshape(16)).item()
    with pytest.raises(IndexError, match=r"zerofuse.models.GPT: expected idx in \[0, 65\), got 65"):
        unfused(torch.full((1, 4), 65))
    with pytest.raises(TypeError, match="expected idx of int64 or int32 token ids, got torch.uint8"):
        unfused(idx.to(torch.uint8))
    for tiny in (1e-40, 1e-46):  # (1e-46 is 0 in fp32: the logits were divided by zero)
        out = unfused.generate(idx.int(), 3, temperature=tiny, generator=torch.Generator().manual_seed(0))
        assert out.dtype == torch.int32 and torch.equal(out, unfused.generate(idx.int(), 3, temperature=0))
    for seed in (None, True, 1.5):
        with pytest.raises(TypeError, match=f"expected seed to be an int, got {seed!r}"):
            GPT(GPTConfig(**SMALL), seed=seed)


def test_torch_attention_checks_document_ids_as_the_kernel_does():
    m = GPT(GPTConfig(**SMALL, attention="torch"), seed=0)
    idx = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"zerofuse.nn.Attention: expected document_ids of shape \[2, 8\] or "
                                         r"\[1, 8\] \(batch, sequence\) on cpu, got \[2, 4\]"):
        m(idx, document_ids=torch.zeros(2, 4, dtype=torch.long))


def test_a_pipeline_stage_holding_both_ends_of_a_tied_gpt_loads_as_the_gpt():
    """split_gpt's one stage (or merge_stages of the first and last) holds the tied matrix under both
    names: load_state_dict(assign=True) untied it and two different matrices loaded silently (a
    review's reproduction, 2026-12-07)."""
    from zerofuse.pipeline import merge_stages, split_gpt

    cfg = GPTConfig(**SMALL, tie_embeddings=True)
    for held in (split_gpt(GPT(cfg, seed=0), 1, [0])[0], merge_stages(split_gpt(GPT(cfg, seed=0), 2, [0, 1]))):
        sd = {k: v.clone() for k, v in GPT(cfg, seed=1).state_dict().items()}
        held.load_state_dict(sd, assign=True)
        assert held.head.weight is held.wte.weight and torch.equal(held.wte.weight, sd["wte.weight"])
        with pytest.raises(ValueError, match="ties wte.weight and head.weight"):
            held.load_state_dict({**sd, "head.weight": torch.randn_like(sd["head.weight"])})
