"""Activation offload (zerofuse/models/recompute.py, ``model.activation_offload``): what "full" and
"selective" checkpointing keep (block inputs; also the kept matmul outputs under "selective") is
copied to host memory in forward and back in backward, with the loss and grads of the same model
without offload bit for bit (also under ZeRO-3); params and small tensors stay put; refused without
checkpointing; the job's --activation-offload flag."""
import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zerofuse
from zerofuse import train
from zerofuse.models import GPT, GPTConfig, recompute

from dist_utils import run_distributed
from test_recompute import CFG
from train_common import _ok, metrics, run

pytestmark = pytest.mark.usefixtures("native_kernels")

X = torch.randint(0, 65, (8, 65), generator=torch.Generator().manual_seed(0))
MOE = dict(CFG, mlp="swiglu", moe_experts=4, moe_top_k=2, moe_bias_rate=1e-3)


def _cpu_bf16_attention() -> bool:
    """torch's CPU flash attention in bf16 (zerofuse's CPU attention path) needs ATEN_CPU_CAPABILITY
    avx512: at avx2 or default it raises 'pack_vnni2 is only supported when avx512 is supported'."""
    q = torch.zeros(1, 4, 64, 24, dtype=torch.bfloat16)
    try:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, True, scale=1.0)
    except RuntimeError:
        return False
    return True


BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not _cpu_bf16_attention(), reason=(
    "torch's CPU bf16 flash attention needs ATEN_CPU_CAPABILITY avx512")))


def _model(mode, offload, cfg=CFG, dtype=torch.float32, device="cpu"):
    model = GPT(GPTConfig(**cfg), seed=0).to(device=device, dtype=dtype)
    model.activation_checkpointing, model.activation_offload = mode, offload
    return model


def _step(model, device="cpu"):
    x = X.to(device)
    loss = model(x[:, :-1], x[:, 1:])[1]
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _spy(monkeypatch):
    """Wrap the offload's pack and unpack: a row per host copy made (the saved tensor, weakly; whether
    it was a param; the copy) and the count of copies brought back."""
    log = dict(copies=[], back=0)
    to_host, from_host = recompute._to_host, recompute._from_host

    def pack(t):
        packed = to_host(t)
        if packed is not t:
            param = isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad)
            log["copies"].append((weakref.ref(t), param, packed))
        return packed

    def unpack(packed):
        log["back"] += isinstance(packed, recompute._OnHost)
        return from_host(packed)

    monkeypatch.setattr(recompute, "_to_host", pack)
    monkeypatch.setattr(recompute, "_from_host", unpack)
    return log


