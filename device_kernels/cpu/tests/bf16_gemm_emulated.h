// Portable TileOps::bf16_gemm and bf16_pairs_gemm for the tests: the contract of
// attention_tiles.h, lane by lane as vdpbf16ps computes it (per pair the odd
// product is added first, then the even one; each product is exact in float32,
// each addition rounds), except that denormals are not flushed. With it a CPU
// without AVX512_BF16 runs the kernels' bfloat16 dot-product branches
// (attention_kernel_test); attention_tiles_test holds it to the same checks as
// the instruction.
#pragma once

#include <atomic>
#include <cstdint>

#include "device_kernels/cpu/attention_tiles.h"
#include "device_kernels/cpu/float_convert.h"

namespace jax_rope::cpu::test {

inline std::atomic<int64_t> g_emulated_bf16_gemm_calls{0};

inline float Bf16BitsToFloat(uint32_t bits) {
  return ToFloat(BFloat16{static_cast<uint16_t>(bits)});
}

inline void EmulatedBf16Gemm(int64_t m, int64_t n, int64_t kp, const uint16_t* a, int64_t lda,
                             const uint32_t* b, int64_t ldb, float* c, int64_t ldc) {
  g_emulated_bf16_gemm_calls.fetch_add(1, std::memory_order_relaxed);
  const int64_t columns = RoundUpToTile(n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < columns; ++j) {
      float acc = 0.0f;
      for (int64_t p = 0; p < kp; ++p) {
        const uint32_t pair = b[p * ldb + j];
        const float odd = Bf16BitsToFloat(a[i * lda + 2 * p + 1]) * Bf16BitsToFloat(pair >> 16);
        acc = acc + odd;
        const float even = Bf16BitsToFloat(a[i * lda + 2 * p]) * Bf16BitsToFloat(pair & 0xffff);
        acc = acc + even;
      }
      c[i * ldc + j] = acc;
    }
  }
}

// TileOps::bf16_pairs_gemm, lane by lane in the same order.
inline void EmulatedBf16PairsGemm(int64_t m, int64_t n, int64_t kp, const uint32_t* a,
                                  int64_t a_row, int64_t a_col, const uint32_t* b, int64_t ldb,
                                  float* c, int64_t ldc, bool accumulate) {
  g_emulated_bf16_gemm_calls.fetch_add(1, std::memory_order_relaxed);
  const int64_t columns = RoundUpToTile(n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < columns; ++j) {
      float acc = accumulate ? c[i * ldc + j] : 0.0f;
      for (int64_t p = 0; p < kp; ++p) {
        const uint32_t pa = a[i * a_row + p * a_col], pb = b[p * ldb + j];
        acc = acc + Bf16BitsToFloat(pa >> 16) * Bf16BitsToFloat(pb >> 16);
        acc = acc + Bf16BitsToFloat(pa & 0xffff) * Bf16BitsToFloat(pb & 0xffff);
      }
      c[i * ldc + j] = acc;
    }
  }
}

}  // namespace jax_rope::cpu::test
