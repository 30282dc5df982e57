"""Attention faces: ``scaled_dot_product_attention`` (torch's signature, plus ``document_ids`` for
packed documents) and ``qkv_attention`` (straight from a fused QKV projection), re-exported by
zerofuse.nn.functional. Triton kernels on CUDA (the interpreter on CPU under
ZEROFUSE_TRITON_ON_CPU=1), torch's CPU flash kernels on the cpu; what the kernels do not take runs
torch's sdpa after a one-time warning."""
from __future__ import annotations

import weakref

import torch
from torch import Tensor

from zerofuse import kernels as _kernels
from zerofuse.nn.autocast import autocast_dtype, autocast_on, cast_all
from zerofuse.nn.functional import _needs_grad
from zerofuse.ops import attention as _attn
from zerofuse.ops import attention_qkv as _qkv
from zerofuse.ops.signatures import Plans, autograd_modes, signature, torch_only

_warned: set[str] = set()


def _fallback_warning(reason: str) -> None:
    # (under torch.compile the warning is untraceable: fullgraph failed, other modes broke the graph,
    # on every fallback torch's own sdpa compiles; a review's reproduction, 2026-12-07)
    if reason not in _warned and not torch.compiler.is_compiling():
        _warned.add(reason)
        import warnings

        warnings.warn(f"zerofuse.nn.functional.scaled_dot_product_attention: {reason}; running torch's "
                      "implementation instead (warned once)", stacklevel=3)


def _check_attention(query, key, value, dropout_p) -> None:
    """What torch's sdpa also refuses, named; the fused kernel would otherwise run a key on another
    device (meta: uninitialised memory) or of another dtype."""
    where = "zerofuse.nn.functional.scaled_dot_product_attention"
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(f"{where}: expected {name} to be a floating-point tensor, got {got}")
    from zerofuse.kernels.attention import check_like_query

    check_like_query(query, key, value, where)
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{where}: expected dropout_p in [0, 1], got {dropout_p}")


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False, *, document_ids: Tensor | None = None) -> Tensor:
    """torch.nn.functional.scaled_dot_product_attention with zerofuse's fused kernel: (B, H, N, D)
    tensors, causal or not, grouped-query attention with enable_gqa=True. What the kernel does not
    take (an attn_mask, dropout_p > 0, other ranks, head_dim > 256, a value head_dim of its own,
    key/value batches broadcast, a single head broadcast without enable_gqa, float64 on CUDA, an
    empty query or batch) runs torch's
    implementation after a one-time warning: never a silently different result. Query, key and value
    must share a device and a dtype (as for torch's); under autocast they are cast to its dtype first,
    as torch's sdpa's are. No double backward (create_graph=True raises).
    document_ids (B, N) integers, causal only: packed documents, each a run of equal ids along N; a
    query sees only the earlier keys of its own document (varlen attention without unpadding; the
    kernel skips the key blocks of other documents). Their bounds are made once per ids tensor and
    version (every layer of a forward passes the same ids): refill a reused ids buffer with an op
    that bumps its version (copy_, indexing), not a torch.distributed collective, ``.data`` or
    numpy writes, which torch does not count (then pass ``ids.clone()``)."""
    if torch_only():  # (torch.func transforms, jit.trace, forward AD: torch's own)
        if document_ids is not None:
            if torch._C._are_functorch_transforms_active() or torch._C._get_tracing_state() is not None:
                raise RuntimeError("zerofuse.nn.functional.scaled_dot_product_attention: document_ids is not "
                                   "supported under torch.func transforms or torch.jit.trace; pass an attn_mask of "
                                   "the documents")
            # forward AD: the documents as torch's mask (refused before, as under the transforms: a
            # review's reproduction, 2026-12-07)
            attn_mask, is_causal = _with_documents(attn_mask, _documents(query, key, is_causal, document_ids)), False
        kw = {"enable_gqa": enable_gqa} if enable_gqa else {}
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                                                scale=scale, **kw)
    sig = None
    if not torch.compiler.is_compiling():  # a plan for these arguments' signature: no checks, no choices
        sig = signature(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, document_ids,
                        _kernels.TRITON_ON_CPU, autocast_on(query), autograd_modes())
        plan = _PLANS.get(sig)
        if plan is not None:
            docs = None if document_ids is None else _bounds(document_ids, query.shape[0], query.shape[2])
            return plan(query, key, value, docs)
    # under autocast torch's sdpa runs in the autocast dtype (its floating inputs cast): so here
    cast = autocast_dtype(query)
    query, key, value = cast_all(cast, query, key, value)
    _check_attention(query, key, value, dropout_p)
    docs = None
    if document_ids is not None:
        docs = _documents(query, key, is_causal, document_ids)
    # heads that differ without enable_gqa: torch broadcasts a single one (refused here before)
    broadcast = query.dim() == 4 and key.dim() == 4 and query.shape[1] != key.shape[1] and not enable_gqa
    if broadcast and 1 not in (query.shape[1], key.shape[1]):
        raise ValueError(f"zerofuse.nn.functional.scaled_dot_product_attention: query has {query.shape[1]} heads, "
                         f"key {key.shape[1]}: pass enable_gqa=True for grouped-query attention")
    reason = None
    if broadcast:
        reason = f"heads broadcast without enable_gqa (query {query.shape[1]}, key {key.shape[1]})"
    elif attn_mask is not None:
        reason = "attn_mask is not supported by the fused kernel"
    elif dropout_p > 0.0:
        reason = "dropout_p > 0 is not supported by the fused kernel"
    elif query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        reason = f"expected 4-D (B, H, N, D) inputs, got {query.dim()}-D"
    elif value.shape[-1] != query.shape[-1] and key.shape[-1] == query.shape[-1]:  # (q and k must agree: checked)
        reason = f"a value head_dim ({value.shape[-1]}) other than query's ({query.shape[-1]})"
    elif key.shape[0] != query.shape[0] or value.shape[:-1] != key.shape[:-1]:
        reason = f"key/value batches or lengths broadcast (query {list(query.shape)}, key {list(key.shape)}, " \
                 f"value {list(value.shape)})"
    elif 0 in query.shape or 0 in key.shape[:2]:
        # nothing to compute; torch's CPU flash kernel divides by zero on an empty query (SIGFPE)
        reason = f"empty input (query {list(query.shape)}, key {list(key.shape)})"
    elif query.shape[-1] > _attn.MAX_HEAD_DIM:
        reason = f"head_dim {query.shape[-1]} > {_attn.MAX_HEAD_DIM}"
    elif query.is_cuda and query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        reason = f"dtype {query.dtype} on CUDA"
    elif key.shape[-2] == 0:
        reason = "no keys"
    elif max(query.shape[0], query.shape[1]) > _attn.MAX_GRID_YZ:
        reason = f"more than {_attn.MAX_GRID_YZ} batches or heads (the kernels' grid)"
    if reason is not None:
        _fallback_warning(reason)
        kw = {"enable_gqa": enable_gqa} if enable_gqa else {}
        if docs is not None:  # the documents as a mask, causal included
            attn_mask, is_causal = _with_documents(attn_mask, docs), False
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                                                scale=scale, **kw)
    given_scale, scale = scale, query.shape[-1] ** -0.5 if scale is None else float(scale)
    # the kernel takes any strides but a unit one along head_dim (torch's sdpa takes any layout)
    as_given = all(t.stride(-1) == 1 for t in (query, key, value))
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    if torch.compiler.is_compiling():
        return torch.ops.zerofuse.attention(query, key, value, bool(is_causal), scale, docs)[0]
    grad = _needs_grad(query, key, value, None)
    # a plan where the kernels take the tensors as given and every argument it bakes in is a plain
    # value (a tensor's value is not in the signature); autocast off (its dtype is not either)
    if (sig is not None and as_given and cast is None and _attn.use_triton(query)
            and all(type(a) in _PLAIN for a in (dropout_p, is_causal, enable_gqa, given_scale))
            and all(_attn.K._tileable(t) is t for t in (query, key, value))):
        plan = _attn.Plan(query, key, value, bool(is_causal), scale, docs is not None, grad)
        out = plan(query, key, value, docs)
        _PLANS.put(sig, plan)  # once it ran: a call that fails leaves no plan
        return out
    if not grad:  # no autograd at all
        return _attn._fwd(query, key, value, bool(is_causal), scale, docs)[0]
    return _attn.eager_attention(query, key, value, bool(is_causal), scale, docs)


