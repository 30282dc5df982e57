"""zero.Optimizer's state dict: this rank's shard of the states in torch.optim's layout, named by
the ZeRO layout it belongs to (zerofuse.checkpoint saves and reshards across layouts)."""
from __future__ import annotations

import torch

from zerofuse.zero.options import NAME


class OptimizerState:
    """state_dict / load_state_dict / write_params of zerofuse.zero.Optimizer (a mixin: it reads the
    Optimizer's engine, param_groups, state, steps, scaler and host steps)."""

    def _layout(self) -> dict:
        eng = self.engine
        return dict(world_size=eng.world_size, rank=eng.rank, stage=eng.stage, kind=self.kind,
                    units=[(u.names, u.padded) for u in eng.units])

    def _indexed(self) -> list[torch.nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict:
        """torch.optim's layout: ``state[i]`` (i counting params over the groups, as torch) holds
        ``step`` and this rank's piece of each state of param i (1-D, where it has one), and
        ``param_groups`` the options with param indices; ``zerofuse`` names the layout (world size,
        rank, stage, optimizer, buckets) and holds the fp16 loss scale. Load it back at the same
        layout; zerofuse.checkpoint saves and reshards across world sizes and stages."""
        self.apply_pending()
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
        self.apply_pending()
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

    @torch.no_grad()
    def write_params(self) -> None:
        """Params from the fp32 masters (after a load), then gathered (stage 1/2)."""
        eng = self.engine
        for u, st in zip(eng.units, self.unit_states):
            if "master" in st:
                u.shard.copy_(st["master"])
        if eng.stage != 3:
            eng.start_param_sync()
            eng.finish_param_sync()


def _brief(layout) -> str:
    if not isinstance(layout, dict):
        return repr(layout)
    return (f"world_size={layout.get('world_size')}, rank={layout.get('rank')}, stage={layout.get('stage')}, "
            f"optimizer={layout.get('kind')}, {len(layout.get('units', []))} units")
