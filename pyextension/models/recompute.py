"""Activation checkpointing of zerofuse.models.GPT's blocks (``model.activation_checkpointing``):

- "none" (or False): every activation autograd saves is kept;
- "full" (or True): only each block's input is kept, the whole block recomputed in backward;
- "selective": the block is recomputed except the matmul outputs (aten mm / addmm / bmm and the
  MoE experts' grouped mm), which are kept: attention, the norms and the elementwise ops are
  recomputed (Megatron's selective recomputation keeps the linear layers' outputs and recomputes
  the attention core). torch's selective activation checkpointing (torch.utils.checkpoint
  ``create_selective_checkpoint_contexts``) applies the policy to the ops the block dispatches.

Recomputation runs the same ops on the same inputs, so grads are bitwise those of "none" on
deterministic kernels. Under expert parallelism the recomputed forward runs its all-to-alls again,
on every rank in the same order.

``model.activation_offload = True`` (with "full" or "selective"; refused with "none" when the model
runs, as offloading every activation is not its intent) also moves what checkpointing keeps to host
memory until backward: the block inputs (through torch.autograd.graph.saved_tensors_hooks around
the checkpoint, as torch's ``save_on_cpu``) and, under "selective", the kept matmul outputs (through
the selective-checkpoint cache, one entry late: a block's last kept output that is the block's
output is not copied, ``_OffloadStorage``). On CUDA each tensor is copied to pinned memory on a side stream
after an event of the current one (forward is not blocked; the device memory is released once the
copy is done) and copied back on the backward stream after the copy's event. On CPU the host copy is
still made (the same path, testable). Tensors under MIN_NUMEL elements, non-float ones and params
(leaves requiring grad, or views of them) stay as they are. The copy holds the value at save time:
a later in-place change of a kept matmul output is not detected as the device-resident cache does.
"""
from __future__ import annotations

import collections
import functools

import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "full", "selective")
MIN_NUMEL = 1024  # smaller saved tensors are not offloaded: the copy would cost more than it frees
_aten = torch.ops.aten
SAVED = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default}
if hasattr(_aten, "_grouped_mm"):
    SAVED.add(_aten._grouped_mm.default)


def mode_of(value) -> str:
    """The mode of a ``model.activation_checkpointing`` value (True/False as "full"/"none")."""
    if value is True:
        return "full"
    if value is False or value is None:
        return "none"
    if value not in MODES:
        raise ValueError(f"zerofuse.models.GPT: expected activation_checkpointing one of {MODES} (or a bool), got "
                         f"{value!r}")
    return value


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED else CheckpointPolicy.PREFER_RECOMPUTE


class _OnHost:
    """A saved tensor's host copy: its device, the CPU tensor, the copy's event (CUDA; else None)."""
    __slots__ = ("device", "host", "event")

    def __init__(self, device, host, event):
        self.device, self.host, self.event = device, host, event


_side_streams: dict = {}


def offloadable(t: torch.Tensor) -> bool:
    """Whether activation offload copies t to the host (params and small or non-float tensors: no)."""
    base = t if t._base is None else t._base
    return (t.layout == torch.strided and t.is_floating_point() and t.numel() >= MIN_NUMEL
            and not isinstance(base, torch.nn.Parameter) and not (base.is_leaf and base.requires_grad))


def _to_host(t: torch.Tensor):
    """Pack: a host copy of t (pinned, on a side stream, on CUDA), or t itself if not offloadable."""
    if not offloadable(t):
        return t
    src, cuda = t.detach(), t.device.type == "cuda"
    host = torch.empty_like(src, device="cpu", pin_memory=cuda)  # t's strides when dense
    if not cuda:
        host.copy_(src)
        return _OnHost(t.device, host, None)
    side = _side_streams.get(t.device)
    if side is None:
        side = _side_streams[t.device] = torch.cuda.Stream(t.device)
    side.wait_event(torch.cuda.current_stream(t.device).record_event())
    with torch.cuda.stream(side):
        host.copy_(src, non_blocking=True)
    src.record_stream(side)  # t's memory is not reused before the copy has read it
    return _OnHost(t.device, host, side.record_event())


def _from_host(packed):
    """Unpack: the tensor back on its device (after the host copy's event on CUDA)."""
    if not isinstance(packed, _OnHost):
        return packed
    if packed.event is None:
        return packed.host
    torch.cuda.current_stream(packed.device).wait_event(packed.event)
    return packed.host.to(packed.device, non_blocking=True)


