"""Splitting a model into pipeline stages.

A :class:`Stage` is an ``nn.Module`` that holds one contiguous slice of a model's modules,
registered under the names they have in the whole model (``blocks.4.attn.qkv.weight`` stays
``blocks.4.attn.qkv.weight``), so state_dicts, checkpoints and ZeRO see the unsplit model's names.
``forward(*inputs, targets=None)`` takes what the previous stage sent (the first stage: the token
ids) and returns a tuple of tensors for the next stage, or, on the last stage, the loss.

- :func:`split_gpt`: a ``zerofuse.models.GPT`` by layer counts (balanced by parameters, or an
  explicit layout such as ``"E,4,4,4,L"``); its stages run the model's own ``embed``, blocks and
  ``final``, and take the micro-batch's ``document_ids`` (packed documents) for their blocks.
- ``split_modules`` (zerofuse/pipeline/modules.py): any model given as an ordered list of
  ``(name, module)`` (or an ``nn.Sequential``), each module called on the previous one's output,
  and a ``loss_fn(output, targets)`` on the last stage.

Tied embeddings (``GPTConfig(tie_embeddings=True)``, the gpt2-* presets): when the last stage is
on another rank than the first, its output layer reads a *mirror* of ``wte.weight``: a
non-persistent buffer (not a parameter: no optimizer, ZeRO or checkpoint sees it) that
``zerofuse.pipeline.Pipeline`` fills from the first stage's weight every step and whose grad it
adds into the first stage's before that stage's last backward, so the one real weight is trained
on the sum of both uses, as in the unsplit model (Megatron's embedding group does the same with an
all-reduce). ``Stage.tied`` names the pair on both sides.

Only the stage's own modules are materialized: a model built under ``torch.device("meta")`` gets
just this stage's params allocated and initialised (the model's ``param_init_fn`` per module);
the params of stages this rank does not hold are moved to the meta device, so no rank keeps the
whole model.
"""
from __future__ import annotations

import numbers
import re
from collections.abc import Callable, Sequence

import torch

from zerofuse.tp.spec import swap_keeping_marks

NAME = "zerofuse.pipeline"
_STAGE = re.compile(r"^(E)?(\d+)?(L)?$")


class Stage(torch.nn.Module):
    """One pipeline stage (see the module docstring). ``index`` / ``num_stages``: its place in the
    pipeline; ``parts``: its (name, module) in order."""

    def __init__(self, parts: Sequence[tuple[str, torch.nn.Module]], run: Callable, index: int, num_stages: int,
                 *, takes_documents: bool = False):
        super().__init__()
        for name, module in parts:
            path = name.split(".")
            node = self
            for p, nxt in zip(path[:-1], path[1:]):
                if p not in node._modules:  # blocks.4 -> a ModuleDict "blocks" holding "4" (ZeRO-3 wraps its children)
                    node.add_module(p, torch.nn.ModuleDict() if nxt.isdigit() else torch.nn.Module())
                node = node._modules[p]
            node.add_module(path[-1], module)
        from zerofuse.models.tied import is_tied, keep_tied_on_load  # noqa: PLC0415

        if is_tied(self):  # both ends of a tied GPT here (one stage, or merged): loaded as the GPT loads them
            keep_tied_on_load(self)  # (assign=True untied them, and two different matrices loaded silently)
        self.parts = [name for name, _ in parts]
        self._run = run
        self.index, self.num_stages = index, num_stages
        self.takes_documents = takes_documents  # forward takes document_ids (split_gpt's stages)
        # tied embeddings split over two ranks (see the module docstring): the first stage's real
        # weight ("source") or the last stage's mirror of it ("mirror"), else None
        self.tied: tuple[str, torch.Tensor] | None = None
        self.tied_at: tuple[torch.nn.Module, str] | None = None  # the mirror's module and buffer name
        # state_dict names of the unsplit model that a param here also goes by (its tied uses held
        # elsewhere): checkpoints record them, so the consolidated state_dict is the unsplit model's
        self.state_dict_aliases: dict[str, str] = {}
        # MoE layers (split_gpt's stages): their router losses are trained through the stage's
        # outputs at loss_weight, the gradient zerofuse.pipeline.Pipeline seeds the last stage's loss
        # with (1 / micro-batches, times the fp16 loss scale; it sets it each step), and are not in the
        # loss the last stage returns (the cross-entropy); router_losses: [aux, z] of the last forward
        self.moe_layers: list = []
        self.loss_weight: float | torch.Tensor = 1.0
        self.router_losses: torch.Tensor | None = None

    def tied_mirror(self) -> torch.Tensor:
        """The mirror as the stage's module holds it now. A cast or move of the module after the split
        (zerofuse.zero.parallelize's precision, Module.to) replaced the buffer by a converted copy, a
        non-leaf of the split's tensor: the weight was received into the old tensor while the head
        read the copy (stale), and a bf16 weight landed in an fp32 buffer (a review's reproduction,
        2026-12-07). The converted copy becomes the mirror, a leaf of its own."""
        module, name = self.tied_at
        buf = module._buffers[name]
        if buf.grad_fn is not None:
            buf = buf.detach().requires_grad_(buf.requires_grad)
            module._buffers[name] = buf
        self.tied = ("mirror", buf)
        return buf

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def forward(self, *inputs: torch.Tensor, targets: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None):
        """document_ids (B, N): packed documents of this micro-batch (zerofuse.models.GPT's), for
        the attention of the stage's blocks; only where takes_documents."""
        if document_ids is None:
            return self._run(*inputs, targets=targets)
        if not self.takes_documents:
            raise ValueError(f"{NAME}: document_ids given to stage {self.index}, whose modules take none "
                             f"(split_gpt's stages do)")
        return self._run(*inputs, targets=targets, document_ids=document_ids)

    def extra_repr(self) -> str:
        return f"stage {self.index} of {self.num_stages}: {', '.join(self.parts)}"


