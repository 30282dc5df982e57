// Shared argument checks of zerofuse::flatten_into / unflatten_from (CPU and CUDA kernels).
#pragma once

#include "checks.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

namespace zerofuse {

inline bool is_copyable_dtype(at::ScalarType t) {
  return !at::isComplexType(t) && !at::isQIntType(t) && !at::isBitsType(t) &&
         !at::isFloat8Type(t) && t != at::kBool;
}

// The first and last byte that a non-empty tensor's elements span.
inline std::pair<uintptr_t, uintptr_t> byte_span(const at::Tensor& t) {
  const auto first = reinterpret_cast<uintptr_t>(t.data_ptr());
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return {first, first + static_cast<uintptr_t>((last + 1) * t.element_size()) - 1};
}

// Validates the flat buffer, list lengths, devices, dtypes, that each range
// [offsets[i], offsets[i] + tensors[i].numel()) lies inside flat, that no two ranges overlap, and
// that no tensor shares memory with flat except as the contiguous view of its own range (ZeRO's
// params, which the kernels skip): any other overlap would read what this call writes.
inline void check_flatten_args(at::TensorList tensors,       // n tensors, any shapes
                               const at::Tensor& flat,       // (N,) contiguous
                               at::IntArrayRef offsets,      // (n,) element offsets into flat
                               const char* op, const char* list_name) {
  check_1d_contiguous(flat, op, "flat");
  ZF_CHECK(is_copyable_dtype(flat.scalar_type()), op, "expected flat to have a real, non-bool dtype, got ",
           flat.scalar_type());
  ZF_CHECK_VALUE(tensors.size() == offsets.size(), op, "expected len(offsets) == len(", list_name,
                 ") == ", tensors.size(), ", got len(offsets) == ", offsets.size());
  const int64_t n_flat = flat.numel();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    check_same_device(t, flat, op, indexed(list_name, i), "flat");
    ZF_CHECK(is_copyable_dtype(t.scalar_type()), op, "expected ", indexed(list_name, i),
             " to have a real, non-bool dtype, got ", t.scalar_type());
    // n_flat - offsets[i] cannot overflow once offsets[i] >= 0; offsets[i] + numel could
    ZF_CHECK_VALUE(offsets[i] >= 0 && t.numel() <= n_flat - offsets[i], op, "offsets[", i, "] = ", offsets[i],
                   " with ", indexed(list_name, i), ".numel() = ", t.numel(), " runs outside flat of numel ",
                   n_flat);
  }
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  // by offset, then index: the order (and so the message) of the fake impl's check
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return std::make_pair(offsets[a], a) < std::make_pair(offsets[b], b); });
  int64_t end = 0;
  size_t last = 0;
  bool any = false;
  for (size_t i : order) {
    if (tensors[i].numel() == 0) continue;
    ZF_CHECK_VALUE(!any || offsets[i] >= end, op, "ranges of ", indexed(list_name, last), " [",
                   offsets[last], ", ", end, ") and ", indexed(list_name, i), " [", offsets[i], ", ",
                   offsets[i] + tensors[i].numel(), ") overlap in flat");
    end = offsets[i] + tensors[i].numel();
    last = i;
    any = true;
  }
  if (flat.numel() == 0) return;
  const auto [flat_first, flat_last] = byte_span(flat);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() == 0) continue;
    const auto [first, last_byte] = byte_span(t);
    if (last_byte < flat_first || first > flat_last) continue;
    const auto own = reinterpret_cast<uintptr_t>(flat.data_ptr()) +
                     static_cast<uintptr_t>(offsets[i]) * static_cast<uintptr_t>(flat.element_size());
    ZF_CHECK_VALUE(t.is_contiguous() && t.scalar_type() == flat.scalar_type() && first == own, op, "expected ",
                   indexed(list_name, i), " not to share memory with flat, except as the view of its own range "
                   "flat[", offsets[i], ":", offsets[i] + t.numel(), "], got a ", t.scalar_type(), " tensor of shape ",
                   t.sizes(), " with strides ", t.strides(), " at byte ",
                   static_cast<int64_t>(first - reinterpret_cast<uintptr_t>(flat.data_ptr())), " of flat");
  }
}

// unflatten_from writes every tensor: two that share memory (a tied weight listed twice, w and w.t())
// would be written by two threads at once, or in an order the sequential copy_s it stands for would
// not use. Refused where torch's overlap test says they overlap (interleaved strided views, which
// it cannot tell, pass, as they do for Tensor::copy_).
inline void check_outputs_disjoint(at::TensorList tensors, const char* op, const char* list_name) {
  std::vector<std::pair<std::pair<uintptr_t, uintptr_t>, size_t>> spans;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel() > 0) spans.push_back({byte_span(tensors[i]), i});
  }
  std::sort(spans.begin(), spans.end());
  std::vector<size_t> open;  // indices into spans of earlier spans reaching past the current start
  for (size_t s = 0; s < spans.size(); ++s) {
    const uintptr_t first = spans[s].first.first;
    const size_t i = spans[s].second;
    open.erase(std::remove_if(open.begin(), open.end(), [&](size_t k) { return spans[k].first.second < first; }),
               open.end());
    for (size_t k : open) {
      const size_t j = spans[k].second;
      const auto status = at::get_overlap_status(tensors[j], tensors[i]);
      ZF_CHECK_VALUE(status != at::MemOverlapStatus::Full && status != at::MemOverlapStatus::Partial, op,
                     "expected ", indexed(list_name, std::min(i, j)), " and ", indexed(list_name, std::max(i, j)),
                     " not to share memory (both are written), got tensors that overlap");
    }
    open.push_back(s);
  }
}

// Tensor::copy_ between tensors[i] and its range of flat, for each i in `which`: the path for the
// tensors a kernel's fast path does not take (non-contiguous ones; on CUDA also other dtypes).
inline void copy_ranges_with_aten(at::TensorList tensors, const at::Tensor& flat, at::IntArrayRef offsets,
                                  const std::vector<size_t>& which, bool to_flat) {
  for (size_t i : which) {
    const at::Tensor& t = tensors[i];
    at::Tensor range = flat.narrow(0, offsets[i], t.numel()).view(t.sizes());
    if (to_flat) range.copy_(t);
    else const_cast<at::Tensor&>(t).copy_(range);
  }
}

}  // namespace zerofuse
