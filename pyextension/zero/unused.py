"""``parallelize(..., find_unused_parameters=True)``: params that will get no grad in a backward are
marked ready when that backward starts, as DDP's reducer does.

[Note: unused params]
Without it a param with no grad on some ranks holds that rank's launch order back to its end of
backward ([Note: launch order], zero/bucket_group.py): correct, unless the model runs a collective
during backward (MoE's all-to-all, tensor parallelism's all-reduce), where the held-back rank
reaches that collective while the other ranks wait, with ``max_inflight`` reductions in flight, for
reductions it launches only later: a hang until the communicator's timeout. With it, a forward hook
on the model walks the autograd graph from every tensor of the forward's output (the params it
reaches are the AccumulateGrad nodes' variables) and the first grad hook of the next synced backward
marks every param not reached as arrived, so each bucket launches as soon as its used params'
grads are in, in the common order, with zeros in the unused params' regions.

Reached: the union over the grad-enabled forwards since the last backward ended (one loss summed
over several forwards counts them all; gradient accumulation walks each micro-batch's forward
afresh). Forwards interleaved with backwards of earlier ones (F1 F2 B1 B2) give B1 the union of
both and B2 none: no param is marked there, and an unused one holds the order back as without the
option. A grad that arrives for a param marked unused (a loss term computed from outside the
forward's outputs, e.g. a module attribute added to the loss afterwards) is an error naming the
param: its bucket may have been reduced without it on this rank. The output's tensors are found
in tuples, lists, dicts, dataclasses and other objects' attributes (zero/grads.py output_tensors);
an output with no tensor that requires grad found in it marks nothing: that forward counts as not
walked. Re-entrant activation checkpointing hides the params inside it from the walk: refused
at the forward. The walk is Python over the graph's nodes, once per forward (0.32 ms for GPT-2
124M on this project's CPU; DDP's costs the same): off by default."""
from __future__ import annotations

import torch

from zerofuse._compile import opaque_to_compile
from zerofuse.zero.grads import output_tensors

NAME = "zerofuse.zero.parallelize(find_unused_parameters=True)"


class FindUnused:
    """The engine's part: ``_install_find_unused(model)`` at build, ``_mark_unused_once()`` and
    ``_check_not_unused(p)`` from each grad hook."""

    find_unused = False

    def _install_find_unused(self, model) -> None:
        self.find_unused = True
        self._reached: set[int] = set()  # ids of the params the forwards since the last backward reached
        self._walked = False  # a grad-enabled forward was walked since then
        self._marked: set[int] = set()  # ids of the params marked arrived, unused, in this backward
        self._marked_done = False  # this backward's first grad marked them
        self._hooks.append(model.register_forward_hook(self._walk_outputs))

    @opaque_to_compile  # (a graph walk is not for dynamo to trace: run as it is on the compiled forward's output)
    def _walk_outputs(self, _module, _args, out) -> None:
        if not torch.is_grad_enabled():
            return
        stack, seen, found = [], set(), False
        for t in output_tensors(out, objects=True):  # (dataclasses and result objects too, as DDP's
            if t.requires_grad:  # _find_tensors: tree_leaves missed an aux loss in a dataclass, refused)
                found = True
                if t.grad_fn is None:
                    self._reached.add(id(t))  # a param returned as it is
                else:
                    stack.append(t.grad_fn)
        if not found:  # an output it cannot look into (or one without a graph): no param marked
            return
        while stack:
            fn = stack.pop()
            if fn in seen:
                continue
            seen.add(fn)
            var = getattr(fn, "variable", None)
            if var is not None:  # AccumulateGrad
                self._reached.add(id(var))
                continue
            if type(fn).__name__ == "CheckpointFunctionBackward":
                raise RuntimeError(f"{NAME}: the forward's output depends on re-entrant activation checkpointing "
                                   "(torch.utils.checkpoint(..., use_reentrant=True)), which hides the params inside "
                                   "it from the graph walk: use use_reentrant=False, or find_unused_parameters=False")
            stack.extend(f for f, _ in fn.next_functions if f is not None)
        self._walked = True

    def _mark_unused_once(self) -> None:
        """At the first grad of a synced backward: every param no walked forward reached is arrived,
        and the units it completes are launched in the common order."""
        if self._marked_done:
            return
        self._marked_done = True
        if self._walked and self.sync_grads:
            self._mark_unused()

    def _mark_unused(self) -> None:
        done = []
        for p in self.params:
            if id(p) in self._reached:
                continue
            unit, i = self.unit_of[id(p)]
            if unit.arrived[i]:
                continue
            unit.arrived[i] = True
            self._marked.add(id(p))
            unit.ready += 1
            if unit.ready == len(unit.params) and unit not in done:
                done.append(unit)
        for unit in done:
            self._unit_complete(unit)

    def _check_not_unused(self, p: torch.Tensor) -> None:
        if self._marked and id(p) in self._marked:
            name = self.names[self.param_index[id(p)]]
            raise RuntimeError(f"{NAME}: param {name!r} got a grad in a backward although the forward's outputs do "
                               "not reach it (its bucket may be reduced without it): a loss term computed outside "
                               "the forward (e.g. from a module attribute) must be returned by the forward, or use "
                               "find_unused_parameters=False")

    def _forget_walk(self) -> None:
        """A backward ended: the next one's forwards are walked afresh."""
        if self.find_unused:
            self._reached = set()
            self._walked = False
            self._marked = set()
            self._marked_done = False
