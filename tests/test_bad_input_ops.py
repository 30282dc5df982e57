"""Bad input to zerofuse's ops (issue 22): the C++ ops called directly and the attention op on
empty input (in a child process, so a missing check fails its row instead of crashing the
session), the optimizer, attention and norm ops on both their paths (C++ / torch CPU kernels;
Triton kernels, in the interpreter here) and their fake impls, and the flat-shard functions.
Tables and runners: tests/bad_input.py."""
from __future__ import annotations

import math

import pytest
import torch

import zerofuse
from zerofuse import kernels
from zerofuse.ops import adam_, l2norm, lamb_, lamb_stage1_, lamb_stage2_, lars_
from zerofuse.ops.l2norm import clip_inputs
from zerofuse.optim import functional as F

from bad_input import TARGET, Behaviour, Case, assert_isolated, params, print_census, run_isolated

ops = torch.ops.zerofuse
z = torch.zeros
r = torch.randn
BF16, F64, I64, META = torch.bfloat16, torch.float64, torch.int64, "meta"
ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
LAMB = dict(beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0)
LARS = dict(lr=0.1, momentum=0.9, weight_decay=0.0, trust_coefficient=1e-3)


def one() -> list:
    return [torch.zeros(())]


def _adam_cpp(params, grads, m, v, masters=(), steps=None, grad_mult=None, found_inf=None):
    steps = [torch.zeros(()) for _ in params] if steps is None else steps
    ops.adam_(params, grads, m, v, list(masters), steps, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, False, grad_mult,
              found_inf)


def _lamb_cpp(trust_mode):
    ops.lamb_([z(4)], [z(4)], [z(4)], [z(4)], [], one(), 1e-3, 0.9, 0.999, 1e-6, 0.0, True, trust_mode, 0.0, 10.0,
              None, None)


def _norm_fwd(x, weight=None, bias=None, residual=None):
    return ops.norm_fwd_cpu(x, weight, bias, residual, 1e-5, False)


def _norm_bwd(dy, x, weight=None, mean=None, rstd=None, dh=None):
    m = x.shape[0] if x.dim() == 2 else 1
    mean = z(m) if mean is None else mean
    rstd = torch.ones(m) if rstd is None else rstd
    return ops.norm_bwd_cpu(dy, dh, x, weight, None, mean, rstd, False)


def _sdpa_empty_matches_torch(shape_q, shape_k):
    from zerofuse.nn.functional import scaled_dot_product_attention as sdpa

    q, k = r(*shape_q), r(*shape_k)
    with pytest.warns(UserWarning, match="empty input"):
        got = sdpa(q, k, k)
    assert got.shape == torch.nn.functional.scaled_dot_product_attention(q, k, k).shape


def _attention_empty(shape_q, shape_k, causal=False):
    """zerofuse::attention and its backward on an empty batch, head count, query or key length: zeros
    (torch's sdpa gives zeros for a query with no key), lse -inf, zero gradients (no kernel runs)."""
    leaves = [r(*s, requires_grad=True) for s in (shape_q, shape_k, shape_k)]
    out, lse = ops.attention(*leaves, causal, 0.5)
    assert out.shape == leaves[0].shape and lse.shape == leaves[0].shape[:3]
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -math.inf).all())
    if leaves[0].shape[1] == leaves[1].shape[1] > 0:
        torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(
            *leaves, is_causal=causal, scale=0.5))
    out.backward(torch.ones_like(out))
    for t in leaves:
        assert t.grad.shape == t.shape and not t.grad.any()


def _in_fake_mode(call):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # fake tensors may be on cuda without a GPU
        return call()


