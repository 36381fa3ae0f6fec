// Dropout keep factors of a run of tile positions, hashed in vector lanes: the
// same Threefry2x32 (threefry.h) for consecutive row or column counters, written
// as loops the compiler vectorises, compiled once per instruction set and picked
// at run time. A round's three steps depend on each other, so one vector of
// counters at a time waits on them; kLanes counters per step give several
// independent vectors to interleave. Measured per instruction set (Zen 4,
// cycles per counter in runs of 64, a loop calling the run alone): AVX-512VL
// at 256 bits with 64 lanes 2.75, where 512-bit vectors took 3.10 (3.54 with 32
// lanes); AVX2 64 lanes 4.3 (32: 4.5); baseline SSE2 32 lanes 8.3 (64: 8.9).
#include "device_kernels/cpu/dropout_keep.h"

#include <algorithm>

#include "device_kernels/cpu/threefry.h"

namespace jax_rope::cpu {
namespace {

template <int kLanes>
inline __attribute__((always_inline)) void KeepRunLanes(uint32_t k0, uint32_t k1,
                                                        uint32_t row_word, uint32_t col,
                                                        bool down_column, int64_t count,
                                                        uint32_t threshold, float kept,
                                                        float* out) {
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

// AVX-512VL supplies the rotate instruction at 256 bits.
__attribute__((target("avx512f,avx512vl,prefer-vector-width=256"))) void KeepRunAvx512(
    uint32_t k0, uint32_t k1, uint32_t row_word, uint32_t col, bool down_column, int64_t count,
    uint32_t threshold, float kept, float* out) {
  KeepRunLanes<64>(k0, k1, row_word, col, down_column, count, threshold, kept, out);
}

__attribute__((target("avx2"))) void KeepRunAvx2(uint32_t k0, uint32_t k1, uint32_t row_word,
                                                 uint32_t col, bool down_column, int64_t count,
                                                 uint32_t threshold, float kept, float* out) {
  KeepRunLanes<64>(k0, k1, row_word, col, down_column, count, threshold, kept, out);
}

void KeepRunBaseline(uint32_t k0, uint32_t k1, uint32_t row_word, uint32_t col,
                     bool down_column, int64_t count, uint32_t threshold, float kept,
                     float* out) {
  KeepRunLanes<32>(k0, k1, row_word, col, down_column, count, threshold, kept, out);
}

}  // namespace

KeepRunFn KeepRunFor(TileIsa isa) {
  __builtin_cpu_init();
  switch (isa) {
    case TileIsa::kAvx512Amx:
    case TileIsa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")
                 ? KeepRunAvx512
                 : nullptr;
    case TileIsa::kAvx2:
      return __builtin_cpu_supports("avx2") ? KeepRunAvx2 : nullptr;
    case TileIsa::kBaseline:
      return KeepRunBaseline;
  }
  return nullptr;
}

void KeepRun(uint32_t k0, uint32_t k1, uint32_t row_word, uint32_t col, bool down_column,
             int64_t count, uint32_t threshold, float kept, float* out) {
  static const KeepRunFn best = [] {
    for (TileIsa isa : {TileIsa::kAvx512, TileIsa::kAvx2}) {
      if (KeepRunFn fn = KeepRunFor(isa)) return fn;
    }
    return KeepRunFor(TileIsa::kBaseline);
  }();
  best(k0, k1, row_word, col, down_column, count, threshold, kept, out);
}

}  // namespace jax_rope::cpu
