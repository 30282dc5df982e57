// CPU kernel of zerofuse::adam_ (Adam / AdamW over many tensors, or one flat ZeRO shard).
//
// Per element, in fp32, the same sequence of operations as torch.optim's Adam/AdamW:
//   g  = grad * inv_grad_scale            (fused unscale; negated when maximize)
//   p  = master or param                  (fp32 master weights when params are bf16/fp16)
//   AdamW: p *= 1 - lr * wd      Adam: g += wd * p
//   m  = lerp(m, g, 1 - beta1)
//   v  = v * beta2 + (1 - beta2) * g * g
//   p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
// then the param is written (rounded once) from p. Elements are processed in chunks of one tensor
// at a time, spread over threads by bytes; the arithmetic loop is an omp-simd loop inside
// target_clones (AVX-512 / AVX2 / baseline) so it vectorises at the machine's width.
#include "../checks.h"
#include "convert.h"
#include "spans.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace zerofuse {
namespace {

constexpr int64_t kChunk = 4096;  // elements converted at a time into stack buffers
constexpr int64_t kSpan = 1 << 16;  // elements per span / group of spans (spans.h)

// Scalars are derived in double and rounded once, as torch.optim passes Python floats to its ops:
// float(1 - beta1) differs from 1 - float(beta1).
struct AdamConsts {
  float beta1, beta2, eps, wd, w1, w2, decay, step_size, bc2_sqrt, inv_scale;
  bool decoupled, maximize;
};

ZF_VECTOR_CLONES void adam_chunk(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                                 float* __restrict__ v, int64_t n, const AdamConsts c) {
  // c by value: through a reference its fields were reloaded in every iteration (2.6x slower)
  const float w1 = c.w1, w2 = c.w2, decay = c.decay;
  const float sign = c.maximize ? -c.inv_scale : c.inv_scale;
  const bool decoupled = c.decoupled, l2 = !c.decoupled && c.wd != 0.f;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i] * sign;
    float pi = p[i];
    if (decoupled) pi *= decay;
    if (l2) gi += c.wd * pi;
    // torch's lerp for weights < 0.5 (1 - beta1 for any usual beta1): m + w * (g - m)
    const float mi = w1 < 0.5f ? m[i] + w1 * (gi - m[i]) : gi - (gi - m[i]) * c.beta1;
    const float vi = v[i] * c.beta2 + w2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi - c.step_size * (mi / (std::sqrt(vi) / c.bc2_sqrt + c.eps));
  }
}

void check_lists(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList masters) {
  const char* op = "adam_";
  const size_t n = params.size();
  ZF_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n, op,
                 "expected params, grads, exp_avgs and exp_avg_sqs of the same length, got ", n, ", ", grads.size(),
                 ", ", exp_avgs.size(), ", ", exp_avg_sqs.size());
  ZF_CHECK_VALUE(masters.empty() || masters.size() == n, op, "expected masters to be empty or of length ", n, ", got ",
                 masters.size());
  auto low_or_float = [](at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; };
  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = params[i].numel();
    ZF_CHECK(params[i].device().is_cpu(), op, "expected ", indexed("params", i), " on cpu, got ", params[i].device());
    ZF_CHECK(low_or_float(params[i].scalar_type()), op, "expected ", indexed("params", i),
             " in float32, bfloat16 or float16, got ", params[i].scalar_type());
    ZF_CHECK(low_or_float(grads[i].scalar_type()), op, "expected ", indexed("grads", i),
             " in float32, bfloat16 or float16, got ", grads[i].scalar_type());
    for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{params[i], "params"},
                                  {grads[i], "grads"}, {exp_avgs[i], "exp_avgs"}, {exp_avg_sqs[i], "exp_avg_sqs"}}) {
      ZF_CHECK(t.is_contiguous(), op, "expected ", indexed(name, i), " to be contiguous, got strides ", t.strides());
      ZF_CHECK_VALUE(t.numel() == numel, op, "expected ", indexed(name, i), " to have ", numel,
                     " elements like params[", i, "], got ", t.numel());
      check_same_device(t, params[i], op, indexed(name, i), indexed("params", i));
    }
    for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{exp_avgs[i], "exp_avgs"},
                                  {exp_avg_sqs[i], "exp_avg_sqs"}}) {
      ZF_CHECK(t.scalar_type() == at::kFloat, op, "expected ", indexed(name, i), " in float32, got ", t.scalar_type());
    }
    if (!masters.empty()) {
      const at::Tensor& t = masters[i];
      ZF_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == numel, op, "expected ",
               indexed("masters", i), " to be a contiguous float32 tensor of ", numel, " elements, got ",
               t.scalar_type(), " ", t.sizes());
    }
  }
}

