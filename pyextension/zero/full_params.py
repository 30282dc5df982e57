"""``zerofuse.zero.full_params``: every param whole inside a block, what the block wrote kept (a
mixin of ZeroEngine, zerofuse/zero/engine.py), and the refusal of writes the offloaded host steps
running meanwhile would not see."""
from __future__ import annotations

import contextlib

from zerofuse.zero.buckets import FREE


class FullParams:
    @contextlib.contextmanager
    def full_params(self):
        """Every param holds its full value inside the block (stage 3 gathers and frees after;
        stage 1/2 wait for a pending all-gather). Stage 3: what the block wrote into the params it
        gathered (an init, weight surgery, model.load_state_dict) is written back to each rank's
        shard on exit, and the Optimizer's fp32 masters of those units refreshed, as FSDP's
        summon_full_params(writeback=True); each rank keeps its own part of what it wrote. Stages
        0-2 hold the params whole already: what the block wrote into a param with an fp32 master
        (bf16/fp16, offload) refreshes that master on exit (it was written back over the edit at
        the next step)."""
        if self.stage != 3:
            self.finish_param_sync()
            versions = self._versions_if_host_steps()
            self._in_full_params += 1
            try:
                yield
            finally:
                self._in_full_params -= 1
                self._refuse_writes_under_host_steps(versions)
                if versions is None:  # (else nothing was written, and the masters are the host's to step)
                    self.params_loaded(written_only=True)
            return
        was_free = [u for u in self.units if u.state == FREE]
        for u in was_free:
            u.start_param_sync(self.comm)
        for u in self.units:
            u.finish_param_sync(self.comm)
        versions = self._versions_if_host_steps()
        # a forward (an evaluation) or backward inside the block frees no unit: it freed them all,
        # the block's later reads saw NaN placeholders and its exit failed on a freed buffer
        self._in_full_params += 1
        try:
            yield
        finally:
            self._in_full_params -= 1
            self._refuse_writes_under_host_steps(versions)
            # every unit's writes (one gathered before the block too: an edit there was lost); none
            # while the host steps run (the shards may hold their results already)
            written = [u for u in self.units if u.write_back()] if versions is None else []
            for u in was_free:  # units a forward/backward in progress holds stay gathered
                u.free()
            self._masters_of_writes(written, outermost=not self._in_full_params, exiting=True)

    def _masters_of_writes(self, written, outermost: bool, exiting: bool) -> None:
        """Stage 3: the fp32 masters of what the block wrote (``written``: the units written back),
        of the elements it changed: of a load's (model.load_state_dict inside the outermost block,
        from every param, as stages 0-2's load hook), else of an edit's units."""
        if self._loaded_in_full_params and outermost:
            if exiting:
                self._loaded_in_full_params = False
            self.params_loaded(written_only=True)
        elif written:
            self.params_loaded(written, written_only=True)

    def flush_full_params(self) -> None:
        """Inside full_params (collective): what the block wrote so far reaches the shards (stage 3)
        and the fp32 masters of the elements it changed, as the block's exit does, the params
        staying whole (a checkpoint saved inside the block wrote the shards and masters of before
        the edit: a review's reproduction, 2026-12-07). Nothing outside the block, or while the
        offloaded host steps run (the exit refuses their writes)."""
        if not self._in_full_params or self.host_steps_started(pending_too=True):
            return
        if self.stage != 3:
            self.params_loaded(written_only=True)
            return
        self._masters_of_writes([u for u in self.units if u.write_back()], outermost=True, exiting=False)

    def live_optimizer(self):
        """The zero.Optimizer built on this engine, while it lives (None otherwise)."""
        return self.optimizer_ref() if self.optimizer_ref is not None else None

    def fold_clip(self) -> None:
        """A backward begins after clip_grad_norm_ in the same step: the live Optimizer's fold_clip
        (none left: nothing to apply the clip)."""
        opt = self.live_optimizer()
        if opt is None:
            self.clip_pending = False
        else:
            opt.fold_clip()

    def host_steps_started(self, pending_too: bool = False) -> bool:
        """Whether the Optimizer's offloaded host steps of this backward are running already
        (offload_overlap: they start as each unit's grads arrive); pending_too: or a delayed update
        is pending (its masters hold the next params, the shards the current ones: full_params'
        refresh from the shards undid the update, a review's reproduction, 2026-12-06)."""
        opt = self.live_optimizer()
        return opt is not None and opt.host is not None and bool(opt.host.futures or
                                                                 (pending_too and opt.host.pending))

    def apply_pending_update(self) -> None:
        """The Optimizer's pending delayed update applied (before a load writes the params)."""
        opt = self.live_optimizer()
        if opt is not None:
            opt.apply_pending()

    def _versions_if_host_steps(self):
        return [p._version for p in self.params] if self.host_steps_started(pending_too=True) else None

    def _refuse_writes_under_host_steps(self, versions) -> None:
        """A write inside full_params after backward started the host steps: they read the params
        of before it, and the step then put their result over it (the step's update vanished)."""
        if versions is not None and [p._version for p in self.params] != versions:
            raise RuntimeError("zerofuse.zero.full_params: the params were written while the offloaded optimizer "
                               "steps of the last backward were running (offload_overlap) or a delayed update was "
                               "pending (delayed_update): they would not see the write; write before backward or "
                               "after opt.apply_pending(), or build the Optimizer with offload_overlap=False")
