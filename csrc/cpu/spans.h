// Work planning shared by the multi-tensor CPU kernels: cut tensors into spans and group
// consecutive spans to about the same weight, so that at::parallel_for, which splits its range by
// count, splits the work by size. (Split by span count, a list of many small tensors followed by a
// few large ones left one thread with nearly all the bytes: flatten measured 2x slower.)
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace zerofuse {

struct Span {
  size_t tensor;  // index into the caller's list
  int64_t begin;  // element range of that tensor
  int64_t end;
};

struct SpanPlan {
  std::vector<Span> spans;
  std::vector<size_t> group_begin;  // group g is spans[group_begin[g], group_begin[g + 1])
  int64_t total_weight = 0;

  // Adds elements [0, numel) of tensor `tensor`, each weighing `weight` (bytes, say), cut into
  // spans of at most `target / weight` elements.
  void add(size_t tensor, int64_t numel, int64_t weight, int64_t target) {
    const int64_t per_span = std::max<int64_t>(1, target / std::max<int64_t>(weight, 1));
    for (int64_t b = 0; b < numel; b += per_span) {
      const int64_t e = std::min(numel, b + per_span);
      if (group_begin.empty() || group_weight_ >= target) {
        group_begin.push_back(spans.size());
        group_weight_ = 0;
      }
      spans.push_back({tensor, b, e});
      group_weight_ += (e - b) * weight;
      total_weight += (e - b) * weight;
    }
  }

  int64_t groups() const { return static_cast<int64_t>(group_begin.size()); }

  // fn(const Span&) for every span, groups spread over threads; serial below `parallel_weight`.
  template <typename F>
  void for_each(int64_t parallel_weight, const F& fn) const {
    const int64_t n = groups();
    const int64_t grain = total_weight < parallel_weight ? n + 1 : 1;
    at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
      const size_t end = hi < n ? group_begin[hi] : spans.size();
      for (size_t k = group_begin[lo]; k < end; ++k) fn(spans[k]);
    });
  }

 private:
  int64_t group_weight_ = 0;
};

}  // namespace zerofuse
