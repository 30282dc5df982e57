// Shared by the CPU optimizer kernels (adam.cpp, lamb.cpp, lars.cpp, l2norm.cpp): argument checks
// for lists of params and their states, per-tensor step counts, the gradient multiplier and skip
// flag, and a chunk driver that hands fp32 views of each param (or its master) and grad to the
// arithmetic and writes bf16/fp16 params back, spread over threads by size (spans.h).
#pragma once

#include "../checks.h"
#include "convert.h"
#include "spans.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

namespace zerofuse {

constexpr int64_t kOptimChunk = 4096;  // elements converted at a time into stack buffers
constexpr int64_t kOptimSpan = 1 << 16;  // elements per span / group of spans

struct NamedList {
  at::TensorList list;
  const char* name;
};

inline bool float_or_low(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

// params: contiguous fp32/bf16/fp16 on cpu. `like` lists (grads, bf16 allowed) and `fp32` lists
// (optimizer states) hold one contiguous tensor of the param's numel per param; masters is empty
// or one fp32 tensor per param; steps (if not nullptr) one 1-element float tensor per param.
inline void check_param_lists(const char* op, at::TensorList params, std::initializer_list<NamedList> like,
                              std::initializer_list<NamedList> fp32, at::TensorList masters,
                              const at::TensorList* steps, const char* params_name = "params") {
  const size_t n = params.size();
  for (const auto& l : like) {
    ZF_CHECK_VALUE(l.list.size() == n, op, "expected ", l.name, " to have one tensor per param (", n, "), got ",
                   l.list.size());
  }
  for (const auto& l : fp32) {
    ZF_CHECK_VALUE(l.list.size() == n, op, "expected ", l.name, " to have one tensor per param (", n, "), got ",
                   l.list.size());
  }
  ZF_CHECK_VALUE(masters.empty() || masters.size() == n, op, "expected masters to be empty or of length ", n,
                 ", got ", masters.size());
  if (steps) {
    ZF_CHECK_VALUE(steps->size() == n, op, "expected steps to have one tensor per param (", n, "), got ",
                   steps->size());
  }
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const int64_t numel = p.numel();
    ZF_CHECK(p.device().is_cpu(), op, "expected ", indexed(params_name, i), " on cpu, got ", p.device());
    ZF_CHECK(float_or_low(p.scalar_type()), op, "expected ", indexed(params_name, i),
             " in float32, bfloat16 or float16, got ", p.scalar_type());
    ZF_CHECK(p.is_contiguous(), op, "expected ", indexed(params_name, i), " to be contiguous, got strides ",
             p.strides());
    auto check_like = [&](const at::Tensor& t, const std::string& name) {
      ZF_CHECK(t.is_contiguous(), op, "expected ", name, " to be contiguous, got strides ", t.strides());
      ZF_CHECK_VALUE(t.numel() == numel, op, "expected ", name, " to have ", numel, " elements like ",
                     indexed(params_name, i), ", got ", t.numel());
      check_same_device(t, p, op, name, indexed(params_name, i));
    };
    for (const auto& l : like) {
      ZF_CHECK(float_or_low(l.list[i].scalar_type()), op, "expected ", indexed(l.name, i),
               " in float32, bfloat16 or float16, got ", l.list[i].scalar_type());
      check_like(l.list[i], indexed(l.name, i));
    }
    for (const auto& l : fp32) {
      ZF_CHECK(l.list[i].scalar_type() == at::kFloat, op, "expected ", indexed(l.name, i), " in float32, got ",
               l.list[i].scalar_type());
      check_like(l.list[i], indexed(l.name, i));
    }
    if (!masters.empty()) {
      ZF_CHECK(masters[i].scalar_type() == at::kFloat, op, "expected ", indexed("masters", i),
               " in float32, got ", masters[i].scalar_type());
      check_like(masters[i], indexed("masters", i));
    }
    if (steps) {
      const at::Tensor& s = (*steps)[i];
      ZF_CHECK(s.device().is_cpu() && s.numel() == 1 &&
                   (s.scalar_type() == at::kFloat || s.scalar_type() == at::kDouble),
               op, "expected ", indexed("steps", i), " to be a 1-element float32/float64 cpu tensor, got ",
               s.scalar_type(), " ", s.sizes(), " on ", s.device());
    }
  }
}

// Adds 1 to every distinct step tensor (a flat shard's segments may share one) and returns each
// param's new count, without dispatcher calls (torch.optim keeps counts as float tensors). Every
// count is checked before any is advanced, so a bad one leaves all of them as they were.
inline std::vector<double> advance_steps(at::TensorList steps, const char* op) {
  auto read = [](const at::Tensor& s) {
    return s.scalar_type() == at::kFloat ? static_cast<double>(*s.data_ptr<float>()) : *s.data_ptr<double>();
  };
  for (size_t i = 0; i < steps.size(); ++i) {
    const double v = read(steps[i]);
    ZF_CHECK_VALUE(v >= 0, op, "expected ", indexed("steps", i), " >= 0 before the step, got ", v);
  }
  std::vector<const void*> done;
  std::vector<double> out(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    const at::Tensor& s = steps[i];
    void* ptr = s.data_ptr();
    if (std::find(done.begin(), done.end(), ptr) == done.end()) {
      done.push_back(ptr);
      if (s.scalar_type() == at::kFloat) {
        *static_cast<float*>(ptr) += 1.f;
      } else {
        *static_cast<double*>(ptr) += 1.0;
      }
    }
    out[i] = read(s);
  }
  return out;
}

// The tensors an op updates in place (params, states, masters) must not share memory: a tensor
// listed twice, or a state that is a view of a param, would be updated twice, in an order that
// depends on the thread schedule. (Step counts are exempt: segments of a flat shard share one.)
inline void check_no_overlap(const char* op, std::initializer_list<NamedList> lists) {
  struct Range {
    uintptr_t begin, end;
    const char* name;
    size_t index;
  };
  std::vector<Range> ranges;
  for (const auto& l : lists) {
    for (size_t i = 0; i < l.list.size(); ++i) {
      const at::Tensor& t = l.list[i];
      if (t.numel() == 0) continue;
      const auto b = reinterpret_cast<uintptr_t>(t.data_ptr());
      ranges.push_back({b, b + static_cast<uintptr_t>(t.numel() * t.element_size()), l.name, i});
    }
  }
  // stable: of two tensors at one address the message names the later-listed one as the repeat
  std::stable_sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  for (size_t k = 1; k < ranges.size(); ++k) {
    const Range& a = ranges[k - 1];
    const Range& b = ranges[k];
    ZF_CHECK_VALUE(b.begin >= a.end, op, "expected ", indexed(b.name, b.index), " not to share memory with ",
                   indexed(a.name, a.index), " (each tensor is updated in place once), got overlapping tensors");
  }
}

// The step count of one param, as stored.
inline double step_count(const at::Tensor& s) {
  return s.scalar_type() == at::kFloat ? *s.data_ptr<float>() : *s.data_ptr<double>();
}

// A 1-element cpu tensor read as a double: the gradient multiplier (default 1) or the skip flag.
inline double scalar_arg(const c10::optional<at::Tensor>& t, const char* op, const char* name, double dflt) {
  if (!t.has_value() || !t->defined()) return dflt;
  ZF_CHECK(t->device().is_cpu() && t->numel() == 1, op, "expected ", name,
           " to be a 1-element cpu tensor, got shape ", t->sizes(), " on ", t->device());
  return t->item<double>();
}

inline bool skip_step(const c10::optional<at::Tensor>& found_inf, const char* op) {
  return scalar_arg(found_inf, op, "found_inf", 0.0) != 0.0;
}

inline SpanPlan plan_params(at::TensorList params) {
  SpanPlan plan;
  for (size_t i = 0; i < params.size(); ++i) plan.add(i, params[i].numel(), 1, kOptimSpan);
  return plan;
}

// One chunk of one param, in fp32: `p` is the master, the fp32 param itself, or a staged copy;
// `g` the fp32 grad or a staged copy (nullptr without grads).
struct Chunk {
  size_t tensor;
  size_t span;     // index into plan.spans, for per-span partial results
  int64_t begin;   // element offset in the tensor
  int64_t len;
  float* p;
  const float* g;
};

// fn(const Chunk&) over every chunk of every param, in parallel. With write_param, bf16/fp16
// params are rounded (once) from the fp32 values fn left in chunk.p.
template <typename F>
void for_each_chunk(const SpanPlan& plan, at::TensorList params, at::TensorList grads, at::TensorList masters,
                    bool write_param, const F& fn) {
  plan.for_each(kOptimChunk, [&](const Span& sp) {
    float gbuf[kOptimChunk];
    float pbuf[kOptimChunk];
    const at::Tensor& param = params[sp.tensor];
    float* master = masters.empty() ? nullptr : masters[sp.tensor].data_ptr<float>();
    const bool p32 = param.scalar_type() == at::kFloat;
    char* pbase = static_cast<char*>(param.data_ptr());
    const int64_t pe = param.element_size();
    const at::Tensor* grad = grads.empty() ? nullptr : &grads[sp.tensor];
    const bool g32 = grad && grad->scalar_type() == at::kFloat;
    const char* gbase = grad ? static_cast<const char*>(grad->data_ptr()) : nullptr;
    const int64_t ge = grad ? grad->element_size() : 0;
    const size_t span = static_cast<size_t>(&sp - plan.spans.data());
    for (int64_t b = sp.begin; b < sp.end; b += kOptimChunk) {
      const int64_t len = std::min(kOptimChunk, sp.end - b);
      const float* g = nullptr;
      if (grad) {
        if (g32) {
          g = reinterpret_cast<const float*>(gbase) + b;
        } else {
          to_float(gbase + b * ge, grad->scalar_type(), gbuf, len);
          g = gbuf;
        }
      }
      float* p;
      if (master) {
        p = master + b;
      } else if (p32) {
        p = reinterpret_cast<float*>(pbase) + b;
      } else {
        to_float(pbase + b * pe, param.scalar_type(), pbuf, len);
        p = pbuf;
      }
      fn(Chunk{sp.tensor, span, b, len, p, g});
      if (write_param && (master || !p32)) from_float(p, pbase + b * pe, param.scalar_type(), len);
    }
  });
}

}  // namespace zerofuse