class _CountKept(TorchDispatchMode):
    """The outputs the selective policy keeps (recompute.SAVED ops) that are big enough to offload."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.n += func in recompute.SAVED and out.numel() >= recompute.MIN_NUMEL
        return out


def _expected_copies(model, mode):
    """Per block: its tensor inputs (x; the pending delta from the second block on), plus under
    "selective" the kept matmul outputs, counted in a plain forward of the blocks."""
    n = 2 * len(model.blocks) - 1
    if mode == "selective":
        with torch.no_grad():
            x, delta = model.embed(X[:, :-1]), None
            for block in model.blocks:
                with _CountKept() as count:
                    x, delta = block(x, delta)
                assert count.n > 0
                n += count.n - 1  # (the last is the block's output: not copied)
    return n


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_offloaded_loss_and_grads_are_the_same_bits(mode, dtype):
    base_loss, base = _step(_model(mode, False, dtype=dtype))
    loss, grads = _step(_model(mode, True, dtype=dtype))
    assert torch.equal(loss, base_loss)
    for n, g in base.items():
        assert torch.equal(grads[n], g), n


def test_offloaded_moe_grads_are_the_same_bits():
    base_loss, base = _step(_model("selective", False, cfg=MOE))
    loss, grads = _step(_model("selective", True, cfg=MOE))
    assert torch.equal(loss, base_loss)
    for n, g in base.items():
        assert torch.equal(grads[n], g), n


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_what_checkpointing_keeps_is_copied_to_the_host(mode, monkeypatch):
    log = _spy(monkeypatch)
    model = _model(mode, True)
    x = X[:, :-1]
    loss = model(x, X[:, 1:])[1]
    copies = log["copies"]
    assert len(copies) == _expected_copies(model, mode) > 0
    assert not any(param for _, param, _ in copies)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for _, _, packed in copies:
        assert packed.host.device.type == "cpu" and packed.host.untyped_storage().data_ptr() not in params
    gc.collect()
    assert all(ref() is None for ref, _, _ in copies)  # the originals are not held until backward
    loss.backward()
    # every copy is brought back: "selective" stops recomputing a block once backward has what it
    # needs, so the block's last kept output (the MLP's down projection, the block's output) is not
    # copied (it was, and never read back, before 2026-12-07)
    assert log["back"] == len(copies)


def _zero3_rank(rank, ws, offload):
    model = _model("selective", offload)
    zerofuse.zero.parallelize(model, stage=3)
    x = torch.randint(0, 65, (4, 33), generator=torch.Generator().manual_seed(rank))
    model(x[:, :-1], x[:, 1:])[1].backward()
    with zerofuse.zero.full_grads(model):
        return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_offload_under_zero3():
    base = run_distributed(_zero3_rank, 2, False, timeout=120)[0]
    got = run_distributed(_zero3_rank, 2, True, timeout=120)[0]
    for n, g in base.items():
        assert torch.equal(got[n], g), n


def test_params_small_and_integer_tensors_are_not_offloaded():
    w = torch.nn.Parameter(torch.randn(64, 64))
    assert not recompute.offloadable(w) and not recompute.offloadable(w.t())
    assert not recompute.offloadable(torch.randn(recompute.MIN_NUMEL - 1))
    assert not recompute.offloadable(torch.zeros(4096, dtype=torch.long))
    assert recompute.offloadable(torch.randn(64, 64, requires_grad=True) * 2)
    t = torch.randn(64, 64)
    packed = recompute._to_host(t)
    assert packed.host is not t and torch.equal(packed.host, t) and recompute._from_host(packed) is packed.host
    assert recompute._to_host(w) is w


def test_offload_without_checkpointing_is_refused():
    model = _model("none", True)
    with pytest.raises(ValueError, match=r"expected activation_offload with activation_checkpointing 'full' or "
                                         r"'selective' .*got activation_offload=True with activation_checkpointing "
                                         r"'none'"):
        model(X[:, :-1], X[:, 1:])
    model.activation_checkpointing = "full"
    for bad in ("yes", 1, 1.0, None):  # (1 and 1.0 were taken as True)
        model.activation_offload = bad
        with pytest.raises(ValueError, match=rf"expected activation_offload True or False, got {bad!r}"):
            model(X[:, :-1], X[:, 1:])


def test_job_flag_without_checkpointing_is_a_usage_error(capsys, tmp_path):
    assert train.main(["--activation-offload", "--out", str(tmp_path)]) == train.EXIT_USAGE
    err = capsys.readouterr().err
    assert "--activation-offload: expected --activation-checkpointing full or selective, got none" in err
    assert err.count("\n") == 1, err


@pytest.mark.timeout(120)
def test_job_with_activation_offload_matches_without(tmp_path):
    steps = ["--model", "tiny", "--nproc", 1, "--steps", 3, "--eval-every", 0, "--sample-tokens", 0,
             "--activation-checkpointing", "selective"]
    _ok(run(*steps, "--out", tmp_path / "base"))
    _ok(run(*steps, "--activation-offload", "--out", tmp_path / "offload"))
    got, base = metrics(tmp_path / "offload"), metrics(tmp_path / "base")
    assert [m["loss"] for m in got] == [m["loss"] for m in base] and len(got) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_cuda_offload_uses_pinned_host_copies(mode, monkeypatch):
    """bf16 on one GPU: the copies are pinned CPU tensors made on a side stream (an event each), and
    the loss and grads are those without offload."""
    base_loss, base = _step(_model(mode, False, dtype=torch.bfloat16, device="cuda"), "cuda")
    log = _spy(monkeypatch)
    loss, grads = _step(_model(mode, True, dtype=torch.bfloat16, device="cuda"), "cuda")
    torch.cuda.synchronize()
    assert log["copies"] and log["back"] > 0
    for _, param, packed in log["copies"]:
        assert not param and packed.host.device.type == "cpu" and packed.host.is_pinned()
        assert packed.event is not None and packed.device.type == "cuda"
    assert torch.equal(loss, base_loss)
    for n, g in base.items():
        assert torch.equal(grads[n], g), n


def test_the_host_cache_serves_the_list_layout_of_older_torch():
    """Torch releases before 2.13's per-call index kept an op's saved outputs in a list (append in
    forward, pop(0) in recompute): the offloading cache had only 2.13's dict face (AttributeError
    'append' there); both faces give the entries back in order."""
    from torch.utils.checkpoint import _VersionWrapper

    a, b = torch.randn(3), torch.randn(2)
    old = recompute._HostCache()
    old.append(_VersionWrapper(a))
    old.append(_VersionWrapper(b))
    assert torch.equal(old.pop(0).val, a) and torch.equal(old.pop(0).val, b) and len(old) == 0
    new = recompute._HostCache()
    new[0], new[1] = _VersionWrapper(a), _VersionWrapper(b)
    assert torch.equal(new.get(1).val, b) and torch.equal(new.get(0).val, a)


def test_a_kept_output_changed_in_place_before_its_copy_is_refused():
    """Selective offload copies each kept output once the next is kept (the block's output: never):
    an in-place op on it in between went into the copy, and recompute applied it twice (grads 11
    off, silently: a review's reproduction, 2026-12-07). Refused, as torch refuses it without
    offload."""
    g = torch.Generator().manual_seed(0)
    w1, w2 = (torch.randn(64, 64, generator=g).requires_grad_() for _ in range(2))

    def block(x):
        return (torch.nn.functional.silu(x @ w1, inplace=True) @ w2).sin()

    x = torch.randn(32, 64, generator=g)
    with pytest.raises(RuntimeError, match="cached during selective activation checkpoint has been mutated"):
        recompute.run(block, "selective", x, offload=False).sum().backward()
    with pytest.raises(RuntimeError, match="zerofuse.models.recompute: a tensor kept by selective activation "
                                           "checkpointing was changed in place before it went to the host"):
        recompute.run(block, "selective", x, offload=True).sum().backward()
