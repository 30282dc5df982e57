"""What FusedAdam, FusedAdamW, FusedLAMB and FusedLARS share: collecting a group's params and
states, fp32 master weights, per-param step counters, and the mixed-precision inputs of a step
(loss-scale unscaling, global grad-norm clipping, the inf/NaN skip flag) as device tensors, so a
CUDA step never waits on the host.

[Note: skipped steps] A step with found_inf != 0 changes nothing: the kernels read the flag and
write nothing, and the ops advance step counters by (1 - found_inf). With the C++ CPU kernels the flag
is read on the host and the step returns early. torch.amp.GradScaler works unchanged: like torch's fused
optimizers these set _step_supports_amp_scaling, and GradScaler hands over its scale and inf flag
as the attributes grad_scale / found_inf before calling step().
"""
from __future__ import annotations

import numbers
import operator
import warnings

import torch

from zerofuse.ops.l2norm import clip_inputs
from zerofuse.ops._optim import Prepared, StepPlans, use_triton

LOW_PRECISION = (torch.bfloat16, torch.float16)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_CONTIGUOUS = torch.Tensor.is_contiguous

# [Note: step plans] (one cache, zerofuse.ops._optim.StepPlans, serves these optimizers and
# zerofuse.zero.Optimizer) A step's host work over every param (finding grads and states, checking them,
# building the kernels' tables) cost ~1 ms for 91 tensors on an H100's host, longer than the
# kernels of a 10M-param step. So step() keeps, per param group, the params with a grad and their
# states (lists per state key) and the ops' launch tables (zerofuse.ops._optim.Prepared), and only
# re-reads what can change between steps: the grads (their addresses are compared by the ops, which
# also compare the params' addresses: `p.data = ...`). The plan is rebuilt when the group, the
# optimizer's state (load_state_dict), the params, which of them have a grad, master_weights, or
# any state tensor (compared by identity, every step) changed, or when `opt.state` gained, lost or
# replaced a param's state dict (`opt.state[p] = {...}`: the dicts are compared by identity, in
# order, every step). A rebuilt plan re-checks its params' states (dtype, device, layout).


def refresh_master(master: torch.Tensor, p: torch.Tensor) -> None:
    """master <- p where p is not master's rounding (no host sync)."""
    p = p.detach()
    torch.where(master.to(p.dtype) == p, master, p.float(), out=master)


class _Part:
    """Params of one group with (or without) fp32 masters, their state dicts, the state tensors
    per key, and the ops' Prepared tables."""

    __slots__ = ("idx", "params", "states", "lists", "prepared")

    def __init__(self, idx, params, states, keys):
        self.idx, self.params, self.states = idx, params, states
        self.lists = {k: [s[k] for s in states] for k in keys}
        self.prepared = Prepared()

    def refresh_masters(self, versions: dict) -> None:
        """A param written since its last step (`p.data = ...`, an in-place copy under no_grad or
        through detach(): a load, an EMA swap, a re-initialised layer): the master takes the elements
        it does not round to (the step wrote round(old master - update) over the write), keeping its
        fp32 bits where the param still holds their rounding. ``versions``: the optimizer's
        id(param) -> (address, version) after the param's last step, kept across plans (kept in the
        part, a plan rebuilt because another param's grad was None lost them: the write was undone).
        An in-place op on ``p.data`` moves no version counter: Optimizer.params_written() then."""
        for p, m in zip(self.params, self.lists["master"]):
            was = versions.get(id(p))
            if was is not None and was != (p.data_ptr(), p._version):
                refresh_master(m, p)

    def stepped(self, versions: dict) -> None:
        for p in self.params:
            versions[id(p)] = (p.data_ptr(), p._version)

    def unchanged(self) -> bool:
        states = self.states
        try:  # C-level maps: this runs every step over every param
            return all(all(map(operator.is_, map(operator.itemgetter(k), states), lst)) for k, lst in self.lists.items())
        except KeyError:  # a state key deleted
            return False


class _GroupPlan:
    """A group's parts; it holds the group and the state dict it was built for, so the ids in its
    StepPlans key cannot be reused while it is kept."""

    __slots__ = ("group", "state", "devices", "parts")

    def __init__(self, group, state, devices):
        self.group, self.state, self.devices, self.parts = group, state, devices, []