def _pack_kept(entry):
    if isinstance(getattr(entry, "val", None), torch.Tensor):  # torch's _VersionWrapper of a kept output
        entry.val = _to_host(entry.val)
    return entry


def _unpack_kept(entry):
    if isinstance(getattr(entry, "val", None), _OnHost):
        entry.val = _from_host(entry.val)
        entry.version = entry.val._version  # the device copy is new: its own version counter
    return entry


class _HostCache(dict):
    """One op's slots of torch's selective-checkpoint cache, the kept outputs on the host. Torch
    2.13 numbers an op's calls (cache[idx] = entry, cache.get(idx)); torch releases before that
    per-call index kept a list per op (append in forward, pop(0) in recompute): both are served
    (pyproject takes torch >= 2.8, the GPU image has 2.11; only 2.13's layout runs in CI). The
    latest entry of the region waits (``_OffloadStorage``) until the next one or the region's end."""

    storage = None  # its _OffloadStorage (none: each entry goes to the host as it comes)

    def __setitem__(self, idx, entry):
        if self.storage is None:
            entry = tree_map(_pack_kept, entry)
        super().__setitem__(idx, entry)
        if self.storage is not None and any(isinstance(getattr(e, "val", None), torch.Tensor)
                                            for e in _leaves(entry)):  # (not torch's marks of recomputed ops)
            self.storage.wait(self, idx)

    def get(self, idx, default=None):
        return tree_map(_unpack_kept, super().get(idx, default))

    appended = 0  # entries appended (the list layout's next index)

    def append(self, entry) -> None:
        self[self.appended] = entry
        self.appended += 1

    def pop(self, first=0):
        """The oldest entry left (a list's pop(0)), unpacked."""
        if first != 0 or not self:
            raise IndexError("zerofuse.models.recompute: pop(0) of an empty or list-like cache only")
        return tree_map(_unpack_kept, super().pop(min(self)))


class _OffloadStorage(collections.defaultdict):
    """A selective checkpoint region's cache (op -> _HostCache) whose kept outputs go to the host one
    entry late: each when the next is kept, the last at the region's end (``end(outputs)``), where
    one that is (a view of) the region's output is not copied but marked for recomputation: backward
    does not read it (recomputation stops before it) and its memory lives on as the output, so its
    copy was transfer and host memory spent for nothing (each block's MLP down projection: 3 of
    17 copies of a 3-block GPT, per a review, 2026-12-07)."""

    def __init__(self):
        super().__init__()
        self.pending = None  # (cache, idx) of the entry not yet copied

    def __missing__(self, key):
        cache = self[key] = _HostCache()
        cache.storage = self
        return cache

    def wait(self, cache, idx) -> None:
        """(cache, idx) holds a kept output: the one before it goes to the host."""
        self._pack_pending()
        self.pending = (cache, idx)

    def _pack_pending(self) -> None:
        if self.pending is not None:
            cache, idx = self.pending
            self.pending = None
            entry = dict.__getitem__(cache, idx)
            for e in _leaves(entry):  # (copied late: an in-place change since it was kept would be in the copy)
                if isinstance(getattr(e, "val", None), torch.Tensor) and getattr(e, "version", None) is not None \
                        and e.val._version != e.version:
                    raise RuntimeError("zerofuse.models.recompute: a tensor kept by selective activation checkpointing "
                                       "was changed in place before it went to the host (torch refuses the same "
                                       "without offload: 'Tensor cached during selective activation checkpoint has "
                                       "been mutated'); make the op after the matmul out of place")
            dict.__setitem__(cache, idx, tree_map(_pack_kept, entry))

    def end(self, outputs) -> None:
        # torch 2.13's entry "recompute this op" (its caches numbered per call; a list layout, before,
        # had none: a copy as ever)
        recompute_entry = getattr(torch.utils.checkpoint, "_RECOMPUTE", None)
        if self.pending is not None and recompute_entry is not None and not self.pending[0].appended:
            cache, idx = self.pending
            out = {t.untyped_storage().data_ptr() for t in _tensors(outputs)}
            vals = [getattr(e, "val", None) for e in _leaves(dict.__getitem__(cache, idx))]
            if vals and all(isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in out for v in vals):
                dict.__setitem__(cache, idx, recompute_entry)
                self.pending = None
        self._pack_pending()


def _leaves(tree) -> list:
    return tree_leaves(tree, is_leaf=lambda x: hasattr(x, "val"))


