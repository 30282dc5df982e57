"""ZeRO-3's parameter hooks (a mixin of ZeroEngine, zerofuse/zero/engine.py; [Note: ZeRO hooks]
there): the root unit gathered around the model's forward, each wrap unit gathered by its forward
pre-hook with the next ``prefetch`` units of the recorded order, freed after its forward, gathered
again before its backward by hooks on its outputs' grads."""
from __future__ import annotations

import functools

import torch

from zerofuse._compile import opaque_to_compile
from zerofuse.zero.buckets import FREE, Bucket
from zerofuse.zero.grads import close_dead_backward, output_tensors


def _pair(u: Bucket):
    """A unit and its expert companion (a wrapped module's expert-parallel params, in a unit over
    the expert-DP group: ZeroEngine._stage3_unit), gathered and freed together."""
    return (u,) if u.companion is None else (u, u.companion)


class Stage3Hooks:
    def _install_stage3_hooks(self, model) -> None:
        # model.state_dict() / load_state_dict() where the params are freed shards (NaN placeholders,
        # zero/buckets.py) raise: a state dict of NaNs, writes lost; inside full_params they are the
        # model's (a load written back on exit); keep_vars=True (the Parameters themselves, as
        # zerofuse.checkpoint lists them) stays allowed. On the model and on every module holding a
        # param of ours: torch runs the hooks of the module called and its descendants only (a block's
        # own state_dict() gave NaN placeholders outside full_params, and inside it views that the
        # block's end left without storage, a crash when read; a review's reproduction, 2026-12-07)
        for m in model.modules():
            if m is model or any(id(p) in self.param_index for p in m.parameters(recurse=False)):
                self._hooks.append(m.register_state_dict_pre_hook(self._check_state_dict))
                # (a function, not the bound method: torch marks its post hooks with an attribute)
                self._hooks.append(m.register_state_dict_post_hook(functools.partial(Stage3Hooks._own_state_dict,
                                                                                     self)))
                self._hooks.append(m.register_load_state_dict_pre_hook(self._refuse_load_state_dict))
        self._hooks.append(model.register_forward_pre_hook(self._root_pre_forward))
        self._hooks.append(model.register_forward_hook(self._root_post_forward))
        for m in self._wrap_mods:
            u = self.wrap_units[id(m)]
            self._hooks.append(m.register_forward_pre_hook(self._make_pre_forward(u)))
            self._hooks.append(m.register_forward_hook(self._make_post_forward(u)))

    # The forward hooks are opaque to torch.compile: traced, their p.data swaps (gather, free) bumped
    # the params' version counters inside the compiled region after AOT autograd saved them, and the
    # first backward of torch.compile(model) failed ("modified by an inplace operation"; a review's
    # reproduction, 2026-12-06). Each unit's forward compiles on its own, as zerofuse-train's.
    @opaque_to_compile
    def _root_pre_forward(self, _mod, _args) -> None:
        close_dead_backward(self)
        if self.root is not None:
            for x in _pair(self.root):
                x.finish_param_sync(self.comm)
        if not self._in_backward:
            self._fwd_order = []
            self._prefetch(self._last_order[: self.prefetch])

    @opaque_to_compile
    def _root_post_forward(self, _mod, _args, out) -> None:
        if self._fwd_order:
            self._last_order = self._fwd_order
        if not torch.is_grad_enabled() and not self._in_backward:
            if not self._in_full_params:
                for u in self.units:
                    u.free()
        elif self.root is not None and not self._in_backward:
            # the root unit stays gathered from this forward to the end of the first backward; a
            # second backward through a retained graph finds it freed: gathered again by these hooks
            # (it failed in the head's backward: "setStorage ... out of bounds for storage of size 0")
            for t in output_tensors(out):
                if t.requires_grad:
                    t.register_hook(self._make_pre_backward(self.root))

    def _prefetch(self, units) -> None:
        for u in units:
            for x in _pair(u):
                x.start_param_sync(self.comm)

    def _next(self, u: Bucket, order: list[Bucket]) -> list[Bucket]:
        for i, v in enumerate(order):
            if v is u:
                return order[i + 1:i + 1 + self.prefetch]
        return []

    def _make_pre_forward(self, u: Bucket):
        @opaque_to_compile
        def hook(_mod, _args):
            for x in _pair(u):
                x.finish_param_sync(self.comm)
            if not self._in_backward:
                self._fwd_order.append(u)
                self._prefetch(self._next(u, self._last_order))

        return hook

    def _make_post_forward(self, u: Bucket):
        @opaque_to_compile
        def hook(_mod, _args, out):
            if self._in_backward:  # a re-run forward (activation checkpointing): backward needs the params
                return
            tensors = list(output_tensors(out)) if torch.is_grad_enabled() else []
            # an output it cannot look into (no tensor found in it): its backward would find the unit
            # freed with no hook to gather it, so it stays gathered to the end of backward
            opaque = torch.is_grad_enabled() and out is not None and not tensors
            if not self._in_full_params and not opaque and ((self.reshard_after_forward and not self.hold_params)
                                                            or not torch.is_grad_enabled()):
                for x in _pair(u):
                    x.free()
            for t in tensors:
                if t.requires_grad:
                    t.register_hook(self._make_pre_backward(u))

        return hook

    def _make_pre_backward(self, u: Bucket):
        def hook(_grad):
            if torch.is_grad_enabled() and not self.hold_params and not self._in_full_params:  # create_graph=True
                raise RuntimeError(
                    "zerofuse.zero: a backward with create_graph=True (a gradient penalty, a double backward) "
                    "through a ZeRO-3 model: each unit's params are freed after its backward, and the "
                    "second-order graph reads them later without a hook to gather them (it crashed in "
                    "torch's setStorage); use ZeRO stage 1 or 2 for it")
            self._in_backward = True
            if not self._final_queued:
                self._final_queued = True
                self.backward_began()
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            # a unit freed already in this backward is gathered again: a re-entrant checkpoint inside
            # a module called twice completed the unit's grads in its first recompute's backward, and
            # the second recompute read the freed params, NaN (a review's reproduction, 2026-12-07)
            waiting = [x for x in _pair(u) if x.ready < len(x.params) or x.state == FREE]
            for x in waiting:
                x.finish_param_sync(self.comm)
            if waiting:
                self._prefetch(self._next(u, self._last_order[::-1]))

        return hook

    def _check_state_dict(self, module, prefix, keep_vars) -> None:
        if not keep_vars and any(u.state == FREE for u in self.units):
            raise RuntimeError("zerofuse.zero: model.state_dict() at stage 3 outside zerofuse.zero.full_params(model): "
                               "the params are freed shards there (NaN placeholders); call it inside "
                               "full_params, or save with zerofuse.checkpoint.save")

    def _own_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        """The state dict's tensors are the gathered units' buffers' views, which the end of
        full_params (or the next backward) frees: copies, as torch's full state dicts (they were
        left with no storage: torch.save wrote no data, reading them crashed). keep_vars=True's
        Parameters stay themselves."""
        live = {u.full.untyped_storage().data_ptr() for u in self.units if u.state != FREE}
        for k in [prefix + n for n in module._parameters]:  # (its own params': each holder has this hook)
            t = state_dict.get(k)
            if (isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)
                    and t.untyped_storage().data_ptr() in live):
                state_dict[k] = t.clone()

    def _refresh_gathered(self) -> None:
        """After a step wrote the shards: units still gathered (a forward with grad that no
        backward freed, full_params) gathered again, their params keeping their storage: their
        full values were the last step's (the next forward used them, and full_params wrote them
        back over the update)."""
        stale = [u for u in self.units if u.state != FREE]  # (expert companions are units too)
        for u in stale:
            u.free()
            u.start_param_sync(self.comm)
        for u in stale:
            u.finish_param_sync(self.comm)

    def _refuse_load_state_dict(self, *args) -> None:
        if any(u.state == FREE for u in self.units):
            raise RuntimeError("zerofuse.zero: model.load_state_dict() at stage 3 outside zerofuse.zero.full_params"
                               "(model): the params are freed shards there; call it inside full_params (written "
                               "back to the shards on exit), or load with zerofuse.checkpoint.load")
        self._loaded_in_full_params = True  # its exit sets every master from the params, as a load at stages 0-2

