// Shared argument checks of zerofuse::flatten_into / unflatten_from (CPU and CUDA kernels).
#pragma once

#include "checks.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <numeric>
#include <vector>

namespace zerofuse {

inline bool is_copyable_dtype(at::ScalarType t) {
  return !at::isComplexType(t) && !at::isQIntType(t) && !at::isBitsType(t) &&
         !at::isFloat8Type(t) && t != at::kBool;
}

// Validates the flat buffer, list lengths, devices, dtypes and that each range
// [offsets[i], offsets[i] + tensors[i].numel()) lies inside flat and no two ranges overlap.
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
    ZF_CHECK_VALUE(offsets[i] >= 0 && offsets[i] + t.numel() <= n_flat, op, "offsets[", i, "] = ", offsets[i],
                   " with ", indexed(list_name, i), ".numel() = ", t.numel(),
                   " runs outside flat of numel ", n_flat);
  }
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return offsets[a] < offsets[b]; });
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
