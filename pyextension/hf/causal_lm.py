"""The fused output layer + loss in a Hugging Face causal LM, per instance.

``lm_head`` becomes a zerofuse LinearCrossEntropyHead holding the same weight Parameter (a tie
to the input embedding stays a tie; state_dict keys unchanged), and the instance's forward, when
given ``labels`` (or ``shift_labels``), runs the decoder and computes the loss in the head's own
forward: ZeRO's hooks gather the head's weight first (Liger-Kernel#1048 read it raw), the
(tokens, vocab) logits never exist, and the returned ``logits`` is None. Without labels it is the
model's own forward (logits for evaluation and generation). Loss semantics are transformers'
ForCausalLMLoss: labels shifted left by one with ignore_index -100 appended, the mean over
non-ignored targets, or with ``num_items_in_batch`` (gradient accumulation, as the Trainer passes
it) the sum divided by it; Gemma 2's final-logit softcap is applied inside the fused loss. A loss
pass builds no KV cache unless ``use_cache=True`` is passed.
"""
from __future__ import annotations

import dataclasses
import types

import torch
import torch.nn.functional as F

from zerofuse.nn.loss import LinearCrossEntropyHead
from zerofuse.tp.cross_entropy import VocabParallelLinearCrossEntropyHead

IGNORE_INDEX = -100


def fused_head(model) -> None:
    """Swap model.lm_head (a torch.nn.Linear) for a LinearCrossEntropyHead sharing its params."""
    head = model.lm_head
    if isinstance(head, (LinearCrossEntropyHead, VocabParallelLinearCrossEntropyHead)):
        return
    if type(head) is not torch.nn.Linear:
        raise ValueError(f"zerofuse.patch: linear_cross_entropy expects lm_head to be a torch.nn.Linear, got "
                         f"{type(head).__name__}")
    new = LinearCrossEntropyHead(head.in_features, head.out_features, bias=head.bias is not None, device="meta")
    new.weight = head.weight
    if head.bias is not None:
        new.bias = head.bias
    new.train(head.training)
    model.lm_head = new


def _output_class(model):
    """The causal-LM output dataclass the model's own forward returns (from its annotation)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: PLC0415

    fn = type(model).forward
    ann = getattr(fn, "__annotations__", {}).get("return")
    if isinstance(ann, type) and dataclasses.is_dataclass(ann) and "loss" in {f.name for f in dataclasses.fields(ann)}:
        return ann
    return CausalLMOutputWithPast


def _shifted(labels, shift_labels):
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def lm_forward(self, input_ids=None, *args, labels=None, shift_labels=None, num_items_in_batch=None,
               logits_to_keep=0, return_dict=None, **kwargs):
    """The patched forward; see the module doc."""
    if (labels is None and shift_labels is None) or args:
        kw = {} if labels is None else {"labels": labels}
        if shift_labels is not None:
            kw["shift_labels"] = shift_labels
        if num_items_in_batch is not None:
            kw["num_items_in_batch"] = num_items_in_batch
        if return_dict is not None:
            kw["return_dict"] = return_dict
        return type(self).forward(self, input_ids, *args, logits_to_keep=logits_to_keep, **kw, **kwargs)
    arch = self._zerofuse_arch
    decoder = getattr(self, arch.decoder)
    # a loss pass builds no KV cache unless asked (config.use_cache defaults to True: the stock
    # forward concatenates every layer's K/V into a cache a training step never reads)
    kwargs.setdefault("use_cache", False)
    out = decoder(input_ids=input_ids, return_dict=True, **kwargs)
    hidden = out[0]
    target = _shifted(labels, shift_labels).to(hidden.device)
    softcap = getattr(self.config, arch.final_softcap, None) if arch.final_softcap else None
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = self.lm_head(hidden, target, ignore_index=IGNORE_INDEX, reduction=reduction, softcap=softcap)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    cls, fields = self._zerofuse_output
    rest = {k: v for k, v in out.items() if k in fields and k not in ("loss", "logits")}
    result = cls(loss=loss, logits=None, **rest)
    if return_dict is False or (return_dict is None and not getattr(self.config, "return_dict", True)):
        return result.to_tuple()
    return result


def patch_lm(model, arch) -> bool:
    if getattr(model, "_zerofuse_lce", False):
        return False
    fused_head(model)
    model._zerofuse_arch = arch
    cls = _output_class(model)  # once, not per forward
    model._zerofuse_output = (cls, frozenset(f.name for f in dataclasses.fields(cls)))
    model.forward = types.MethodType(lm_forward, model)
    model._zerofuse_lce = True
    return True
