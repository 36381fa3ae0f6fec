// Dropout keep factors of a run of tile positions, hashed in vector lanes: the
// same Threefry2x32 (threefry.h) for consecutive row or column counters, written
// as loops the compiler vectorises, one clone per instruction set (chosen at
// load time). A round's three steps depend on each other, so one vector of
// counters at a time waits on them (about 70 cycles a vector on AVX2 Zen 3);
// kLanes counters per step give several independent vectors to interleave.
#include "device_kernels/cpu/dropout_keep.h"

#include <algorithm>

#include "device_kernels/cpu/threefry.h"

namespace jax_rope::cpu {

__attribute__((target_clones("avx512f", "avx2", "default"))) void KeepRun(
    uint32_t k0, uint32_t k1, uint32_t row_word, uint32_t col, bool down_column, int64_t count,
    uint32_t threshold, float kept, float* out) {
  constexpr int kLanes = 32;
  const uint32_t k2 = k0 ^ k1 ^ 0x1BD11BDAu;
  const uint32_t row_steps = down_column ? ~0u : 0u;  // t & row_steps: t or 0
  for (int64_t t0 = 0; t0 < count; t0 += kLanes) {
    uint32_t x0[kLanes], x1[kLanes];
    for (int i = 0; i < kLanes; ++i) {
      const uint32_t step = static_cast<uint32_t>(t0 + i);
      x0[i] = row_word + (step & row_steps) + k0;
      x1[i] = col + (step & ~row_steps) + k1;
    }
#define JAX_ROPE_ROUND(r)             \
  for (int i = 0; i < kLanes; ++i) {  \
    x0[i] += x1[i];                   \
    x1[i] = RotL32(x1[i], r);         \
    x1[i] ^= x0[i];                   \
  }
#define JAX_ROPE_GROUP(a, b, c, d, ka, kb, s)                             \
  JAX_ROPE_ROUND(a) JAX_ROPE_ROUND(b) JAX_ROPE_ROUND(c) JAX_ROPE_ROUND(d) \
  for (int i = 0; i < kLanes; ++i) {                                      \
    x0[i] += ka;                                                          \
    x1[i] += kb + s;                                                      \
  }
    JAX_ROPE_GROUP(13, 15, 26, 6, k1, k2, 1u)
    JAX_ROPE_GROUP(17, 29, 16, 24, k2, k0, 2u)
    JAX_ROPE_GROUP(13, 15, 26, 6, k0, k1, 3u)
    JAX_ROPE_GROUP(17, 29, 16, 24, k1, k2, 4u)
    JAX_ROPE_GROUP(13, 15, 26, 6, k2, k0, 5u)
#undef JAX_ROPE_GROUP
#undef JAX_ROPE_ROUND
    const int64_t n = std::min<int64_t>(kLanes, count - t0);
    for (int64_t i = 0; i < n; ++i) out[t0 + i] = x0[i] < threshold ? kept : 0.0f;
  }
}

}  // namespace jax_rope::cpu
