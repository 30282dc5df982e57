"""zerofuse.nn.Attention: multi-head self-attention with grouped-query heads, one fused QKV
projection, zerofuse's fused attention, and the output projection."""
from __future__ import annotations

import torch
from torch import Tensor

from zerofuse.nn.functional import qkv_attention, scaled_dot_product_attention
from zerofuse.nn.rotary import RotaryEmbedding
from zerofuse.ops.signatures import torch_only


class _OutProjection(torch.nn.Linear):
    """nn.Linear (same params, state_dict keys, init) whose forward can add its bias without a
    gradient path to it (bias_grad=False: the caller gives the bias its gradient). Called as a
    module, so hooks on it (ZeRO-3's parameter gathers when it is a unit of its own) still run."""

    def forward(self, x: Tensor, bias_grad: bool = True) -> Tensor:
        bias = self.bias if bias_grad or self.bias is None else self.bias.detach()
        return torch.nn.functional.linear(x, self.weight, bias)


class Attention(torch.nn.Module):
    """x (B, N, embed_dim) -> (B, N, embed_dim). num_kv_heads (default num_heads) must divide
    num_heads; qkv is one Linear of embed_dim -> (num_heads + 2 * num_kv_heads) * head_dim. sdpa:
    the attention function (default zerofuse.nn.functional.scaled_dot_product_attention; any
    function with torch's signature, e.g. torch.nn.functional.scaled_dot_product_attention). rope:
    a zerofuse.nn.RotaryEmbedding applied to q and k after the projection (None: no rotation; one
    module may serve every layer)."""

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, *, bias: bool = False,
                 causal: bool = True, sdpa=None, rope=None, device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for arg, value in (("embed_dim", embed_dim), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if value < 1:
                raise ValueError(f"zerofuse.nn.Attention: expected {arg} >= 1, got {value}")
        if embed_dim % num_heads:
            raise ValueError(f"zerofuse.nn.Attention: expected num_heads ({num_heads}) to divide embed_dim ({embed_dim})")
        if num_heads % num_kv_heads:
            raise ValueError(f"zerofuse.nn.Attention: expected num_kv_heads ({num_kv_heads}) to divide num_heads "
                             f"({num_heads})")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.causal = causal
        # the attention function: zerofuse's by default; torch.nn.functional's to compare against
        self.sdpa = scaled_dot_product_attention if sdpa is None else sdpa
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.qkv = torch.nn.Linear(embed_dim, (num_heads + 2 * num_kv_heads) * self.head_dim, **kw)
        self.proj = _OutProjection(embed_dim, embed_dim, **kw)
        if isinstance(rope, RotaryEmbedding) and rope.head_dim != self.head_dim:  # (rotated across heads before)
            raise ValueError(f"zerofuse.nn.Attention: expected rope for head_dim {self.head_dim} (embed_dim "
                             f"{embed_dim} / num_heads {num_heads}), got a RotaryEmbedding of head_dim {rope.head_dim}")
        self.rope = rope

    def forward(self, x: Tensor, *, proj_bias_grad: bool = True, document_ids: Tensor | None = None) -> Tensor:
        """proj_bias_grad=False: the output projection adds its bias without a gradient path to it;
        the caller gives the bias its gradient (zerofuse.models.gpt.Block: the next norm's
        input_bias, summed in the norm's backward kernel instead of a separate sum here).
        document_ids (B, N) (causal only): packed documents, as scaled_dot_product_attention's; a
        torch sdpa given as ``sdpa`` gets them as a mask."""
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            where = f"{type(self).__module__.rsplit('.', 1)[0]}.{type(self).__name__}"
            raise ValueError(f"{where}: expected x of shape (batch, seq, embed_dim={self.embed_dim}), got "
                             f"{list(x.shape)}")
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x)
        b, n = qkv.shape[:2]  # not x's: a sequence-parallel projection gathers the sequence
        # (under torch.func transforms and jit.trace the heads go through the faces' torch fallbacks)
        rope_packed = isinstance(self.rope, RotaryEmbedding) and not torch.compiler.is_compiling() and not torch_only()
        if self.sdpa is scaled_dot_product_attention and (self.rope is None or rope_packed):
            # straight from the projection: no copy of the heads, the output or the gradients (RoPE
            # rotates the q and k heads of a copy of the packed qkv, ops.rotary.EagerRopeQKV)
            if self.rope is not None:
                qkv = self.rope.rotate_packed(qkv, hq + hkv, d)
            out = qkv_attention(qkv, hq, hkv, is_causal=self.causal, document_ids=document_ids)
            return self._project(out, proj_bias_grad)
        # views of the fused projection in (B, H, N, D) order (strided; the kernel takes strides)
        q = qkv[..., : hq * d].view(b, n, hq, d).transpose(1, 2)
        k = qkv[..., hq * d:(hq + hkv) * d].view(b, n, hkv, d).transpose(1, 2)
        v = qkv[..., (hq + hkv) * d:].view(b, n, hkv, d).transpose(1, 2)
        if self.rope is not None:  # positions 0..n-1: the whole sequence is here (SP gathered it)
            q, k = self.rope(q, k)
        if document_ids is None:
            out = self.sdpa(q, k, v, is_causal=self.causal, enable_gqa=hq != hkv)
        elif self.sdpa is scaled_dot_product_attention:
            out = self.sdpa(q, k, v, is_causal=self.causal, enable_gqa=hq != hkv, document_ids=document_ids)
        else:  # another sdpa (torch's): the documents as its mask (causal included), checked as the kernel's
            from zerofuse.nn.sdpa import _documents  # (a mis-shaped one: a bare broadcasting error before)
            from zerofuse.ops.attention import document_mask

            docs = _documents(q, k, self.causal, document_ids, "zerofuse.nn.Attention")
            out = self.sdpa(q, k, v, attn_mask=document_mask(docs), enable_gqa=hq != hkv)
        return self._project(out.transpose(1, 2).reshape(b, n, hq * d), proj_bias_grad)

    def _project(self, out: Tensor, bias_grad: bool) -> Tensor:
        return self.proj(out) if bias_grad else self.proj(out, bias_grad=False)
