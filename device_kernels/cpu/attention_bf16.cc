// The bfloat16 GEMMs of TileOps::bf16_gemm and bf16_pairs_gemm: vdpbf16ps multiplies pairs of
// bfloat16 along the depth axis exactly and adds them into float32 lanes, twice
// the products per instruction of a float32 FMA, with no conversion of A (read
// in place, a 32-bit pair per broadcast); and TileOps::bf16_dot_scores, the
// float32 dot scores' register blocks (attention_tile_products.h) on the same
// instruction, key rows read in place. Compiled for AVX-512 + AVX512_BF16 only
// inside this file's functions; attention_tiles.cc hands them out only when
// the CPU has both.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "device_kernels/cpu/attention_tile_products.h"
#include "device_kernels/cpu/attention_tiles.h"

#define JAX_ROPE_BF16 __attribute__((target("avx512f,avx512bf16")))

namespace jax_rope::cpu {
namespace {

// C[MR x NV vectors] (+)= A * B (pairs), A's pair p of row i at
// a[i * a_row + p * a_col].
template <int MR, int NV>
JAX_ROPE_BF16 inline __attribute__((always_inline)) void MicroPairs(
    int64_t kp, const uint32_t* a, int64_t a_row, int64_t a_col, const uint32_t* b, int64_t ldb,
    float* c, int64_t ldc, bool accumulate) {
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NV; ++j) {
      acc[i][j] = accumulate ? _mm512_loadu_ps(c + i * ldc + j * 16) : _mm512_setzero_ps();
    }
  }
  for (int64_t p = 0; p < kp; ++p) {
    __m512bh bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(b + p * ldb + j * 16);
    const uint32_t* ap = a + p * a_col;
    for (int i = 0; i < MR; ++i) {
      uint32_t pair;  // (a may be bfloat16 rows: read as bytes, not as a uint32_t object)
      std::memcpy(&pair, ap + i * a_row, sizeof(pair));
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av, bv[j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(c + i * ldc + j * 16, acc[i][j]);
  }
}

template <int MR, int NV>
JAX_ROPE_BF16 inline __attribute__((always_inline)) void MicroPairsEdge(
    int mr, int nv, int64_t kp, const uint32_t* a, int64_t a_row, int64_t a_col,
    const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  if constexpr (MR > 1) {
    if (mr < MR) {
      return MicroPairsEdge<MR - 1, NV>(mr, nv, kp, a, a_row, a_col, b, ldb, c, ldc, accumulate);
    }
  }
  if constexpr (NV > 1) {
    if (nv < NV) {
      return MicroPairsEdge<MR, NV - 1>(mr, nv, kp, a, a_row, a_col, b, ldb, c, ldc, accumulate);
    }
  }
  MicroPairs<MR, NV>(kp, a, a_row, a_col, b, ldb, c, ldc, accumulate);
}

// RB query rows x (16 / RB) keys per register block: 16 accumulators of pair
// products, folded into one vector of scores (tile_simd::LaneSums). The last
// pairs of a row, short of a whole vector, come in masked loads: nothing past
// a key row is read. The blocking is tile_simd::DotScoresBlocked's; one
// template for both would need its loop compiled for AVX512_BF16, as GCC
// inlines no AVX512_BF16 step into a caller compiled without it.
template <int RB>
JAX_ROPE_BF16 inline __attribute__((always_inline)) void DotScoresBlocked(
    int64_t keys, int64_t rows, int64_t kp, const uint16_t* k, int64_t ldk, const uint32_t* q,
    int64_t ldq, float* s, int64_t key_step, int64_t row_step, const RowsAhead& ahead) {
  using V = tile_simd::Avx512::V;
  constexpr int w = 16, KB = w / RB;
  const int64_t whole = kp / w * w;
  const __mmask16 tail = static_cast<__mmask16>((1u << (kp - whole)) - 1);
  for (int64_t i0 = 0; i0 < rows; i0 += RB) {
    const int64_t nrow = rows - i0 < RB ? rows - i0 : RB;
    const uint32_t* qi = q + i0 * ldq;
    for (int64_t j0 = 0; j0 < keys; j0 += KB) {
      const uint16_t* kr[KB];
      // Past the last key, the last key again (its scores are not stored).
      for (int kk = 0; kk < KB; ++kk) kr[kk] = k + (j0 + kk < keys ? j0 + kk : keys - 1) * ldk;
      for (int kk = 0; kk < KB && i0 == 0; ++kk) ahead.Fetch(j0 + kk);
      __m512 acc[w];
      for (int a = 0; a < w; ++a) acc[a] = _mm512_setzero_ps();
      for (int64_t p = 0; p < kp; p += w) {
        const __mmask16 mask = p < whole ? static_cast<__mmask16>(0xffff) : tail;
        __m512bh qv[RB];
        for (int r = 0; r < RB; ++r) {
          qv[r] = (__m512bh)_mm512_maskz_loadu_epi32(mask, qi + r * ldq + p);
        }
        for (int kk = 0; kk < KB; ++kk) {
          const __m512bh kv = (__m512bh)_mm512_maskz_loadu_epi32(mask, kr[kk] + 2 * p);
          for (int r = 0; r < RB; ++r) {
            acc[kk * RB + r] = _mm512_dpbf16_ps(acc[kk * RB + r], kv, qv[r]);
          }
        }
      }
      V folded[w];
      for (int a = 0; a < w; ++a) folded[a] = (V)acc[a];
      tile_simd::LaneSums<tile_simd::Avx512>(folded);
      for (int kk = 0; kk < KB && j0 + kk < keys; ++kk) {
        float* out = s + (j0 + kk) * key_step + i0 * row_step;
        for (int64_t r = 0; r < nrow; ++r) out[r * row_step] = folded[0][kk * RB + r];
      }
    }
  }
}

}  // namespace

JAX_ROPE_BF16 void Bf16DotScoresAvx512(int64_t keys, int64_t rows, int64_t kp, const uint16_t* k,
                                       int64_t ldk, const uint32_t* q, int64_t ldq, float* s,
                                       int64_t key_step, int64_t row_step,
                                       const RowsAhead& ahead) {
#define JAX_ROPE_DOT(RB) \
  return DotScoresBlocked<RB>(keys, rows, kp, k, ldk, q, ldq, s, key_step, row_step, ahead)
  if (rows <= 1) JAX_ROPE_DOT(1);
  if (rows <= 2) JAX_ROPE_DOT(2);
  if (rows <= 4) JAX_ROPE_DOT(4);
  if (rows <= 8) JAX_ROPE_DOT(8);
  JAX_ROPE_DOT(16);
#undef JAX_ROPE_DOT
}

JAX_ROPE_BF16 void Bf16PairsGemmAvx512(int64_t m, int64_t n, int64_t kp, const uint32_t* a,
                                       int64_t a_row, int64_t a_col, const uint32_t* b,
                                       int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  constexpr int kMr = 4, kNv = 4;
  const int64_t vectors = (n + 15) / 16;
  for (int64_t j0 = 0; j0 < vectors; j0 += kNv) {
    const int nv = static_cast<int>(vectors - j0 < kNv ? vectors - j0 : kNv);
    for (int64_t i0 = 0; i0 < m; i0 += kMr) {
      const int mr = static_cast<int>(m - i0 < kMr ? m - i0 : kMr);
      const uint32_t* ai = a + i0 * a_row;
      const uint32_t* bj = b + j0 * 16;
      float* cij = c + i0 * ldc + j0 * 16;
      if (mr == kMr && nv == kNv) {
        MicroPairs<kMr, kNv>(kp, ai, a_row, a_col, bj, ldb, cij, ldc, accumulate);
      } else {
        MicroPairsEdge<kMr, kNv>(mr, nv, kp, ai, a_row, a_col, bj, ldb, cij, ldc, accumulate);
      }
    }
  }
}

// bf16_gemm is the pairs GEMM with A's rows read in place as pairs (lda even:
// its callers' rows are of an even head_dim).
JAX_ROPE_BF16 void Bf16GemmAvx512(int64_t m, int64_t n, int64_t kp, const uint16_t* a,
                                  int64_t lda, const uint32_t* b, int64_t ldb, float* c,
                                  int64_t ldc) {
  Bf16PairsGemmAvx512(m, n, kp, reinterpret_cast<const uint32_t*>(a), lda / 2, 1, b, ldb, c, ldc,
                      false);
}

}  // namespace jax_rope::cpu
