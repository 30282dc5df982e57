"""The torch.optim contract where a review (2026-11-27) found zerofuse's optimizers silently
different from torch.optim (each test failed before its fix): resuming bf16 params from the
optimizer's own state_dict, Adam's per-group decoupled_weight_decay, amsgrad set in a group, a
group's max_grad_norm; zerofuse.zero.Optimizer's param-group options, a tensor lr under sync_lr,
add_param_group; a parallelized model's torch surfaces (zero_grad, load_state_dict, state_dict and
param reads at stage 3, conversions, requires_grad changed after parallelize)."""
from __future__ import annotations

import copy

import pytest
import torch

import zerofuse
from zerofuse.optim import FusedAdam, FusedAdamW, FusedLAMB

from optim_common import small_model, train_steps
from tolerances import assert_close

pytestmark = pytest.mark.usefixtures("cpu_kernels")



@pytest.mark.parametrize("master_weights", [True, False])
def test_bf16_params_resume_from_their_own_state_dict_bit_for_bit(master_weights):
    """torch's load_state_dict casts every floating state to its param's dtype: the fp32 masters
    and moments of bf16 params came back bf16 (the next step refused the master; without masters
    the moments were rounded: 4.8e-4 off an uninterrupted run after 5 steps)."""
    straight = small_model(torch.bfloat16)
    opt = FusedAdamW(straight.parameters(), lr=1e-2, master_weights=master_weights)
    train_steps(straight, opt, 3)
    saved_model, saved = copy.deepcopy(straight.state_dict()), copy.deepcopy(opt.state_dict())
    train_steps(straight, opt, 5, start=3)
    resumed = small_model(torch.bfloat16, seed=1)
    resumed.load_state_dict(saved_model)
    opt2 = FusedAdamW(resumed.parameters(), lr=1e-2, master_weights=master_weights)
    opt2.load_state_dict(saved)
    for p in resumed.parameters():
        keys = ("exp_avg", "exp_avg_sq") + (("master",) if master_weights else ())
        assert all(opt2.state[p][k].dtype == torch.float32 for k in keys)
    train_steps(resumed, opt2, 5, start=3)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), opt2.state.values()):
        for k in a:
            assert torch.equal(a[k].float(), b[k].float()), k


def test_adams_decoupled_weight_decay_is_read_per_group():
    """torch.optim.Adam reads decoupled_weight_decay per group (set there, added with a group, or
    loaded from an AdamW's state_dict); FusedAdam applied the constructor's to every group
    (0.015-0.018 off)."""
    results = []
    for cls in (torch.optim.Adam, FusedAdam):
        model = small_model()
        ps = list(model.parameters())
        opt = cls([{"params": ps[:2]}], lr=1e-2, weight_decay=0.1)
        opt.add_param_group({"params": ps[2:], "decoupled_weight_decay": True})
        train_steps(model, opt, 3)
        opt.param_groups[0]["decoupled_weight_decay"] = True
        train_steps(model, opt, 3, start=3)
        results.append(list(model.parameters()))
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # an AdamW's state dict loaded into FusedAdam steps as AdamW (torch.optim.Adam does)
    for cls in (torch.optim.Adam, FusedAdam):
        src = small_model()
        adamw = torch.optim.AdamW(src.parameters(), lr=1e-2, weight_decay=0.1)
        train_steps(src, adamw, 2)
        opt = cls(src.parameters(), lr=1e-2, weight_decay=0.1)
        opt.load_state_dict(adamw.state_dict())
        train_steps(src, opt, 3, start=2)
        results.append(list(src.parameters()))
    for a, b in zip(results[2], results[3]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_amsgrad_in_a_group_is_refused_not_ignored():
    model = small_model()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match=r"amsgrad=True in a param group is not supported"):
        train_steps(model, opt, 1)
    src = small_model()
    torch_opt = torch.optim.Adam(src.parameters(), lr=1e-2, amsgrad=True)
    train_steps(src, torch_opt, 1)
    opt = FusedAdam(src.parameters(), lr=1e-2)
    opt.load_state_dict(torch_opt.state_dict())
    with pytest.raises(ValueError, match="amsgrad"):
        train_steps(src, opt, 1)


