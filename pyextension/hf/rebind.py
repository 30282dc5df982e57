"""zerofuse's RoPE and attention inside a Hugging Face attention module, per instance.

A patched attention module runs its architecture's own forward (so every model-specific step stays
the model's: Qwen3's q/k norms, Gemma 2's softcap and sliding windows, KV caches) from a copy of
that function whose module-level names ``apply_rotary_pos_emb`` and ``ALL_ATTENTION_FUNCTIONS`` are
bound to zerofuse's (the attention function of zerofuse/hf/attention.py); the class, its other
instances and the modeling module are untouched.
"""
from __future__ import annotations

import inspect
import sys
import types

import torch

from zerofuse.hf.attention import _INTERFACE, register
from zerofuse.hf.bound import Bound, forward_slot
from zerofuse.nn import functional as zF

_rebound: dict = {}


def make_rope(original):
    """apply_rotary_pos_emb(q, k, cos, sin, ..., unsqueeze_dim=1) on zerofuse's kernel for
    transformers' half-split tables cos/sin (B, N, head_dim) (cat(freqs, freqs), any rope scaling
    already applied); other layouts run ``original``."""

    last: dict = {}  # the tables of the last cos/sin seen: every layer of a forward gets the same ones

    def tables(cos, sin, half):
        # (inference tensors have no version counter: not cached)
        keep = not torch.compiler.is_compiling() and not cos.is_inference() and not sin.is_inference()
        if keep and last.get("cos") is cos and last.get("sin") is sin and last["version"] == (cos._version, sin._version):
            return last["tables"]
        b, n = cos.shape[0], cos.shape[1]
        c, s = cos[..., :half].detach(), sin[..., :half].detach()
        if b == 1:
            out = (c[0].contiguous(), s[0].contiguous(), None)
        else:
            out = (c.reshape(b * n, half).contiguous(), s.reshape(b * n, half).contiguous(),
                   torch.arange(b * n, device=cos.device).view(b, n))
        if keep:  # holding cos/sin: their addresses are not reused meanwhile
            last.update(cos=cos, sin=sin, version=(cos._version, sin._version), tables=out)
        return out

    def apply_rotary_pos_emb(q, k, cos, sin, *args, unsqueeze_dim=1, **kwargs):
        d = q.shape[-1] if q.dim() == 4 else -1
        if (args or kwargs or unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3
                or cos.shape[-1] != d or d % 2 or cos.shape[1] != q.shape[2] or cos.shape[0] not in (1, q.shape[0])):
            return original(q, k, cos, sin, *args, unsqueeze_dim=unsqueeze_dim, **kwargs)
        c, s, pos = tables(cos, sin, d // 2)
        return zF.rotary_embedding(q, k, c, s, pos)

    return apply_rotary_pos_emb


def _copy(fn, globals_, closure):
    new = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__, new.__doc__ = fn.__qualname__, fn.__doc__
    return new


def _rebind(fn, names: dict, module_name: str):
    """A copy of the function ``fn`` whose module-level names in ``names`` resolve to the given
    values: its globals are those of a module ``module_name`` (registered in sys.modules, so
    torch.compile's guards on globals resolve there) holding fn's globals plus ``names``.
    Decorators made with functools.wraps (transformers' deprecate_kwarg, which renames
    past_key_values to cache) are kept: each wrapper is copied around the rebound inner function."""
    inner = getattr(fn, "__wrapped__", None)
    cells = fn.__closure__ or ()
    if inner is not None and any(c.cell_contents is inner for c in cells):
        new_inner = _rebind(inner, names, module_name)
        closure = tuple(types.CellType(new_inner) if c.cell_contents is inner else c for c in cells)
        new = _copy(fn, fn.__globals__, closure)
        new.__wrapped__ = new_inner
        return new
    mod = sys.modules.get(module_name)
    if mod is None:
        mod = types.ModuleType(module_name)
        mod.__dict__.update(fn.__globals__)
        mod.__dict__.update(names, __name__=module_name)
        sys.modules[module_name] = mod
    return _copy(fn, mod.__dict__, fn.__closure__)


def _rebound_forward(cls, want: frozenset):
    """cls.forward with zerofuse's names bound, one copy per (class, replacements) for every
    instance (nothing per instance: patched models are not kept alive by a cache)."""
    key = (cls, want)
    if "attention" in want:
        register()  # (a model unpickled in a new process: its config may name "zerofuse")
    if key not in _rebound:
        inner = inspect.unwrap(cls.forward)
        names = {}
        if "rope" in want:
            names["apply_rotary_pos_emb"] = make_rope(inner.__globals__["apply_rotary_pos_emb"])
        if "attention" in want:
            names["ALL_ATTENTION_FUNCTIONS"] = _INTERFACE
        module_name = f"zerofuse.hf._bound.{cls.__module__}.{cls.__qualname__}.{'_'.join(sorted(want))}"
        _rebound[key] = _rebind(cls.forward, names, module_name)
    return _rebound[key]


def attention_names(module) -> set[str]:
    """Which of zerofuse's replacements the module's forward can take: {'rope', 'attention'}."""
    fn = inspect.unwrap(type(module).forward)
    code = getattr(fn, "__code__", None)
    if code is None:
        return set()
    have = set()
    if "apply_rotary_pos_emb" in code.co_names and callable(fn.__globals__.get("apply_rotary_pos_emb")):
        have.add("rope")
    if "ALL_ATTENTION_FUNCTIONS" in code.co_names:
        have.add("attention")
    return have


def patch_attention(module, rope: bool, attention: bool) -> set[str]:
    """Bind the instance's forward to its class's forward with zerofuse's RoPE and/or attention;
    returns what was applied."""
    asked = ({"rope"} if rope else set()) | ({"attention"} if attention else set())
    done = set(getattr(module, "_zerofuse_attention", ()))
    want = (attention_names(module) & asked) | done
    if want == done:
        return set()
    setattr(module, forward_slot(module), Bound(module, _rebound_forward, type(module), frozenset(want)))
    module._zerofuse_attention = tuple(sorted(want))
    return want - done