def merge_stages(stages: Sequence[Stage]) -> Stage:
    """One module holding every part of ``stages`` (a rank's virtual stages) under the whole
    model's names: what ZeRO shards and checkpoints see for that rank (pass it to Pipeline as
    zero_module). It is not run itself."""
    parts = [(n, m) for s in stages for n, m in zip(s.parts, _part_modules(s))]

    def run(*_a, **_k):
        raise RuntimeError(f"{NAME}: a merged stage holds params; run its stages through zerofuse.pipeline.Pipeline")

    merged = Stage(parts, run, -1, stages[0].num_stages)
    for s in stages:
        merged.state_dict_aliases.update(s.state_dict_aliases)
    # ZeRO's expert group (zero/experts.py), the same on every stage of a rank (it was lost: interleaved
    # stages with expert parallelism refused at parallelize; a review's reproduction, 2026-12-07)
    groups = {id(g): g for s in stages if (g := getattr(s, "edp_group", None)) is not None}
    if len(groups) > 1:
        raise ValueError(f"{NAME}: the stages hold {len(groups)} expert-data-parallel groups; expected one (a rank's "
                         "stages are split from one model)")
    merged.edp_group = next(iter(groups.values()), None)
    return merged


def _part_modules(stage: Stage) -> list[torch.nn.Module]:
    return [stage.get_submodule(n) for n in stage.parts]


def parse_layout(layout: str | Sequence, n_layer: int) -> list[tuple[bool, int, bool]]:
    """"E,4,4,4,L" or ["E4", 4, "4L"] -> per stage (has embedding, block count, has loss head).
    Without E / L the first stage takes the embedding and the last the head."""
    items = layout.split(",") if isinstance(layout, str) else list(layout)
    out = []
    for i, item in enumerate(items):
        m = _STAGE.match(str(item).strip())
        if not m or not any(m.groups()):
            raise ValueError(f"{NAME}: expected each stage of layout to be a block count with an optional leading E "
                             f"(embedding) and trailing L (final norm, head, loss), e.g. 'E,4,4,4,L' or 'E2,4,2L'; got "
                             f"{item!r} at position {i} of {layout!r}")
        out.append((bool(m.group(1)), int(m.group(2) or 0), bool(m.group(3))))
    if not any(e for e, _, _ in out):
        out[0] = (True, *out[0][1:])
    if not any(ell for _, _, ell in out):
        out[-1] = (*out[-1][:2], True)
    for i, (e, n, ell) in enumerate(out):
        if e and i != 0:
            raise ValueError(f"{NAME}: the embedding (E) must be on the first stage; layout {layout!r} puts it on stage {i}")
        if ell and i != len(out) - 1:
            raise ValueError(f"{NAME}: the loss head (L) must be on the last stage; layout {layout!r} puts it on stage {i}")
    total = sum(n for _, n, _ in out)
    if total != n_layer:
        raise ValueError(f"{NAME}: layout {layout!r} places {total} blocks; expected the model's n_layer ({n_layer})")
    return out