void adam_cpu(at::TensorList params,       // n tensors (any shape), fp32/bf16/fp16, updated in place
              at::TensorList grads,        // n tensors like params, fp32/bf16/fp16
              at::TensorList exp_avgs,     // n fp32 tensors like params, updated
              at::TensorList exp_avg_sqs,  // n fp32 tensors like params, updated
              at::TensorList masters,      // empty, or n fp32 master copies of params, updated
              double lr, double beta1, double beta2, double eps, double weight_decay,
              double bias_correction1,     // 1 - beta1^step
              double bias_correction2,     // 1 - beta2^step
              bool decoupled,              // AdamW (decoupled decay) vs Adam (L2 added to the gradient)
              bool maximize,
              double inv_grad_scale,       // grads are multiplied by this (1 / loss scale)
              const c10::optional<at::Tensor>& found_inf) {  // nonzero: skip the whole step
  check_lists(params, grads, exp_avgs, exp_avg_sqs, masters);
  if (found_inf.has_value() && found_inf->defined() && found_inf->item<double>() != 0.0) return;
  const AdamConsts c{static_cast<float>(beta1),
                     static_cast<float>(beta2),
                     static_cast<float>(eps),
                     static_cast<float>(weight_decay),
                     static_cast<float>(1.0 - beta1),
                     static_cast<float>(1.0 - beta2),
                     static_cast<float>(1.0 - lr * weight_decay),
                     static_cast<float>(lr / bias_correction1),
                     static_cast<float>(std::sqrt(bias_correction2)),
                     static_cast<float>(inv_grad_scale),
                     decoupled,
                     maximize};
  SpanPlan plan;
  for (size_t i = 0; i < params.size(); ++i) plan.add(i, params[i].numel(), 1, kSpan);
  const bool has_master = !masters.empty();

  plan.for_each(kChunk, [&](const Span& sp) {
    std::vector<float> gbuf(kChunk), pbuf(kChunk);  // fp32 staging for bf16/fp16 chunks
    const at::Tensor& param = params[sp.tensor];
    const at::Tensor& grad = grads[sp.tensor];
    float* m = exp_avgs[sp.tensor].data_ptr<float>();
    float* v = exp_avg_sqs[sp.tensor].data_ptr<float>();
    float* master = has_master ? masters[sp.tensor].data_ptr<float>() : nullptr;
    const bool p32 = param.scalar_type() == at::kFloat, g32 = grad.scalar_type() == at::kFloat;
    char* pbase = static_cast<char*>(param.data_ptr());
    const char* gbase = static_cast<const char*>(grad.data_ptr());
    const int64_t pe = param.element_size(), ge = grad.element_size();
    for (int64_t b = sp.begin; b < sp.end; b += kChunk) {
      const int64_t len = std::min(kChunk, sp.end - b);
      const float* g = g32 ? reinterpret_cast<const float*>(gbase) + b : gbuf.data();
      if (!g32) to_float(gbase + b * ge, grad.scalar_type(), gbuf.data(), len);
      float* p;
      if (master) {
        p = master + b;
      } else if (p32) {
        p = reinterpret_cast<float*>(pbase) + b;
      } else {
        to_float(pbase + b * pe, param.scalar_type(), pbuf.data(), len);
        p = pbuf.data();
      }
      adam_chunk(p, g, m + b, v + b, len, c);
      if (master || !p32) from_float(p, pbase + b * pe, param.scalar_type(), len);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(zerofuse, CPU, m) { m.impl("adam_", &adam_cpu); }

}  // namespace zerofuse
