// One CPU kernel loop, compiled for AVX-512, AVX2 and baseline x86-64, the version picked at each
// call by vector_isa(): the machine's widest, capped by torch's CPU capability, so
// ATEN_CPU_CAPABILITY=avx2 (or default) runs zerofuse's AVX2 (or baseline) loops on an AVX-512
// machine as it runs torch's: the suite can be run as an AVX2-only CPU would run it. (GCC's
// target_clones, used before, chose by cpuid alone at load time, so an AVX2-only machine ran
// loops that no test on an AVX-512 machine had run.)
//
//   ZF_MULTIVERSION(float, sum_squares, (const float* __restrict__ x, int64_t n), (x, n)) {
//     ... the body, once ...
//   }
//
// defines `float sum_squares(const float* x, int64_t n)`. The return type must be one token or
// an alias without commas.
#pragma once

#include <cstdint>

namespace zerofuse {

// 2: AVX-512 (avx512f), 1: AVX2, 0: baseline; computed once per process.
int vector_isa();

}  // namespace zerofuse

#if defined(__x86_64__) && defined(__GNUC__)
#define ZF_MULTIVERSION(ret, name, params, args)                                             \
  static inline __attribute__((always_inline)) ret name##_body params;                     \
  __attribute__((target("avx512f"))) static ret name##_avx512 params {                     \
    return name##_body args;                                                               \
  }                                                                                        \
  __attribute__((target("avx2"))) static ret name##_avx2 params { return name##_body args; } \
  static ret name##_baseline params { return name##_body args; }                           \
  ret name params {                                                                        \
    switch (::zerofuse::vector_isa()) {                                                    \
      case 2:                                                                              \
        return name##_avx512 args;                                                         \
      case 1:                                                                              \
        return name##_avx2 args;                                                           \
      default:                                                                             \
        return name##_baseline args;                                                       \
    }                                                                                      \
  }                                                                                        \
  static inline __attribute__((always_inline)) ret name##_body params
#else
#define ZF_MULTIVERSION(ret, name, params, args) ret name params
#endif
