"""zerofuse.models.GPT.generate's sampling loop and argument checks."""
from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor


def sample(model, idx, max_new_tokens, temperature, top_k, generator, vocab_size=None):
    """The sampling loop of GPT.generate (its arguments checked by check_generate). vocab_size: only
    ids below it are drawn (a padded vocabulary's padding ids, GPT-2's 50257..50303, were drawn
    and fed back: a review's reproduction, 2026-12-07)."""
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -model.config.seq_len:])
        logits = model.gather_logits(logits[:, -1, :].contiguous()).float()
        if vocab_size is not None:
            logits = logits[:, :vocab_size]
        # (logits / 1e-6 before: a coin flip between logits a few ulps apart; a temperature fp32 takes
        # for 0, 1e-46, divided the logits by zero)
        if temperature == 0 or torch.tensor(temperature, dtype=logits.dtype).item() == 0:
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True).to(idx.dtype)], dim=1)  # (int32 stays int32)
            continue
        # less the row's max first: a tiny temperature overflowed the logits to inf, and softmax to NaN
        logits = (logits - logits.max(-1, keepdim=True).values) / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device, idx.dtype)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


def check_generate(idx, max_new_tokens, temperature, top_k, vocab_size=None, model_vocab=None) -> None:
    """generate's arguments (torch's errors deep in the loop before, or a silent greedy/no-op run)."""
    who = "zerofuse.models.GPT.generate"
    if not isinstance(idx, Tensor) or idx.dim() != 2 or idx.shape[1] < 1 or idx.dtype not in (torch.int64, torch.int32):
        got = f"{idx.dtype} {list(idx.shape)}" if isinstance(idx, Tensor) else type(idx).__name__
        raise ValueError(f"{who}: expected idx to be token ids (batch, seq >= 1), got {got}")
    for name, v, low in (("max_new_tokens", max_new_tokens, 0), ("top_k", top_k, 1)):
        if (v is not None or name != "top_k") and (isinstance(v, bool) or not isinstance(v, numbers.Integral)
                                                   or v < low):
            raise ValueError(f"{who}: expected {name} to be an int >= {low}{' or None' if name == 'top_k' else ''}, "
                             f"got {v!r}")
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral)
                                   or not 1 <= vocab_size <= model_vocab):
        raise ValueError(f"{who}: expected vocab_size to be an int in [1, {model_vocab}] (the model's vocabulary) "
                         f"or None, got {vocab_size!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not 0 <= temperature < math.inf:
        raise ValueError(f"{who}: expected temperature to be a finite number >= 0 (0: greedy), got {temperature!r}")
