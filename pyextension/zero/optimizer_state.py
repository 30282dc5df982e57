"""zero.Optimizer's torch.optim surfaces: its state dict (this rank's shard of the states in
torch.optim's layout, named by the ZeRO layout it belongs to: zerofuse.checkpoint saves and
reshards across layouts), the lr as device tensors (sync_lr), add_param_group."""
from __future__ import annotations

import torch

from zerofuse.zero.buckets import INT_OF_SIZE
from zerofuse.zero.options import NAME


class OptimizerState:
    """state_dict / load_state_dict / write_params / sync_lr / add_param_group of
    zerofuse.zero.Optimizer (a mixin: it reads the Optimizer's engine, param_groups, state, steps,
    scaler and host steps)."""

    def sync_lr(self, on: bool = True) -> None:
        """Keep each group's lr in a float64 device tensor, written here (a fill, no copy from the
        host) when group["lr"] changed; from the first call on, step() hands the kernels those
        tensors, which they read on the device. A CUDA graph of the step then follows the lr
        schedule: call this before the capture and before every replay (zerofuse.train's
        --cuda-graphs). The values are the floats' exactly. on=False: back to the floats."""
        if not on:
            self._device_lr = None
            return
        if self._device_lr is None or len(self._device_lr) != len(self.param_groups):
            dev = self.scale.device
            self._device_lr = [torch.full((1,), float("nan"), dtype=torch.float64, device=dev)
                               for _ in self.param_groups]
            self._lr_synced = [None] * len(self.param_groups)
        for gi, group in enumerate(self.param_groups):
            lr = group["lr"]
            if torch.is_tensor(lr):  # schedulers update a tensor lr in place: read every call
                if lr.device.type == "cpu":  # a fill from the host value (a copy from pageable memory would sync)
                    self._device_lr[gi].fill_(float(lr))
                else:
                    self._device_lr[gi].copy_(lr.reshape(1))
                self._lr_synced[gi] = None
            elif self._lr_synced[gi] != lr:
                self._device_lr[gi].fill_(float(lr))
                self._lr_synced[gi] = lr

    def add_param_group(self, param_group) -> None:
        if getattr(self, "_built", False):
            raise NotImplementedError(f"{NAME}: add_param_group after construction: the groups' params are laid out "
                                      f"in the shards when the Optimizer is built; pass every group in param_groups=")
        super().add_param_group(param_group)

    def _lr(self, gi: int, group):
        return self._device_lr[gi] if self._device_lr is not None else group["lr"]

    def _layout(self) -> dict:
        eng = self.engine
        return dict(world_size=eng.world_size, rank=eng.rank, stage=eng.stage, kind=self.kind,
                    units=[(u.names, u.padded) for u in eng.units])

    def _indexed(self) -> list[torch.nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict:
        """torch.optim's layout: ``state[i]`` (i counting params over the groups, as torch) holds
        ``step`` (not under LARS, as torch's SGD) and this rank's piece of each state of param i (1-D,
        where it has one), and
        ``param_groups`` the options with param indices; ``zerofuse`` names the layout (world size,
        rank, stage, optimizer, buckets) and holds the fp16 loss scale. Load it back at the same
        layout; zerofuse.checkpoint saves and reshards across world sizes and stages."""
        self.apply_pending(f"{NAME}.Optimizer.state_dict")
        params = self._indexed()
        state = {i: {k: t.clone() for k, t in self.state[p].items()} for i, p in enumerate(params) if p in self.state}
        groups, i = [], 0
        for g in self.param_groups:
            groups.append({k: v for k, v in g.items() if k != "params"} | {"params": list(range(i, i + len(g["params"])))})
            i += len(g["params"])
        return {"state": state, "param_groups": groups,
                "zerofuse": {"layout": self._layout(), "steps": [s.clone() for s in self._steps],
                             "scale": self.scale.clone(), "growth_tracker": self._growth_tracker.clone()}}

    def load_state_dict(self, state_dict: dict) -> None:
        mine = self._layout()
        extra = state_dict.get("zerofuse") if isinstance(state_dict, dict) else None
        theirs = extra.get("layout") if isinstance(extra, dict) else None
        if theirs != mine:
            raise ValueError(f"{NAME}.load_state_dict: the state is for a different layout (world size, rank, stage, "
                             f"optimizer or model): expected {_brief(mine)}, got {_brief(theirs)}; use "
                             "zerofuse.checkpoint to reshard")
        self._check_loadable(state_dict)
        self.apply_pending(f"{NAME}.Optimizer.load_state_dict")
        params = self._indexed()
        with torch.no_grad():
            for i, saved in state_dict["state"].items():
                for k, t in self.state[params[int(i)]].items():
                    if k != "step":
                        t.copy_(saved[k])
            for s, saved in zip(self._steps, extra["steps"]):
                s.copy_(saved)
            if self.host is not None:
                self.host.load_steps()
            self.scale.copy_(extra["scale"])
            self._growth_tracker.copy_(extra["growth_tracker"])
            for g, saved in zip(self.param_groups, state_dict["param_groups"]):
                g.update({k: v for k, v in saved.items() if k != "params"})
            self.write_params()

    def _check_loadable(self, state_dict: dict) -> None:
        """Everything load_state_dict copies matches before anything is copied (torch.optim refuses
        other groups too; a mismatch found midway left the optimizer half loaded)."""
        where = f"{NAME}.load_state_dict"
        groups, extra = state_dict.get("param_groups"), state_dict["zerofuse"]
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            got = len(groups) if isinstance(groups, list) else type(groups).__name__
            raise ValueError(f"{where}: the state has {got} param groups, this optimizer {len(self.param_groups)}")
        for gi, (g, saved) in enumerate(zip(self.param_groups, groups)):
            if len(saved.get("params", ())) != len(g["params"]):
                raise ValueError(f"{where}: param_groups[{gi}] holds {len(saved.get('params', ()))} params in the "
                                 f"state, {len(g['params'])} in this optimizer")
        if len(extra.get("steps", ())) != len(self.param_groups):
            raise ValueError(f"{where}: the state has {len(extra.get('steps', ()))} step counters, this optimizer "
                             f"{len(self.param_groups)} groups")
        params = self._indexed()
        state = state_dict.get("state")
        ours = {i for i, p in enumerate(params) if p in self.state}
        theirs = {int(i) for i in state} if isinstance(state, dict) else None
        if theirs != ours:
            raise ValueError(f"{where}: the state holds states for params {sorted(theirs or ())}, this optimizer "
                             f"for {sorted(ours)} (indexed over the param groups)")
        for i, saved in state.items():
            for k, t in self.state[params[int(i)]].items():
                if k == "step":
                    continue
                got = saved.get(k) if isinstance(saved, dict) else None
                if not isinstance(got, torch.Tensor) or got.shape != t.shape:
                    what = "no such state" if not isinstance(got, torch.Tensor) else f"shape {tuple(got.shape)}"
                    hint = " (a state of another precision: master weights)" if k == "master" else ""
                    raise ValueError(f"{where}: state[{i}][{k!r}]: expected a tensor of shape {tuple(t.shape)}, "
                                     f"got {what}{hint}; zerofuse.checkpoint converts between layouts")
            extra_keys = set(saved) - set(self.state[params[int(i)]]) - {"step"} if isinstance(saved, dict) else set()
            if extra_keys:
                raise ValueError(f"{where}: state[{i}] holds {sorted(extra_keys)} that this optimizer does not keep "
                                 "(a state of another precision or optimizer)")

    @torch.no_grad()
    def read_params(self, units=None, written_only: bool = False) -> None:
        """fp32 masters from the params (after model.load_state_dict wrote them: stages 0-2 call this
        from the model's load hook; without it the next step wrote the old masters back over the
        loaded weights - a review's reproduction, 2026-11-27), of ``units`` only where given;
        ``written_only`` (leaving full_params): only the elements that differ bit for bit from their
        master's rounding, the others keep their fp32 bits (a whole unit's masters were replaced by
        their rounding when one of its params was edited: a clamp of one param each step stalled
        every other param of its bucket, a review's reproduction, 2026-12-06)."""
        for u, st in zip(self.engine.units, self.unit_states):
            if "master" not in st or (units is not None and not any(u is w for w in units)):
                continue
            master = st["master"]
            if not written_only:
                master.copy_(u.shard)
                continue
            rounded = master.to(device=u.shard.device, dtype=u.shard.dtype)
            bits = INT_OF_SIZE[rounded.element_size()]
            changed = rounded.view(bits) != u.shard.view(bits)
            if changed.any():
                new = u.shard.to(device=master.device, dtype=master.dtype)
                master.copy_(torch.where(changed.to(master.device), new, master))

    def write_params(self) -> None:
        """Params from the fp32 masters (after a load), then gathered where they are (stages 1/2;
        stage 3: the units gathered now, as full_params holds them)."""
        eng = self.engine
        for u, st in zip(eng.units, self.unit_states):
            if "master" in st:
                u.shard.copy_(st["master"])
        eng.params_written()


def _brief(layout) -> str:
    if not isinstance(layout, dict):
        return repr(layout)
    return (f"world_size={layout.get('world_size')}, rank={layout.get('rank')}, stage={layout.get('stage')}, "
            f"optimizer={layout.get('kind')}, {len(layout.get('units', []))} units")
