// CPU stand-in for cuda_fp16.h (tests/cuda_emu/cuda_runtime.h): __half with CUDA's
// round-to-nearest-even conversions, through the compiler's _Float16.
#pragma once

#include <cstdint>
#include <cstring>

struct __half {
  uint16_t bits;
};

inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.bits, 2);
  return static_cast<float>(f);
}

inline __half __float2half_rn(float x) {
  const _Float16 f = static_cast<_Float16>(x);  // round to nearest even, as cvt.rn.f16.f32
  __half h;
  std::memcpy(&h.bits, &f, 2);
  return h;
}