def balanced_layout(n_layer: int, num_stages: int, block_params: int, first_params: int,
                    last_params: int) -> list[tuple[bool, int, bool]]:
    """Contiguous block counts per stage minimising the largest stage's parameter count (the
    embedding counted on the first stage, the final norm + head on the last); ties go to the
    layout with the fewest blocks on the last stage (its loss costs compute too)."""
    if num_stages > n_layer + 2:
        raise ValueError(f"{NAME}: cannot split a model of {n_layer} blocks into {num_stages} stages (at most "
                         f"n_layer + 2, with the embedding and the head alone)")
    # stage s holds counts[s] blocks; search the counts by dynamic programming over prefixes
    inf = float("inf")
    cost = [[inf] * (n_layer + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n_layer + 1) for _ in range(num_stages + 1)]
    cost[0][0] = 0
    for s in range(1, num_stages + 1):
        extra = (first_params if s == 1 else 0) + (last_params if s == num_stages else 0)
        for j in range(n_layer + 1):
            for k in range(0, j + 1):  # k blocks on stage s
                if k == 0 and extra == 0:
                    continue  # a stage with nothing to run
                c = max(cost[s - 1][j - k], k * block_params + extra)
                if c < cost[s][j] or (c == cost[s][j] and s == num_stages and k < choice[s][j]):
                    cost[s][j], choice[s][j] = c, k
    if cost[num_stages][n_layer] == inf:
        raise ValueError(f"{NAME}: cannot split {n_layer} blocks into {num_stages} non-empty stages")
    counts, j = [], n_layer
    for s in range(num_stages, 0, -1):
        counts.append(choice[s][j])
        j -= choice[s][j]
    counts.reverse()
    return [(s == 0, n, s == num_stages - 1) for s, n in enumerate(counts)]


def _materialize(modules: list[torch.nn.Module], device, init: Callable | None) -> None:
    """Allocate and initialise the meta params and buffers of ``modules`` on ``device`` (swapped in
    place: the Parameter objects, and whatever refers to them, stay the same); real ones are moved
    to ``device`` if given."""
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "meta":  # left for zerofuse.zero.parallelize to materialize shard by shard
        return
    for module in modules:
        if not any(t.is_meta for t in list(module.parameters()) + list(module.buffers())):
            module.to(device)
            continue
        for sub in module.modules():
            for p in sub.parameters(recurse=False):
                if p.is_meta:
                    swap_keeping_marks(p, torch.empty_like(p, device=device))
            for key, b in sub._buffers.items():
                if b is not None and b.is_meta:
                    sub._buffers[key] = torch.empty_like(b, device=device)
        with torch.no_grad():
            for sub in module.modules():
                if next(sub.parameters(recurse=False), None) is None:
                    continue
                if init is not None:
                    init(sub)
                elif hasattr(sub, "reset_parameters"):
                    sub.reset_parameters()
                else:
                    raise ValueError(f"{NAME}: module {type(sub).__name__} holds parameters on the meta device and "
                                     "has no reset_parameters() to initialise them")


def _release(modules: list[torch.nn.Module], keep: set[int]) -> None:
    """Move the params of modules this rank does not hold to meta (frees them; shared ones kept)."""
    for module in modules:
        for p in module.parameters():
            if id(p) not in keep and not p.is_meta:
                swap_keeping_marks(p, torch.empty_like(p, device="meta"))


