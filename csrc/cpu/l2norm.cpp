// CPU kernel of zerofuse::l2norm: the 2-norm of many tensors taken together (the global gradient
// norm used for clipping, logging and the inf/NaN check) and, optionally, of each one (LARS).
// Squares are summed in fp32 within a chunk (omp simd: vectorised) and in double across chunks,
// per span in a fixed order, so the result does not depend on the thread count. An inf or NaN
// anywhere makes the norm inf or NaN.
#include "optim.h"
#include "vector_isa.h"

#include <torch/library.h>

#include <cmath>
#include <vector>

namespace zerofuse {
namespace {

ZF_MULTIVERSION(float, sum_squares, (const float* __restrict__ x, int64_t n),
                (x, n)) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i] * x[i];
  return s;
}

// the sum of (m * x)^2: a loss-scaled grad's squares overflowed fp32 (|x| > 1.8e19) where its
// unscaled values' did not (GradScaler's scale grows without bound under bf16/fp32)
ZF_MULTIVERSION(float, sum_squares_scaled, (const float* __restrict__ x, int64_t n, float m),
                (x, n, m)) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] * m;
    s += v * v;
  }
  return s;
}

std::tuple<at::Tensor, at::Tensor> l2norm_cpu(at::TensorList tensors,  // n tensors, fp32/bf16/fp16, contiguous
                                              bool per_tensor,          // also return each tensor's norm
                                              const c10::optional<at::Tensor>& mult,  // (1,): scales the
                                              int64_t mult_from) {      // tensors from this index on
  const char* op = "l2norm";
  check_param_lists(op, tensors, {}, {}, {}, nullptr, "tensors");
  ZF_CHECK(mult_from >= 0, op, "expected mult_from >= 0, got ", mult_from);
  const bool scaled = mult.has_value() && mult->defined();
  const float m = static_cast<float>(scalar_arg(mult, op, "mult", 1.0));
  const SpanPlan plan = plan_params(tensors);
  std::vector<double> partial(plan.spans.size(), 0.0);
  // the tensors stand in the params' place: for_each_chunk hands their fp32 values as chunk.p
  for_each_chunk(plan, tensors, {}, {}, /*write_param=*/false, [&](const Chunk& c) {
    partial[c.span] += scaled && static_cast<int64_t>(c.tensor) >= mult_from ? sum_squares_scaled(c.p, c.len, m) : sum_squares(c.p, c.len);
  });
  std::vector<double> sums(tensors.size(), 0.0);
  for (size_t k = 0; k < plan.spans.size(); ++k) sums[plan.spans[k].tensor] += partial[k];
  double total = 0.0;
  for (double s : sums) total += s;
  at::Tensor norm = at::full({}, std::sqrt(total), at::TensorOptions().dtype(at::kFloat));
  at::Tensor each = at::empty({per_tensor ? static_cast<int64_t>(tensors.size()) : 0}, at::kFloat);
  if (per_tensor) {
    float* out = each.data_ptr<float>();
    for (size_t i = 0; i < sums.size(); ++i) out[i] = static_cast<float>(std::sqrt(sums[i]));
  }
  return {norm, each};
}

}  // namespace

TORCH_LIBRARY_IMPL(zerofuse, CPU, m) { m.impl("l2norm", &l2norm_cpu); }

}  // namespace zerofuse