@pytest.mark.parametrize("cls", [FusedAdamW, FusedLAMB])
def test_a_groups_max_grad_norm_is_the_threshold(cls):
    """Every group carries max_grad_norm (torch.optim puts the defaults there): changing it in
    param_groups, as one changes the lr, takes effect (it was read from the constructor's only);
    groups disagreeing is an error (the norm is global)."""
    want_model, got_model = small_model(), small_model()
    want = cls(want_model.parameters(), lr=1e-2, max_grad_norm=0.05)
    got = cls(got_model.parameters(), lr=1e-2, max_grad_norm=1.0)
    for g in got.param_groups:
        g["max_grad_norm"] = 0.05
    train_steps(want_model, want, 3)
    train_steps(got_model, got, 3)
    for a, b in zip(want_model.parameters(), got_model.parameters()):
        assert torch.equal(a, b)
    ps = list(got_model.parameters())
    split = cls([{"params": ps[:2]}, {"params": ps[2:], "max_grad_norm": 2.0}], lr=1e-2, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="expected one max_grad_norm in every param group"):
        train_steps(got_model, split, 1)


def test_zero_optimizer_refuses_what_it_would_ignore(world_of_one):
    """zerofuse.zero.Optimizer: a param group asking for maximize / amsgrad / the other Adam's decay,
    or a max_grad_norm of its own, is refused (they were accepted and ignored: 0.16 off
    torch.optim.Adam with maximize); add_param_group after construction says why (a bare IndexError
    before). Other keys (a group name) stay allowed, as in torch."""
    model = zerofuse.zero.parallelize(small_model(), stage=1)
    ps = list(model.parameters())
    for kind, extra, msg in (("adam", {"maximize": True}, "'maximize'] = True is not supported"),
                             ("adam", {"amsgrad": True}, "'amsgrad'] = True"),
                             ("adam", {"decoupled_weight_decay": True}, "choose optimizer='adamw' or 'adam'"),
                             ("adamw", {"decoupled_weight_decay": False}, "choose optimizer='adamw' or 'adam'"),
                             ("adamw", {"max_grad_norm": 1.0}, "clipping is global"),
                             # (accepted in a group and dropped, though refused as keywords: 2026-12-07)
                             ("lars", {"dampening": 0.5}, "'dampening'] = 0.5 is not supported"),
                             ("adamw", {"bias_correction": False}, "'bias_correction'] = False is not supported"),
                             ("lamb", {"grad_averaging": False}, "'grad_averaging'] = False is not supported")):
        with pytest.raises(TypeError, match=msg):
            zerofuse.zero.Optimizer(model, kind, param_groups=[{"params": ps, **extra}])
    opt = zerofuse.zero.Optimizer(model, "adamw", param_groups=[{"params": ps, "name": "all", "maximize": False}])
    with pytest.raises(NotImplementedError, match="add_param_group after construction"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    opt.param_groups[0]["maximize"] = True  # set after construction (or loaded): refused at the step
    with pytest.raises(TypeError, match="'maximize'] = True is not supported"):
        train_steps(model, opt, 1)
    opt.param_groups[0]["maximize"] = False
    import numpy as np  # a scheduler's table of numpy floats (accepted before the per-step check; torch takes them)
    opt.param_groups[0]["lr"], opt.param_groups[0]["betas"] = np.float32(1e-3), (np.float32(0.9), np.float64(0.99))
    train_steps(model, opt, 1)
    for key, value in (("lr", -1.0), ("betas", (1.5, 0.9)), ("eps", float("inf"))):  # (these were stepped with)
        opt.param_groups[0][key], before = value, opt.param_groups[0][key]
        with pytest.raises(ValueError, match=rf"param_groups\[0\]\['?{key}'?\]"):
            train_steps(model, opt, 1)
        opt.param_groups[0][key] = before
    train_steps(model, opt, 1)


def test_fused_adam_takes_max_grad_norm_0_as_no_clipping():
    """0 is no clipping for every optimizer (FusedAdam/W refused it, FusedLAMB/LARS and a group's
    value took it so: a review, 2026-12-06)."""
    got = []
    for mgn in (0, None):
        model = small_model()
        opt = FusedAdamW(model.parameters(), lr=1e-2, max_grad_norm=mgn)
        train_steps(model, opt, 3)
        got.append([p.detach().clone() for p in model.parameters()])
        assert opt.last_grad_norm is None
    for a, b in zip(*got):
        assert torch.equal(a, b)


def test_zero_optimizer_sync_lr_follows_a_tensor_lr_updated_in_place(world_of_one):
    """torch's schedulers write a tensor lr in place: sync_lr compared the tensor with itself and
    kept the first value (0.06 off torch after 10 steps); it copies the tensor every call."""
    results = []
    for zero in (False, True):
        model = small_model()
        if zero:
            model = zerofuse.zero.parallelize(model, stage=1)
            opt = zerofuse.zero.Optimizer(model, "adamw", lr=torch.tensor(0.01))
            opt.sync_lr()
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3)
        for i in range(6):
            train_steps(model, opt, 1, start=i)
            sched.step()
            if zero:
                opt.sync_lr()
        with zerofuse.zero.full_params(model) if zero else torch.no_grad():
            results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_zero_grad_of_a_parallelized_model_clears_its_grads(stage, world_of_one):
    """model.zero_grad() (as torch training loops call it) on a parallelized model: the grads live in
    the units' shards, which Module.zero_grad never touched, so every step added all earlier grads
    (0.045 off the plain model after 5 steps); it is now the Optimizer's zero_grad."""
    plain, wrapped = small_model(), zerofuse.zero.parallelize(small_model(), stage=stage)
    opts = (torch.optim.AdamW(plain.parameters(), lr=1e-2), zerofuse.zero.Optimizer(wrapped, "adamw", lr=1e-2))
    for model, opt in zip((plain, wrapped), opts):
        for i in range(5):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            model.zero_grad()
    with zerofuse.zero.full_params(wrapped):
        for a, b in zip(plain.parameters(), wrapped.parameters()):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_weights_loaded_into_a_bf16_parallelized_model_are_the_ones_trained(stage, world_of_one):
    """bf16 params keep fp32 masters in the Optimizer: model.load_state_dict wrote the params and
    the next step wrote the old masters back over them (0.66 off the loaded weights after one step
    at lr 1e-6). The model's load hook now refreshes the masters."""
    model = zerofuse.zero.parallelize(small_model(), stage=stage, precision="bf16")
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-6, weight_decay=0.0)
    train_steps(model, opt, 2)
    loaded = {k: v.clone() for k, v in small_model(torch.bfloat16, seed=7).state_dict().items()}
    model.load_state_dict(loaded)
    train_steps(model, opt, 1, start=2)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, loaded[name], rtol=0, atol=1e-2, msg=name)


