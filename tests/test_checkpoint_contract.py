"""zerofuse.checkpoint where a review (2026-11-27) reproduced silent differences from what
torch.distributed.checkpoint / FSDP2 users expect (each test failed before its fix): fp16's loss
scale restored into other precisions (and not saved by the DCP format), offloaded step counters and
param groups of a DCP load, checkpoints of a bigger model, buffers of another shape, a tensor lr,
a meta.json cut off by a failed write, an optimizer of another model or of another update rule,
torch's per-param step counts, a param frozen on one side only."""
from __future__ import annotations

import os

import pytest
import torch

import zerofuse
from zerofuse.checkpoint import files
from zerofuse.models import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("native_kernels")

CFG = dict(vocab_size=65, seq_len=32, n_layer=2, n_head=4, n_kv_head=2, dim=32)
FORMATS = ["zerofuse", "dcp"]


def _zmodel(precision="fp32", n_layer=2, offload=None):
    model = GPT(GPTConfig(**CFG | {"n_layer": n_layer}), seed=0)
    return zerofuse.zero.parallelize(model, stage=2, precision=precision, bucket_mb=0.05, offload=offload)


def _train(model, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        b = torch.randint(0, 65, (4, 17), generator=g)
        _, loss = model(b[:, :-1], b[:, 1:])
        (opt.scale_loss(loss) if getattr(opt, "fp16", False) else loss).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_loss_scale_goes_only_from_fp16_to_fp16(fmt, tmp_path, world_of_one):
    """fp16 -> bf16 restored a scale of 65536 into a run without scaling (every grad divided by it:
    the next update 70% off); bf16 -> fp16 started fp16 from a scale of 1, not initial_scale; the
    DCP format did not save the scale at all (fp16 -> fp16 restarted from initial_scale)."""
    saved = {}
    for precision in ("fp16", "bf16"):
        model = _zmodel(precision)
        opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-3, initial_scale=2.0 ** 10, growth_interval=2)
        _train(model, opt, 3)
        saved[precision] = (float(opt.scale.item()), int(opt._growth_tracker.item()))
        zerofuse.checkpoint.save(str(tmp_path / precision), model, opt, format=fmt)
    assert saved["fp16"][0] != 2.0 ** 10  # the scale moved (grew) during the run
    for src, dst, want in (("fp16", "bf16", (1.0, 0)), ("bf16", "fp16", (2.0 ** 12, 0)),
                           ("fp16", "fp16", saved["fp16"])):
        model = _zmodel(dst)
        opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-3, initial_scale=2.0 ** 12, growth_interval=2)
        zerofuse.checkpoint.load(str(tmp_path / src), model, opt)
        assert (float(opt.scale.item()), int(opt._growth_tracker.item())) == want, (src, dst)


def test_a_dcp_load_with_offload_restores_the_host_step_counters(tmp_path, world_of_one):
    """offload='optimizer' keeps host copies of the step counters: the DCP load left them at 0
    (Adam's bias correction restarted: the resumed losses differed from the second step)."""
    model = _zmodel(offload="optimizer")
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=3e-3)
    _train(model, opt, 3)
    zerofuse.checkpoint.save(str(tmp_path / "ck"), model, opt, format="dcp")
    want = _train(model, opt, 2, seed=1)
    other = _zmodel(offload="optimizer")
    other_opt = zerofuse.zero.Optimizer(other, "adamw", lr=3e-3)
    zerofuse.checkpoint.load(str(tmp_path / "ck"), other, other_opt)
    assert _train(other, other_opt, 2, seed=1) == want


