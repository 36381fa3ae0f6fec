// Dropout keep factors of a run of tile positions, hashed in vector lanes: the
// same Threefry2x32 (threefry.h) for consecutive row or column counters, written
// as a loop the compiler vectorises, one clone per instruction set (chosen at
// load time).
#include "device_kernels/cpu/dropout_keep.h"

#include "device_kernels/cpu/threefry.h"

namespace jax_rope::cpu {

__attribute__((target_clones("avx512f", "avx2", "default"))) void KeepRun(
    uint32_t k0, uint32_t k1, uint32_t row_word, uint32_t col, bool down_column, int64_t count,
    uint32_t threshold, float kept, float* out) {
  const uint32_t k2 = k0 ^ k1 ^ 0x1BD11BDAu;
  const uint32_t row_steps = down_column ? ~0u : 0u;  // t & row_steps: t or 0
  for (int64_t t = 0; t < count; ++t) {
    const uint32_t step = static_cast<uint32_t>(t);
    uint32_t x0 = row_word + (step & row_steps) + k0;
    uint32_t x1 = col + (step & ~row_steps) + k1;
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
    out[t] = x0 < threshold ? kept : 0.0f;
  }
}

}  // namespace jax_rope::cpu
