"""MoE GPTs through zerofuse.pipeline on real gloo ranks against one process training the same
global batch: the routers' aux and z losses of every stage train through the activations the stage
sends (zerofuse.models.moe.attach_loss, at the last stage's loss gradient: 1 / micro-batches, times
the fp16 loss scale), the loss the pipeline returns is the cross-entropy; pp 2 alone (1f1b, zb,
interleaved), pp 2 x dp 2 with ep 2 under ZeRO-2 and -3; fp16's loss scale."""
import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from tolerances import assert_close_training

pytestmark = pytest.mark.usefixtures("native_kernels")

CFG = dict(vocab_size=65, seq_len=16, n_layer=4, n_head=4, dim=32, mlp="swiglu", mlp_hidden=48, moe_experts=4,
           moe_top_k=2, moe_aux_loss=5e-2, moe_aux_scope="global", moe_z_loss=1e-2)
BATCH, STEPS, LR = 8, 4, 3e-3


def _batches():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 65, (BATCH, CFG["seq_len"] + 1), generator=g) for _ in range(STEPS)]


def _reference(micro: int, flip=False, order=None):
    """One process, the batch in ``micro`` micro-batches: (cross-entropy per step, params); flip:
    each micro-batch's rows in reverse order (the same losses, summed in another order: the
    training-parity rule's alternative); order: the batch's rows reordered first (the DP ranks'
    k-th micro-batches together, as the global aux loss sees them)."""
    from zerofuse.models import GPT, GPTConfig

    model = GPT(GPTConfig(**CFG), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for b in _batches():
        ce = 0.0
        for part in (b if order is None else b[order]).chunk(micro):
            part = part.flip(0) if flip else part
            loss = model(part[:, :-1], part[:, 1:])[1]
            (loss / micro).backward()
            ce += (loss - model.router_losses.sum()).item() / micro
        losses.append(ce)
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _pp_rank(rank, ws, dp, ep, zero_stage, schedule, v, micro):
    import zerofuse  # noqa: F401
    from zerofuse import zero
    from zerofuse.models import GPT, GPTConfig
    from zerofuse.parallel import init_mesh
    from zerofuse.pipeline import Pipeline, merge_stages, split_gpt

    pp = ws // dp
    mesh = init_mesh(dp=dp, pp=pp, ep=ep)
    with torch.device("meta"):
        model = GPT(GPTConfig(**CFG), seed=0, ep_group=mesh.ep_group, edp_group=mesh.edp_group,
                    dp_group=mesh.dp_group)
    stages = split_gpt(model, pp * v, [mesh.pp_rank + k * pp for k in range(v)], device="cpu")
    held = stages[0] if v == 1 else merge_stages(stages)
    zero.parallelize(held, stage=zero_stage, group=mesh.dp_group, pp_group=mesh.pp_group)
    opt = zero.Optimizer(held, "adamw", lr=LR)
    pipe = Pipeline(stages, schedule=schedule, microbatches=micro, group=mesh.pp_group,
                    zero_module=None if v == 1 else held)
    losses, per = [], BATCH // dp
    for b in _batches():
        mine = b[mesh.dp_rank * per:(mesh.dp_rank + 1) * per]
        loss = pipe.step(mine[:, :-1], mine[:, 1:])
        dist.all_reduce(loss, group=mesh.dp_group)
        losses.append(loss.item() / dp)
        opt.step()
        opt.zero_grad()
    named = {}
    with zero.full_params(held):
        for n, p in held.named_parameters():
            t = p.detach().clone()
            if getattr(p, "_zf_ep", None) is not None:  # the whole [E, ...] from the ep group
                parts = [torch.empty_like(t) for _ in range(mesh.ep)]
                dist.all_gather(parts, t.contiguous(), group=mesh.ep_group)
                t = torch.cat(parts)
            named[n] = t
    return losses, named


# interleaved at dp 2: micro-batch k of each rank's half batch, rows 2k, 2k+1 and 4+2k, 5+2k together
RANKS_MICRO = [0, 1, 4, 5, 2, 3, 6, 7]


@pytest.mark.parametrize("ws,dp,ep,zero_stage,schedule,v,micro,order", [
    (2, 1, 1, 1, "1f1b", 1, 2, None), (2, 1, 1, 2, "zb", 1, 2, None), (2, 1, 1, 1, "interleaved", 2, 2, None),
    (4, 2, 2, 2, "1f1b", 1, 1, None), (4, 2, 2, 3, "1f1b", 1, 1, None),
    (4, 2, 2, 1, "interleaved", 2, 2, RANKS_MICRO)])
def test_moe_through_pipeline_stages_matches_one_process(ws, dp, ep, zero_stage, schedule, v, micro, order):
    # the aux loss's load fractions are over the DP group's micro-batch (scope "global"): one
    # process's micro-batches are the ranks' together
    ref_losses, ref_params = _reference(micro, order=order)
    alt_params = _reference(micro, flip=True, order=order)[1]
    out = run_distributed(_pp_rank, ws, dp, ep, zero_stage, schedule, v, micro, timeout=300)
    for losses, _ in out:  # the cross-entropy, on every rank
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    params = {n: t for _, named in out for n, t in named.items()}
    assert set(params) == set(ref_params)
    for n, want in ref_params.items():  # (every router's weight moves with its aux and z losses)
        assert_close_training(params[n], want, alt_params[n], msg=n)


def _fp16_rank(rank, ws, precision):
    import zerofuse  # noqa: F401
    from zerofuse import zero
    from zerofuse.models import GPT, GPTConfig
    from zerofuse.parallel import init_mesh
    from zerofuse.pipeline import Pipeline, split_gpt

    mesh = init_mesh(dp=1, pp=2)
    cfg = GPTConfig(**{**CFG, "moe_aux_loss": 1.0, "moe_z_loss": 0.0})  # the aux loss's grads dominate the router's
    model = GPT(cfg, seed=0)
    before = model.blocks[0].mlp.router.weight.detach().clone()
    (stage,) = split_gpt(model, 2, [rank], device="cpu")
    zero.parallelize(stage, stage=1, precision=precision, group=mesh.dp_group, pp_group=mesh.pp_group)
    opt = zero.Optimizer(stage, "adamw", lr=1e-3, weight_decay=0.0)
    pipe = Pipeline([stage], schedule="1f1b", microbatches=2, group=mesh.pp_group)
    x = _batches()[0]
    pipe.step(x[:, :-1], x[:, 1:])
    opt.step()
    if rank != 0:
        return None, None
    w = model.blocks[0].mlp.router.weight.detach().float()
    return (w - before).sign(), stage.loss_weight


def test_fp16_router_losses_take_the_loss_scale():
    """Block 0's router is on stage 0: its aux loss's gradient there is the last stage's loss
    gradient, 1 / micro-batches times fp16's loss scale (at 1 / micro-batches alone it reached the
    step 65536 times too small beside the scaled cross-entropy grads: Adam's first step, the sign
    of the grad, followed the cross-entropy's)."""
    (fp32, w32), _ = run_distributed(_fp16_rank, 2, "fp32", timeout=300)
    (fp16, w16), _ = run_distributed(_fp16_rank, 2, "fp16", timeout=300)
    assert w32 == 0.5 and isinstance(w16, torch.Tensor) and w16.item() == 0.5 * 2.0 ** 16, (w32, w16)
    agree = (fp32 == fp16).float().mean().item()
    assert agree > 0.9, agree
