// Philox4x32-10, the counter-based RNG of Salmon et al., "Parallel random numbers:
// as easy as 1, 2, 3" (SC'11), as in Random123 and cuRAND. A pure function of
// (counter, key): no state, so any thread can draw the numbers of any position
// and the CPU, the GPU and the NumPy reference (roberta_fast/masking.py) agree
// bit for bit. Plain C++ with __host__ __device__ markers, no torch headers.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define RF_HD __host__ __device__ __forceinline__
#else
#define RF_HD inline
#endif

// Loop unrolling hint for the device pass only (host compilers warn on it).
#if defined(__CUDA_ARCH__)
#define RF_UNROLL _Pragma("unroll")
#else
#define RF_UNROLL
#endif

namespace roberta_fast {

struct Philox4 {
  uint32_t x, y, z, w;
};

// High 32 bits of a 32x32 -> 64 bit product.
RF_HD uint32_t mulhi32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// Ten rounds of Philox4x32 on counter c with key (k0, k1).
RF_HD Philox4 philox4x32_10(Philox4 c, uint32_t k0, uint32_t k1) {
  const uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
  const uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  RF_UNROLL
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = mulhi32(M0, c.x), lo0 = M0 * c.x;
    const uint32_t hi1 = mulhi32(M1, c.z), lo1 = M1 * c.z;
    c = Philox4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    k0 += W0;
    k1 += W1;
  }
  return c;
}

// Uniform integer in [0, n) from a 32-bit draw (multiply-shift, no modulo bias
// beyond 2^-32 and no division).
RF_HD uint64_t draw_below(uint32_t u, uint64_t n) {
  return (static_cast<uint64_t>(u) * n) >> 32;
}

}  // namespace roberta_fast