# C++ ops called directly, run with ZEROFUSE_TRITON_ON_CPU=0 in a child process
NATIVE = [
    Case("flatten_into-flat-2d", zerofuse.flatten_into, lambda: ([r(4)], z(2, 4), [0]), RuntimeError,
         r"expected flat to be a 1-D contiguous tensor, got shape \[2, 4\]"),
    Case("flatten_into-flat-strided", zerofuse.flatten_into, lambda: ([r(4)], z(8, 2)[:, 0], [0]), RuntimeError,
         r"expected flat to be a 1-D contiguous tensor, got shape \[8\] with strides \[2\]"),
    Case("flatten_into-offsets-length", zerofuse.flatten_into, lambda: ([r(2), r(2)], z(8), [0]), ValueError,
         r"expected len\(offsets\) == len\(tensors\) == 2, got len\(offsets\) == 1"),
    Case("flatten_into-offset-negative", zerofuse.flatten_into, lambda: ([r(4)], z(8), [-1]), ValueError,
         r"offsets\[0\] = -1 .*runs outside flat"),
    Case("flatten_into-offset-past-end", zerofuse.flatten_into, lambda: ([r(4)], z(8), [6]), ValueError,
         r"offsets\[0\] = 6 .*runs outside flat"),
    Case("flatten_into-offset-overflowing", zerofuse.flatten_into, lambda: ([r(4)], z(8), [2**63 - 2]), ValueError,
         r"offsets\[0\] = 9223372036854775806 .*runs outside flat"),
    Case("flatten_into-ranges-overlap", zerofuse.flatten_into, lambda: ([r(4), r(4)], z(8), [0, 2]), ValueError,
         r"tensors\[0\] \[0, 4\) and tensors\[1\] \[2, 6\) overlap"),
    Case("flatten_into-tensor-on-meta", zerofuse.flatten_into, lambda: ([r(4, device=META)], z(8), [0]), RuntimeError,
         r"expected tensors\[0\] on the device of flat \(cpu\), got meta"),
    Case("flatten_into-flat-bool", zerofuse.flatten_into, lambda: ([r(4)], z(8, dtype=torch.bool), [0]), RuntimeError,
         r"expected flat to have a real, non-bool dtype, got Bool"),
    Case("flatten_into-tensor-complex", zerofuse.flatten_into, lambda: ([r(2, dtype=torch.complex64)], z(8), [0]),
         RuntimeError, r"expected tensors\[0\] to have a real, non-bool dtype, got ComplexFloat"),
    Case("unflatten_from-flat-2d", zerofuse.unflatten_from, lambda: (z(2, 4), [r(4)], [0]), RuntimeError,
         r"expected flat to be a 1-D contiguous tensor, got shape \[2, 4\]"),
    Case("unflatten_from-offset-negative", zerofuse.unflatten_from, lambda: (z(8), [r(4)], [-3]), ValueError,
         r"offsets\[0\] = -3 .*runs outside flat"),
    Case("unflatten_from-offset-overflowing", zerofuse.unflatten_from, lambda: (z(8), [r(4)], [2**63 - 1]),
         ValueError, r"offsets\[0\] = 9223372036854775807 .*runs outside flat"),
    Case("unflatten_from-ranges-overlap", zerofuse.unflatten_from, lambda: (z(8), [r(4), r(3)], [1, 3]), ValueError,
         r"\[1, 5\) and .*\[3, 6\) overlap"),
    Case("norm_fwd_cpu-weight-short", _norm_fwd, lambda: (r(2, 1000), r(3)), RuntimeError,
         r"expected weight to be a float32, float16 or bfloat16 cpu tensor of 1000 elements .*got Float \[3\]"),
    Case("norm_fwd_cpu-bias-short", _norm_fwd, lambda: (r(2, 1000), None, r(999)), RuntimeError,
         r"expected bias to be .* of 1000 elements .*got Float \[999\]"),
    Case("norm_fwd_cpu-weight-int", _norm_fwd, lambda: (r(2, 8), torch.ones(8, dtype=I64)), RuntimeError,
         r"expected weight to be a float32, float16 or bfloat16 cpu tensor of 8 elements .*got Long"),
    Case("norm_fwd_cpu-x-1d", _norm_fwd, lambda: (r(8),), RuntimeError,
         r"expected x of 2 dims \(rows, hidden\) with a hidden size >= 1, got shape \[8\]"),
    Case("norm_fwd_cpu-x-strided", _norm_fwd, lambda: (r(2, 8).t(),), RuntimeError,
         r"expected x to be a contiguous \(8, 2\) tensor, got shape \[8, 2\] with strides \[1, 8\]"),
    Case("norm_fwd_cpu-x-int", _norm_fwd, lambda: (torch.ones(2, 8, dtype=I64),), RuntimeError,
         r"expected x in float32, float16 or bfloat16, got Long"),
    Case("norm_fwd_cpu-residual-shape", _norm_fwd, lambda: (r(2, 8), None, None, r(2, 7)), RuntimeError,
         r"expected residual to be a contiguous \(2, 8\) tensor, got shape \[2, 7\]"),
    Case("norm_bwd_cpu-weight-short", _norm_bwd, lambda: (r(2, 1000), r(2, 1000), r(3)), RuntimeError,
         r"expected weight to be .* of 1000 elements .*got Float \[3\]"),
    Case("norm_bwd_cpu-mean-int", _norm_bwd, lambda: (r(2, 8), r(2, 8), None, z(2, dtype=I64)), RuntimeError,
         r"expected mean to be a contiguous float32 cpu tensor of 2 elements \(one per row\), got Long"),
    Case("norm_bwd_cpu-rstd-rows", _norm_bwd, lambda: (r(2, 8), r(2, 8), None, None, torch.ones(3)), RuntimeError,
         r"expected rstd to be a contiguous float32 cpu tensor of 2 elements \(one per row\), got Float \[3\]"),
    Case("norm_bwd_cpu-dy-shape", _norm_bwd, lambda: (r(2, 7), r(2, 8)), RuntimeError,
         r"expected dy to be a contiguous \(2, 8\) tensor, got shape \[2, 7\]"),
    Case("norm_bwd_cpu-dh-shape", _norm_bwd, lambda: (r(2, 8), r(2, 8), None, None, None, r(1, 8)), RuntimeError,
         r"expected dh to be a contiguous \(2, 8\) tensor, got shape \[1, 8\]"),
    Case("adam_-cpp-param-twice", lambda p: _adam_cpp([p, p], [r(4), r(4)], [z(4), z(4)], [z(4), z(4)]),
         lambda: (r(4),), ValueError, r"expected params\[1\] not to share memory with params\[0\]"),
    Case("adam_-cpp-state-is-param", lambda p: _adam_cpp([p], [r(4)], [p], [z(4)]), lambda: (r(4),), ValueError,
         r"expected exp_avgs\[0\] not to share memory with params\[0\]"),
    Case("adam_-cpp-views-overlap", lambda f: _adam_cpp([f[:4], f[2:]], [r(4), r(4)], [z(4), z(4)], [z(4), z(4)]),
         lambda: (r(6),), ValueError, r"expected params\[1\] not to share memory with params\[0\]"),
    Case("adam_-cpp-step-negative", _adam_cpp, lambda: ([r(4)], [r(4)], [z(4)], [z(4)], (), [torch.tensor(-5.0)]),
         ValueError, r"expected steps\[0\] >= 0 before the step, got -5"),
    Case("adam_-cpp-step-nan", _adam_cpp, lambda: ([r(4)], [r(4)], [z(4)], [z(4)], (), [torch.tensor(math.nan)]),
         ValueError, r"expected steps\[0\] >= 0 before the step, got nan"),
    Case("adam_-cpp-grad_mult-shape", _adam_cpp, lambda: ([r(4)], [r(4)], [z(4)], [z(4)], (), None, z(2)),
         RuntimeError, r"expected grad_mult to be a 1-element cpu tensor, got shape \[2\]"),
    Case("adam_-cpp-found_inf-shape", _adam_cpp, lambda: ([r(4)], [r(4)], [z(4)], [z(4)], (), None, None, z(3)),
         RuntimeError, r"expected found_inf to be a 1-element cpu tensor, got shape \[3\]"),
    Case("lamb_-cpp-trust_mode", _lamb_cpp, lambda: (5,), ValueError,
         r"expected trust_mode 0 \(paper\) or 1 \(nvlamb\), got 5"),
    Behaviour("sdpa-native-empty-queries", lambda: _sdpa_empty_matches_torch((1, 2, 0, 8), (1, 2, 5, 8))),
    Behaviour("sdpa-native-empty-batch", lambda: _sdpa_empty_matches_torch((0, 2, 5, 8), (0, 2, 5, 8))),
    Behaviour("sdpa-native-head-dim-0", lambda: _sdpa_empty_matches_torch((1, 2, 5, 0), (1, 2, 5, 0))),
    Behaviour("attention-native-empty-batch", lambda: _attention_empty((0, 2, 5, 8), (0, 2, 5, 8), True)),
    Behaviour("attention-native-no-heads", lambda: _attention_empty((1, 0, 5, 8), (1, 0, 5, 8))),
    Behaviour("attention-native-no-query-heads-gqa", lambda: _attention_empty((1, 0, 5, 8), (1, 2, 5, 8))),
    Behaviour("attention-native-no-queries", lambda: _attention_empty((1, 4, 0, 8), (1, 2, 5, 8))),
    Behaviour("attention-native-no-keys", lambda: _attention_empty((1, 2, 5, 8), (1, 2, 0, 8), True)),
]