def test_stage3_state_dict_outside_full_params_raises_instead_of_crashing(world_of_one):
    """At stage 3 the params outside a forward/backward are freed shards (storage resized to 0):
    model.state_dict() handed them out and reading them crashed the process (SIGSEGV), and
    load_state_dict wrote into them. Now both raise saying what to use; inside full_params the
    state dict is the model's."""
    plain = small_model()
    model = zerofuse.zero.parallelize(small_model(), stage=3)
    with pytest.raises(RuntimeError, match=r"state_dict\(\) at stage 3 outside zerofuse.zero.full_params"):
        model.state_dict()
    with pytest.raises(RuntimeError, match=r"load_state_dict\(\) at stage 3.*zerofuse.checkpoint.load"):
        model.load_state_dict(plain.state_dict())
    with zerofuse.zero.full_params(model):
        got = model.state_dict()
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    assert set(model.state_dict(keep_vars=True)) == set(plain.state_dict())  # (the Parameters, as checkpoints list them)


def test_stage3_params_read_outside_a_gather_are_nan_placeholders_of_their_shape(world_of_one):
    """Outside a forward/backward or full_params, a stage-3 param's storage is freed: reading it
    (a norm, an EMA, print) crashed the process (SIGSEGV). Now it reads as NaNs of the param's
    shape, dtype and numel (parameter counts stay right), an in-place write raises, and gathers
    and training are unchanged."""
    plain = small_model()
    model = zerofuse.zero.parallelize(small_model(), stage=3)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-2)
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for step in range(2):
        for m in (model, plain):
            assert [(p.shape, p.dtype) for p in m.parameters()] == [(p.shape, p.dtype) for p in plain.parameters()]
        assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in plain.parameters())
        for p in model.parameters():
            assert torch.isnan(p.detach().sum()), "a freed param read as values"
        with pytest.raises(RuntimeError, match="single memory location"):
            with torch.no_grad():
                model[0].weight.mul_(0.5)
        with zerofuse.zero.full_params(model):
            for p, q in zip(model.parameters(), plain.parameters()):
                assert_close(p, q, op="training_params")
        train_steps(model, opt, 1, start=step)
        train_steps(plain, ref_opt, 1, start=step)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_converting_a_parallelized_model_raises_instead_of_detaching_its_params(stage, world_of_one):
    """model.double() / .half() / .to(dtype) after parallelize replaced each param's data (a view
    into the buckets) with a copy nothing steps: at stages 0-2 the loss stayed the same step after
    step, at stage 3 a kernel failed on mixed dtypes. Now a conversion that would change a param
    raises before anything (a buffer either) is converted; no-op conversions pass."""
    plain = small_model()
    model = zerofuse.zero.parallelize(small_model(), stage=stage)
    model.register_buffer("scale", torch.ones(3))
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-2)
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    assert model.to(torch.float32) is model and model.float() is model and model.cpu() is model
    for convert in (lambda m: m.double(), lambda m: m.half(), lambda m: m.to(torch.bfloat16),
                    lambda m: m[2].to(torch.float64)):
        with pytest.raises(RuntimeError, match=r"after parallelize would replace (0|2)\.weight's data .*before "
                                               r"zerofuse.zero.parallelize"):
            convert(model)
    assert model.scale.dtype == torch.float32
    train_steps(model, opt, 2)
    train_steps(plain, ref_opt, 2)
    with zerofuse.zero.full_params(model):
        for p, q in zip(model.parameters(), plain.parameters()):
            assert_close(p, q, op="training_params")


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("change", ["unfreeze", "freeze"])
def test_requires_grad_changed_after_parallelize_raises_at_the_step(stage, change, world_of_one):
    """A param unfrozen after parallelize was never stepped (0.30 off torch after 3 steps), one frozen
    after it was still stepped on zero grads (1e-3 off: torch.optim skips it). Now the step raises
    naming the param, before changing anything; set back, training goes on as torch's."""
    plain, model = small_model(), small_model()
    if change == "unfreeze":
        for m in (plain, model):
            m[0].weight.requires_grad_(False)
    zerofuse.zero.parallelize(model, stage=stage)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2)
    model[0].weight.requires_grad_(change == "unfreeze")
    x = torch.randn(5, 8)
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match=r"0\.weight\.requires_grad changed after parallelize \(was "
                                           + ("False, now True" if change == "unfreeze" else "True, now False")):
        opt.step()
    model[0].weight.requires_grad_(change != "unfreeze")
    opt.zero_grad()
    train_steps(model, opt, 2)
    train_steps(plain, ref_opt, 2)
    with zerofuse.zero.full_params(model):
        for p, q in zip(model.parameters(), plain.parameters()):
            assert_close(p, q, op="training_params")


def test_stage3_backward_twice_through_a_retained_graph_matches_torch(world_of_one):
    """loss.backward(retain_graph=True) then loss.backward(): the second backward found the root
    unit (embedding and tied head) freed by the first and failed in the head's backward ('setStorage
    ... out of bounds for storage of size 0'). Now the root is gathered again; both grads add up."""
    from zerofuse.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=65, seq_len=32, n_layer=2, n_head=4, n_kv_head=2, dim=48)
    plain, model = GPT(cfg, seed=0), zerofuse.zero.parallelize(GPT(cfg, seed=0), stage=3)
    opts = (zerofuse.zero.Optimizer(model, "adamw", lr=1e-2), torch.optim.AdamW(plain.parameters(), lr=1e-2))
    x = torch.randint(0, 65, (4, 17), generator=torch.Generator().manual_seed(0))
    for m, opt in zip((model, plain), opts):
        for _ in range(2):
            logits, _ = m(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
            loss.backward(retain_graph=True)
            loss.backward()
            opt.step()
            opt.zero_grad()
    with zerofuse.zero.full_params(model):
        for p, q in zip(model.parameters(), plain.parameters()):
            assert_close(p, q, op="training_params")
