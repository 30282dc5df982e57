// CPU kernel of zerofuse::adam_ (Adam / AdamW over many tensors, or one flat ZeRO shard).
//
// Per element, in fp32, the same sequence of operations as torch.optim's Adam/AdamW:
//   g  = grad * grad_mult                 (fused unscale / clipping; negated when maximize)
//   p  = master or param                  (fp32 master weights when params are bf16/fp16)
//   AdamW: p *= 1 - lr * wd      Adam: g += wd * p
//   m  = lerp(m, g, 1 - beta1)
//   v  = v * beta2 + (1 - beta2) * g * g
//   p -= (lr / bc1) * m / (sqrt(v) * (1 / sqrt(bc2)) + eps)
// (torch divides by sqrt(bc2); the reciprocal, rounded once per tensor, leaves one division per
// element: measured ~10% faster where the data sits in cache, and results stay within the tests'
// 1e-6 of torch.optim, which this kernel never matched bit for bit because of FMA contraction)
// with bc1 = 1 - beta1^step, bc2 = 1 - beta2^step from each param's own step count; then the param
// is written (rounded once) from p. Chunks of one tensor at a time are spread over threads by size
// (optim.h); the arithmetic loop is an omp-simd loop inside
// target_clones (AVX-512 / AVX2 / baseline) so it vectorises at the machine's width.
#include "optim.h"
#include "vector_isa.h"

#include <torch/library.h>

#include <cmath>
#include <vector>

namespace zerofuse {
namespace {

// Scalars are derived in double and rounded once, as torch.optim passes Python floats to its ops:
// float(1 - beta1) differs from 1 - float(beta1).
struct AdamConsts {
  float beta1, beta2, eps, wd, w1, w2, decay, step_size, inv_bc2_sqrt, mult;
  bool decoupled, maximize;
};

ZF_MULTIVERSION(void, adam_chunk, (float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m, float* __restrict__ v, int64_t n, const AdamConsts c),
                (p, g, m, v, n, c)) {
  // c by value: through a reference its fields were reloaded in every iteration (2.6x slower)
  const float w1 = c.w1, w2 = c.w2, decay = c.decay;
  const float sign = c.maximize ? -c.mult : c.mult;
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
    p[i] = pi - c.step_size * (mi / (std::sqrt(vi) * c.inv_bc2_sqrt + c.eps));
  }
}

struct AdamArgs {
  double lr, beta1, beta2, eps, weight_decay;
  bool decoupled, maximize;
  float mult;
};

AdamConsts consts_for(const AdamArgs& a, double step) {
  const double bc1 = 1.0 - std::pow(a.beta1, step), bc2 = 1.0 - std::pow(a.beta2, step);
  return AdamConsts{static_cast<float>(a.beta1),
                    static_cast<float>(a.beta2),
                    static_cast<float>(a.eps),
                    static_cast<float>(a.weight_decay),
                    static_cast<float>(1.0 - a.beta1),
                    static_cast<float>(1.0 - a.beta2),
                    static_cast<float>(1.0 - a.lr * a.weight_decay),
                    static_cast<float>(a.lr / bc1),
                    static_cast<float>(1.0 / std::sqrt(bc2)),
                    a.mult,
                    a.decoupled,
                    a.maximize};
}

void adam_cpu(at::TensorList params,       // n tensors (any shape), fp32/bf16/fp16, updated in place
              at::TensorList grads,        // n tensors like params, fp32/bf16/fp16
              at::TensorList exp_avgs,     // n fp32 tensors like params, updated
              at::TensorList exp_avg_sqs,  // n fp32 tensors like params, updated
              at::TensorList masters,      // empty, or n fp32 master copies of params, updated
              at::TensorList steps,        // n 1-element float tensors: step counts, advanced by 1 here (not when skipped)
              double lr, double beta1, double beta2, double eps, double weight_decay,
              bool decoupled,              // AdamW (decoupled decay) vs Adam (L2 added to the gradient)
              bool maximize,
              const c10::optional<at::Tensor>& grad_mult,   // (1,) grads are multiplied by it (1 / loss scale)
              const c10::optional<at::Tensor>& found_inf) {  // (1,) nonzero: skip the whole step
  const char* op = "adam_";
  check_param_lists(op, params, {{grads, "grads"}}, {{exp_avgs, "exp_avgs"}, {exp_avg_sqs, "exp_avg_sqs"}},
                    masters, &steps);
  check_no_overlap(op,
                   {{params, "params"}, {exp_avgs, "exp_avgs"}, {exp_avg_sqs, "exp_avg_sqs"}, {masters, "masters"}});
  const double mult = scalar_arg(grad_mult, op, "grad_mult", 1.0);
  if (skip_step(found_inf, op)) return;
  const AdamArgs args{lr, beta1, beta2, eps, weight_decay, decoupled, maximize, static_cast<float>(mult)};
  std::vector<AdamConsts> consts;
  consts.reserve(params.size());
  for (double step : advance_steps(steps, op)) consts.push_back(consts_for(args, step));
  const SpanPlan plan = plan_params(params);
  for_each_chunk(plan, params, grads, masters, /*write_param=*/true, [&](const Chunk& c) {
    adam_chunk(c.p, c.g, exp_avgs[c.tensor].data_ptr<float>() + c.begin,
               exp_avg_sqs[c.tensor].data_ptr<float>() + c.begin, c.len, consts[c.tensor]);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(zerofuse, CPU, m) { m.impl("adam_", &adam_cpu); }

}  // namespace zerofuse