def _grouped(model, first):
    mats = [p for p in model.parameters() if p.dim() >= 2]
    vecs = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": mats, "weight_decay": 0.1}, {"params": vecs, "weight_decay": 0.0, "lr": 5e-3}]
    return zerofuse.zero.Optimizer(model, "adamw", lr=1e-3, param_groups=groups if first == "mats" else groups[::-1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_checkpoints_of_another_model_or_other_groups_are_refused(fmt, tmp_path, world_of_one):
    """DCP loaded a 3-layer checkpoint into a 2-layer model, and applied saved group options by
    position (the vector group got the matrices' weight decay); native checked buffers by name only
    (a [1] buffer broadcast into a [4] one)."""
    big = _zmodel(n_layer=3)
    zerofuse.checkpoint.save(str(tmp_path / "big"), big, format=fmt)
    with pytest.raises(ValueError, match=r"different model; not in the model: \['blocks\.2\."):
        zerofuse.checkpoint.load(str(tmp_path / "big"), _zmodel())
    model = _zmodel()
    opt = _grouped(model, "mats")
    zerofuse.checkpoint.save(str(tmp_path / "groups"), model, opt, format=fmt)
    other = _zmodel()
    if fmt == "dcp":  # (native named neither the group nor the params before)
        with pytest.raises(ValueError, match=r"param group 0 over other params"):
            zerofuse.checkpoint.load(str(tmp_path / "groups"), other, _grouped(other, "vecs"))
    else:  # the groups in another order: each takes the saved group of its own params, and its options
        reordered = _grouped(other, "vecs")
        zerofuse.checkpoint.load(str(tmp_path / "groups"), other, reordered)
        assert [(g["weight_decay"], g["lr"]) for g in reordered.param_groups] == [(0.0, 5e-3), (0.1, 1e-3)]
    one = zerofuse.zero.Optimizer(other, "adamw", lr=1e-3)  # the same params in other groups: refused
    with pytest.raises(ValueError, match=r"(holds params of the checkpoint's param groups \[0, 1\]|has 2 param "
                                         r"groups, the optimizer 1)"):
        zerofuse.checkpoint.load(str(tmp_path / "groups"), other, one)
    # buffers (and frozen params): DCP kept one the checkpoint lacked and failed in torch's planner
    # (a CheckpointException, no ValueError) on a wrong shape (a review's reproduction, 2026-12-06)
    model = _zmodel()
    model.register_buffer("mark", torch.full((1,), 7.0))
    zerofuse.checkpoint.save(str(tmp_path / "buf"), model, format=fmt)
    for name, shape, match in (("mark", 4, r"shape mismatch: \['mark: saved \[1\], model \[4\]'\]"),
                               ("mark2", 1, r"buffers or frozen params missing( in the checkpoint)?: \['mark2'\]")):
        other = _zmodel()
        other.register_buffer("mark", torch.zeros(1))
        other.register_buffer(name, torch.zeros(shape))
        before = {n: t.clone() for n, t in other.state_dict().items()}
        with pytest.raises(ValueError, match=match):
            zerofuse.checkpoint.load(str(tmp_path / "buf"), other)
        assert all(torch.equal(t, before[n]) for n, t in other.state_dict().items())  # nothing half-loaded


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_tensor_lr_saves_and_loads_as_its_value(fmt, tmp_path, world_of_one):
    """Optimizer(lr=torch.tensor(...)) (as sync_lr takes): the native save failed in json.dump and
    left a cut-off meta.json; DCP saved it but could not load it."""
    model = _zmodel()
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=torch.tensor(2e-3))
    _train(model, opt, 1)
    zerofuse.checkpoint.save(str(tmp_path / "ck"), model, opt, format=fmt)
    other = _zmodel()
    other_opt = zerofuse.zero.Optimizer(other, "adamw", lr=1e-3)
    zerofuse.checkpoint.load(str(tmp_path / "ck"), other, other_opt)
    assert float(other_opt.param_groups[0]["lr"]) == pytest.approx(2e-3)


def test_a_write_that_fails_leaves_no_file(tmp_path):
    """meta.json is the mark of a complete checkpoint: a dump that failed halfway left it cut off,
    and the directory counted as complete."""
    with pytest.raises(TypeError, match="not JSON serializable"):
        files.write_json(str(tmp_path / files.META), {"lr": 1e-3, "x": object()})
    assert os.listdir(tmp_path) == [] and not files.complete(str(tmp_path))


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_optimizer_of_another_model_is_named_not_a_key_error(fmt, tmp_path, world_of_one):
    model, other = _zmodel(), _zmodel()
    opt, other_opt = (zerofuse.zero.Optimizer(m, "adamw") for m in (model, other))
    want = r"expected optimizer to be the zerofuse.zero.Optimizer built on this model, got a Optimizer of a different"
    with pytest.raises(ValueError, match=want):
        zerofuse.checkpoint.save(str(tmp_path / "ck"), model, other_opt, format=fmt)
    zerofuse.checkpoint.save(str(tmp_path / "ck"), model, opt, format=fmt)
    with pytest.raises(ValueError, match=want):
        zerofuse.checkpoint.load(str(tmp_path / "ck"), model, other_opt)


def test_a_plain_model_asking_for_an_optimizer_state_that_was_not_saved(tmp_path, world_of_one):
    """A plain model loading a checkpoint saved without an optimizer: AttributeError after the
    model had been overwritten; now a clear error first."""
    zerofuse.checkpoint.save(str(tmp_path / "ck"), _zmodel())
    plain = GPT(GPTConfig(**CFG), seed=5)
    before = {n: t.clone() for n, t in plain.state_dict().items()}
    with pytest.raises(ValueError, match="holds no optimizer state"):
        zerofuse.checkpoint.load(str(tmp_path / "ck"), plain, torch.optim.AdamW(plain.parameters()))
    assert all(torch.equal(t, before[n]) for n, t in plain.state_dict().items())


def test_a_checkpoint_loads_only_into_an_optimizer_of_its_update_rule(tmp_path, world_of_one):
    """A plain model's SGD took adamw's saved state and ignored it (training went on from no
    momentum); an Adam took it with L2 decay in place of decoupled decay; a DCP checkpoint of
    torch's AdamW loaded into zerofuse's 'adam' the same way."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    for fmt in FORMATS:
        model = _zmodel()
        opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-3)
        _train(model, opt, 1)
        zerofuse.checkpoint.save(str(tmp_path / fmt), model, opt, format=fmt)
        for make, name in ((lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "sgd"),
                           (lambda ps: torch.optim.Adam(ps), "adam")):
            plain = GPT(GPTConfig(**CFG), seed=5)
            before = {n: t.clone() for n, t in plain.state_dict().items()}
            with pytest.raises(ValueError, match=f"optimizer is 'adamw', this one is '{name}'"):
                zerofuse.checkpoint.load(str(tmp_path / fmt), plain, make(plain.parameters()))
            assert all(torch.equal(t, before[n]) for n, t in plain.state_dict().items())
        plain = GPT(GPTConfig(**CFG), seed=5)  # the same rule loads
        zerofuse.checkpoint.load(str(tmp_path / fmt), plain, torch.optim.AdamW(plain.parameters()))
    plain = GPT(GPTConfig(**CFG), seed=0)
    torch_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    _, loss = plain(torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long))
    loss.backward()
    torch_opt.step()
    msd, osd = get_state_dict(plain, torch_opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "torch"))
    with pytest.raises(ValueError, match="optimizer is 'adamw', this one is 'adam'"):
        zerofuse.checkpoint.load(str(tmp_path / "torch"), model, zerofuse.zero.Optimizer(model, "adam"))


def _torch_dcp_skipping_a_step(path, split):
    """A plain torch AdamW checkpoint (DCP) in which wte.weight had no grad at the first of 3 steps
    (torch skips it: its count is 2, the others' 3); split: wte.weight in a group of its own."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    plain = GPT(GPTConfig(**CFG), seed=0)
    others = [p for p in plain.parameters() if p is not plain.wte.weight]
    groups = [{"params": [plain.wte.weight]}, {"params": others}] if split else [{"params": list(plain.parameters())}]
    torch_opt = torch.optim.AdamW(groups, lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        b = torch.randint(0, 65, (2, 9), generator=g)
        _, loss = plain(b[:, :-1], b[:, 1:])
        loss.backward()
        if step == 0:
            plain.wte.weight.grad = None
        torch_opt.step()
        torch_opt.zero_grad()
    msd, osd = get_state_dict(plain, torch_opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def test_per_param_step_counts_of_a_torch_dcp_checkpoint_must_agree_in_a_group(tmp_path, world_of_one):
    """torch counts Adam's steps per param; zerofuse's optimizer keeps one count per group: the last
    param's count was loaded for all (a param that had skipped steps got another bias correction)."""
    _torch_dcp_skipping_a_step(str(tmp_path / "one"), split=False)
    model = _zmodel()
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-3)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"param group 0 has several step counts: .*'wte.weight': 2"):
        zerofuse.checkpoint.load(str(tmp_path / "one"), model, opt)
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())  # refused before loading
    _torch_dcp_skipping_a_step(str(tmp_path / "two"), split=True)  # the same run, wte.weight in its own group
    model = _zmodel()
    others = [p for p in model.parameters() if p is not model.wte.weight]
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-3,
                                  param_groups=[{"params": [model.wte.weight]}, {"params": others}])
    zerofuse.checkpoint.load(str(tmp_path / "two"), model, opt)
    assert [float(s) for s in opt._steps] == [2.0, 3.0]


