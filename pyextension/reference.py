"""Pure-PyTorch references of every zerofuse op: the same math, written for clarity.

Tests and benchmarks import these; nothing else copies them. They run on any device and dtype
(float64 included), in place where the op is in place.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def flatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets: Sequence[int]) -> None:
    """flat[offsets[i] : offsets[i] + tensors[i].numel()] = tensors[i] in row-major order, cast to flat.dtype."""
    for t, off in zip(tensors, offsets):
        flat[off : off + t.numel()].copy_(t.reshape(-1))


def unflatten_from(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """tensors[i][...] = flat[offsets[i] : offsets[i] + tensors[i].numel()].view(tensors[i].shape), cast."""
    for t, off in zip(tensors, offsets):
        t.copy_(flat[off : off + t.numel()].view(t.shape))


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, residual=None):
    """(y, h): h = x + residual (or x), y = (h - mean) / sqrt(var + eps) * weight + bias over the
    trailing normalized_shape dims (biased variance). Computed in the inputs' dtype: pass float64
    tensors for a float64 reference."""
    h = x + residual if residual is not None else x
    dims = tuple(range(-len(normalized_shape), 0))
    mean = h.mean(dims, keepdim=True)
    var = (h - mean).square().mean(dims, keepdim=True)
    y = (h - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y, h


def default_rms_eps(dtype: torch.dtype) -> float:
    """torch.nn.functional.rms_norm's eps=None: the epsilon of its compute dtype (ATen's opmath:
    fp32 for bf16/fp16; measured 2026-11-27, torch 2.13: equal to eps=finfo(float32).eps, 3.1 off
    eps=finfo(bfloat16).eps on inputs of size 0.01, whatever its docs say)."""
    return torch.finfo(torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype).eps


def rms_norm(x, normalized_shape, weight=None, eps=None, residual=None):
    """(y, h): h = x + residual (or x), y = h / sqrt(mean(h^2) + eps) * weight; eps defaults to
    torch.nn.functional.rms_norm's (default_rms_eps of x's dtype)."""
    h = x + residual if residual is not None else x
    eps = default_rms_eps(x.dtype) if eps is None else eps
    dims = tuple(range(-len(normalized_shape), 0))
    y = h * torch.rsqrt(h.square().mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    return y, h


def adam_step(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
              decoupled=True, maximize=False):
    """One Adam (decoupled=False: L2 decay added to the gradient, as torch.optim.Adam) or AdamW
    (decoupled=True: param *= 1 - lr * weight_decay, as torch.optim.AdamW) step, in place, in the
    tensors' dtype (Kingma & Ba 2015; Loshchilov & Hutter 2019). `step` counts from 1."""
    g = -grad if maximize else grad
    if weight_decay:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            g = g + weight_decay * param
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))


def global_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """2-norm of all the tensors taken together, in float64 (0-dim)."""
    total = torch.zeros((), dtype=torch.float64)
    for t in tensors:
        total = total + t.double().square().sum().cpu()
    return total.sqrt()


def lamb_step(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay,
              bias_correction=True, mode="nvlamb", min_trust=0.0, max_trust=10.0, max_grad_norm=None):
    """One LAMB step over a list of tensors, in place, in the tensors' dtype.

    Paper (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2, with Adam's
    moments and bias correction):
        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  r = (m / bc1) / (sqrt(v / bc2) + eps)
        u = r + wd * x;  x -= lr * phi(|x|) / |u| * u,  phi(z) = clamp(z, min_trust, max_trust)
    (|u| = 0: ratio 1). mode="nvlamb" (NVIDIA's LAMB as in Apex FusedLAMB with use_nvlamb=True):
    the ratio is |x| / |u|, 1 when either norm is 0, for every tensor. In both modes, with
    max_grad_norm, grads are first divided by max(1, global_norm / max_grad_norm) (Apex).
    """
    if max_grad_norm:
        norm = float(global_norm(grads))
        if norm > max_grad_norm:
            grads = [g / (norm / max_grad_norm) for g in grads]
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    for x, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        u = (m / bc1) / ((v / bc2).sqrt() + eps) + weight_decay * x
        xn, un = float(x.double().norm()), float(u.double().norm())
        if mode == "paper":
            ratio = min(max(xn, min_trust), max_trust) / un if un > 0 else 1.0
        elif mode == "nvlamb":
            ratio = xn / un if xn > 0 and un > 0 else 1.0
        else:
            raise ValueError(f"mode: expected 'paper' or 'nvlamb', got {mode!r}")
        x.add_(u, alpha=-lr * ratio)


