"""zerofuse's attention as a Hugging Face attention function (``attn_implementation="zerofuse"`` and
the function zerofuse/hf/rebind.py binds into a patched attention module's forward).

Attention: zerofuse's fused kernel runs where the model's mask function handed the layer no mask
(a causal batch without padding: sdpa's mask function returns None then; a flash-configured model's
packed documents given by kwargs) or the mask of packed sequences ([Note: packed sequences in
transformers]), queries and keys of one length, q and v of one head dim, no dropout, softcap,
attention sinks, sliding window shorter than the sequence or attention weights asked for; anything else
runs the model's configured implementation (sdpa where that is zerofuse itself) — a different
result is never returned silently. ``attn_implementation="zerofuse"`` (at
load or in the config) selects the same function through transformers' AttentionInterface.
"""
from __future__ import annotations

import functools
import weakref

import torch

from zerofuse.nn import functional as zF

NAME = "zerofuse"
_calls = {"fused": 0, "fallback": 0}


def __getattr__(name: str):
    """Names that moved to zerofuse/hf/rebind.py (2026-12-07): a patched model pickled before names
    its bound forward's maker here."""
    if name in ("_rebound_forward", "patch_attention", "make_rope", "attention_names"):
        from zerofuse.hf import rebind  # noqa: PLC0415 - rebind imports this module

        return getattr(rebind, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def attention_calls() -> dict:
    """How many attention calls ran the fused kernel and how many fell back (since import)."""
    return dict(_calls)


def _fallback_impl(module, default, kwargs=None):
    """What the module's configured implementation would run (sdpa where that is zerofuse's; the
    model's eager function where attention sinks or a softcap need it)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: PLC0415

    impl = getattr(getattr(module, "config", None), "_attn_implementation", None) or "sdpa"
    if impl == NAME:
        impl = "sdpa"
        # what sdpa cannot do: attention sinks (it would drop them: a different result), Gemma 2's
        # logit softcap (transformers' sdpa refuses it: every forward of such a model raised)
        need = [what for k, what in (("s_aux", "attention sinks (s_aux)"), ("softcap", "a logit softcap"))
                if (kwargs or {}).get(k) is not None]
        if need:
            if default is None:
                verb = "needs" if need == ["a logit softcap"] else "need"
                raise ValueError(f"zerofuse attention: {' and '.join(need)} {verb} the model's eager attention, which "
                                 f"{type(module).__name__} did not hand over: load the model with "
                                 f"attn_implementation='eager' (zerofuse.patch it to fuse what it can)")
            # the masks of this implementation are sdpa's (registered with sdpa_mask): made the
            # additive ones eager reads (it added a bool mask to the scores, and a causal batch's
            # None attended to the future)
            return functools.partial(_eager_with_sdpa_mask, default)
    if impl == "eager" and default is not None:
        return default
    if impl == "eager":  # selected by name with no model default at hand: transformers' sdpa
        impl = "sdpa"
    return ALL_ATTENTION_FUNCTIONS.get_interface(impl, default)


def _eager_with_sdpa_mask(eager, module, query, key, value, attention_mask, *args, is_causal=None, **kwargs):
    """The model's eager attention given the mask sdpa_mask made: bool (True: attend) or None (causal
    by sdpa's is_causal, or no mask), as the float mask eager adds to the scores."""
    if attention_mask is None or attention_mask.dtype == torch.bool:
        causal = (is_causal if is_causal is not None else getattr(module, "is_causal", True)) and query.shape[2] > 1
        n, m = query.shape[2], key.shape[2]
        if attention_mask is None and causal:  # (sdpa_mask gives None for queries and keys of one length)
            attention_mask = torch.ones(n, m, dtype=torch.bool, device=query.device).tril(m - n)[None, None]
        if attention_mask is not None:
            attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~attention_mask, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, attention_mask, *args, is_causal=is_causal, **kwargs)


