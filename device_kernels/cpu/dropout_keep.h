// Dropout keep factors of one tile row or column from the key
// (spec/attention_bias_dropout.md section 3.3): position t of the run has the
// counter (row_word + t, col) when down_column, else (row_word, col + t), and
// out[t] = kept when Threefry2x32((k0, k1), counter).y0 < threshold, else 0.
// Vectorised (dropout_keep.cc).
#pragma once

#include <cstdint>

namespace jax_rope::cpu {

void KeepRun(uint32_t k0, uint32_t k1, uint32_t row_word, uint32_t col, bool down_column,
             int64_t count, uint32_t threshold, float kept, float* out);

}  // namespace jax_rope::cpu
