// CPU stand-in for cuda_bf16.h (tests/cuda_emu/cuda_runtime.h): __nv_bfloat16 with
// CUDA's round-to-nearest-even conversion (cvt.rn.bf16.f32); NaN stays NaN.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
  uint16_t bits;
};

inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t bits = static_cast<uint32_t>(h.bits) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline __nv_bfloat16 __float2bfloat16_rn(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  __nv_bfloat16 h;
  if (std::isnan(x)) {
    h.bits = 0x7FC0;
  } else {
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    h.bits = static_cast<uint16_t>(bits >> 16);
  }
  return h;
}
