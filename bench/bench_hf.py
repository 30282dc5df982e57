"""An end-to-end Hugging Face Llama training step: the stock transformers model vs the same model after
``zerofuse.patch`` (and Liger-Kernel's ``_apply_liger_kernel_to_instance`` on a GPU, when installed).

bench_hf_llama_step times forward (with labels: the loss) + backward + AdamW step; tokens/s in
extra_info, speedups vs the peers in the same run. bench_hf_llama_memory records, untimed, the peak
bytes allocated above the start during forward + backward (zerofuse.zero.peak_memory), with the ratio
to stock's. Models are random-initialised from configs (nothing downloaded): Llama-3.2-1B's shape on
a GPU (bf16, 4 x 2048 tokens), a small Llama with Llama-3's vocabulary on the cpu (fp32, 2 x 256).

Checked ([Note: checked results] in bench/conftest.py): the loss of each provider's first step
(the warm-up's; in the memory benchmark the measured forward's) against the stock model's in
float64 by the reference rule, the stock model's in the dtype the peer, the losses in the model's
dtype as tests/test_hf_patch.py compares them. A loss checks the forward only: the float64
backward of the GPU shape would need ~40 GB more.
"""
import copy

import pytest
import torch

import zerofuse
from conftest import cached_reference, check_result, import_peer  # bench/conftest.py
from zerofuse.zero import peak_memory

transformers = import_peer("transformers")

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocab, batch, seq
    "cuda": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=8192, vocab_size=128256, batch=4, seq=2048),
    "cpu": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                intermediate_size=688, vocab_size=128256, batch=2, seq=256),
    "smoke": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, vocab_size=1000, batch=2, seq=32),
}
PROVIDERS = ["stock", "liger", "zerofuse"]  # zerofuse last: its ratios to the others


def _shape(device, smoke):
    return dict(SHAPES["smoke" if smoke else device.type])


_base: dict = {}


def _model(provider, device, smoke):
    s = _shape(device, smoke)
    b, n = s.pop("batch"), s.pop("seq")
    key = (device.type, smoke)
    if key not in _base:
        cfg = transformers.LlamaConfig(**s, max_position_embeddings=n, tie_word_embeddings=False, rope_theta=500000.0)
        torch.manual_seed(0)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        _base[key] = transformers.LlamaForCausalLM(cfg).to(dtype)
    model = copy.deepcopy(_base[key]).to(device).train()
    if provider == "zerofuse":
        zerofuse.patch(model)
    elif provider == "liger":
        if device.type != "cuda":
            pytest.skip("Liger-Kernel's kernels are Triton launches: GPU only")
        lk = import_peer("liger_kernel.transformers")
        lk._apply_liger_kernel_to_instance(model=model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, s["vocab_size"], (b, n), generator=g).to(device)
    return model, ids


def _check_loss(loss, ids, device, smoke, what):
    """loss (of the model of (device, smoke) on ids) against the stock model's in float64 and in its dtype."""
    base = _base[(device.type, smoke)]

    def losses():  # (the float64 loss from float64 logits: transformers' own loss upcasts them to fp32 only)
        from zerofuse import reference

        model = copy.deepcopy(base).to(device, torch.float64).train()
        with torch.no_grad():
            logits = model(ids).logits[:, :-1]
            want = reference.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            del model, logits
            peer = copy.deepcopy(base).to(device).train()(ids, labels=ids).loss
        return want, peer

    want, peer = cached_reference(("hf_llama_loss", device, smoke), losses)
    check_result(loss.to(base.dtype), want, peer.to(base.dtype), what=f"{what} loss")


@pytest.mark.parametrize("provider", PROVIDERS)
def bench_hf_llama_step(measure, benchmark, device, smoke, provider):
    model, ids = _model(provider, device, smoke)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

    def step():
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    first = step()  # optimizer states and kernel caches outside the timing; its loss checked below
    tokens = ids.numel()
    params = sum(p.numel() for p in model.parameters())
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if emb is not head:  # a lookup, no matmul (as the job's MFU counts N: GPT.num_params(matmul=True))
        params -= emb.numel()
    cfg = model.config
    # 6 N T for the weights + the causal attention's 6 * L * N^2 * d per sequence (half of the square)
    attn = 6 * cfg.num_hidden_layers * ids.shape[0] * ids.shape[1] ** 2 * cfg.hidden_size
    case = f"hf_llama/train_step/{next(model.parameters()).dtype}/{ids.shape[0]}x{ids.shape[1]}"
    # a whole step: its host time is part of what it costs (timed by wall, the device time beside)
    seconds = measure(step, case=case, provider=provider, flops=6.0 * params * tokens + attn, timing="wall")
    if seconds is not None:
        benchmark.extra_info["tokens_per_s"] = round(tokens / seconds, 1)
    _check_loss(first, ids, device, smoke, provider)


_peaks: dict = {}


@pytest.mark.parametrize("provider", PROVIDERS)
def bench_hf_llama_memory(benchmark, device, smoke, provider):
    model, ids = _model(provider, device, smoke)
    model(ids, labels=ids).loss.backward()  # grads allocated once: the peak measures activations
    with peak_memory(device) as mem:
        loss = model(ids, labels=ids).loss
        loss.backward()
    benchmark.pedantic(lambda: None, rounds=1)  # untimed: the figure is the peak, in extra_info
    _peaks[provider] = mem.peak
    info = dict(case=f"hf_llama/fwd+bwd_peak/{ids.shape[0]}x{ids.shape[1]}", provider=provider, device=str(device),
                timing="untimed", peak_MiB=round(mem.peak / 2**20, 1))
    if provider != "stock" and "stock" in _peaks:
        info["ratio_vs_stock"] = round(mem.peak / _peaks["stock"], 3)
    benchmark.extra_info.update(info)
    _check_loss(loss.detach(), ids, device, smoke, provider)