# zerofuse::attention and the norm ops: checked in Python before any kernel (Triton on CUDA and
# interpreted; C++ / torch CPU kernels), on both paths, and by their fake impls
ATT = "zerofuse::attention"
NORM_W = r"expected weight to be a 1-D floating-point tensor of 1000 elements \(the hidden size\) on cpu, got "
TENSOR_OPS = [
    Case("attention-key-on-meta", ops.attention, lambda: (r(1, 2, 5, 8), r(1, 2, 5, 8, device=META), r(1, 2, 5, 8),
                                                          False, 0.5),
         ValueError, ATT + r": expected key on the device of query \(cpu\), got meta"),
    Case("attention-value-bf16", ops.attention, lambda: (r(1, 2, 5, 8), r(1, 2, 5, 8), r(1, 2, 5, 8, dtype=BF16),
                                                         False, 0.5),
         TypeError, ATT + r": expected value of the dtype of query \(torch.float32\), got torch.bfloat16"),
    Case("attention-kv-heads-0", ops.attention, lambda: (r(1, 2, 5, 8), r(1, 0, 5, 8), r(1, 0, 5, 8), False, 0.5),
         ValueError, ATT + r": expected the key/value heads \(0\) to divide the query heads \(2\)"),
    Case("attention_backward-key-f64", ops.attention_backward,
         lambda: (r(1, 2, 5, 8), r(1, 2, 5, 8), r(1, 2, 5, 8, dtype=F64), r(1, 2, 5, 8), r(1, 2, 5, 8), z(1, 2, 5),
                  False, 0.5),
         TypeError, ATT + r"_backward: expected key of the dtype of query \(torch.float32\), got torch.float64"),
    Case("attention_backward-dout-bf16", ops.attention_backward,
         lambda: (r(1, 2, 5, 8, dtype=BF16), *[r(1, 2, 5, 8)] * 4, z(1, 2, 5), False, 0.5),
         TypeError, ATT + r"_backward: expected dout of the dtype of query \(torch.float32\), got torch.bfloat16"),
    Case("attention_backward-lse-rows", ops.attention_backward,
         lambda: (*[r(1, 2, 5, 8)] * 5, z(1, 2, 4), False, 0.5), ValueError,
         ATT + r"_backward: expected lse to be a floating-point tensor of shape \[1, 2, 5\] on cpu, got torch.float32 "
               r"\[1, 2, 4\]"),
    Case("attention-fake-value-on-cuda", _in_fake_mode, lambda: (lambda: ops.attention(
        r(1, 2, 5, 8), r(1, 2, 5, 8), r(1, 2, 5, 8, device="cuda"), False, 0.5),), ValueError,
         ATT + r": expected value on the device of query \(cpu\), got cuda"),
    Case("layer_norm-weight-short", ops.layer_norm, lambda: (r(2, 1000), r(3), None, None, 1e-5), RuntimeError,
         r"zerofuse::layer_norm: " + NORM_W + r"torch.float32 \[3\] on cpu"),
    Case("layer_norm-bias-short", ops.layer_norm, lambda: (r(2, 1000), r(1000), r(999), None, 1e-5), RuntimeError,
         r"zerofuse::layer_norm: expected bias to be .* of 1000 elements .*got torch.float32 \[999\] on cpu"),
    Case("rms_norm-weight-int", ops.rms_norm, lambda: (r(2, 1000), torch.ones(1000, dtype=I64), None, 1e-5),
         RuntimeError, r"zerofuse::rms_norm: " + NORM_W + r"torch.int64 \[1000\] on cpu"),
    Case("rms_norm-weight-on-meta", ops.rms_norm, lambda: (r(2, 1000), r(1000, device=META), None, 1e-5),
         RuntimeError, r"zerofuse::rms_norm: " + NORM_W + r"torch.float32 \[1000\] on meta"),
    Case("layer_norm-residual-rows", ops.layer_norm, lambda: (r(4, 8), None, None, r(2, 8), 1e-5), RuntimeError,
         r"zerofuse::layer_norm: expected residual to be a floating-point tensor of x's shape \[4, 8\] on cpu, got "
         r"torch.float32 \[2, 8\]"),
    Case("layer_norm_backward-rstd-rows", ops.layer_norm_backward,
         lambda: (r(4, 8), None, r(4, 8), None, None, z(4), torch.ones(2)), RuntimeError,
         r"zerofuse::layer_norm_backward: expected rstd to be a floating-point tensor of 4 elements \(one per row of "
         r"x\) on cpu, got torch.float32 \[2\]"),
    Case("rms_norm_backward-weight-short", ops.rms_norm_backward,
         lambda: (r(2, 1000), None, r(2, 1000), r(7), torch.ones(2)), RuntimeError,
         r"zerofuse::rms_norm_backward: " + NORM_W + r"torch.float32 \[7\]"),
    Case("layer_norm-fake-weight-on-cuda", _in_fake_mode, lambda: (lambda: ops.layer_norm(
        r(2, 8), r(8, device="cuda"), None, None, 1e-5),), RuntimeError,
         r"zerofuse::layer_norm: expected weight .* of 8 elements \(the hidden size\) on cpu, got torch.float32 \[8\] "
         r"on cuda"),
    Case("layer_norm-meta-weight-short", ops.layer_norm, lambda: (r(2, 1000, device=META), r(3, device=META), None,
                                                                  None, 1e-5),
         RuntimeError, r"zerofuse::layer_norm: expected weight .* of 1000 elements .* on meta, got torch.float32 \[3\]"),
    Case("rms_norm-fake-residual-rows", _in_fake_mode, lambda: (lambda: ops.rms_norm(r(4, 8), None, r(3, 8), 1e-5),),
         RuntimeError, r"zerofuse::rms_norm: expected residual .* of x's shape \[4, 8\] on cpu, got torch.float32 "
                       r"\[3, 8\]"),
    Case("layer_norm_backward-meta-mean-rows", ops.layer_norm_backward,
         lambda: (r(4, 8, device=META), None, r(4, 8, device=META), None, None, z(3, device=META), z(4, device=META)),
         RuntimeError, r"layer_norm_backward: expected mean to be .* of 4 elements .* on meta, got torch.float32 \[3\]"),
    Case("rms_norm_backward-fake-weight-on-cuda", _in_fake_mode, lambda: (lambda: ops.rms_norm_backward(
        r(4, 8), None, r(4, 8), r(8, device="cuda"), r(4)),), RuntimeError,
         r"zerofuse::rms_norm_backward: expected weight .* on cpu, got torch.float32 \[8\] on cuda"),
    Case("norm_fwd_cpu-meta-weight-short", ops.norm_fwd_cpu, lambda: (r(2, 8, device=META), r(3, device=META), None,
                                                                      None, 1e-5, False),
         RuntimeError, r"zerofuse::norm_cpu: expected weight to be a float32, float16 or bfloat16 meta tensor of 8 "
                       r"elements \(the hidden size\), got torch.float32 \[3\] on meta"),
    Case("norm_bwd_cpu-fake-rstd-rows", _in_fake_mode, lambda: (lambda: ops.norm_bwd_cpu(
        r(2, 8), None, r(2, 8), None, None, z(0), torch.ones(3), True),), RuntimeError,
         r"zerofuse::norm_cpu: expected rstd to be a contiguous float32 cpu tensor of 2 elements \(one per row\), "
         r"got torch.float32 \[3\]"),
]