def test_a_param_frozen_at_save_and_trained_at_load_is_named_as_such(tmp_path, world_of_one):
    """A param whose requires_grad differs between save and load was reported as 'missing in the
    checkpoint' (it was there, as a frozen param) or 'not in the model'."""
    model = GPT(GPTConfig(**CFG), seed=0)
    model.blocks[0].attn.qkv.weight.requires_grad_(False)
    zerofuse.zero.parallelize(model, stage=2, bucket_mb=0.05)
    zerofuse.checkpoint.save(str(tmp_path / "frozen"), model)
    zerofuse.checkpoint.save(str(tmp_path / "trained"), _zmodel())
    want = r"frozen when saved, trained by this model: \['blocks.0.attn.qkv.weight'\].*consolidate"
    with pytest.raises(ValueError, match=want):
        zerofuse.checkpoint.load(str(tmp_path / "frozen"), _zmodel())
    model = GPT(GPTConfig(**CFG), seed=0)
    model.blocks[0].attn.qkv.weight.requires_grad_(False)
    zerofuse.zero.parallelize(model, stage=2, bucket_mb=0.05)
    with pytest.raises(ValueError, match=r"trained when saved, frozen in this model: \['blocks.0.attn.qkv.weight'\]"):
        zerofuse.checkpoint.load(str(tmp_path / "trained"), model)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("stage", [1, 3])
