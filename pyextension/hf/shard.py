"""``zerofuse.shard(model, dp=..., tp=..., zero_stage=...)``: tensor parallelism and ZeRO for a
Hugging Face causal LM in one call.

TP (Megatron's plan, from the architecture's table in zerofuse/hf/archs.py): q/k/v and gate/up
projections column-parallel, o/down projections row-parallel (one all-reduce each forward and
backward), the input embedding vocabulary-parallel and the output layer a vocabulary-parallel
fused linear + cross-entropy head (logits gathered when asked for without labels). The attention
modules keep their own forward: with q/k/v split by whole heads they see num_heads / tp heads.
Norm weights stay replicated. Those of the decoder (on the whole hidden state: no sequence
parallelism here) get the same gradient on every TP rank; those inside a module the plan split
(Qwen3's per-head q_norm / k_norm, applied to this rank's heads only) get a part of it on each,
summed over the TP group by a hook (tp.sync_replicated_grads; before, each rank stepped its part:
the ranks' copies drifted apart and from one process's). ZeRO then shards over the data-parallel
group (zerofuse.zero.parallelize; stage 3 wraps each decoder layer). Every rank calls it with the
same model (same weights: load, or seed, alike).
"""
from __future__ import annotations

import functools

import torch

from zerofuse import zero
from zerofuse.hf import archs
from zerofuse.hf.bound import Bound
from zerofuse.parallel import init_mesh
from zerofuse.tp import comm as tp_comm
from zerofuse.tp import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from zerofuse.tp.cross_entropy import VocabParallelLinearCrossEntropyHead

WHO = "zerofuse.shard"


def _scaled_embedding_forward(self, idx):  # Gemma's embedding: the lookup times embed_scale
    out = VocabParallelEmbedding.forward(self, idx)
    return out * self.embed_scale.to(out.dtype)


def _embedding(emb, group):
    if not isinstance(emb, torch.nn.Embedding) or emb.max_norm is not None or emb.sparse:
        raise ValueError(f"{WHO}: expected the input embedding to be a plain torch.nn.Embedding, got {emb!r}")
    new = VocabParallelEmbedding.from_full(emb.weight, group=group, padding_idx=emb.padding_idx)
    if type(emb).forward is not torch.nn.Embedding.forward:
        scale = getattr(emb, "embed_scale", None)
        if scale is None:
            raise ValueError(f"{WHO}: the input embedding {type(emb).__name__} has a forward zerofuse does not know")
        new.register_buffer("embed_scale", torch.as_tensor(scale).detach().clone(), persistent=False)
        new.forward = Bound(new, _scaled_embedding_forward)
    return new


def _tensor_parallel(model, arch, decoder, mesh) -> None:
    cfg, tp, group = model.config, mesh.tp, mesh.tp_group
    for key in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(cfg, key, None)
        if n is not None and n % tp:
            raise ValueError(f"{WHO}: expected the TP size {tp} to divide config.{key} ({n})")
    partial, comm = [], None
    for parent in list(model.modules()):
        split = False
        for name, child in list(parent.named_children()):
            style = arch.tp.get(name)
            if style is None:
                continue
            if type(child) is not torch.nn.Linear:
                raise ValueError(f"{WHO}: expected {name} to be a torch.nn.Linear for the TP plan, got "
                                 f"{type(child).__name__}")
            cls = ColumnParallelLinear if style == "column" else RowParallelLinear
            new = cls.from_full(child.weight, child.bias, group=group)
            setattr(parent, name, new)
            split, comm = True, new.comm
        if split:  # the module's own replicated params see this rank's heads / columns only
            partial += [p for n, c in parent.named_children() if arch.tp.get(n) is None
                        for p in c.parameters() if p.requires_grad]
    if partial:
        tp_comm.sync_replicated_grads(partial, comm)
    emb = getattr(decoder, arch.embed)
    head = model.lm_head
    tied = head.weight is emb.weight
    new_emb = _embedding(emb, group)
    setattr(decoder, arch.embed, new_emb)
    new_head = VocabParallelLinearCrossEntropyHead.from_full(head.weight, head.bias, group=group, gather_output=True)
    if tied:
        new_head.weight = new_emb.weight
    model.lm_head = new_head
    # the decoder layers keep the global head counts in their config; their forward infers this
    # rank's heads from the projections' widths (view(..., -1, head_dim))