# zerofuse.ops' optimizer faces, on the C++ and the Triton path (their checks are separate code)
NORMS = r"lamb_stage1_: expected norms to be a contiguous float32 (cpu )?tensor "
OPTIM_OPS = [
    Case("adam_-state-list-short", adam_, lambda: ([r(5)], [r(5)], [], [z(5)], one()), ValueError,
         r"zerofuse::adam_: expected exp_avgs to have one tensor per param \(1\), got 0", ADAM),
    Case("adam_-state-bf16", adam_, lambda: ([r(5)], [r(5)], [z(5, dtype=BF16)], [z(5)], one()), RuntimeError,
         r"expected exp_avgs\[0\] in float32, got .*(BFloat16|bfloat16)", ADAM),
    Case("adam_-grad-numel", adam_, lambda: ([r(5)], [r(4)], [z(5)], [z(5)], one()), ValueError,
         r"expected grads\[0\] to have 5 elements like params\[0\], got 4", ADAM),
    Case("adam_-param-strided", adam_, lambda: ([r(5, 2).t()], [r(2, 5)], [z(10)], [z(10)], one()), RuntimeError,
         r"expected params\[0\] to be contiguous, got strides \[1, 2\]", ADAM),
    Case("adam_-param-float64", adam_, lambda: ([r(5, dtype=F64)], [r(5)], [z(5)], [z(5)], one()), RuntimeError,
         r"expected params\[0\] in float32, bfloat16 or float16, got .*(Double|float64)", ADAM),
    Case("adam_-grad-on-meta", adam_, lambda: ([r(5)], [r(5, device=META)], [z(5)], [z(5)], one()), RuntimeError,
         r"expected grads\[0\] on the device of params\[0\] \(cpu\), got meta", ADAM),
    Case("adam_-params-two-devices", adam_, lambda: ([r(5), r(5, device=META)], [r(5), r(5)], [z(5), z(5)],
                                                     [z(5), z(5)], one() * 2), RuntimeError,
         r"expected params\[1\] on cpu.*got meta", ADAM),
    Case("adam_-steps-short", adam_, lambda: ([r(5)], [r(5)], [z(5)], [z(5)], []), ValueError,
         r"expected steps to have one tensor per param \(1\), got 0", ADAM),
    Case("adam_-step-int", adam_, lambda: ([r(5)], [r(5)], [z(5)], [z(5)], [z((), dtype=I64)]), RuntimeError,
         r"expected steps\[0\] to be a 1-element float32", ADAM),
    Case("adam_-masters-length", adam_, lambda: ([r(5)], [r(5)], [z(5)], [z(5)], one()), ValueError,
         r"expected masters to be empty or of length 1, got 2", lambda: dict(ADAM, masters=[z(5), z(5)])),
    Case("adam_-master-bf16", adam_, lambda: ([r(5)], [r(5)], [z(5)], [z(5)], one()), RuntimeError,
         r"expected masters\[0\] in float32", lambda: dict(ADAM, masters=[z(5, dtype=BF16)])),
    Case("adam_-param-twice", lambda p: adam_([p, p], [r(4)] * 2, [z(4), z(4)], [z(4), z(4)], one() * 2, **ADAM),
         lambda: (r(4),), ValueError, r"zerofuse::adam_: expected params\[1\] not to share memory with params\[0\]"),
    Case("adam_-moments-alias", lambda m: adam_([r(4)], [r(4)], [m], [m], one(), **ADAM), lambda: (z(4),),
         ValueError, r"expected exp_avg_sqs\[0\] not to share memory with exp_avgs\[0\]"),
    Case("adam_-master-is-param", lambda p: adam_([p], [r(4)], [z(4)], [z(4)], one(), masters=[p], **ADAM),
         lambda: (r(4),), ValueError, r"expected masters\[0\] not to share memory with params\[0\]"),
    Case("adam_-param-views-overlap", lambda f: adam_([f[:4], f[3:]], [r(4)] * 2, [z(4), z(4)], [z(4), z(4)],
                                                       one() * 2, **ADAM),
         lambda: (r(7),), ValueError, r"expected params\[1\] not to share memory with params\[0\]"),
    Case("lamb_-mode", lamb_, lambda: ([r(5)], [r(5)], [z(5)], [z(5)], one()), ValueError,
         r"zerofuse::lamb_: expected mode 'paper' or 'nvlamb', got 'x'", dict(LAMB, lr=1.0, mode="x")),
    Case("lamb_-param-twice", lambda p: lamb_([p, p], [r(4)] * 2, [z(4), z(4)], [z(4), z(4)], one() * 2, lr=1.0,
                                              **LAMB),
         lambda: (r(4),), ValueError, r"zerofuse::lamb_.*expected params\[1\] not to share memory with params\[0\]"),
    Case("lamb_stage1_-norms-shape", lamb_stage1_, lambda: ([r(5)], [r(5)], [z(5)], [z(5)], one(), z(2)),
         RuntimeError, NORMS + r"of shape \[1, 2\]", LAMB),
    Case("lamb_stage1_-norms-float64", lamb_stage1_,
         lambda: ([r(5)], [r(5)], [z(5)], [z(5)], one(), z(1, 2, dtype=F64)), RuntimeError,
         NORMS + r".*(Double|float64)", LAMB),
    Case("lamb_stage2_-norms-on-meta", lamb_stage2_, lambda: ([r(5)], [z(5)], [z(5)], one(), z(1, 2, device=META)),
         RuntimeError, r"lamb_stage2_: expected norms (on the params' device \(cpu\)|.* cpu tensor).*meta",
         dict(LAMB, lr=1.0)),
    Case("lamb_stage2_-mode", lamb_stage2_, lambda: ([r(5)], [z(5)], [z(5)], one(), z(1, 2)), ValueError,
         r"lamb_stage2_: expected mode 'paper' or 'nvlamb', got 'adam'", dict(LAMB, lr=1.0, mode="adam")),
    Case("lars_-norms-shape", lars_, lambda: ([r(5)], [r(5)], [z(5)]), RuntimeError,
         r"lars_: expected norms to be a contiguous float32 (cpu )?tensor of shape \[2\]",
         lambda: dict(LARS, norms=z(3))),
    Case("lars_-buffer-bf16", lars_, lambda: ([r(5)], [r(5)], [z(5, dtype=BF16)]), RuntimeError,
         r"expected momentum_buffers\[0\] in float32", LARS),
    Case("lars_-param-twice", lambda p: lars_([p, p], [r(4)] * 2, [z(4), z(4)], **LARS), lambda: (r(4),), ValueError,
         r"zerofuse::lars_: expected params\[1\] not to share memory with params\[0\]"),
    Case("lars_-buffer-is-param", lambda p: lars_([p], [r(4)], [p], **LARS), lambda: (r(4),), ValueError,
         r"expected momentum_buffers\[0\] not to share memory with params\[0\]"),
    Case("l2norm-int", l2norm, lambda: ([torch.ones(3, dtype=torch.int32)],), RuntimeError,
         r"l2norm: expected tensors\[0\] in float32, bfloat16 or float16, got .*(Int|int32)"),
    Case("l2norm-two-devices", l2norm, lambda: ([r(3), r(3, device=META)],), RuntimeError,
         r"l2norm: expected tensors\[1\] on cpu.*got meta"),
    Case("l2norm-strided", l2norm, lambda: ([r(3, 2).t()],), RuntimeError,
         r"l2norm: expected tensors\[0\] to be contiguous, got strides \[1, 2\]"),
]
PATHS = ("cpp", "triton")
OPTIM_OP_PARAMS = [pytest.param(c, p, id=f"{c.id}-{p}") for c in OPTIM_OPS for p in PATHS]
TENSOR_OP_PARAMS = [pytest.param(c, p, id=f"{c.id}-{p}") for c in TENSOR_OPS for p in PATHS]