_PLANS = Plans()  # [Note: call signatures]: scaled_dot_product_attention's
_PLAIN = (bool, int, float, type(None))


def _documents(query: Tensor, key: Tensor, is_causal: bool, document_ids: Tensor,
               where: str = "zerofuse.nn.functional.scaled_dot_product_attention") -> Tensor:
    """scaled_dot_product_attention's document_ids as the op's docs (document_bounds), checked."""
    n = query.shape[-2] if query.dim() >= 2 else None
    if not is_causal or key.dim() < 2 or key.shape[-2] != n:
        raise ValueError(f"{where}: document_ids are for causal attention of queries and keys of one length, "
                         f"got is_causal={is_causal}, query {list(query.shape)}, key {list(key.shape)}")
    b = query.shape[0]
    if not isinstance(document_ids, Tensor) or document_ids.dim() != 2 or document_ids.shape[0] not in (1, b) \
            or document_ids.shape[1] != n or document_ids.device != query.device:
        got = (f"{list(document_ids.shape)} on {document_ids.device}" if isinstance(document_ids, Tensor)
               else type(document_ids).__name__)
        raise ValueError(f"{where}: expected document_ids of shape [{b}, {n}] or [1, {n}] (batch, sequence) on "
                         f"{query.device}, got {got}")
    return _bounds(document_ids, b, n)