def _runs_fused(query, key, value, attention_mask, dropout, kwargs) -> bool:
    window = kwargs.get("sliding_window")
    return (attention_mask is None and not dropout and kwargs.get("softcap") is None
            and kwargs.get("s_aux") is None and value.shape[-1] == query.shape[-1]  # (sinks; MLA's v head dim)
            and (window is None or window >= key.shape[2]) and not kwargs.get("output_attentions")
            and kwargs.get("position_bias") is None and query.shape[2] == key.shape[2]
            and query.shape[1] % key.shape[1] == 0 and not _attentions_recorded())


def _attentions_recorded() -> bool:
    """Whether transformers records this forward's attention weights: its output collector (5.x's
    capture_outputs) asks for them from config.output_attentions as well as the kwarg, and GPT-2's
    attention takes the kwarg without handing it on: the fused kernel (no weights) ran and
    outputs.attentions came back empty, silently (a review's reproduction, 2026-12-07)."""
    collector = _output_collector()
    if collector is None:
        return False
    try:
        active = collector.get()
    except LookupError:
        return False
    return bool(active) and "attentions" in active


@functools.cache
def _output_collector():
    """transformers' active output collector (a context variable), or None (an older transformers:
    the kwarg is what it hands the layer)."""
    try:
        from transformers.utils.output_capturing import _active_collector  # noqa: PLC0415
    except ImportError:
        return None
    return _active_collector


# [Note: packed sequences in transformers] Packed training batches (several documents in one row,
# position_ids restarting at 0 for each: DataCollatorWithFlattening) come in two forms, and the
# fused kernel takes both as document ids (no N x N mask read):
# - sdpa/eager (and "zerofuse"): a bool (B, 1, N, N) mask, causal and block-diagonal, made by the
#   model's mask function from the position_ids it also hands the layer (transformers >= 4.53
#   detects packing where no 2-D mask and no cache were given). The ids come from position_ids'
#   restarts, and the mask must equal theirs exactly (checked once per forward and mask object -
#   layers share them; models alternating full and windowed layers hold two - one comparison and one
#   host sync each; transformers' packing detection syncs too) - a mask with padding, a window or
#   anything else falls back.
# - flash_attention_* (any implementation named "flash"; "zerofuse" for the first form): no mask;
#   the documents are the kwargs cu_seq_lens_q/_k (with max_length_q/_k: all four, as transformers'
#   flash path reads them; over the batch flattened to B*N tokens) or else, for one row, the tokens
#   where position_ids equal their minimum (transformers' rule there). Without this a patched flash
#   model attended across documents (test). Offsets that do not cover B*N, differ between q and k or
#   cross a row boundary, and position_ids whose first token does not start a document, run the
#   model's implementation. zerofuse's own implementation ("zerofuse") also reads the offsets, and
#   having no other implementation to defer to, raises on ones it cannot take and takes them
#   unchecked where nothing may sync (compile, capture, inference mode).
# Not under torch.compile, a CUDA graph capture or inference mode (a host sync or a version counter
# they do not allow): those fall back.
_PACKED_KEPT = 4
_packed: list = []  # (refs of the tensors read, their versions and the shape, ids or None), the latest last


def _unsyncable(*tensors) -> bool:
    return (torch.compiler.is_compiling() or any(t.is_inference() for t in tensors)
            or (tensors[0].is_cuda and torch.cuda.is_current_stream_capturing()))


def _cached_ids(tensors, shape, make):
    """make() for these tensors (document ids or None), once per tensors, versions and shape."""
    key = (tuple(t._version for t in tensors), shape)
    for refs, k, ids in _packed:
        if k == key and all(r() is t for r, t in zip(refs, tensors, strict=True)):
            return ids
    ids = make()
    _packed.append((tuple(weakref.ref(t) for t in tensors), key, ids))
    del _packed[:-_PACKED_KEPT]
    return ids