# path-independent checks of the flat-shard functions and helpers
FLAT = [
    Case("clip_inputs-max_norm-0", clip_inputs, lambda: ([r(3)], 0.0), ValueError,
         r"clip_inputs: expected max_norm > 0, got 0.0"),
    Case("clip_inputs-max_norm-nan", clip_inputs, lambda: ([r(3)], math.nan), ValueError,
         r"clip_inputs: expected max_norm > 0, got nan"),
    Case("adamw_flat-param-2d", F.adamw_flat, lambda: (z(2, 3), z(6), z(6), z(6), z(())), ValueError,
         r"expected param to be a 1-D contiguous tensor, got shape \[2, 3\]", dict(lr=1e-3)),
    Case("adamw_flat-grad-strided", F.adamw_flat, lambda: (z(4), z(4, 2)[:, 0], z(4), z(4), z(())), ValueError,
         r"expected grad to be a 1-D contiguous tensor, got shape \[4\] with strides \[2\]", dict(lr=1e-3)),
    Case("adamw_flat-moments-alias", lambda m: F.adamw_flat(r(4), r(4), m, m, z(()), lr=1e-3), lambda: (z(4),),
         ValueError, r"expected exp_avg_sqs\[0\] not to share memory with exp_avgs\[0\]"),
    Case("lamb_flat-segment-past-end", F.lamb_flat, lambda: (z(5), z(5), z(5), z(5), z(()), [(0, 3), (3, 9)]),
         ValueError, r"segments\[1\] = \(3, 9\) runs outside the flat buffer of 5 elements", dict(lr=1e-3)),
    Case("lamb_flat-segment-negative", F.lamb_flat, lambda: (z(5), z(5), z(5), z(5), z(()), [(-1, 2)]), ValueError,
         r"segments\[0\] = \(-1, 2\) runs outside the flat buffer", dict(lr=1e-3)),
    Case("lamb_flat-segments-overlap", F.lamb_flat, lambda: (z(8), z(8), z(8), z(8), z(()), [(0, 4), (2, 2)]),
         ValueError, r"expected disjoint segments, got segments\[0\] = \(0, 4\) and segments\[1\] = \(2, 2\) "
                     r"overlapping", dict(lr=1e-3)),
    Case("packed_offsets-align-0", zerofuse.packed_offsets, lambda: ([3, 4], 0), ValueError,
         r"expected align >= 1, got 0"),
    Case("packed_offsets-tensors", zerofuse.packed_offsets, lambda: ([z(3), z(4)],), TypeError,
         r"expected numels\[0\] to be an element count .*got a tensor of shape \[3\]"),
    Case("packed_offsets-fraction", zerofuse.packed_offsets, lambda: ([3, 4.5],), TypeError,
         r"expected numels\[1\] to be an element count .*got 4.5"),
]