def _tensors(tree) -> list:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _selective_contexts(storage=None):
    """storage: an _OffloadStorage (offload), else torch's own device-resident cache."""
    fwd, rec = create_selective_checkpoint_contexts(_policy)
    if storage is not None:  # both modes share the cache (op -> {call index: entry}): give them one that offloads
        fwd.storage = rec.storage = storage
    return fwd, rec


def run(block, mode: str, *args, offload: bool = False):
    """block(*args) under the mode (no checkpointing without grad); offload: see the module's doc."""
    if not isinstance(offload, bool):  # (1, 0 and 1.0 passed `in (True, False)`; None did not)
        raise ValueError(f"zerofuse.models.GPT: expected activation_offload True or False, got {offload!r}")
    if offload and mode == "none":
        raise ValueError("zerofuse.models.GPT: expected activation_offload with activation_checkpointing 'full' or "
                         "'selective' (it offloads what checkpointing keeps), got activation_offload=True with "
                         "activation_checkpointing 'none'")
    compiled_for = getattr(block, "_zerofuse_checkpointed", None)  # compile_block checkpoints it inside
    if compiled_for is not None and compiled_for != mode and torch.is_grad_enabled():  # (its forward went on
        # checkpointing under 'none', under 'full' an eager checkpoint wrapped its checkpointed forward: both
        # silently; without grad it checkpoints nothing: an evaluation with checkpointing off is one)
        raise ValueError(f"zerofuse.models.GPT: a block compile_block compiled for activation_checkpointing "
                         f"{compiled_for!r} checkpoints inside its compiled forward, expected activation_checkpointing "
                         f"{compiled_for!r}, got {mode!r}: compile the blocks again for the new mode")
    inside = compiled_for == mode
    if inside and offload:  # (its compiled forward's own checkpoint: nothing was offloaded, silently)
        raise ValueError("zerofuse.models.GPT: a block compile_block compiled for activation_checkpointing "
                         f"{mode!r} without offload, expected activation_offload=False, got True: compile the "
                         "blocks with offload=True (the offload's hooks run eagerly around the compiled forward)")
    if mode == "none" or not torch.is_grad_enabled() or inside:
        return block(*args)
    storage = _OffloadStorage() if offload and mode == "selective" else None
    context_fn = {} if mode == "full" else dict(context_fn=functools.partial(_selective_contexts, storage))
    if not offload:
        return checkpoint(block, *args, use_reentrant=False, **context_fn)
    with torch.autograd.graph.saved_tensors_hooks(_to_host, _from_host):  # the inputs checkpoint saves
        out = checkpoint(block, *args, use_reentrant=False, **context_fn)
    if storage is not None:
        storage.end(out)
    return out


def compile_block(block: torch.nn.Module, mode: str, offload: bool = False, **compile_kwargs) -> str:
    """``block.forward`` compiled (torch.compile) for ``run`` under ``mode``; what the mode becomes.

    "selective" without offload: the checkpoint goes inside the compiled forward, where AOTAutograd's
    partitioner applies the policy (the graph's matmul outputs saved, the rest recomputed in the
    compiled backward); ``run`` then calls the block as it is. An eager checkpoint around a compiled
    forward saw inductor's out= matmuls, which the policy must not cache (a cached out= result left the
    replay's buffer unwritten): everything was recomputed, full's memory and FLOPs (small preset,
    8 x 128 tokens, CPU inductor: selective 61.7 MiB as full, inside the compiled forward 102.1 MiB
    against eager selective's 111.9). "full", and offload (its saved-tensor hooks run eagerly), keep the
    eager checkpoint around the compiled forward. The block's hooks (ZeRO's gathers) stay eager.
    A block with an MoE layer under checkpointing is left eager ("eager"): its dispatch breaks the
    graph, so the compiled forward recomputed in backward traced other graphs than the forward's
    (CheckpointError under "full"), and dynamo ran "selective"'s checkpoint eagerly anyway."""
    from zerofuse.moe import MoE  # noqa: PLC0415 - (models.moe imports this module's users)

    if mode != "none" and any(isinstance(m, MoE) for m in block.modules()):
        return "eager"
    if mode == "selective" and not offload:
        forward = block.forward

        def checkpointed(*args):
            if not torch.is_grad_enabled():
                return forward(*args)
            return checkpoint(forward, *args, use_reentrant=False,
                              context_fn=_selective_contexts)

        block.forward = torch.compile(checkpointed, **compile_kwargs)
        block._zerofuse_checkpointed = mode
        return "selective"
    block.forward = torch.compile(block.forward, **compile_kwargs)
    return "full" if mode == "selective" else mode
