// Launcher of the CUDA dynamic masking (mask_tokens_cuda.cu), called by the
// torch binding in mask_tokens.cpp. Raw pointers only: no torch headers, so the
// .cu builds with plain nvcc.
#pragma once

#include <stdint.h>

#include "mask_math.h"

namespace roberta_fast {

// Masks `rows` rows of `len` ids on the device; sample index of row i is
// sample_offset + i. word_starts may be null for the token strategy; spans
// (rows x len x 3, see write_row_spans) may be null when not wanted. `stream` is
// a cudaStream_t. Returns null on success, else the CUDA error string.
const char* mask_tokens_cuda(const MaskParams& params, const int64_t* ids,
                             const bool* word_starts, int64_t rows, int64_t len,
                             uint32_t sample_offset, int64_t* out, int64_t* labels,
                             int64_t* spans, void* stream);

}  // namespace roberta_fast