def _bad_step_changes_no_count():
    steps = [torch.tensor(3.0), torch.tensor(-1.0)]
    with pytest.raises(ValueError, match=r"steps\[1\] >= 0"):
        adam_([r(2), r(2)], [r(2), r(2)], [z(2), z(2)], [z(2), z(2)], steps, **ADAM)
    assert [s.item() for s in steps] == [3.0, -1.0]  # checked before any is advanced


def _nan_grad_gives_a_non_finite_norm_and_a_skip_flag():
    g = r(5)
    g[2] = math.nan
    mult, found, norm = clip_inputs([r(3), g], 1.0)
    assert math.isnan(norm.item()) and found.item() == 1.0


def _empty_lists_are_no_ops():
    assert adam_([], [], [], [], [], **ADAM) is None
    total, each = l2norm([], per_tensor=True)
    assert total.item() == 0.0 and each.numel() == 0
    from torch._subclasses.fake_tensor import FakeTensorMode  # the op itself: none to dispatch on, refused
    with FakeTensorMode(), pytest.raises(RuntimeError, match="zerofuse::l2norm: expected at least one tensor"):
        torch.ops.zerofuse.l2norm([], True, None, 0)  # (its fake gave CPU results for what the op refuses)


def _empty_tensors_step():
    p, steps = [z(0), r(3)], [z(()), z(())]
    before = p[1].clone()
    adam_(p, [z(0), torch.ones(3)], [z(0), z(3)], [z(0), z(3)], steps, **dict(ADAM, lr=0.1))
    assert [s.item() for s in steps] == [1.0, 1.0]
    torch.testing.assert_close(p[1], before - 0.1, rtol=0, atol=1e-6)  # Adam's first step is lr * sign(g)