def test_a_weights_only_load_reaches_a_live_optimizers_masters(fmt, stage, tmp_path, world_of_one):
    """Fine-tuning from a checkpoint with a fresh optimizer: load(path, model, None) into a bf16 model
    whose zero.Optimizer (fp32 masters) exists already. Its first step (lr 0: no change) keeps the
    loaded weights (it wrote the old masters back over them: a review's reproduction, 2026-11-28)."""
    src = GPT(GPTConfig(**CFG), seed=0).to(torch.bfloat16)
    zerofuse.zero.parallelize(src, stage=stage, precision="bf16", bucket_mb=0.05)
    src_opt = zerofuse.zero.Optimizer(src, "adamw", lr=5e-2)
    _train(src, src_opt, 2)
    zerofuse.checkpoint.save(str(tmp_path / "ck"), src, src_opt, format=fmt)
    with zerofuse.zero.full_params(src):
        want = {n: p.detach().clone() for n, p in src.named_parameters()}
    model = GPT(GPTConfig(**CFG), seed=1).to(torch.bfloat16)  # other weights than the checkpoint's
    zerofuse.zero.parallelize(model, stage=stage, precision="bf16", bucket_mb=0.05)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=0.0, weight_decay=0.0)
    zerofuse.checkpoint.load(str(tmp_path / "ck"), model, None)
    # the saved fp32 masters, not their bf16 rounding (DCP read them in the param dtype, 2026-12-06)
    for mine, saved in zip(opt.unit_states, src_opt.unit_states):
        assert torch.equal(mine["master"], saved["master"])
    _train(model, opt, 1)
    with zerofuse.zero.full_params(model):
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n


