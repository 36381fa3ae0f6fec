// The tile products: the register-blocked GEMM (TileOps::gemm, and
// TileOps::gemm_bf16_b over bfloat16 B rows) and the dot-product scores of
// short query blocks (TileOps::dot_scores).
// Private to attention_tiles.cc, which includes it after its fp-contract
// pragma and instantiates these templates once per instruction set, and to
// attention_bf16.cc, whose bf16 dot scores fold their lanes with LaneSums.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include "device_kernels/cpu/attention_tile_vectors.h"
#include "device_kernels/cpu/attention_tiles.h"

namespace jax_rope::cpu::tile_simd {

// A vector of B: float32 as stored, or bfloat16 bits widened exactly (a
// bfloat16 is the upper half of a float32) as it is loaded.
template <class Isa>
JAX_ROPE_INLINE void LoadB(typename Isa::V& v, const float* p) {
  Load(v, p);
}
template <class Isa>
JAX_ROPE_INLINE void LoadB(typename Isa::V& v, const uint16_t* p) {
  typename Isa::VI x;
  Isa::WidenBf16(x, p);
  v = (typename Isa::V)x;
}

// C[MR x NV vectors] (+)= A[MR x k] * B[k x NV vectors], C held in registers.
// A is read by scalar broadcasts, so any layout of it costs the same; B is
// float32 or bfloat16 bits (BT = uint16_t, LoadB). With col_max, each
// column's largest result (NaN skipped) is folded into it as C is stored.
template <class Isa, int MR, int NV, class BT>
JAX_ROPE_INLINE void Micro(int64_t k, const float* a, int64_t a_row, int64_t a_col,
                           const BT* b, int64_t ldb, float* c, int64_t ldc, bool accumulate,
                           float* col_max, const ExpTerms* terms) {
  using V = typename Isa::V;
  constexpr int w = kWidth<Isa>;
  V acc[MR][NV];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NV; ++j) {
      if (accumulate) {
        Load(acc[i][j], c + i * ldc + j * w);
      } else {
        acc[i][j] = V{};
      }
    }
  }
  for (int64_t p = 0; p < k; ++p) {
    V bv[NV];
    for (int j = 0; j < NV; ++j) LoadB<Isa>(bv[j], b + p * ldb + j * w);
    const float* ap = a + p * a_col;
    for (int i = 0; i < MR; ++i) {
      const float av = ap[i * a_row];
      for (int j = 0; j < NV; ++j) acc[i][j] += av * bv[j];
    }
  }
  if (terms == nullptr) {
    for (int i = 0; i < MR; ++i) {
      for (int j = 0; j < NV; ++j) Store(c + i * ldc + j * w, acc[i][j]);
    }
  }
  if (col_max == nullptr) return;
  for (int j = 0; j < NV; ++j) {
    V m;
    Load(m, col_max + j * w);
    for (int i = 0; i < MR; ++i) m = acc[i][j] > m ? acc[i][j] : m;
    Store(col_max + j * w, m);
    if (terms == nullptr) continue;
    // The softmax terms in place of the products (ScaledTerm, as Exps makes
    // them), their sums added row by row (the order of Exps' loop over the keys).
    V shift, sum;
    Load(shift, terms->shift + j * w);
    Load(sum, terms->sum + j * w);
    for (int i = 0; i < MR; ++i) {
      const V x = ScaledTerm<Isa>(acc[i][j], terms->scale, shift);
      Store(c + i * ldc + j * w, x);
      sum += x;
    }
    Store(terms->sum + j * w, sum);
  }
}

// Edge blocks: picks the instantiation for mr <= MR rows and nv <= NV vectors.
template <class Isa, int MR, int NV, class BT>
JAX_ROPE_INLINE void MicroEdge(int mr, int nv, int64_t k, const float* a, int64_t a_row,
                               int64_t a_col, const BT* b, int64_t ldb, float* c, int64_t ldc,
                               bool accumulate, float* col_max, const ExpTerms* terms) {
  if constexpr (MR > 1) {
    if (mr < MR) {
      MicroEdge<Isa, MR - 1, NV, BT>(mr, nv, k, a, a_row, a_col, b, ldb, c, ldc, accumulate,
                                     col_max, terms);
      return;
    }
  }
  if constexpr (NV > 1) {
    if (nv < NV) {
      MicroEdge<Isa, MR, NV - 1, BT>(mr, nv, k, a, a_row, a_col, b, ldb, c, ldc, accumulate,
                                     col_max, terms);
      return;
    }
  }
  Micro<Isa, MR, NV, BT>(k, a, a_row, a_col, b, ldb, c, ldc, accumulate, col_max, terms);
}

template <class Isa, class BT>
JAX_ROPE_INLINE void Gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_row,
                          int64_t a_col, const BT* b, int64_t ldb, float* c, int64_t ldc,
                          bool accumulate, float* col_max = nullptr,
                          const ExpTerms* terms = nullptr) {
  constexpr int w = kWidth<Isa>;
  constexpr int mr_max = Isa::kMr;
  constexpr int nv_max = Isa::kNv;
  const int64_t vectors = (n + w - 1) / w;
  // Column panels outside, rows inside: a k x (nv_max * w) panel of B stays in L1.
  for (int64_t j0 = 0; j0 < vectors; j0 += nv_max) {
    const int nv = static_cast<int>(vectors - j0 < nv_max ? vectors - j0 : nv_max);
    for (int64_t i0 = 0; i0 < m; i0 += mr_max) {
      const int mr = static_cast<int>(m - i0 < mr_max ? m - i0 : mr_max);
      const float* ai = a + i0 * a_row;
      const BT* bj = b + j0 * w;
      float* cij = c + i0 * ldc + j0 * w;
      float* mj = col_max != nullptr ? col_max + j0 * w : nullptr;
      ExpTerms tj;
      if (terms != nullptr) tj = {terms->scale, terms->shift + j0 * w, terms->sum + j0 * w};
      const ExpTerms* t = terms != nullptr ? &tj : nullptr;
      if (mr == mr_max && nv == nv_max) {
        Micro<Isa, mr_max, nv_max, BT>(k, ai, a_row, a_col, bj, ldb, cij, ldc, accumulate, mj, t);
      } else {
        MicroEdge<Isa, mr_max, nv_max, BT>(mr, nv, k, ai, a_row, a_col, bj, ldb, cij, ldc,
                                           accumulate, mj, t);
      }
    }
  }
}

