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

std::tuple<at::Tensor, at::Tensor> l2norm_cpu(at::TensorList tensors,  // n tensors, fp32/bf16/fp16, contiguous
                                              bool per_tensor) {         // also return each tensor's norm
  const char* op = "l2norm";
  check_param_lists(op, tensors, {}, {}, {}, nullptr, "tensors");
  const SpanPlan plan = plan_params(tensors);
  std::vector<double> partial(plan.spans.size(), 0.0);
  // the tensors stand in the params' place: for_each_chunk hands their fp32 values as chunk.p
  for_each_chunk(plan, tensors, {}, {}, /*write_param=*/false,
                 [&](const Chunk& c) { partial[c.span] += sum_squares(c.p, c.len); });
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
