"""ZeRO over one rank without hooks (the engine's mixin).

[Note: a world of one] Over one rank (stages 0-2, no TP/PP/expert groups, no offload) hooks have
nothing to overlap: none are registered (``hookless``). ``take_grads`` moves the grads autograd left
in .grad into the units at the next sync point (step, grad norm, full_grads, the end of a no_sync()
window: accumulation stays in the reduce dtype), with the hooks' copies and adds: the same numbers.
Where autograd's .grad would sum in another dtype (bf16/fp16 params, fp32 reduce), a forward hook
on the model puts a grad hook on its outputs that queues ``take_grads`` for the end of each backward
through them, so several backwards before a sync point (no no_sync(), several in one window,
several losses of one forward with retain_graph) still add in the reduce dtype, as the hooked
engine's. A backward that does not pass through the model's outputs (a submodule called directly)
is not seen: it is taken at the next sync point. The hook is torch.compiler.disable'd: a compiled
model breaks its graph there (torch.compile(model, fullgraph=True) refuses it: call
``backwards_end_at_sync_points`` first where it holds). zerofuse-train, whose loop ends every
backward at a sync point, removes the hook (``backwards_end_at_sync_points``): its step runs no hook.
Inside ``full_grads`` (grads handed out as .grad) nothing is taken. Memory: a unit that keeps its
buffer between steps (stage 0, stage 1, stage 2 over one rank: fixed addresses for the kernel tables
and a captured step) holds it while autograd fills .grad, so backward holds the grads twice (a
review measured a 4-layer GPT's three steps at 61.9 MiB against plain torch AdamW's 51.8, 2026-12-06).
parallelize(gradient_as_bucket_view=True), as DDP's, holds them once: every unit keeps its buffer,
zeros, as stage 1 does (``Bucket.hold_grads_as_views``), each param's .grad is its region of it,
always (zero_grad zeroes the buffers), and autograd's AccumulateGrad adds each backward's grad into
that view in place. Nothing tells the engine which views autograd wrote: the buffers' version
counters do (bumped by every in-place write through a view), read at each sync point; a .grad
replaced meanwhile (create_graph=True's out-of-place sum, a tensor the caller assigned, None) is
copied into its region (None: zeros), as torch's step would read it, and the view put back.
The cost: autograd adds each grad into its view (a kernel per param and backward) where it took the
tensor it made: zerofuse-train leaves it off (its GPT-2 step, tests/test_step_launches.py: 25 -> 37
launches per layer with it); tests/test_zero_grad_views.py measures the peaks.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

from zerofuse._compile import opaque_to_compile


class WorldOfOne:
    HOOKLESS = True  # [Note: a world of one]; False: hooks over one rank too (tests compare the two)

    def _hookless(self, model, offload) -> bool:
        """[Note: a world of one]: whether this engine registers no grad hooks (nothing to overlap);
        if so, and .grad would sum in another dtype than the units, the model's forward hook."""
        hookless = (self.HOOKLESS and self.stage != 3 and self.world_size == 1 and offload is None
                    and self.tp_comm is None and self.pp_comm is None and self.edp_comm is None
                    and all(u.comm is None for u in self.units))
        self._take_hook, self._take_queued, self.grads_out = None, False, False
        if hookless and self.dtype != self.reduce_dtype:
            self._take_hook = model.register_forward_hook(self._take_after_backward)
            self._hooks.append(self._take_hook)
        return hookless

    def backwards_end_at_sync_points(self) -> None:
        """The caller promises every backward is followed by a sync point before the next one (each
        in its own no_sync() window, the last before the step), as zerofuse-train's loop does: the
        forward hook of [Note: a world of one] has nothing to take and is removed (no hook at all
        over one rank; nothing for torch.compile to step around)."""
        if self._take_hook is not None:
            self._take_hook.remove()
            self._hooks.remove(self._take_hook)
            self._take_hook = None

    def take_grads(self) -> None:
        """[Note: a world of one] The grads in .grad taken into the units as one backward's (per
        unit one zerofuse::flatten_into of the empty regions, adds for the others), .grad dropped."""
        if self.grads_out:  # full_grads handed the units' grads out as .grad: they are not new ones
            return
        if self._views is not None:
            self._take_views()
            return
        pending = False
        for p in self.params:
            if p.grad is not None:
                if self.clip_pending:  # (as _grad_ready's: the clip applies to the grads taken before)
                    self.fold_clip()
                unit, i = self.unit_of[id(p)]
                unit.defer(i)
                pending = True
        if pending:
            self.backward_began()
            self._final_queued = True  # ended here, not by an autograd callback
            self._close_backward()

    def _check_grad_views(self, wanted, name: str) -> None:
        if not isinstance(wanted, bool):
            raise TypeError(f"{name}: expected gradient_as_bucket_view to be a bool, got {wanted!r}")
        if wanted and self.dtype != self.reduce_dtype:
            raise ValueError(f"{name}: gradient_as_bucket_view=True makes each .grad a view of its bucket's buffer, "
                             f"so the grads must be in the params' dtype: expected reduce_dtype equal to "
                             f"{self.dtype} (precision={self.precision!r}), got reduce_dtype={self.reduce_dtype}")

    def _grad_views(self, wanted: bool) -> None:
        """parallelize(gradient_as_bucket_view=...): the units' buffers as the params' .grad."""
        self._views = None
        if not wanted or not self.hookless:  # the hooks move each grad into its bucket as it arrives: held once already
            return
        views = {}
        for u in self.units:
            views.update(zip(map(id, u.params), u.hold_grads_as_views()))
        self._views = [views[id(p)] for p in self.params]
        self.release_grads()

    def release_grads(self) -> None:
        """The params' .grad as after zero_grad: None, or the units' (zeroed) views."""
        if self._views is None:
            for p in self.params:
                p.grad = None
            return
        for p, v in zip(self.params, self._views):
            if p.grad is not v:
                p.grad = v
        for u in self.units:
            u.seen = u.gflat._version

    def is_grad_view(self, p) -> bool:
        return self._views is not None and p.grad is self._views[self.param_index[id(p)]]

    @torch.no_grad()
    def _take_views(self) -> None:
        """take_grads with gradient_as_bucket_view: a .grad that is no longer its view copied in
        (None: zeros), then, where any buffer was written since the last sync point, one backward
        ended (as take_grads')."""
        for p, v in zip(self.params, self._views):
            g = p.grad
            if g is not v:
                v.zero_() if g is None else v.copy_(g)
                p.grad = v
        if any(u.gflat._version != u.seen for u in self.units):
            self.backward_began()
            for u in self.units:
                u.dirty = True
            self._final_queued = True
            self._close_backward()
            for u in self.units:
                u.seen = u.gflat._version

    @opaque_to_compile
    def _take_after_backward(self, module, args, output) -> None:
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return  # nothing to differentiate, or a forward re-run inside a backward
        self._take_queued = False  # (a backward that failed before its callback left it set)
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._queue_take)

    def _queue_take(self, grad):
        if not self._take_queued:  # once per backward, whichever output it passes through
            self._take_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._take_queued_grads)

    def _take_queued_grads(self) -> None:
        self._take_queued = False
        self.take_grads()