def _packed_documents(query, attention_mask, kwargs):
    """Document ids (B, N) when attention_mask is exactly the packed-sequence mask of the layer's
    position_ids (one document a row: the causal mask), else None. A bool mask (sdpa's) or an
    additive float one (eager's: 0 where a query sees a key, the dtype's minimum elsewhere; a model
    configured for eager attention never ran fused before: its mask function hands every layer that
    mask, padding or not; a review's reproduction, 2026-12-07)."""
    pos = kwargs.get("position_ids")
    b, n = query.shape[0], query.shape[2]
    if (not isinstance(pos, torch.Tensor) or not isinstance(attention_mask, torch.Tensor)
            or not (attention_mask.dtype == torch.bool or attention_mask.is_floating_point())
            or attention_mask.dim() != 4 or attention_mask.shape[0] not in (1, b)
            or tuple(attention_mask.shape[1:]) != (1, n, n) or pos.dim() != 2 or pos.shape[0] not in (1, b)
            or pos.shape[1] != n or pos.is_floating_point() or pos.device != query.device
            or _unsyncable(attention_mask, pos)):
        return None

    def make():
        from zerofuse.ops.attention import document_bounds, document_mask  # noqa: PLC0415

        restart = torch.ones_like(pos, dtype=torch.bool)
        restart[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        ids = restart.cumsum(1).expand(b, n)
        want = document_mask(document_bounds(ids))
        mask = attention_mask.expand(b, 1, n, n)
        if mask.dtype != torch.bool:  # additive: exactly 0 where seen and the minimum elsewhere (no bias)
            mask = torch.where(mask == 0, True, torch.where(mask == torch.finfo(mask.dtype).min, False, ~want))
        return ids if torch.equal(mask, want) else None

    return _cached_ids((attention_mask, pos), (b, n), make)


_NOT_SAME = object()  # flash semantics the kernel cannot reproduce: run the model's implementation


_VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")  # (all four: transformers' rule)


def _implementation(module) -> str:
    return getattr(getattr(module, "config", None), "_attn_implementation", None) or ""


def _offsets_ids(cu: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """Document ids (B, N) of offsets over the flattened batch (no checks, no host sync)."""
    tokens = torch.arange(b * n, device=cu.device)
    return torch.searchsorted(cu[1:].long(), tokens, right=True).view(b, n)


def _flash_documents(module, query, kwargs, causal: bool):
    """For a module configured with a flash implementation (or zerofuse's, for the offsets), the
    documents its kwargs describe: ids (B, N), None (one causal sequence per row) or _NOT_SAME.
    zerofuse's own implementation has no other to fall back to: offsets it cannot take raise, and
    where nothing may sync (compile, capture, inference mode) they are taken unchecked."""
    impl = _implementation(module)
    flash = "flash" in impl
    if not flash and impl != NAME:
        return None
    ids = _kwargs_documents(query, kwargs, flash)
    if ids is None or ids is _NOT_SAME or causal or query.shape[2] == 1:
        return ids
    if flash:  # the kernel's documents are causal
        return _NOT_SAME
    raise ValueError(f"zerofuse attention: packed documents (cu_seq_lens_q/_k) are for causal attention, got "
                     f"{type(module).__name__} with is_causal=False")


def _kwargs_documents(query, kwargs, flash: bool):
    b, n = query.shape[0], query.shape[2]
    dev = query.device
    varlen = [kwargs.get(k) for k in _VARLEN]
    if all(v is not None for v in varlen):
        cu_q, cu_k = varlen[:2]

        def refused():
            if flash:
                return _NOT_SAME
            got = [c.tolist() if isinstance(c, torch.Tensor) and c.numel() < 64 else type(c).__name__ for c in (cu_q, cu_k)]
            raise ValueError(f"zerofuse attention: expected cu_seq_lens_q and cu_seq_lens_k to be the same offsets on "
                             f"{dev}, from 0 to batch x sequence ({b} x {n}), splitting no row; got {got[0]} and {got[1]}")

        if not all(isinstance(c, torch.Tensor) and c.dim() == 1 and c.numel() >= 2 and not c.is_floating_point()
                   and c.device == dev for c in (cu_q, cu_k)):
            return refused()
        if _unsyncable(cu_q, cu_k):
            return _NOT_SAME if flash else _offsets_ids(cu_q, b, n)

        def make():
            if cu_q.shape != cu_k.shape:
                return refused()
            oq, ok = torch.stack((cu_q.long(), cu_k.long())).tolist()  # one host read (the offsets are short)
            if (oq != ok or oq[0] != 0 or oq[-1] != b * n or any(x > y for x, y in zip(oq, oq[1:]))
                    or not {r * n for r in range(1, b)} <= set(oq)):
                return refused()
            return _offsets_ids(cu_q, b, n)

        return _cached_ids((cu_q, cu_k), (b, n), make)
    pos = kwargs.get("position_ids")
    if not flash or b != 1 or n == 1 or not isinstance(pos, torch.Tensor) or pos.shape != (1, n):
        return None
    if pos.is_floating_point() or pos.device != dev or _unsyncable(pos):
        return _NOT_SAME

    def make():
        starts = pos == pos.min()
        if not bool(starts[0, 0]):
            return _NOT_SAME
        return starts.cumsum(1) if bool(starts[0, 1:].any()) else None

    return _cached_ids((pos,), (b, n), make)


def _mask_keeps_documents(mask, docs) -> bool:
    """Whether the fallback's attention mask keeps every query within its document (ids (B, N) from
    cu_seq_lens; None: one document a row): transformers builds the packed block-diagonal mask from
    the position_ids a packing collator sends beside the flash kwargs, and the fallback applying it
    is exact (it was refused: Gemma 2's softcap, a sliding window, dropout; a review, 2026-12-06).
    A mask that lets a query see another document (or none at all) is not."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or docs is _NOT_SAME:
        return False
    if docs is None:
        return True
    if mask.shape[-2:] != (docs.shape[1], docs.shape[1]):
        return False
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    same = docs[:, None, :, None] == docs[:, None, None, :]
    return not bool((allowed & ~same).any())


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, *, default=None, **kwargs):
    """transformers' attention-function signature: (B, H, N, D) q, k, v -> ((B, N, H, D), None).
    default: the model's own eager function, for a fallback when that is its configured one."""
    docs = None
    causal = (is_causal if is_causal is not None else getattr(module, "is_causal", True)) and query.shape[2] > 1
    if _runs_fused(query, key, value, None, dropout, kwargs):  # (the cheap checks first)
        if attention_mask is not None:
            docs = _packed_documents(query, attention_mask, kwargs)
        else:
            docs = _flash_documents(module, query, kwargs, causal)
    if docs is _NOT_SAME or not _runs_fused(query, key, value, attention_mask if docs is None else None, dropout, kwargs):
        if _implementation(module) == NAME and all(kwargs.get(k) is not None for k in _VARLEN) \
                and not _mask_keeps_documents(attention_mask, _kwargs_documents(query, kwargs, False)):
            raise ValueError("zerofuse attention: cu_seq_lens_q/_k (packed documents) given to a call the fused kernel "
                             "cannot run (an attention mask, e.g. a sliding window's or padding, dropout, a softcap, "
                             "sinks, attention weights asked for, or queries and keys of different lengths), and "
                             "its fallback, sdpa, would ignore them: pass packed batches as position_ids instead")
        _calls["fallback"] += 1
        return _fallback_impl(module, default, kwargs)(module, query, key, value, attention_mask, dropout=dropout,
                                               scaling=scaling, is_causal=is_causal, **kwargs)
    _calls["fused"] += 1
    out = zF.scaled_dot_product_attention(query, key, value, is_causal=bool(causal) or docs is not None, scale=scaling,
                                          enable_gqa=key.shape[1] != query.shape[1], document_ids=docs)
    return out.transpose(1, 2).contiguous(), None


class _Interface:
    """Stands for ALL_ATTENTION_FUNCTIONS in a patched forward: every lookup yields zerofuse's
    attention, which falls back to the model's configured one where the kernel does not apply."""

    def get_interface(self, name, default):
        return functools.partial(attention_forward, default=default)


_INTERFACE = _Interface()


@functools.cache
def register() -> None:
    """Make ``attn_implementation="zerofuse"`` known to transformers (adds the name; changes no model)."""
    from transformers import AttentionInterface  # noqa: PLC0415
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: PLC0415

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)

