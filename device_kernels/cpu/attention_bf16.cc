// The bfloat16 GEMM of TileOps::bf16_gemm: vdpbf16ps multiplies pairs of
// bfloat16 along the depth axis exactly and adds them into float32 lanes, twice
// the products per instruction of a float32 FMA, with no conversion of A (read
// in place, a 32-bit pair per broadcast). Compiled for AVX-512 + AVX512_BF16
// only inside this file's functions; attention_tiles.cc hands it out only when
// the CPU has both.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define JAX_ROPE_BF16 __attribute__((target("avx512f,avx512bf16")))

namespace jax_rope::cpu {
namespace {

// C[MR x NV vectors] = A[MR x 2 kp] * B (pairs), C held in registers.
template <int MR, int NV>
JAX_ROPE_BF16 inline __attribute__((always_inline)) void Micro(
    int64_t kp, const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb, float* c,
    int64_t ldc) {
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < kp; ++p) {
    __m512bh bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(b + p * ldb + j * 16);
    for (int i = 0; i < MR; ++i) {
      uint32_t pair;
      std::memcpy(&pair, a + i * lda + 2 * p, sizeof(pair));
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av, bv[j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(c + i * ldc + j * 16, acc[i][j]);
  }
}

template <int MR, int NV>
JAX_ROPE_BF16 inline __attribute__((always_inline)) void MicroEdge(
    int mr, int nv, int64_t kp, const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb,
    float* c, int64_t ldc) {
  if constexpr (MR > 1) {
    if (mr < MR) return MicroEdge<MR - 1, NV>(mr, nv, kp, a, lda, b, ldb, c, ldc);
  }
  if constexpr (NV > 1) {
    if (nv < NV) return MicroEdge<MR, NV - 1>(mr, nv, kp, a, lda, b, ldb, c, ldc);
  }
  Micro<MR, NV>(kp, a, lda, b, ldb, c, ldc);
}

}  // namespace

JAX_ROPE_BF16 void Bf16GemmAvx512(int64_t m, int64_t n, int64_t kp, const uint16_t* a,
                                  int64_t lda, const uint32_t* b, int64_t ldb, float* c,
                                  int64_t ldc) {
  constexpr int kMr = 4, kNv = 4;
  const int64_t vectors = (n + 15) / 16;
  for (int64_t j0 = 0; j0 < vectors; j0 += kNv) {
    const int nv = static_cast<int>(vectors - j0 < kNv ? vectors - j0 : kNv);
    for (int64_t i0 = 0; i0 < m; i0 += kMr) {
      const int mr = static_cast<int>(m - i0 < kMr ? m - i0 : kMr);
      const uint16_t* ai = a + i0 * lda;
      const uint32_t* bj = b + j0 * 16;
      float* cij = c + i0 * ldc + j0 * 16;
      if (mr == kMr && nv == kNv) {
        Micro<kMr, kNv>(kp, ai, lda, bj, ldb, cij, ldc);
      } else {
        MicroEdge<kMr, kNv>(mr, nv, kp, ai, lda, bj, ldb, cij, ldc);
      }
    }
  }
}

}  // namespace jax_rope::cpu