// Lane o of the shuffles that fold two vectors of g groups of l lanes into one
// of 2g groups of l / 2 lanes (group s * g + t holds a's (s = 0) or b's (s = 1)
// group t, its two halves added), so that after log2(w) folds of w vectors
// lane a holds the sum of vector a.
constexpr int FoldLane(int w, int g, int l, int o, int half) {
  const int h = l / 2, group = o / h;
  return (group / g) * w + (group % g) * l + o % h + half * h;
}

template <class Isa, int G, size_t... I>
JAX_ROPE_INLINE void Fold(typename Isa::V& out, const typename Isa::V& a,
                          const typename Isa::V& b, std::index_sequence<I...>) {
  using VI = typename Isa::VI;
  constexpr int w = kWidth<Isa>, l = w / G;
  const VI lo = {FoldLane(w, G, l, static_cast<int>(I), 0)...};
  const VI hi = {FoldLane(w, G, l, static_cast<int>(I), 1)...};
  out = __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

// Leaves in acc[0] the w lane sums of the w vectors acc[0..w) (lane a: vector a).
template <class Isa, int G = 1>
JAX_ROPE_INLINE void LaneSums(typename Isa::V* acc) {
  constexpr int w = kWidth<Isa>;
  if constexpr (G < w) {
    for (int m = 0; m < w / (2 * G); ++m) {
      Fold<Isa, G>(acc[m], acc[2 * m], acc[2 * m + 1], std::make_index_sequence<w>());
    }
    LaneSums<Isa, 2 * G>(acc);
  }
}

// RB rows x (w / RB) keys of dot products per register block: w accumulators,
// folded into one vector of scores at the end.
template <class Isa, int RB>
JAX_ROPE_INLINE void DotScoresBlocked(int64_t keys, int64_t rows, int64_t d, const float* k,
                                      int64_t ldk, const float* q, int64_t ldq, float* s,
                                      int64_t key_step, int64_t row_step,
                                      const RowsAhead& ahead) {
  using V = typename Isa::V;
  constexpr int w = kWidth<Isa>;
  constexpr int KB = w / RB;
  const int64_t dp = RoundUpToTile(d);
  for (int64_t i0 = 0; i0 < rows; i0 += RB) {
    const int64_t nrow = rows - i0 < RB ? rows - i0 : RB;
    const float* qi = q + i0 * ldq;
    for (int64_t j0 = 0; j0 < keys; j0 += KB) {
      const float* kr[KB];
      // Past the last key, the last key again (its scores are not stored).
      for (int kk = 0; kk < KB; ++kk) kr[kk] = k + (j0 + kk < keys ? j0 + kk : keys - 1) * ldk;
      for (int kk = 0; kk < KB && i0 == 0; ++kk) ahead.Fetch(j0 + kk);
      V acc[w];
#pragma GCC unroll 16
      for (int a = 0; a < w; ++a) acc[a] = V{};
      for (int64_t p = 0; p < dp; p += w) {
        V qv[RB];
#pragma GCC unroll 16
        for (int r = 0; r < RB; ++r) Load(qv[r], qi + r * ldq + p);
#pragma GCC unroll 16
        for (int kk = 0; kk < KB; ++kk) {
          V kv;
          Load(kv, kr[kk] + p);
#pragma GCC unroll 16
          for (int r = 0; r < RB; ++r) acc[kk * RB + r] += kv * qv[r];
        }
      }
      LaneSums<Isa>(acc);
      for (int kk = 0; kk < KB && j0 + kk < keys; ++kk) {
        float* out = s + (j0 + kk) * key_step + i0 * row_step;
        for (int64_t r = 0; r < nrow; ++r) out[r * row_step] = acc[0][kk * RB + r];
      }
    }
  }
}

template <class Isa>
JAX_ROPE_INLINE void DotScores(int64_t keys, int64_t rows, int64_t d, const float* k,
                               int64_t ldk, const float* q, int64_t ldq, float* s,
                               int64_t key_step, int64_t row_step, const RowsAhead& ahead) {
  constexpr int w = kWidth<Isa>;
#define JAX_ROPE_DOT(RB) \
  return DotScoresBlocked<Isa, RB>(keys, rows, d, k, ldk, q, ldq, s, key_step, row_step, ahead)
  if (rows <= 1) JAX_ROPE_DOT(1);
  if (rows <= 2) JAX_ROPE_DOT(2);
  if (rows <= 4 || w == 4) JAX_ROPE_DOT(4);
  if constexpr (w >= 8) {
    if (rows <= 8 || w == 8) JAX_ROPE_DOT(8);
  }
  if constexpr (w >= 16) JAX_ROPE_DOT(16);
#undef JAX_ROPE_DOT
}

}  // namespace jax_rope::cpu::tile_simd
