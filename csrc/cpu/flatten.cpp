// CPU kernels of zerofuse::flatten_into / unflatten_from (bucket copy-in / copy-out).
//
// Contiguous tensors are cut into ~256 KiB spans (spans.h) that at::parallel_for spreads over threads:
// a memcpy when dtypes match, a converting loop otherwise (e.g. bf16 grads into an fp32 bucket;
// bf16 <-> fp32 through the vectorised loops of convert.h, which c10::convert's path is not).
// Non-contiguous tensors go through Tensor::copy_ on a view of their range (TensorIterator walks
// the strides and parallelises itself), after the parallel loop so it is not nested in it.
#include "../flatten.h"
#include "convert.h"
#include "spans.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/TypeCast.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace zerofuse {
namespace {

constexpr int64_t kItemBytes = int64_t{1} << 18;
// Below this much data, one thread finishes before a second one would have started.
constexpr int64_t kParallelBytes = int64_t{1} << 16;

#define ZF_DISPATCH_COPY_TYPES(TYPE, NAME, ...) \
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

// The dtypes ZF_DISPATCH_COPY_TYPES takes (a uint16 tensor into an fp32 flat raised "not implemented").
bool has_convert_loop(at::ScalarType t) {
  switch (t) {
    case at::kByte: case at::kChar: case at::kShort: case at::kInt: case at::kLong:
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16:
      return true;
    default:
      return false;
  }
}

void convert(const void* src, at::ScalarType src_type, void* dst, at::ScalarType dst_type, int64_t n) {
  if (src_type == at::kBFloat16 && dst_type == at::kFloat) {
    return bf16_to_f32(static_cast<const uint16_t*>(src), static_cast<float*>(dst), n);
  }
  if (src_type == at::kFloat && dst_type == at::kBFloat16) {
    return f32_to_bf16(static_cast<const float*>(src), static_cast<uint16_t*>(dst), n);
  }
  ZF_DISPATCH_COPY_TYPES(dst_type, "zerofuse_convert_dst", [&] {
    using dst_t = scalar_t;
    ZF_DISPATCH_COPY_TYPES(src_type, "zerofuse_convert_src", [&] {
      const scalar_t* s = static_cast<const scalar_t*>(src);
      dst_t* d = static_cast<dst_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = c10::convert<dst_t>(s[i]);
    });
  });
}

// kToFlat: tensors -> flat (flatten_into); otherwise flat -> tensors (unflatten_from).
template <bool kToFlat>
void copy_ranges(at::TensorList tensors, const at::Tensor& flat, at::IntArrayRef offsets) {
  at::AutoDispatchBelowADInplaceOrView no_autograd;  // internal copies are not part of any graph
  SpanPlan plan;
  std::vector<size_t> strided;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() == 0) continue;
    // strided tensors, and conversions convert() has no loop for (uint16/32/64, ...), take copy_
    if (!t.is_contiguous() || (t.scalar_type() != flat.scalar_type() &&
                               !(has_convert_loop(t.scalar_type()) && has_convert_loop(flat.scalar_type())))) {
      strided.push_back(i);
      continue;
    }
    plan.add(i, t.numel(), static_cast<int64_t>(t.element_size()), kItemBytes);
  }

  char* flat_base = static_cast<char*>(flat.data_ptr());
  const at::ScalarType flat_type = flat.scalar_type();
  const int64_t flat_size = static_cast<int64_t>(flat.element_size());
  plan.for_each(kParallelBytes, [&](const Span& it) {
    const at::Tensor& t = tensors[it.tensor];
    const int64_t len = it.end - it.begin;
    char* tp = static_cast<char*>(t.data_ptr()) + it.begin * t.element_size();
    char* fp = flat_base + (offsets[it.tensor] + it.begin) * flat_size;
    if (tp == fp) return;  // a tensor that is already a view of its own range (ZeRO params)
    if (t.scalar_type() == flat_type) {
      if (kToFlat) std::memcpy(fp, tp, len * flat_size);
      else std::memcpy(tp, fp, len * flat_size);
    } else if (kToFlat) {
      convert(tp, t.scalar_type(), fp, flat_type, len);
    } else {
      convert(fp, flat_type, tp, t.scalar_type(), len);
    }
  });

  copy_ranges_with_aten(tensors, flat, offsets, strided, kToFlat);
}

void flatten_into_cpu(at::TensorList tensors,  // n tensors, any shapes/strides/dtypes
                      const at::Tensor& flat,  // (N,) contiguous, written
                      at::IntArrayRef offsets  // (n,) element offsets into flat
) {
  check_flatten_args(tensors, flat, offsets, "flatten_into", "tensors");
  copy_ranges<true>(tensors, flat, offsets);
}

void unflatten_from_cpu(const at::Tensor& flat,  // (N,) contiguous, read
                        at::TensorList tensors,  // n tensors, any shapes/strides/dtypes, written
                        at::IntArrayRef offsets  // (n,) element offsets into flat
) {
  check_flatten_args(tensors, flat, offsets, "unflatten_from", "tensors");
  check_outputs_disjoint(tensors, "unflatten_from", "tensors");
  copy_ranges<false>(tensors, flat, offsets);
}

}  // namespace

TORCH_LIBRARY_IMPL(zerofuse, CPU, m) {
  m.impl("flatten_into", &flatten_into_cpu);
  m.impl("unflatten_from", &unflatten_from_cpu);
}

}  // namespace zerofuse
