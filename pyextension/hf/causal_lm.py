"""The fused output layer + loss in a Hugging Face causal LM, per instance.

``lm_head`` becomes a zerofuse LinearCrossEntropyHead holding the same weight Parameter (a tie
to the input embedding stays a tie; state_dict keys unchanged), and the instance's forward, when
given ``labels`` (or ``shift_labels``) in training mode, runs the decoder and computes the loss in
the head's own forward: ZeRO's hooks gather the head's weight first (Liger-Kernel#1048 read it
raw), the (tokens, vocab) logits never exist, and the returned ``logits`` is None. Without labels,
or in eval mode (``model.eval()``: the Trainer's evaluate() wants logits for compute_metrics, as
Liger-Kernel decides), it is the model's own forward (logits and loss), and so is a model whose
``loss_function`` is not transformers' ForCausalLMLoss (set by the user or by ``loss_type``). Loss
semantics are ForCausalLMLoss's: labels shifted left by one with ``ignore_index`` (a kwarg, -100 by
default) appended, the mean over non-ignored targets (NaN when there are none), or with
``num_items_in_batch`` (gradient accumulation, as the Trainer passes it) the sum divided by it,
over the positions ``logits_to_keep`` keeps; Gemma 2's final-logit softcap is applied inside the
fused loss. The decoder runs as the stock forward runs it (the same kwargs, a KV cache where the
config's use_cache asks: transformers detects packed sequences only without one). The patched
forward has the stock forward's signature (transformers reads it: generate's attention_mask and
position_ids, the Trainer's columns); ``return_dict=False`` keeps the logits' slot (None) in the
tuple.
"""
from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.nn.functional as F

from zerofuse.hf.bound import Bound, forward_slot
from zerofuse.nn.loss import LinearCrossEntropyHead
from zerofuse.tp.cross_entropy import VocabParallelLinearCrossEntropyHead

IGNORE_INDEX = -100


def check_fusable_head(model) -> None:
    """model.lm_head is one fused_head can swap (zerofuse.patch checks before it changes anything:
    a refusal after the norms and MLPs were patched left the model half patched, counted as none)."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, (LinearCrossEntropyHead, VocabParallelLinearCrossEntropyHead)) and \
            type(head) is not torch.nn.Linear:
        raise ValueError(f"zerofuse.patch: linear_cross_entropy expects lm_head to be a torch.nn.Linear, got "
                         f"{type(head).__name__} (pass linear_cross_entropy=False to patch the rest)")


def fused_head(model) -> None:
    """Swap model.lm_head (a torch.nn.Linear) for a LinearCrossEntropyHead sharing its params."""
    head = model.lm_head
    if isinstance(head, (LinearCrossEntropyHead, VocabParallelLinearCrossEntropyHead)):
        return
    check_fusable_head(model)
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


def _shifted(labels, shift_labels, ignore_index: int):
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _kept(hidden, logits_to_keep):
    """transformers' slice_logits_to_keep (an int, a 1-D tensor of positions; since transformers 5.x
    also a 2-D one: (batch, k) positions per sample, or a bool (batch, seq) mask, flattened): the
    2-D forms were indexed as 1-D ones (a (B, B, K, D) tensor; an IndexError)."""
    try:
        from transformers.modeling_utils import slice_logits_to_keep  # noqa: PLC0415
    except ImportError:  # (older transformers: the int and 1-D forms only)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden[:, keep, :]
    return slice_logits_to_keep(hidden, logits_to_keep)


def _fused_head_ready(model) -> bool:
    """Whether lm_head is the fused head; an nn.Linear put there since the patch (transformers'
    resize_token_embeddings makes a new one) is swapped again."""
    if isinstance(model.lm_head, (LinearCrossEntropyHead, VocabParallelLinearCrossEntropyHead)):
        return True
    if type(model.lm_head) is torch.nn.Linear:
        fused_head(model)
        return True
    return False


def _stock_loss(model) -> bool:
    """Whether the model's loss is transformers' ForCausalLMLoss (what the fused loss computes)."""
    if "_loss_function" in model.__dict__:
        fn = model.__dict__["_loss_function"]
    else:
        from transformers.loss.loss_utils import LOSS_MAPPING  # noqa: PLC0415

        fn = LOSS_MAPPING.get(getattr(model, "loss_type", None) or "ForCausalLM", LOSS_MAPPING["ForCausalLM"])
    from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: PLC0415

    return fn is ForCausalLMLoss


def lm_forward(self, input_ids=None, *args, labels=None, shift_labels=None, num_items_in_batch=None,
               logits_to_keep=0, return_dict=None, **kwargs):
    """The patched forward; see the module doc."""
    # in eval mode the stock forward (as Liger-Kernel's): the Trainer's evaluate() with compute_metrics
    # needs the logits with the loss (it got None)
    if (labels is None and shift_labels is None) or not self.training or args or not _stock_loss(self) \
            or not _fused_head_ready(self):
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
    out = decoder(input_ids=input_ids, return_dict=True, **kwargs)  # as the stock forward: every kwarg
    hidden = out[0]
    hidden = _kept(hidden, logits_to_keep)  # the positions whose logits the stock forward would make
    ignore_index = int(kwargs.get("ignore_index", IGNORE_INDEX))
    target = _shifted(labels, shift_labels, ignore_index).to(hidden.device)
    if target.shape != hidden.shape[:-1] and target.numel() == hidden[..., 0].numel():
        target = target.reshape(hidden.shape[:-1])  # (1-D labels of a batch of one: the stock loss flattens both)
    softcap = getattr(self.config, arch.final_softcap, None) if arch.final_softcap else None
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = self.lm_head(hidden, target, ignore_index=ignore_index, reduction=reduction, softcap=softcap)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    else:  # F.cross_entropy's mean over no targets is NaN (zerofuse's is 0): 0 / False is stock's NaN
        loss = loss / (target != ignore_index).any()
    cls, fields = self._zerofuse_output
    rest = {k: v for k, v in out.items() if k in fields and k not in ("loss", "logits")}
    result = cls(loss=loss, logits=None, **rest)
    if return_dict is False or (return_dict is None and not getattr(self.config, "return_dict", True)):
        return (loss, None) + tuple(v for k, v in result.items() if k not in ("loss", "logits"))
    return result


_FORWARDS: dict = {}


def _forward_of(cls):
    """lm_forward presented with cls.forward's signature (one function per class): transformers
    inspects model.forward's parameters (generate's attention_mask / position_ids, the Trainer's
    columns to keep), and lm_forward's own ((input_ids, *args, ..., **kwargs)) named neither."""
    if cls not in _FORWARDS:
        def forward(self, *args, **kwargs):
            return lm_forward(self, *args, **kwargs)

        forward.__signature__ = inspect.signature(cls.forward)
        forward.__doc__ = lm_forward.__doc__
        forward.__name__ = forward.__qualname__ = "forward"
        _FORWARDS[cls] = forward
    return _FORWARDS[cls]


def patch_lm(model, arch) -> bool:
    if getattr(model, "_zerofuse_lce", False):
        return False
    fused_head(model)
    model._zerofuse_arch = arch
    cls = _output_class(model)  # once, not per forward
    model._zerofuse_output = (cls, frozenset(f.name for f in dataclasses.fields(cls)))
    setattr(model, forward_slot(model), Bound(model, _forward_of, type(model)))
    model._zerofuse_lce = True
    return True
