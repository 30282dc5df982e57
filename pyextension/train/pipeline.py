"""The training job's pipeline parallelism (--pp > 1): this rank's stages of the GPT, ZeRO over
the stage's data-parallel group, the schedule's runtime, and the bubble the ranks measured."""
from __future__ import annotations

import torch


class PipelineJob:
    """Built by the Trainer when --pp > 1: ``module`` is what ZeRO, the optimizer and the
    checkpoints see (this rank's params under the whole model's names); ``pipe`` runs the steps."""

    def __init__(self, trainer, model):
        from zerofuse import zero
        from zerofuse.pipeline import Pipeline, merge_stages, split_gpt

        args, mesh = trainer.args, trainer.mesh
        p, v = args.pp, args.virtual_stages
        ids = [mesh.pp_rank + k * p for k in range(v)]
        device = "meta" if args.zero_stage == 3 else trainer.device  # ZeRO-3 materializes its shards itself
        self.stages = split_gpt(model, p * v, ids, layout=args.pp_layout, device=device)
        self.module = self.stages[0] if v == 1 else merge_stages(self.stages)
        offload = {} if args.offload == "none" else {"offload": args.offload, "offload_ratio": args.offload_ratio}
        zero.parallelize(self.module, stage=args.zero_stage, group=mesh.dp_group, precision=args.precision,
                         device=trainer.device, pp_group=mesh.pp_group, param_gather="module",
                         param_init_fn=model.param_init_fn, **offload)
        self.pipe = Pipeline(self.stages, schedule=args.pp_schedule, microbatches=args.microbatches,
                             group=mesh.pp_group, zero_module=None if v == 1 else self.module)
        self.idle: list[float] = []  # per step: 1 - compute / step time on this rank

    def step(self, xs: torch.Tensor, ys: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Forward + backward of the M micro-batches xs (M, batch, seq) (document_ids: their packed
        documents, the same shape); returns the mean loss."""
        flat = (lambda t: None if t is None else t.reshape(-1, t.shape[-1]))
        loss = self.pipe.step(flat(xs), flat(ys), document_ids=flat(document_ids))
        self.idle.append(1.0 - self.pipe.compute_seconds / max(self.pipe.step_seconds, 1e-9))
        return loss

    def record_moe(self, stats, layers: list) -> None:
        """Each training forward of a stage records its MoE layers' loads and router losses into
        stats (zerofuse.models.moe.Stats over the whole model's ``layers``); the first stage counts
        the micro-batches' forwards."""
        index = {id(m): i for i, m in enumerate(layers)}
        rows = {id(s): [index[id(m)] for m in s.moe_layers] for s in self.stages}  # (once, not per forward)

        def hook(stage, _args, _out):
            if not torch.is_grad_enabled():  # (evaluation's forwards are not the steps')
                return
            if stage.moe_layers:
                stats.record(stage.router_losses, rows[id(stage)], forward=False)
            if stage.is_first:
                stats.count_forward()

        for s in self.stages:
            s.register_forward_hook(hook)

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.pipe.forward_only(x, y, document_ids=document_ids)

    def report(self, world: int) -> dict:
        """Gathered on every rank (collective): each rank's measured idle fraction (mean over the
        steps after the first, without the launch-counting one: None in ``idle``) beside the
        schedule's formula."""
        import torch.distributed as dist
        from zerofuse.pipeline import bubble_fraction, build_schedule, simulate

        pipe = self.pipe
        steady = [f for f in self.idle[1:] if f is not None] or [f for f in self.idle if f is not None]
        mine = sum(steady) / len(steady) if steady else None
        every = [None] * world
        dist.all_gather_object(every, mine)
        try:
            formula = bubble_fraction(pipe.schedule, pipe.p, pipe.m, pipe.v)
        except ValueError:  # zero-bubble: no closed form, the simulator's (F = I = W = 1)
            sim = simulate(build_schedule(pipe.schedule, pipe.p, pipe.m, pipe.v), pipe.p, costs=dict(F=1, I=1, W=1))
            formula = max(sim.idle_fraction)
        return {"pp": pipe.p, "schedule": pipe.schedule, "microbatches": pipe.m, "virtual_stages": pipe.v,
                "bubble_formula": formula, "bubble_measured_per_rank": every}
