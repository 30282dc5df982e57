#include "convert.h"
#include "vector_isa.h"

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstring>

namespace zerofuse {

ZF_MULTIVERSION(void, bf16_to_f32, (const uint16_t* src, float* dst, int64_t n),
                (src, dst, n)) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &u, 4);
  }
}

ZF_MULTIVERSION(void, f32_to_bf16, (const float* src, uint16_t* dst, int64_t n),
                (src, dst, n)) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, 4);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    dst[i] = static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
  }
}

void to_float(const void* src, at::ScalarType t, float* dst, int64_t n) {
  switch (t) {
    case at::kFloat: std::memcpy(dst, src, n * sizeof(float)); return;
    case at::kBFloat16: bf16_to_f32(static_cast<const uint16_t*>(src), dst, n); return;
    case at::kHalf: {
      const auto* s = static_cast<const at::Half*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
      return;
    }
    default: TORCH_CHECK(false, "zerofuse: unexpected dtype ", t);
  }
}

void from_float(const float* src, void* dst, at::ScalarType t, int64_t n) {
  switch (t) {
    case at::kFloat: std::memcpy(dst, src, n * sizeof(float)); return;
    case at::kBFloat16: f32_to_bf16(src, static_cast<uint16_t*>(dst), n); return;
    case at::kHalf: {
      auto* d = static_cast<at::Half*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = static_cast<at::Half>(src[i]);
      return;
    }
    default: TORCH_CHECK(false, "zerofuse: unexpected dtype ", t);
  }
}

}  // namespace zerofuse