def lars_step(params, grads, momentum_buffers, *, lr, momentum, weight_decay, trust_coefficient, eps=0.0):
    """One LARS step (You, Gitman & Ginsburg 2017, "Large Batch Training of Convolutional Networks",
    Algorithm 1), in place: per tensor, local_lr = trust_coefficient * |x| / (|g| + wd |x| + eps)
    (1 when |x| or |g| is 0, as NVIDIA's LARC does), v = momentum v + lr * local_lr * (g + wd x),
    x -= v; wd is 0 where |x| or |g| is 0 (LARC adds the decay only with the ratio)."""
    for x, g, v in zip(params, grads, momentum_buffers):
        xn, gn = float(x.double().norm()), float(g.double().norm())
        scaled = xn > 0 and gn > 0
        local = trust_coefficient * xn / (gn + weight_decay * xn + eps) if scaled else 1.0
        v.mul_(momentum).add_(g + (weight_decay if scaled else 0.0) * x, alpha=lr * local)
        x.sub_(v)


def attention(q, k, v, is_causal=False, scale=None, document_ids=None):
    """(out, lse) of softmax(q k^T * scale [+ causal mask]) v in the inputs' dtype (pass float64 for
    a float64 reference). (B, H, N, D) layout; key/value heads repeated for grouped-query
    attention (Hq a multiple of Hkv); causal is torch's top-left mask (query i sees keys 0..i);
    lse is the natural log-sum-exp of each row's scaled, masked scores. document_ids (B, N): a
    query sees only keys of its own document, a run of equal ids along N."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-2, -1)) * scale
    if is_causal:
        nq, nk = q.shape[-2], k.shape[-2]
        keep = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if document_ids is not None:
        runs = torch.cat([torch.zeros_like(document_ids[:, :1]),
                          (document_ids[:, 1:] != document_ids[:, :-1]).long()], dim=1).cumsum(1)
        s = s.masked_fill((runs[:, None, :, None] != runs[:, None, None, :]), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ v, lse


def attention_qkv(qkv, num_heads, num_kv_heads, is_causal=False, scale=None):
    """attention() above from a fused projection qkv (B, N, (Hq + 2 Hkv) * D), [q | k | v] heads along
    the last dim: (out (B, N, Hq * D), lse (B, Hq, N))."""
    b, n, c = qkv.shape
    d = c // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q, k, v = (t.reshape(b, n, -1, d).transpose(1, 2) for t in (q, k, v))
    out, lse = attention(q, k, v, is_causal=is_causal, scale=scale)
    return out.transpose(1, 2).reshape(b, n, num_heads * d), lse


def linear_cross_entropy(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                         z_loss=0.0, softcap=None):
    """cross_entropy(hidden @ weight.T + bias, ...) below: the output layer and its loss, in the inputs'
    dtype (pass float64 for a float64 reference)."""
    z = hidden @ weight.T
    if bias is not None:
        z = z + bias
    return cross_entropy(z, target, ignore_index, reduction, label_smoothing, z_loss, softcap)


def cross_entropy(z, target, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None):
    """F.cross_entropy(z, target, label_smoothing=label_smoothing) + z_loss * logsumexp(z)^2 per token
    (PaLM's z-loss), with z softcapped as softcap * tanh(z / softcap) when given (Gemma-2). Tokens
    whose target is ignore_index contribute 0; 'mean' divides by the number of the others (0 when
    there are none)."""
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, dim=-1)
    valid = target != ignore_index
    z_t = z.gather(-1, target.masked_fill(~valid, 0).unsqueeze(-1)).squeeze(-1)
    loss = (1 - label_smoothing) * (lse - z_t) + z_loss * lse * lse
    if label_smoothing:  # (a -inf logit: z.mean is -inf, and 0 * inf made the loss NaN without smoothing)
        loss = loss + label_smoothing * (lse - z.mean(-1))
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum().clamp(min=1)


def swiglu(gate, up, activation="silu"):
    """act(gate) * up: SwiGLU with activation 'silu', GeGLU with 'gelu_tanh' (GELU's tanh
    approximation), in the inputs' dtype."""
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def bias_gelu(x, bias):
    """gelu(x + bias) with GELU's tanh approximation (GPT-2's MLP activation after its matmul), in
    the inputs' dtype."""
    return torch.nn.functional.gelu(x + bias, approximate="tanh")


def rotary_embedding(x, cos, sin, positions=None, interleaved=False):
    """RoPE of x (B, H, N, D) with the tables cos/sin (L, R/2): row n of batch b at position
    positions[b, n] (or n); pairs (x[i], x[i + R/2]) (half-split, GPT-NeoX/Llama) or (x[2i], x[2i+1])
    (interleaved, GPT-J) rotated by the angle of i; dims from R = 2 * cos.shape[1] on unchanged.
    In the dtype of x (the tables cast to it)."""
    b, _, n, _ = x.shape
    half = cos.shape[1]
    pos = positions if positions is not None else torch.arange(n, device=x.device).expand(b, n)
    c, s = cos.to(x.dtype)[pos].unsqueeze(1), sin.to(x.dtype)[pos].unsqueeze(1)  # (B, 1, N, R/2)
    if interleaved:
        x1, x2 = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
    else:
        x1, x2 = x[..., :half], x[..., half:2 * half]
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    rot = torch.stack([o1, o2], dim=-1).flatten(-2) if interleaved else torch.cat([o1, o2], dim=-1)
    return torch.cat([rot, x[..., 2 * half:]], dim=-1)


def moe_route(logits, top_k, score="softmax", normalize=True, bias=None):
    """Top-k routing of logits [T, E] in float64 (fp32 or better): (weights [T, k], experts [T, k]).
    The choice uses score + bias (aux-loss-free balancing: bias steers, never weighs)."""
    z = logits.double()
    scores = torch.softmax(z, dim=-1) if score == "softmax" else torch.sigmoid(z)
    choice = scores if bias is None else scores + bias.double()
    experts = torch.topk(choice, top_k, dim=-1, sorted=True).indices
    weights = scores.gather(1, experts)
    if normalize and top_k > 1:  # (+ 1e-20: Megatron's; the router's, where fp32 sigmoid scores underflow)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights, experts


def moe_permute(x, experts, num_experts):
    """Rows of x [T, d] repeated per choice and grouped by expert, stable in (token, slot) order;
    choices with expert -1 (dropped) at the end as zero rows: (out [T*k, d], counts [E])."""
    t, k = experts.shape
    rows = [[] for _ in range(num_experts)]
    for i in range(t):
        for s in range(k):
            e = int(experts[i, s])
            if e >= 0:
                rows[e].append(x[i])
    kept = [r for e in rows for r in e]
    out = torch.zeros(t * k, x.shape[1], dtype=x.dtype)
    if kept:
        out[:len(kept)] = torch.stack(kept)
    return out, torch.tensor([len(r) for r in rows])


def moe_unpermute(y, experts, weights, num_experts):
    """The inverse of moe_permute(., experts) combined with weights [T, k]: out[t] = sum over kept
    choices s of weights[t, s] * (the row choice (t, s) went to), in the weights' dtype."""
    t, k = experts.shape
    order = sorted(((int(experts[i, s]), i, s) for i in range(t) for s in range(k) if experts[i, s] >= 0))
    out = torch.zeros(t, y.shape[1], dtype=weights.dtype)
    for r, (_, i, s) in enumerate(order):
        out[i] = out[i] + weights[i, s] * y[r].to(weights.dtype)
    return out