def _check_zero_options(model, stage, zero_options) -> None:
    """zero.parallelize's arguments, checked before the TP plan changes the model (a typo left it
    half tensor-parallel, and a corrected call was refused)."""
    import inspect

    from zerofuse.zero.options import check_args

    try:
        bound = inspect.signature(zero.parallelize).bind(model, stage=stage, group=None, tp_group=None, **zero_options)
    except TypeError as e:
        raise TypeError(f"{WHO}: the ZeRO options {sorted(zero_options)}: {e}") from None
    bound.apply_defaults()
    a = bound.arguments
    check_args(WHO, **{k: a[k] for k in ("stage", "precision", "reduce_dtype", "bucket_mb", "prefetch", "max_inflight",
                                         "param_init_fn", "offload", "offload_ratio")})


def shard(model, dp: int | None = None, tp: int = 1, zero_stage: int = 0, **zero_options):
    """Shard ``model`` (a Hugging Face causal LM of a known architecture, zerofuse.patch'ed or not)
    over dp × tp ranks of the default process group, in place; returns it. ``zero_options`` go to
    zerofuse.zero.parallelize (precision, bucket_mb, overlap, prefetch, ...). Train it with
    ``zerofuse.zero.Optimizer(model, ...)``; ``model.zerofuse_mesh`` holds the process groups."""
    if not isinstance(zero_stage, int) or isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"{WHO}: expected zero_stage in 0, 1, 2, 3, got {zero_stage!r}")
    try:
        _, arch = archs.arch_of(model, WHO)
    except ValueError as e:  # (ZeRO alone takes any module: say where)
        raise ValueError(f"{e}. ZeRO alone (tp=1) shards any torch.nn.Module: "
                         f"zerofuse.zero.parallelize(model, stage={zero_stage})") from None
    decoder = archs.decoder_of(model, arch, WHO)
    if getattr(model, "_zerofuse_zero", None) is not None:
        raise ValueError(f"{WHO}: this model is sharded already")
    _check_zero_options(model, zero_stage, zero_options)  # before the model is changed
    mesh = init_mesh(dp, tp)
    if mesh.tp > 1:
        meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
        if meta:
            raise ValueError(f"{WHO}: tp > 1 splits each weight as it is: expected the model's weights loaded or "
                             f"initialised before zerofuse.shard, got {len(meta)} on the meta device ({meta[0]}, ...); "
                             "a model built on meta is materialized by ZeRO at tp=1 only (param_init_fn)")
        if arch.tp is None:
            have = ", ".join(k for k, a in archs.ARCHS.items() if a.tp)
            raise ValueError(f"{WHO}: no tensor-parallel plan for model_type {model.config.model_type!r} "
                             f"(tp > 1 supports {have}); use tp=1")
        _tensor_parallel(model, arch, decoder, mesh)
    zero.parallelize(model, stage=zero_stage, group=mesh.dp_group, tp_group=mesh.tp_group if mesh.tp > 1 else None,
                     **zero_options)
    model.zerofuse_mesh = mesh
    if mesh.tp > 1:  # (ZeRO alone: inside zerofuse.zero.full_params it writes the whole params)
        model.save_pretrained = functools.partial(_refuse_save_pretrained, mesh.tp)
    return model


def _refuse_save_pretrained(tp: int, *_args, **_kwargs):
    """save_pretrained on a sharded model wrote this rank's TP slices under the full model's names
    (from_pretrained then refused every split weight, or re-initialised it with
    ignore_mismatched_sizes; a review's reproduction, 2026-12-06)."""
    raise RuntimeError(f"{WHO}: save_pretrained on a model tensor-parallel over {tp} ranks would write this "
                       "rank's slices under the full model's names; save with zerofuse.checkpoint.save(dir, "
                       "model, optimizer, extra={'config': model.config.to_dict()}) on every rank, then "
                       "zerofuse.checkpoint.export_hf(dir, out_dir) writes the Hugging Face files (one process; the "
                       "config is what from_pretrained reads the model_type from)")
