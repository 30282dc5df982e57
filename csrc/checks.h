// Argument checks shared by every kernel. Each message names the op, the argument, what was
// expected and what came, so bad input fails before any kernel or collective runs.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <sstream>
#include <string>

#define ZF_CHECK(cond, op, ...) TORCH_CHECK(cond, "zerofuse::", op, ": ", __VA_ARGS__)
#define ZF_CHECK_VALUE(cond, op, ...) TORCH_CHECK_VALUE(cond, "zerofuse::", op, ": ", __VA_ARGS__)

namespace zerofuse {

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* op,
                              const std::string& name, const std::string& ref_name) {
  ZF_CHECK(t.device() == ref.device(), op, "expected ", name, " on the device of ", ref_name, " (",
           ref.device(), "), got ", t.device());
}

inline void check_1d_contiguous(const at::Tensor& t, const char* op, const char* name) {
  ZF_CHECK(t.dim() == 1 && t.is_contiguous(), op, "expected ", name,
           " to be a 1-D contiguous tensor, got shape ", t.sizes(), " with strides ", t.strides());
}

inline std::string indexed(const char* name, size_t i) {
  std::ostringstream s;
  s << name << "[" << i << "]";
  return s.str();
}

}  // namespace zerofuse