BEHAVIOUR = [
    Behaviour("adam_-cpp-bad-step-leaves-every-count", _bad_step_changes_no_count),
    Behaviour("clip_inputs-nan-grad-flags-a-skip", _nan_grad_gives_a_non_finite_norm_and_a_skip_flag),
    Behaviour("ops-empty-lists", _empty_lists_are_no_ops),
    Behaviour("adam_-empty-tensor-beside-others", _empty_tensors_step),
]

TABLES = {"C++ ops (isolated)": NATIVE, "optimizer ops x 2 paths": OPTIM_OP_PARAMS,
          "attention and norm ops x 2 paths": TENSOR_OP_PARAMS, "flat shards": FLAT,
          "documented behaviour": BEHAVIOUR}


@pytest.fixture(scope="module")
def native_results():
    return run_isolated(__name__, "NATIVE", [row.id for row in NATIVE], {"ZEROFUSE_TRITON_ON_CPU": "0"})


@pytest.mark.parametrize("row", params(NATIVE))
def test_native_op(row, native_results):
    assert_isolated(row, native_results[row.id])


@pytest.mark.parametrize("case,path", OPTIM_OP_PARAMS + TENSOR_OP_PARAMS)
def test_tensor_op(case, path, monkeypatch):
    if path == "triton" and not kernels.interpreted():
        pytest.skip("Triton on CPU tensors needs the interpreter (ZEROFUSE_TRITON_ON_CPU=1 before import)")
    monkeypatch.setattr(kernels, "TRITON_ON_CPU", path == "triton")
    case.check()


@pytest.mark.parametrize("case", params(FLAT))
def test_flat(case):
    case.check()


@pytest.mark.parametrize("row", params(BEHAVIOUR))
def test_behaviour(row, cpu_kernels):
    row.check()


def test_case_count(capsys):
    assert print_census(__name__, capsys) >= TARGET