class FusedOptimizerMixin:
    """Mixed into torch.optim.Optimizer subclasses; the subclass defines _STATE_KEYS (fp32 states,
    shaped like the param) and _update(group, params, grads, states, masters, steps, mult, found,
    prepared), prepared being the ops' launch tables kept for those lists (see [Note: step plans])."""

    _step_supports_amp_scaling = True
    _STATE_KEYS: tuple[str, ...] = ()
    _USES_STEP = True

    def _name(self) -> str:
        return f"zerofuse.optim.{type(self).__name__}"

    @torch.no_grad()
    def params_written(self) -> None:
        """After writing params where no version counter sees it (an in-place op on ``p.data``:
        ``p.data.copy_(ema)``, ``p.data.normal_()``): with ``master_weights=True`` each fp32 master
        takes the elements of its param it does not round to, as a write through ``p.copy_`` under
        no_grad or ``p.detach()`` is taken at the next step by itself (without this call, the next
        step wrote round(old master - update) over the write)."""
        for p, state in self.state.items():
            if isinstance(state, dict) and isinstance(state.get("master"), torch.Tensor):
                refresh_master(state["master"], p)

    def add_param_group(self, param_group):
        """torch's, refusing a param listed twice in the group (torch warns and updates it twice)."""
        with warnings.catch_warnings():  # torch's warning about it: the error below says more
            warnings.filterwarnings("ignore", message="optimizer contains a parameter group with duplicate")
            super().add_param_group(param_group)
        seen: dict[int, int] = {}
        for i, p in enumerate(self.param_groups[-1]["params"]):
            j = seen.setdefault(id(p), i)
            if j != i:
                self.param_groups.pop()
                raise ValueError(f"{self._name()}: expected each param once in a param group, got params[{i}] of "
                                 f"param_groups[{len(self.param_groups)}] the same tensor as params[{j}]")

    def load_state_dict(self, state_dict):
        """Also takes torch.optim's and Apex's state dicts (_from_apex): missing group options get defaults.
        States saved in fp32 (masters, moments of bf16/fp16 params) load in fp32: torch's own
        load_state_dict casts every floating state to its param's dtype (a bf16 run then resumed
        from its own state_dict with rounded moments, and with masters the kernel refused)."""
        self._checked = set()
        state_dict = self._from_apex(state_dict)
        saved = state_dict.get("state", {})
        ids = [i for g in state_dict.get("param_groups", []) for i in g["params"]]
        super().load_state_dict(state_dict)
        if (plans := self.__dict__.get("_plans")) is not None:  # (they held the old states until the next step)
            plans.clear()
        self._state_seen = None
        for i, p in zip(ids, (p for g in self.param_groups for p in g["params"])):
            for key, value in saved.get(i, {}).items():
                if (key != "step" and torch.is_tensor(value) and value.dtype == torch.float32
                        and p.dtype in LOW_PRECISION):
                    self.state[p][key] = value.to(p.device, copy=True)
            master = self.state[p].get("master") if p in self.state else None
            if torch.is_tensor(master) and master.dtype != torch.float32:
                # a master that went through torch.optim's load (cast to the param's dtype, and not
                # stepped there): made again from the param
                del self.state[p]["master"]
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        # the loaded masters stand for the params as they are now: a write after this (weights
        # other than the checkpoint's) reaches its master at the next step (a fresh optimizer had
        # no versions to compare: the write was undone; a review, 2026-12-06)
        self._master_versions = {id(p): (p.data_ptr(), p._version) for g in self.param_groups for p in g["params"]}

    def _from_apex(self, state_dict):
        """Apex's format: one step count per param group (group['step']), none per param (torch's
        Adam refused it with a KeyError; a review's reproduction, 2026-12-06): each param with state
        takes its group's count (its bias correction continues, not restarted at step 1). Apex's
        options without an equivalent here are refused: grad_averaging=False, and bias_correction=
        False where this optimizer always corrects (Adam/AdamW). Apex's adam_w_mode is not saved:
        load into FusedAdamW what Apex ran with adam_w_mode=True (its default)."""
        groups = state_dict.get("param_groups", [])
        if not any("step" in g for g in groups):
            return state_dict
        who = f"{self._name()}.load_state_dict"
        corrects = "bias_correction" not in self.defaults
        state = {k: dict(v) for k, v in state_dict.get("state", {}).items()}
        out = []
        for gi, g in enumerate(groups):
            g = dict(g)
            step = g.pop("step", None)
            if g.pop("grad_averaging", True) is not True:
                raise ValueError(f"{who}: param_groups[{gi}] of an Apex state dict has grad_averaging=False; "
                                 f"expected True ({self._name()} averages the gradient into the first moment)")
            if corrects and g.pop("bias_correction", True) is not True:
                raise ValueError(f"{who}: param_groups[{gi}] of an Apex state dict has bias_correction=False; "
                                 f"expected True ({self._name()} always corrects the moments' bias)")
            for i in g.get("params", []):
                if i in state and "step" not in state[i] and step is not None:
                    state[i]["step"] = torch.tensor(float(step))
            out.append(g)
        return {**state_dict, "state": state, "param_groups": out}

    def _state(self, p: torch.Tensor, master_weights: bool) -> dict:
        state = self.state[p]
        checked = self.__dict__.setdefault("_checked", set())
        if id(p) in checked:  # states made or converted here already (per-step cost: ~1 us a param)
            return state
        checked.add(id(p))
        for key in self._STATE_KEYS:  # (an SGD state saved by older torch holds momentum_buffer None:
            if key in state and state[key] is None:  # torch's SGD starts it anew, as here; it raised)
                state[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
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

    def _collect(self, gi: int, group) -> list[tuple[int, torch.Tensor, dict]]:
        items = []
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{self._name()}: sparse gradients are not supported")
            if p.is_complex() or p.grad.is_complex():
                raise RuntimeError(f"{self._name()}: complex parameters are not supported")
            # named here, as the user knows them (the ops name their own list positions)
            where = f"param_groups[{gi}]['params'][{i}]"
            if p.dtype not in _KERNEL_DTYPES:
                raise RuntimeError(f"{self._name()}: expected {where} in float32, bfloat16 or float16, got {p.dtype} "
                                   f"(torch.optim's optimizers take other dtypes)")
            if not p.is_contiguous():
                raise RuntimeError(f"{self._name()}: expected {where} to be contiguous (the fused kernels update "
                                   f"params as flat arrays), got shape {list(p.shape)} with strides {list(p.stride())}")
            items.append((i, p, self._state(p, group.get("master_weights", False))))
        return items

    def _plans_for_state(self) -> StepPlans:
        """The kept plans, dropped when a param's state dict was added, removed or replaced since
        they were made (values of a dict keep their order when one is replaced: one C-level pass)."""
        plans = self.__dict__.get("_plans")
        if plans is None:
            plans = self._plans = StepPlans()
        seen = self.__dict__.get("_state_seen")
        values = self.state.values()
        if seen is None or len(seen) != len(values) or not all(map(operator.is_, values, seen)):
            plans.clear()
            self._checked = set()
        return plans

    def _plan(self, plans: StepPlans, gi: int, group, grads: list) -> _GroupPlan:
        """The group's plan, rebuilt when anything it holds may have changed; see [Note: step plans]."""
        has_grad = tuple(g is not None for g in grads)
        key = (id(group), id(self.state), has_grad, group.get("master_weights", False), tuple(map(id, group["params"])),
               tuple(p.dtype for p in group["params"]))  # (model.bfloat16() after a step: masters then made)
        return plans.get(gi, key, lambda: self._build_plan(gi, group),
                         valid=lambda plan: all(part.unchanged() for part in plan.parts))

    def _build_plan(self, gi: int, group) -> _GroupPlan:
        # a state tensor may have been replaced by one the kernels cannot take as it is (a
        # torch.optim-style state: bf16 moments, a step on the cpu): check this group's states again
        self.__dict__.setdefault("_checked", set()).difference_update(map(id, group["params"]))
        items = self._collect(gi, group)
        plan = _GroupPlan(group, self.state, {p.device for _, p, _ in items})
        for with_master in (False, True):
            sel = [(i, s) for i, _, s in items if ("master" in s) == with_master]
            if sel:
                keys = self._STATE_KEYS + (("master",) if with_master else ()) + (("step",) if self._USES_STEP else ())
                plan.parts.append(_Part([i for i, _ in sel], [group["params"][i] for i, _ in sel],
                                        [s for _, s in sel], keys))
        return plan

    def _amp_inputs(self, device, grads, grad_scale, found_inf, max_grad_norm):
        """(grad multiplier or None, skip flag or None, global grad norm or None) as 1-element
        tensors on the params' device; see [Note: skipped steps]."""
        if not grads:  # nothing to step (a found_inf given as a number was returned as one)
            return None, None, None
        scale = None
        if grad_scale is not None:
            _check_amp_arg(self._name(), "grad_scale", grad_scale)
            scale = torch.as_tensor(grad_scale, dtype=torch.float32, device=device).reshape(1)
        if found_inf is not None:
            _check_amp_arg(self._name(), "found_inf", found_inf)
            found_inf = torch.as_tensor(found_inf, device=device).float().reshape(1)
        if max_grad_norm:  # clipping; a non-finite norm (an inf/NaN grad) skips the step
            return clip_inputs(grads, max_grad_norm, scale, found_inf,
                               prepared=self.__dict__.setdefault("_norm_prepared", Prepared()))
        return (scale.reciprocal() if scale is not None else None), found_inf, None

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
        work, all_grads, devices = [], [], set()
        for group in self.param_groups:  # every group's options first: a refusal left earlier groups stepped
            self._check_group(group)
        plans = self._plans_for_state()
        for gi, group in enumerate(self.param_groups):
            grads = [p.grad for p in group["params"]]
            plan = self._plan(plans, gi, group, grads)
            devices |= plan.devices
            for part in plan.parts:
                part_grads = [grads[i] for i in part.idx]
                if not all(map(_CONTIGUOUS, part_grads)):  # the kernels read grads as flat arrays
                    if any(g.layout != torch.strided for g in part_grads):  # (a kept plan checked no layout)
                        raise RuntimeError(f"{self._name()}: sparse gradients are not supported")
                    part_grads = [g if g.is_contiguous() else g.contiguous() for g in part_grads]
                work.append((group, part, part_grads))
                all_grads += part_grads
        self._state_seen = tuple(self.state.values())  # after the plans made any new states
        if len(devices) > 1:
            raise RuntimeError(f"{self._name()}: expected every param with a grad on one device, got {sorted(map(str, devices))}")
        device = next(iter(devices), None)
        mult, found, norm = self._amp_inputs(device, all_grads, grad_scale, found_inf, self._max_grad_norm())
        self.last_grad_norm = norm
        # C++ CPU kernels: the flag is read here and the step returns early; the Triton path (on CPU
        # in the interpreter too) leaves it to the kernels, as on a GPU
        if (device is None or device.type == "cpu") and found is not None and not use_triton(all_grads) \
                and bool(found.ne(0).any()):
            return loss  # [Note: skipped steps]
        versions = self.__dict__.setdefault("_master_versions", {})
        for group, part, part_grads in work:
            if "master" in part.lists:
                part.refresh_masters(versions)
            self._update(group, part.params, part_grads, [part.lists[k] for k in self._STATE_KEYS],
                         part.lists.get("master", []), part.lists.get("step", []), mult, found, part.prepared)
            if "master" in part.lists:
                part.stepped(versions)
        return loss

    def _check_group(self, group) -> None:
        """A group's options the step refuses (before any group is stepped); subclasses add theirs."""

    def _max_grad_norm(self):
        """The clipping threshold: every group's 'max_grad_norm' (the norm is global: they must
        agree), so changing it in param_groups takes effect as the lr does."""
        values = {g.get("max_grad_norm", self.defaults.get("max_grad_norm")) for g in self.param_groups}
        if len(values) > 1:
            raise ValueError(f"{self._name()}: expected one max_grad_norm in every param group (the grad norm is "
                             f"global), got {sorted(values, key=str)}")
        value = values.pop() if values else None
        if value is not None and not value >= 0:
            raise ValueError(f"{self._name()}: expected max_grad_norm >= 0 or None (0: no clipping), got {value}")
        return value or None  # 0: no clipping, as the constructors document


def _check_amp_arg(name: str, arg: str, value) -> None:
    """grad_scale / found_inf: one number. A grad_scale held on the host (a Python number, a cpu
    tensor) must also be finite and > 0 (1 / 0 would turn every param into inf/NaN); one on a GPU
    is not read here, since that would wait for the device."""
    if torch.is_tensor(value):
        if value.numel() != 1:
            raise ValueError(f"{name}.step: expected {arg} to hold one number, got a tensor of shape "
                             f"{list(value.shape)}")
        if arg == "grad_scale" and value.device.type == "cpu":
            value = value.item()
    elif not isinstance(value, (int, float)):
        raise TypeError(f"{name}.step: expected {arg} to be a number or a 1-element tensor, got {type(value).__name__}")
    if arg == "grad_scale" and not torch.is_tensor(value) and not (0 < value < float("inf")):
        raise ValueError(f"{name}.step: expected grad_scale to be finite and > 0, got {value}")


def check_real(name: str, arg: str, value, none: bool = False) -> None:
    """value a real number (or None where ``none``): a string or None compared with 0 raised Python's
    bare "'>=' not supported" naming no argument; a bool was taken as 0 or 1 (a review's
    reproduction, 2026-12-07)."""
    if (none and value is None) or isinstance(value, torch.Tensor):  # (a tensor: as zero.Optimizer's options,
        return  # checked by value where it is used)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected {arg} to be a number{' or None' if none else ''}, got {value!r}")


def check_betas(name: str, betas) -> None:
    """A pair (beta1, beta2), each in [0, 1) (torch.optim indexes them unchecked: IndexError)."""
    try:
        ok = len(betas) == 2 and all(0 <= b < 1 for b in betas)
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"zerofuse.optim.{name}: expected betas to be a pair (beta1, beta2) in [0, 1), got {betas!r}")


def check_unsupported(name: str, **flags) -> None:
    for arg, value in flags.items():
        if value:
            raise ValueError(f"zerofuse.optim.{name}: {arg}=True is not supported (use torch.optim.{name[5:]})")
