// Dropout keep factors of one tile row from the key (spec/attention_bias_dropout.md
// section 3.3): out[j] = keep_scale when Threefry2x32((k0, k1), (row_word,
// first_col + j)).y0 < threshold, else 0. Vectorised (dropout_keep.cc).
#pragma once

#include <cstdint>

namespace jax_rope::cpu {

void KeepRow(uint32_t k0, uint32_t k1, uint32_t row_word, uint32_t first_col, int64_t count,
             uint32_t threshold, float kept, float* out);

}  // namespace jax_rope::cpu
