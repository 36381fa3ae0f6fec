// Dropout keep factors of one row of a tile, hashed in vector lanes: the same
// Threefry2x32 (threefry.h) for consecutive column counters, written as a loop
// the compiler vectorises, one clone per instruction set (chosen at load time).
#include "device_kernels/cpu/dropout_keep.h"

#include "device_kernels/cpu/threefry.h"

namespace jax_rope::cpu {

__attribute__((target_clones("avx512f", "avx2", "default"))) void KeepRow(
    uint32_t k0, uint32_t k1, uint32_t row_word, uint32_t first_col, int64_t count,
    uint32_t threshold, float kept, float* out) {
  const uint32_t k2 = k0 ^ k1 ^ 0x1BD11BDAu;
  for (int64_t j = 0; j < count; ++j) {
    uint32_t x0 = row_word + k0;
    uint32_t x1 = first_col + static_cast<uint32_t>(j) + k1;
#define JAX_ROPE_ROUND(r) \
  x0 += x1;               \
  x1 = RotL32(x1, r);     \
  x1 ^= x0;
#define JAX_ROPE_GROUP(a, b, c, d, ka, kb, s) \
  JAX_ROPE_ROUND(a) JAX_ROPE_ROUND(b) JAX_ROPE_ROUND(c) JAX_ROPE_ROUND(d) \
  x0 += ka;                                                           \
  x1 += kb + s;
    JAX_ROPE_GROUP(13, 15, 26, 6, k1, k2, 1u)
    JAX_ROPE_GROUP(17, 29, 16, 24, k2, k0, 2u)
    JAX_ROPE_GROUP(13, 15, 26, 6, k0, k1, 3u)
    JAX_ROPE_GROUP(17, 29, 16, 24, k1, k2, 4u)
    JAX_ROPE_GROUP(13, 15, 26, 6, k2, k0, 5u)
#undef JAX_ROPE_GROUP
#undef JAX_ROPE_ROUND
    out[j] = x0 < threshold ? kept : 0.0f;
  }
}

}  // namespace jax_rope::cpu