def _bounds(document_ids: Tensor, b: int, n: int) -> Tensor:
    """The bounds of checked document_ids (B or 1, N) for b batches, made once per ids tensor and version."""
    if (torch.compiler.is_compiling() or document_ids.is_inference()
            or (document_ids.is_cuda and torch.cuda.is_current_stream_capturing())):
        # no cache: a traced or captured call must record making the bounds (a captured graph
        # replays over new ids copied into the same tensor); inference tensors have no version
        return _attn.document_bounds(document_ids.expand(b, n))
    # every layer of a forward passes the same ids: their bounds are made once (one entry, read and
    # written whole)
    ref, key, docs = _last_documents[0]
    if ref() is document_ids and key == (document_ids._version, b):
        return docs
    docs = _attn.document_bounds(document_ids.expand(b, n))
    _last_documents[0] = (weakref.ref(document_ids), (document_ids._version, b), docs)
    return docs


_last_documents: list = [(lambda: None, None, None)]


def _with_documents(attn_mask: Tensor | None, docs: Tensor) -> Tensor:
    """torch's sdpa mask for the documents (causal included), combined with the caller's attn_mask."""
    seen = _attn.document_mask(docs)
    if attn_mask is None:
        return seen
    if attn_mask.dtype == torch.bool:
        return attn_mask & seen
    return attn_mask.masked_fill(~seen, float("-inf"))


def qkv_attention(qkv: Tensor, num_heads: int, num_kv_heads: int | None = None, is_causal: bool = False,
                  scale: float | None = None, *, document_ids: Tensor | None = None) -> Tensor:
    """Attention straight from a fused QKV projection: qkv (B, N, (Hq + 2 * Hkv) * D), the q heads then
    the k heads then the v heads along the last dim (zerofuse.nn.Attention's layout) -> (B, N, Hq * D),
    ready for the output projection. The same result as splitting qkv into (B, H, N, D) heads for
    scaled_dot_product_attention and transposing its output back, without the copies that costs
    (zerofuse::attention_qkv: the kernels read the heads in place, write the output in this layout
    and the gradient of qkv as one packed tensor). What the fused kernel does not take (head_dim >
    256, float64 on CUDA, more than 65535 batches or heads) runs scaled_dot_product_attention on
    the split heads. document_ids (B, N): packed documents, as scaled_dot_product_attention's. Under
    autocast qkv is cast to its dtype first (as torch's sdpa's inputs are)."""
    sig = None
    native = torch_only()  # (torch.func transforms, jit.trace, forward AD: the split heads through torch's sdpa)
    if not torch.compiler.is_compiling() and not native:  # a plan for these arguments' signature: no checks, no choices
        sig = signature(qkv, num_heads, num_kv_heads, is_causal, scale, document_ids, _kernels.TRITON_ON_CPU,
                        autocast_on(qkv), autograd_modes())
        plan = _QKV_PLANS.get(sig)
        if plan is not None:
            docs = None if document_ids is None else _bounds(document_ids, qkv.shape[0], qkv.shape[1])
            return plan(qkv, docs)
    given = (num_heads, num_kv_heads, is_causal, scale)
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    d = _qkv.check(qkv, num_heads, num_kv_heads, "zerofuse.nn.functional.qkv_attention")
    scale = d ** -0.5 if scale is None else float(scale)
    cast = autocast_dtype(qkv)  # under autocast, as scaled_dot_product_attention's inputs (torch's sdpa's)
    qkv = cast_all(cast, qkv)[0]
    if (native or d > _attn.MAX_HEAD_DIM or (qkv.is_cuda and qkv.dtype not in (torch.float32, torch.float16, torch.bfloat16))
            or max(qkv.shape[0], num_heads) > _attn.MAX_GRID_YZ):
        q, k, v = _qkv.heads(qkv, num_heads, num_kv_heads, d)
        out = scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                           enable_gqa=num_heads != num_kv_heads, document_ids=document_ids)
        return out.transpose(1, 2).reshape(qkv.shape[0], qkv.shape[1], num_heads * d)
    docs = None
    if document_ids is not None:
        docs = _documents(*_qkv.heads(qkv, num_heads, num_kv_heads, d)[:2], is_causal, document_ids,
                          "zerofuse.nn.functional.qkv_attention")
    if torch.compiler.is_compiling():
        return torch.ops.zerofuse.attention_qkv(qkv, num_heads, num_kv_heads, bool(is_causal), scale, docs)[0]
    # a plan on the Triton path with nothing empty, rows the kernels take in place, plain values
    grad = _needs_grad(qkv, None, None, None)
    if (sig is not None and cast is None and all(type(a) in _PLAIN for a in given) and qkv.numel() > 0
            and _attn.use_triton(qkv[..., :d]) and (qkv.shape[1] <= 1 or qkv.stride(1) <= _attn.K._MAX_ROW_STRIDE)):
        plan = _qkv.Plan(qkv, num_heads, num_kv_heads, bool(is_causal), scale, docs is not None, grad)
        out = plan(qkv, docs)
        _QKV_PLANS.put(sig, plan)  # once it ran: a call that fails leaves no plan
        return out
    if not grad:  # no autograd at all
        return _qkv._fwd(qkv, num_heads, num_kv_heads, bool(is_causal), scale, docs)[0]
    return _qkv.eager_qkv_attention(qkv, num_heads, num_kv_heads, bool(is_causal), scale, docs)


_QKV_PLANS = Plans()  # [Note: call signatures]: qkv_attention's