def test_a_plain_model_load_is_checked_whole_before_anything_is_written(tmp_path, world_of_one):
    """torch's load_state_dict wrote every matching tensor of a bigger model, then refused; an
    optimizer of other groups was refused after the model was loaded (a review's reproduction,
    2026-11-28): both refused first, the model as it was."""
    zerofuse.checkpoint.save(str(tmp_path / "ck"), (m := _zmodel()), zerofuse.zero.Optimizer(m, "adamw"))
    for n_layer, groups, match in ((3, 1, r"for a different model; missing in the checkpoint: \['blocks.2"),
                                   (2, 2, "has 1 param groups, the optimizer 2")):
        plain = GPT(GPTConfig(**CFG | {"n_layer": n_layer}), seed=5)
        ps = list(plain.parameters())
        opt = torch.optim.AdamW([{"params": ps[:3]}, {"params": ps[3:]}] if groups == 2 else ps)
        before = {n: t.clone() for n, t in plain.state_dict().items()}
        with pytest.raises(ValueError, match=match):
            zerofuse.checkpoint.load(str(tmp_path / "ck"), plain, opt)
        assert all(torch.equal(t, before[n]) for n, t in plain.state_dict().items())


def test_a_plain_bf16_model_takes_the_saved_fp32_values_as_its_optimizers_masters(tmp_path, world_of_one):
    """A bf16 ZeRO run (fp32 masters) loaded into a plain bf16 model with a master-weights optimizer:
    the masters are the saved fp32 values, not rebuilt from the rounded params (a review's
    reproduction, 2026-11-28: the resumed run's second loss differed from the continued run's)."""
    from zerofuse.optim import FusedAdamW

    src = GPT(GPTConfig(**CFG), seed=0).to(torch.bfloat16)
    zerofuse.zero.parallelize(src, stage=1, precision="bf16", bucket_mb=0.05)
    src_opt = zerofuse.zero.Optimizer(src, "adamw", lr=1e-2)
    _train(src, src_opt, 2)
    zerofuse.checkpoint.save(str(tmp_path / "ck"), src, src_opt)
    saved = zerofuse.checkpoint.consolidate(str(tmp_path / "ck"))["model"]
    want = _train(src, src_opt, 2, seed=1)
    plain = GPT(GPTConfig(**CFG), seed=5).to(torch.bfloat16)
    opt = FusedAdamW(plain.parameters(), lr=1e-2, master_weights=True)
    zerofuse.checkpoint.load(str(tmp_path / "ck"), plain, opt)
    for n, p in plain.named_parameters():
        assert saved[n].dtype == torch.float32 and torch.equal(opt.state[p]["master"], saved[n]), n
    assert _train(plain, opt, 2, seed=1) == want


def test_a_plain_optimizer_gets_each_params_state_by_name(tmp_path, world_of_one):
    """torch's load_state_dict hands saved states out by position: an optimizer listing the params
    in another order got other params' moments (silently where two shapes agreed; a review's
    reproduction, 2026-12-06). Now renumbered by name; a group over other params is refused."""
    for fmt in FORMATS:
        path = str(tmp_path / fmt)
        model = _zmodel()
        opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-3)
        _train(model, opt, 2)
        zerofuse.checkpoint.save(path, model, opt, format=fmt)
        want = {n: {k: opt.state[p][k].reshape(p.shape) for k in ("exp_avg", "exp_avg_sq")}
                for n, p in model.named_parameters()}  # (one rank: its pieces are whole)
        plain = GPT(GPTConfig(**CFG), seed=5)
        named = list(plain.named_parameters())[::-1]  # (reversed: same-shaped params trade places too)
        torch_opt = torch.optim.AdamW([p for _, p in named], lr=1e-3)
        zerofuse.checkpoint.load(path, plain, torch_opt)
        for n, p in named:
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(torch_opt.state[p][key], want[n][key]), (fmt, n, key)
        fresh = GPT(GPTConfig(**CFG), seed=5)  # the group's size, one of its params not the model's
        other = torch.nn.Parameter(torch.zeros(3))
        with pytest.raises(ValueError, match="param group 0 of the optimizer holds 'a tensor that is not a param"):
            zerofuse.checkpoint.load(path, fresh, torch.optim.AdamW(list(fresh.parameters())[:-1] + [other]))


