// Row loops of the bias and dropout steps, one clone per instruction set
// (attention_bias_rows.h). Built with -ffp-contract=off (CMakeLists.txt): the
// ALiBi score keeps both of its roundings on every instruction set.
#include "device_kernels/cpu/attention_bias_rows.h"

#include <cmath>

namespace jax_rope::cpu {

#define JAX_ROPE_ROW_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

JAX_ROPE_ROW_CLONES void AlibiRow(float* row, int32_t lo, int32_t hi, int32_t base,
                                  int32_t step, float neg_slope, float scale,
                                  bool sqrt_distance) {
  if (sqrt_distance) {
    for (int32_t e = lo; e < hi; ++e) {
      const int32_t dist = base + step * e;
      const float a = std::sqrt(static_cast<float>(dist < 0 ? -dist : dist));
      row[e] = scale * row[e] + neg_slope * a;
    }
    return;
  }
  for (int32_t e = lo; e < hi; ++e) {
    const int32_t dist = base + step * e;
    const float a = static_cast<float>(dist < 0 ? -dist : dist);
    row[e] = scale * row[e] + neg_slope * a;
  }
}

JAX_ROPE_ROW_CLONES void MultiplyRow(float* __restrict__ x, const float* __restrict__ factor,
                                     int64_t lo, int64_t hi) {
  for (int64_t e = lo; e < hi; ++e) x[e] *= factor[e];
}

#undef JAX_ROPE_ROW_CLONES

}  // namespace jax_rope::cpu
