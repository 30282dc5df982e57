"""What FusedAdam, FusedAdamW, FusedLAMB and FusedLARS share: collecting a group's params and
states, fp32 master weights, per-param step counters, and the mixed-precision inputs of a step
(loss-scale unscaling, global grad-norm clipping, the inf/NaN skip flag) as device tensors, so a
CUDA step never waits on the host.

[Note: skipped steps] A step with found_inf != 0 changes nothing: the kernels read the flag and
write nothing, and the ops advance step counters by (1 - found_inf). On CPU the flag is read on
the host and the step returns early. torch.amp.GradScaler works unchanged: like torch's fused
optimizers these set _step_supports_amp_scaling, and GradScaler hands over its scale and inf flag
as the attributes grad_scale / found_inf before calling step().
"""
from __future__ import annotations

import torch

from zerofuse.ops import l2norm

LOW_PRECISION = (torch.bfloat16, torch.float16)


class FusedOptimizerMixin:
    """Mixed into torch.optim.Optimizer subclasses; the subclass defines _STATE_KEYS (fp32 states,
    shaped like the param) and _update(group, params, grads, states, masters, steps, mult, found)."""

    _step_supports_amp_scaling = True
    _STATE_KEYS: tuple[str, ...] = ()
    _USES_STEP = True

    def _name(self) -> str:
        return f"zerofuse.optim.{type(self).__name__}"

    def load_state_dict(self, state_dict):
        """Also takes torch.optim's (and Apex's) state dicts: missing group options get defaults."""
        self._checked = set()
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def _state(self, p: torch.Tensor, master_weights: bool) -> dict:
        state = self.state[p]
        checked = self.__dict__.setdefault("_checked", set())
        if id(p) in checked:  # states made or converted here already (per-step cost: ~1 us a param)
            return state
        checked.add(id(p))
        if not state:
            if self._USES_STEP:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if p.is_cuda else "cpu")
            for key in self._STATE_KEYS:
                state[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        else:
            # states loaded from torch.optim follow the param's dtype and keep 'step' on the cpu:
            # the kernels want fp32 states and, on CUDA, the step on the device
            for key in self._STATE_KEYS:
                if state[key].dtype != torch.float32 or not state[key].is_contiguous():
                    state[key] = state[key].float().contiguous()
            if self._USES_STEP:
                step = state["step"]
                want = p.device if p.is_cuda else torch.device("cpu")
                if not torch.is_tensor(step) or step.device != want or step.dtype != torch.float32:
                    state["step"] = torch.as_tensor(step, dtype=torch.float32).to(want).reshape(())
        if master_weights and p.dtype in LOW_PRECISION and "master" not in state:
            state["master"] = p.detach().float()
        return state

    def _collect(self, group) -> list[tuple[torch.Tensor, dict]]:
        items = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{self._name()}: sparse gradients are not supported")
            if p.is_complex() or p.grad.is_complex():
                raise RuntimeError(f"{self._name()}: complex parameters are not supported")
            items.append((p, self._state(p, group.get("master_weights", False))))
        return items

    def _amp_inputs(self, items_all, grad_scale, found_inf, max_grad_norm):
        """(grad multiplier or None, skip flag or None, global grad norm or None) as 1-element
        tensors on the params' device; see [Note: skipped steps]."""
        if not items_all:
            return None, found_inf, None
        device = items_all[0][0].device
        mult = None
        if grad_scale is not None:
            scale = torch.as_tensor(grad_scale, dtype=torch.float32, device=device).reshape(1)
            mult = scale.reciprocal()
        if found_inf is not None:
            found_inf = torch.as_tensor(found_inf, device=device).float().reshape(1)
        norm = None
        if max_grad_norm:
            grads = [p.grad if p.grad.is_contiguous() else p.grad.contiguous() for p, _ in items_all]
            norm, _ = l2norm(grads)
            norm = norm.reshape(1)
            if mult is not None:
                norm = norm * mult
            # a non-finite norm means an inf/NaN gradient: the step is skipped
            bad = (~torch.isfinite(norm)).float()
            found_inf = bad if found_inf is None else torch.maximum(found_inf, bad)
            clip = max_grad_norm / torch.clamp(norm, min=max_grad_norm)
            mult = clip if mult is None else mult * clip
        return mult, found_inf, norm

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale=None, found_inf=None):
        """One step of every param group. grad_scale: the loss scale the grads carry (divided out
        in the kernels); found_inf: nonzero skips the step. Both may also come from
        torch.amp.GradScaler (attributes of the same names)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        groups = [(g, self._collect(g)) for g in self.param_groups]
        items_all = [it for _, items in groups for it in items]
        devices = {p.device for p, _ in items_all}
        if len(devices) > 1:
            raise RuntimeError(f"{self._name()}: expected every param with a grad on one device, got {sorted(map(str, devices))}")
        mult, found, norm = self._amp_inputs(items_all, grad_scale, found_inf, self._max_grad_norm())
        self.last_grad_norm = norm
        on_cpu = not items_all or items_all[0][0].device.type == "cpu"
        if on_cpu and found is not None and bool(found.ne(0).any()):
            return loss  # [Note: skipped steps]
        for group, items in groups:
            if not items:
                continue
            # params with and without fp32 masters go to separate calls
            for with_master in (False, True):
                sel = [(p, s) for p, s in items if ("master" in s) == with_master]
                if not sel:
                    continue
                self._update(
                    group,
                    [p for p, _ in sel],
                    [p.grad if p.grad.is_contiguous() else p.grad.contiguous() for p, _ in sel],
                    [[s[k] for _, s in sel] for k in self._STATE_KEYS],
                    [s["master"] for _, s in sel] if with_master else [],
                    [s["step"] for _, s in sel] if self._USES_STEP else [],
                    mult,
                    found,
                )
        return loss

    def _max_grad_norm(self):
        return self.defaults.get("max_grad_norm")


def check_unsupported(name: str, **flags) -> None:
    for arg, value in flags.items():
        if value:
            raise ValueError(f"zerofuse.optim.{name}: {arg}=True is not supported (use torch.optim.{name[5:]})")
