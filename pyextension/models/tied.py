"""A tied GPT's embedding and output layer (one matrix under two names) through load_state_dict:
``keep_tied_on_load`` hooks for GPT's __init__ and a pipeline stage holding both ends of one."""
from __future__ import annotations

import torch
from torch import Tensor


def is_tied(model) -> bool:
    """Whether ``model`` (a GPT, or a pipeline stage holding both ends of one) uses its embedding's
    weight as its output layer's."""
    wte, head = getattr(model, "wte", None), getattr(model, "head", None)
    return wte is not None and head is not None and getattr(head, "weight", None) is getattr(wte, "weight", 0)


def keep_tied_on_load(model) -> None:
    """The load_state_dict hooks below, on ``model`` (GPT's __init__; a pipeline stage's)."""
    model.register_load_state_dict_pre_hook(_note_tied_before_load)
    model.register_load_state_dict_post_hook(_retie_after_load)


def _retie_after_load(model, _incompatible) -> None:
    """load_state_dict(assign=True) puts a Parameter of its own on each module: a tie the model had
    before is made again (the output layer otherwise trained apart from the embedding)."""
    if model.__dict__.pop("_zf_was_tied", False) and not is_tied(model):
        model.head.weight = model.wte.weight


def _note_tied_before_load(model, state_dict, prefix, *_):
    """A tied model holds one matrix under two names: a state_dict giving one of them loads it into
    both (load_state_dict(assign=True) kept the embedding and dropped a lone head.weight, assign=False
    loaded it into both), one giving two different matrices is refused (each path kept another of
    them, silently; a review's reproduction, 2026-12-07)."""
    model._zf_was_tied = is_tied(model)
    if not model._zf_was_tied:
        return
    w, h = prefix + "wte.weight", prefix + "head.weight"
    if w in state_dict and h in state_dict:
        a, b = state_dict[w], state_dict[h]
        comparable = isinstance(a, Tensor) and isinstance(b, Tensor) and not a.is_meta and not b.is_meta
        if comparable and (a.shape != b.shape or not torch.equal(a, b.to(a.device))):
            raise ValueError(f"zerofuse.models.GPT.load_state_dict: the model ties {w} and {h} (one matrix); "
                             "expected them equal in the state_dict, got two different ones (load it into "
                             "GPTConfig(tie_embeddings=False))")
    elif h in state_dict:
        state_dict[w] = state_dict[h]
    elif w in state_dict:
        state_dict[h] = state_dict[w]
