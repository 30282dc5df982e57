"""Stage 0/1/2's parameter all-gathers after the step (a mixin of ZeroEngine, zero/engine.py; see
[Note: ZeRO hooks] there): started by the optimizer's step, waited by it (param_gather="step") or
per module by forward pre-hooks (param_gather="module")."""
from __future__ import annotations

import functools

from zerofuse.zero.grads import close_dead_backward


class ParamSync:
    """Needs the engine's stage, overlap, param_gather, buckets, comm, unit_of and _hooks."""

    def start_param_sync(self) -> None:
        """All-gather every unit's updated shard (forward order first); waited per module by the
        forward pre-hooks, or by finish_param_sync."""
        if self.stage == 0:  # every rank stepped the whole buffer
            return
        self.buckets.start_param_sync()
        if not self.overlap or self.param_gather == "step":
            self.finish_param_sync()

    def finish_param_sync(self) -> None:
        self.buckets.finish_param_sync()

    def _install_param_wait_hooks(self, model) -> None:
        self._hooks.append(model.register_forward_pre_hook(functools.partial(close_dead_backward, self)))
        if self.param_gather != "module" or self.stage == 0:  # (whole when the step returns)
            return
        # param_gather="module": a state_dict (torch.save after a step) waits for every gather too, and
        # so does a load (the gathers landed on top of the loaded values: ranks apart, silently)
        self._hooks.append(model.register_state_dict_pre_hook(lambda *_: self.finish_param_sync()))
        self._hooks.append(model.register_load_state_dict_pre_hook(lambda *_: self.finish_param_sync()))
        for m in model.modules():
            units = []
            for p in m.parameters(recurse=False):
                if id(p) in self.unit_of and self.unit_of[id(p)][0] not in units:
                    units.append(self.unit_of[id(p)][0])
            if units:
                self._hooks.append(m.register_forward_pre_hook(self._make_wait_hook(units)))

    def _make_wait_hook(self, units):
        def hook(_mod, _args):
            for u in units:
                u.finish_param_sync(self.comm)

        return hook
