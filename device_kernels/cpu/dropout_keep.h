// Dropout keep factors of one tile row or column from the key
// (spec/attention_bias_dropout.md section 3.3): position t of the run has the
// counter (row_word + t, col) when down_column, else (row_word, col + t), and
// out[t] = kept when Threefry2x32((k0, k1), counter).y0 < threshold, else 0.
// Vectorised per instruction set (dropout_keep.cc), the same bits on each.
#pragma once

#include <cstdint>

#include "device_kernels/cpu/attention_tiles.h"

namespace jax_rope::cpu {

using KeepRunFn = void (*)(uint32_t k0, uint32_t k1, uint32_t row_word, uint32_t col,
                           bool down_column, int64_t count, uint32_t threshold, float kept,
                           float* out);

// The run on the best instruction set of this CPU.
void KeepRun(uint32_t k0, uint32_t k1, uint32_t row_word, uint32_t col, bool down_column,
             int64_t count, uint32_t threshold, float kept, float* out);

// Tests only: the run on one instruction set, or nullptr when this CPU lacks it.
KeepRunFn KeepRunFor(TileIsa isa);

}  // namespace jax_rope::cpu
