// fp32 <-> bf16 conversions of whole arrays for the CPU kernels, bit-identical to torch's for every
// number (round to nearest even); a NaN becomes the quiet NaN 0x7FC0 (c10::BFloat16's; torch's
// vectorised loops write 0xFFFF), in loops the compiler vectorises.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace zerofuse {

void bf16_to_f32(const uint16_t* src, float* dst, int64_t n);
void f32_to_bf16(const float* src, uint16_t* dst, int64_t n);

// n elements of dtype t (float32, bfloat16 or float16) <-> an fp32 array.
void to_float(const void* src, at::ScalarType t, float* dst, int64_t n);
void from_float(const float* src, void* dst, at::ScalarType t, int64_t n);

}  // namespace zerofuse
