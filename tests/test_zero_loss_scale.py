"""zero.Optimizer's fp16 dynamic loss scale (torch.amp.GradScaler's rules) at its edges: an fp16
loss scaled in fp32, a floor (min_scale, DeepSpeed's min_loss_scale), and zerofuse-train's stop
when a run skips every step at that floor (a review's reproductions, 2026-12-06)."""
import pytest
import torch

pytestmark = pytest.mark.usefixtures("world_of_one", "native_kernels")


def _model_and_opt(**kw):
    import zerofuse

    torch.manual_seed(0)
    model = zerofuse.zero.parallelize(torch.nn.Linear(8, 4), stage=2, precision="fp16")
    return model, zerofuse.zero.Optimizer(model, "adamw", lr=1e-3, **kw)


def test_an_fp16_loss_is_scaled_in_fp32():
    """The scale was cast to the loss's dtype: 2**16 in fp16 is inf, so the scaled loss was inf (its
    backward still seeds an fp16 loss with 2**16, inf in fp16, as GradScaler's does: that first
    step is skipped either way; an fp32 loss is not)."""
    model, opt = _model_and_opt()
    loss = model(torch.randn(3, 8).half()).float().pow(2).mean().half()
    scaled = opt.scale_loss(loss)
    assert scaled.dtype == torch.float32 and scaled.shape == loss.shape
    assert torch.isfinite(scaled) and scaled.item() == pytest.approx(loss.item() * 2 ** 16, rel=1e-6)
    opt.scale_loss(model(torch.randn(3, 8).half()).float().pow(2).mean()).backward()  # an fp32 loss
    opt.step()
    assert not bool(opt.last_step_skipped) and opt.loss_scale == 2 ** 16


def test_an_initial_scale_below_one_is_its_own_floor():
    """min_scale's default 1 refused initial_scale=0.5 (fp16 or not) after min_scale came in (a
    review's reproduction, 2026-12-06): the floor is the lower of the two."""
    _, opt = _model_and_opt(initial_scale=0.5)
    assert opt.min_scale == 0.5 and opt.loss_scale == 0.5


def test_the_scale_stops_at_min_scale():
    """Backed off on every overflow, the scale reached 0 after ~165 of them (from 2**16): 0 * grad
    was NaN on every later step, each skipped, the run finishing as a success."""
    model, opt = _model_and_opt(initial_scale=4.0, min_scale=1.0)
    x = torch.randn(3, 8).half()
    for _ in range(4):
        opt.scale_loss(model(x).float().sum() * float("nan")).backward()
        opt.step()
        opt.zero_grad()
        assert bool(opt.last_step_skipped)
    assert opt.loss_scale == 1.0
    before = model.weight.detach().clone()
    opt.scale_loss(model(x).float().pow(2).mean()).backward()
    opt.step()
    assert not bool(opt.last_step_skipped) and not torch.equal(model.weight, before)


@pytest.mark.parametrize("kw,want", [(dict(min_scale=0.0), "expected min_scale in (0, initial_scale=65536.0], got 0.0"),
                                     (dict(initial_scale=8.0, min_scale=16.0),
                                      "expected min_scale in (0, initial_scale=8.0], got 16.0")])
def test_min_scale_is_checked(kw, want):
    with pytest.raises(ValueError) as e:
        _model_and_opt(**kw)
    assert want in str(e.value)


def test_the_job_stops_when_a_window_is_all_skipped_at_the_floor():
    from zerofuse.train.metrics import check_not_stuck

    _, opt = _model_and_opt(initial_scale=1.0, min_scale=1.0)
    skipped = [{"step": 3, "skipped": True}, {"step": 4, "skipped": True}]
    with pytest.raises(RuntimeError, match=r"every step since the last log point \(3-4\) was skipped"):
        check_not_stuck(opt, skipped)
    check_not_stuck(opt, skipped[:1] + [{"step": 4}])  # one step trained: not stuck
    _, above = _model_and_opt(initial_scale=2.0, min_scale=1.0)
    check_not_stuck(above, skipped)  # the scale can still back off