def test_a_lamb_or_lars_dcp_checkpoint_is_refused_by_a_plain_optimizer_of_another_rule(tmp_path, world_of_one):
    """A DCP checkpoint carries no torch option saying LAMB or LARS: the kind came from
    decoupled_weight_decay alone and a LAMB state loaded into AdamW or SGD silently (a review's
    reproduction, 2026-12-06); zerofuse's meta.json names it."""
    for kind in ("lamb", "lars"):
        model = _zmodel()
        opt = zerofuse.zero.Optimizer(model, kind, lr=1e-3)
        _train(model, opt, 1)
        zerofuse.checkpoint.save(str(tmp_path / kind), model, opt, format="dcp")
        for make, name in ((torch.optim.AdamW, "adamw"), (lambda ps: torch.optim.SGD(ps, lr=0.1), "sgd")):
            plain = GPT(GPTConfig(**CFG), seed=5)
            with pytest.raises(ValueError, match=f"optimizer is '{kind}', this one is '{name}'"):
                zerofuse.checkpoint.load(str(tmp_path / kind), plain, make(plain.parameters()))


# ------------------------------------------------- checkpoints inside full_params (a review, 2026-12-07)

@pytest.mark.parametrize("stage,precision", [(3, "fp32"), (3, "bf16"), (1, "bf16")])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_save_inside_full_params_holds_the_blocks_writes(stage, precision, fmt, tmp_path, world_of_one):
    """The shards (stage 3) and fp32 masters (bf16) take the block's writes at its exit: a save
    inside it wrote those of before the edit while the live model held the edit."""
    model = zerofuse.zero.parallelize(GPT(GPTConfig(**CFG), seed=0), stage=stage, precision=precision)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-2)
    _train(model, opt, 1)
    with zerofuse.zero.full_params(model):
        with torch.no_grad():
            model.wte.weight.fill_(0.5)
        zerofuse.checkpoint.save(str(tmp_path / "ck"), model, opt, format=fmt)
    saved = zerofuse.checkpoint.consolidate(str(tmp_path / "ck"))["model"]["wte.weight"]
    assert torch.equal(saved, torch.full_like(saved, 0.5)), saved


@pytest.mark.parametrize("with_optimizer", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_stage3_load_inside_full_params_or_after_a_lone_forward_is_kept(fmt, with_optimizer, tmp_path,
                                                                         world_of_one):
    """The units gathered at the load (inside full_params, where the stage-3 load_state_dict error
    sends users, or left gathered by a forward with grad and no backward) kept their old values,
    and the block's exit (or the next forward) wrote or read those over the load."""
    src = zerofuse.zero.parallelize(GPT(GPTConfig(**CFG), seed=0), stage=3)
    src_opt = zerofuse.zero.Optimizer(src, "adamw", lr=1e-2)
    _train(src, src_opt, 3)
    path = str(tmp_path / "ck")
    zerofuse.checkpoint.save(path, src, src_opt, format=fmt)
    want = zerofuse.checkpoint.consolidate(path)["model"]
    idx = torch.randint(0, 65, (2, 9), generator=torch.Generator().manual_seed(1))
    for where in ("full_params", "after_forward"):
        model = zerofuse.zero.parallelize(GPT(GPTConfig(**CFG), seed=1), stage=3)
        opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-2)
        if where == "full_params":
            with zerofuse.zero.full_params(model):
                zerofuse.checkpoint.load(path, model, opt if with_optimizer else None)
        else:
            model(idx[:, :-1], idx[:, 1:])  # (a NaN loss, say: no backward, a rollback)
            zerofuse.checkpoint.load(path, model, opt if with_optimizer else None)
            loss = model(idx[:, :-1], idx[:, 1:])[1]
            plain = GPT(GPTConfig(**CFG), seed=1)
            plain.load_state_dict(want)
            assert loss.item() == pytest.approx(plain(idx[:, :-1], idx[:, 1:])[1].item(), rel=1e-6), where
        with zerofuse.zero.full_params(model):
            for name, p in model.named_parameters():
                assert torch.equal(p.detach(), want[name]), (where, name)