def split_gpt(model, num_stages: int, stage_ids: Sequence[int], *, layout=None, device=None) -> list[Stage]:
    """The stages ``stage_ids`` (of ``num_stages``) of a ``zerofuse.models.GPT``. layout: None
    (balanced by parameters), a string like "E,4,4,4,L" or a list of per-stage items."""
    cfg = model.config
    _check_ids(stage_ids, num_stages)
    if layout is None:
        per_block = sum(p.numel() for p in model.blocks[0].parameters())
        first = sum(p.numel() for m in (model.wte, model.wpe) if m is not None for p in m.parameters())
        # a tied output layer still costs the last stage its weight's memory (the mirror) and GEMMs
        last = sum(p.numel() for m in (model.norm, model.head) for p in m.parameters(recurse=True)
                   if not (cfg.tie_embeddings and p is model.wte.weight and num_stages == 1))
        plan = balanced_layout(cfg.n_layer, num_stages, per_block, first, last)
    else:
        plan = parse_layout(layout, cfg.n_layer)
        if len(plan) != num_stages:
            raise ValueError(f"{NAME}: layout {layout!r} has {len(plan)} stages; expected {num_stages} "
                             f"(pipeline size x virtual stages)")
    starts = [sum(n for _, n, _ in plan[:s]) for s in range(num_stages)]
    stages, kept = [], set()
    for s in stage_ids:
        emb, n, head = plan[s]
        parts = []
        if emb:
            parts += [("wte", model.wte)] + ([("wpe", model.wpe)] if model.wpe is not None else [])
        blocks = list(range(starts[s], starts[s] + n))
        parts += [(f"blocks.{i}", model.blocks[i]) for i in blocks]
        if head:
            parts += [("norm", model.norm), ("head", model.head)]
        _materialize([m for _, m in parts], device, getattr(model, "param_init_fn", None))
        kept.update(id(p) for _, m in parts for p in m.parameters())
        stage = Stage(parts, None, s, num_stages, takes_documents=True)
        stage._run = _gpt_runner(model, emb, [model.blocks[i] for i in blocks], head, stage)
        stage.edp_group = getattr(model, "edp_group", None)  # (ZeRO's expert group: zero/experts.py)
        stages.append(stage)
        stages[-1].checkpointing = lambda: model.activation_checkpointing  # (read by Pipeline.step for 'zb')
    ends = [i for i in (0, num_stages - 1) if i in stage_ids]
    if cfg.tie_embeddings and num_stages > 1 and len(ends) == 1:  # the two uses on two ranks
        (end,) = ends
        stage = stages[list(stage_ids).index(end)]
        if end == 0:
            stage.tied = ("source", model.wte.weight)
            stage.state_dict_aliases["head.weight"] = "wte.weight"
        else:
            stage.tied = ("mirror", _mirror(model.head, "weight"))
            stage.tied_at = (model.head, "weight")
            kept.discard(id(model.wte.weight))
    _release([model], kept)
    return stages


def _mirror(module: torch.nn.Module, name: str) -> torch.Tensor:
    """module.<name>, a parameter, becomes a non-persistent buffer over the same values (a leaf
    that takes grads; not in parameters() or the state_dict)."""
    param = module._parameters.pop(name)
    mirror = param.detach().requires_grad_(param.requires_grad)
    module.register_buffer(name, mirror, persistent=False)
    return mirror


def _gpt_runner(model, emb: bool, blocks: list, head: bool, stage: Stage) -> Callable:
    from zerofuse.models import moe as zmoe

    moes = zmoe.layers(torch.nn.ModuleList(blocks))
    stage.moe_layers = moes

    def run(*inputs, targets=None, document_ids=None):
        if emb:
            x, delta = model.embed(inputs[0]), None
        else:
            x, delta = inputs if len(inputs) == 2 else (inputs[0], None)
        for block in blocks:
            x, delta = model.run_block(block, x, delta, document_ids)
        losses = zmoe.router_losses(moes) if moes else None
        if losses is not None:
            shown = losses.detach()
            if model.sequence_parallel:  # each TP rank's share of the sequence's: summed, as GPT.router_losses
                from zerofuse.tp.comm import all_reduce  # noqa: PLC0415
                shown = all_reduce(shown.clone(), model._tp_comm)
            stage.router_losses = shown
            if not torch.is_grad_enabled():
                losses = None
        if head:
            logits, loss = model.final(x, delta, targets, router_losses=False)
            if targets is None:
                return logits
            return loss if losses is None else zmoe.attach_loss(loss, losses.sum())
        if losses is not None:  # trained at the weight the pipeline gives the last stage's loss
            x = zmoe.attach_loss(x, losses.sum(), stage.loss_weight)
        return (x,) if delta is None else (x, delta)

    return run


def _check_ids(stage_ids, num_stages: int) -> None:
    """num_stages an int >= 1, stage_ids distinct stages of it (an id past it raised IndexError; -1
    made a stage of the last stage's modules numbered -1)."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"{NAME}: expected the number of stages to be an int >= 1, got {num_stages!r}")
    ids = list(stage_ids) if isinstance(stage_ids, Sequence) else None
    if not ids or any(isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < num_stages
                      for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"{NAME}: expected stage_ids to be distinct ints in [0, {num_stages}) (num_stages "
                         f"{num_stages}), got {ids}")
