// The row loops of the attention bias and dropout steps (attention_bias.h),
// compiled once per instruction set and picked at load time, so that they run
// at the CPU's widest vectors (the code around them is built for baseline
// x86-64). The same bits on every instruction set.
#pragma once

#include <cstdint>

namespace jax_rope::cpu {

// row[e] = scale * row[e] + neg_slope * a for lo <= e < hi, where a is
// float(|base + step * e|) (in int32, which the caller makes sure of), or its
// square root with sqrt_distance: the ALiBi score after scaling, two roundings
// and never a fused multiply-add (spec/attention_bias_dropout.md section 2).
void AlibiRow(float* row, int32_t lo, int32_t hi, int32_t base, int32_t step, float neg_slope,
              float scale, bool sqrt_distance);

// x[e] *= factor[e] for lo <= e < hi: dropout's keep factors on a tile row.
void MultiplyRow(float* x, const float* factor, int64_t lo, int64_t hi);

}  // namespace jax_rope::cpu
