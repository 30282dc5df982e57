"""zerofuse.models.hf_names: a zerofuse GPT of GPT-2's or Llama's shape is transformers' GPT2LMHeadModel
/ LlamaForCausalLM under their names (the logits of the transformers model with the renamed weights
are the GPT's), and back (from_hf gives the GPT the same logits); checkpoint.export_hf with the
mapping writes files AutoModelForCausalLM.from_pretrained loads as that model. Shapes no transformers
model computes are refused by name. (export_hf kept zerofuse's names: a GPT-2-shaped run's export
loaded nowhere; a review's reproduction, 2026-12-07.)"""
from __future__ import annotations

import warnings

import pytest
import torch

import zerofuse
from zerofuse.models import GPT, GPTConfig, hf_names

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("native_kernels")

BASE = dict(vocab_size=97, seq_len=32, n_layer=2, n_head=4, dim=64, mlp_hidden=96, fused_loss=False)
_LLAMA = dict(norm="rmsnorm", pos="rope", mlp="swiglu", norm_eps=1e-5)
SCALING = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16}
CASES = {
    "gpt2-tied": dict(bias=True, tie_embeddings=True),
    "gpt2-bias-free-untied": dict(bias=False),
    "llama-gqa-tied": dict(_LLAMA, n_kv_head=2, tie_embeddings=True),
    "llama-bias-llama3-scaling": dict(_LLAMA, bias=True, rope_base=500.0, rope_scaling=SCALING),
    "llama-mqa": dict(_LLAMA, n_kv_head=1),
}


def _gpt(kw, dtype=torch.float64):
    model = GPT(GPTConfig(**BASE, **kw), seed=1).to(dtype).eval()
    with torch.no_grad():  # norms and biases off their init values: a mapping that drops one shows
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))).to(dtype) * 0.1)
    return model


def _hf_model(cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conf = transformers.AutoConfig.for_model(**hf_names.hf_config(cfg))
        return transformers.AutoModelForCausalLM.from_config(conf, attn_implementation="eager")


@pytest.mark.parametrize("case", list(CASES))
def test_the_renamed_weights_give_transformers_the_gpts_logits_and_back(case):
    gpt = _gpt(CASES[case])
    hf = _hf_model(gpt.config).double().eval()
    missing, unexpected = hf.load_state_dict(hf_names.to_hf(gpt.config, gpt.state_dict()), strict=False)
    assert not unexpected and all(k.endswith(".attn.bias") or k == "lm_head.weight" and gpt.config.tie_embeddings
                                  for k in missing), (missing, unexpected)
    idx = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = gpt(idx)[0]
        torch.testing.assert_close(hf(idx).logits, want, rtol=1e-6, atol=1e-6)
        back = hf_names.from_hf(hf, fused_loss=False).eval()
        assert hf_names.hf_config(back.config) == hf_names.hf_config(gpt.config)  # (GPT-2: biases, eps explicit)
        assert torch.equal(back(idx)[0], want)
    assert (back.head.weight is back.wte.weight) == gpt.config.tie_embeddings
    # the model's own config is not a keyword's to change (tie_embeddings=True dropped an untied lm_head,
    # norm_eps moved the logits by 0.38, silently: a review's reproduction, 2026-12-07)
    with pytest.raises(ValueError, match=r"expected gpt_kwargs among zerofuse's own fields 'attention' and "
                                         r"'fused_loss' .*got \['norm_eps'\]"):
        hf_names.from_hf(hf, norm_eps=0.5)


@pytest.mark.parametrize("case", ["gpt2-tied", "llama-gqa-tied", "llama-bias-llama3-scaling"])
def test_export_hf_writes_what_from_pretrained_loads(tmp_path, world_of_one, case):
    pytest.importorskip("safetensors")
    gpt = _gpt(CASES[case], torch.float32)
    cfg = gpt.config
    zerofuse.zero.parallelize(gpt, stage=2)
    zerofuse.checkpoint.save(str(tmp_path / "ckpt"), gpt)
    import functools

    zerofuse.checkpoint.export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), config=hf_names.hf_config(cfg),
                                  rename=functools.partial(hf_names.to_hf, cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == hf_names.hf_config(cfg)["architectures"][0]
    idx = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, gpt(idx)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["gpt2-tied", "llama-mqa"])
def test_the_config_names_end_of_text_only_where_the_vocabulary_holds_it(case, recwarn):
    """GPT-2's config left bos/eos out: transformers took 50256, outside a vocabulary of 97
    (from_pretrained warned; generate stopped on no token; a review's reproduction, 2026-12-07).
    GPT-2's: 50256 in a GPT-2-sized vocabulary, else None; Llama's: transformers' 1 and 2 (a Llama-2
    vocabulary's own), unless told the tokenizer's (the job tells its corpus's: 50256 or None)."""
    gpt2 = case.startswith("gpt2")
    for vocab, eos, want in ((97, "unset", None if gpt2 else 2), (50304, "unset", 50256 if gpt2 else 2),
                             (32000, "unset", None if gpt2 else 2), (50304, 50256, 50256), (97, None, None)):
        cfg = GPTConfig(**{**BASE, **CASES[case], "vocab_size": vocab})
        hf = hf_names.hf_config(cfg) if eos == "unset" else hf_names.hf_config(cfg, eos)
        hf_cfg = transformers.AutoConfig.for_model(**hf)
        assert hf_cfg.eos_token_id == want and hf_cfg.bos_token_id == (1 if want == 2 else want), (vocab, eos, hf)
    with pytest.raises(ValueError, match=r"expected eos_token_id an id below the vocabulary size 97 or None, got 97"):
        hf_names.hf_config(GPTConfig(**{**BASE, **CASES[case]}), 97)
    assert not [w for w in recwarn if "token_id" in str(w.message)], [str(w.message) for w in recwarn]


def test_what_maps_to_nothing_is_refused_by_name():
    assert hf_names.representable(GPTConfig(**BASE)) is None
    assert hf_names.representable(GPTConfig(**BASE, norm="rmsnorm")) == "norm='rmsnorm' (GPT-2: 'layernorm')"
    moe = GPTConfig(**BASE, **_LLAMA, moe_experts=4)
    with pytest.raises(ValueError, match=r"hf_names: no transformers model computes this GPT: moe_experts=4"):
        hf_names.hf_config(moe)
    llama = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2)
    for change, msg in ((dict(head_dim=32), r"expected head_dim = hidden_size / num_attention_heads \(16\), got 32"),
                        (dict(attention_bias=True), r"expected attention_bias == mlp_bias, got True and False"),
                        (dict(hidden_act="gelu"), r"expected Llama's hidden_act 'silu', got 'gelu'")):
        conf = transformers.LlamaConfig(**{**llama.to_dict(), **change})
        with pytest.raises(ValueError, match=msg):
            hf_names.config_from_hf(conf)
    gpt2 = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, activation_function="relu")
    with pytest.raises(ValueError, match=r"expected GPT-2's activation_function 'gelu_new' \(GELU, tanh\), got 'relu'"):
        hf_names.config_from_hf(gpt2)
    with pytest.raises(ValueError, match=r"expected a GPT-2 or Llama model .*got model_type 'qwen2'"):
        hf_names.config_from_hf(transformers.Qwen2Config())


def test_zerofuse_train_export_notes_a_model_no_transformers_class_computes(tmp_path, capsys):
    from common import tiny_job_args

    tiny_job_args(tmp_path, "--model", "moe-tiny", "--export")
    out = capsys.readouterr()
    assert "--export: no transformers model computes this model (moe_experts=8 (neither has experts)" in \
        out.out + out.err
