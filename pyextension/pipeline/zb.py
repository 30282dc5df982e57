"""The zero-bubble split's bookkeeping (zerofuse.pipeline.Pipeline, schedule "zb"): which params
get their grads in the W pass, from which module's outputs, and which in I.

[Note: zero-bubble coverage]
W asks autograd, module by module, for the grads of a module's own params from its outputs' grads
saved by I. That is a param's whole grad only where every use of the param is an op of that
module's own forward whose result reaches the rest of the graph through the module's outputs. Not
so (each silently lost or double-counted grads before 2026-12-06): a param applied by another
module (nn.MultiheadAttention applies out_proj's weight with F.multi_head_attention_forward,
out_proj's forward never runs; a head computing F.linear(h, self.emb.weight)), a param two modules
use (an embedding tied to a head on one stage: W counted the embedding's part twice), a module
frozen or unfrozen after the Pipeline was built. So the first forward of each (stage, micro-batch
shape, mode, params requiring grad) is analysed once: the autograd graph from the stage's outputs,
the ops each recorded module's forward created (the sequence numbers of its nodes: torch numbers
every node it creates, in order), every edge into each param's AccumulateGrad. A param is W's
("covered") when all its edges come from ops of its module's forward and no op of that forward
reaches the rest of the graph but through the module's outputs; every other param requiring grad
gets its grad in I, whole, with the fused loss heads' (their grads are made in the forward). Cost:
one graph walk per key (a few ms for a GPT stage), a dummy op per module forward of that micro-batch.
"""
from __future__ import annotations

import torch

from zerofuse.zero.grads import output_tensors


def _sequence_number() -> int:
    """The autograd sequence number the next node created on this thread gets (one dummy op)."""
    with torch.enable_grad():
        return (torch.zeros((), requires_grad=True) * 1).grad_fn._sequence_nr() + 1


def _walk(starts, follow=lambda node: True) -> tuple[set, dict, dict]:
    """The autograd nodes reachable from ``starts`` through the nodes ``follow`` takes: (those nodes,
    id(param) -> the edges from them into the param's AccumulateGrad, node -> the nodes using it)."""
    seen, stack, edges, parents = set(), [n for n in starts if follow(n)], {}, {}
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            var = getattr(nxt, "variable", None)
            if var is not None:
                edges[id(var)] = edges.get(id(var), 0) + 1
            elif follow(nxt):
                parents.setdefault(nxt, []).append(node)
                stack.append(nxt)
    return seen, edges, parents


class ZeroBubble:
    """The modules' forward hooks and, per micro-batch, what they recorded; the analysis of
    [Note: zero-bubble coverage] cached by key."""

    def __init__(self, stages, tied_mirror, num_stages: int):
        self.hooks = []
        self.fused: dict[int, list] = {s.index: [] for s in stages}  # params whose grads come in I
        self.params = {s.index: list(s.parameters()) for s in stages}
        for s in stages:
            for mod in s.modules():
                # zerofuse's GPT blocks fold attn.proj's bias into norm2 (one add fewer): unfolded
                # here, else the bias gets its grad in I (it is applied outside attn.proj)
                if getattr(mod, "fold_attn_bias", False):
                    mod.fold_attn_bias = False
                own = list(mod.parameters(recurse=False))
                if not own:
                    continue
                if getattr(mod, "backward_once", False):  # a fused loss: grads made in forward
                    self.fused[s.index].extend(own)
                    continue
                self.hooks.append(mod.register_forward_pre_hook(self._enter))
                self.hooks.append(mod.register_forward_hook(self._record))
        if tied_mirror is not None:  # the fused head's mirror weight: its grads come in I
            self.fused[num_stages - 1].append(tied_mirror)
        self.recording: list | None = None
        self._analysing = False
        self._starts: list[int] = []
        self._plans: dict = {}  # key -> (ids of covered params, params whose grads come in I)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []

    # ------------------------------------------------------------------ forward

    def begin(self, key) -> None:
        """Before a micro-batch's forward (grad enabled); ``key``: the Pipeline's, (stage, micro-batch
        shape, mode, training, which params require grad): what the stage's graph depends on."""
        self.recording = []
        self._analysing = key not in self._plans

    def _enter(self, mod, _args) -> None:
        if self.recording is not None and self._analysing:
            self._starts.append(_sequence_number())

    def _record(self, mod, _args, out) -> None:
        if self.recording is None:
            return
        span = (self._starts.pop(), _sequence_number()) if self._analysing else None
        params = [p for p in mod.parameters(recurse=False) if p.requires_grad]
        outs = [t for t in output_tensors(out) if t.requires_grad]
        if params and (outs or span):
            self.recording.append((params, outs, span))

    def end(self, key, stage: int, outputs) -> list:
        """After the forward: the micro-batch's records, [(covered params, outputs)], the key's
        analysis made first where it is new."""
        rec, self.recording = self.recording, None
        self._starts = []
        if key not in self._plans:
            self._plans[key] = self._analyse(stage, rec, outputs)
        covered = self._plans[key][0]
        out = []
        for params, outs, _ in rec:
            mine = [p for p in params if id(p) in covered]
            if mine and outs:
                out.append((mine, outs))
        return out

    def in_I(self, key, stage: int) -> list:
        """The params whose grads come in I: the fused heads' and those W does not cover."""
        return [p for p in self.fused[stage] if p.requires_grad] + self._plans[key][1]

    # ------------------------------------------------------------------ the analysis

    def _analyse(self, stage: int, rec, outputs) -> tuple[set, list]:
        roots = [t.grad_fn for t in output_tensors(outputs) if t.requires_grad and t.grad_fn is not None]
        _, edges, parents = _walk(roots)
        covered: set[int] = set()
        for params, outs, (lo, hi) in rec:
            inside = lambda n: lo <= n._sequence_nr() < hi  # noqa: E731 (an op of this module's forward)
            out_nodes = {t.grad_fn for t in outs if t.grad_fn is not None}
            region, mine, _ = _walk(out_nodes, inside)
            # an op of the forward used outside it but through an output: its params are not W's
            leaks = any(n not in out_nodes and any(not inside(q) for q in parents.get(n, ())) for n in region)
            if not leaks:
                covered.update(id(p) for p in params if mine.get(id(p), 0) == edges.get(id(p), 0) > 0)
        fused = {id(p) for p in self.fused[stage]}
        rest = [p for p in self.params[stage] if p.requires_grad and id(p) not in covered and id(p) not in fused]
        return covered, rest
