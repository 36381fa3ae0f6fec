#include "device_kernels/cpu/attention_tiles.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

// The GEMM is built on fused multiply-adds whatever -ffp-contract the rest of
// the library uses (contraction only ever removes a rounding step).
#pragma GCC optimize("fp-contract=fast")

// The routines are written once over GCC vector types and inlined into one
// wrapper per instruction set (a `target` attribute each); vectors never cross
// a call boundary, so no vector ABI is involved.
#define JAX_ROPE_INLINE inline __attribute__((always_inline))

namespace jax_rope::cpu {

// attention_bf16.cc, compiled for AVX-512 with AVX512_BF16.
void Bf16GemmAvx512(int64_t m, int64_t n, int64_t kp, const uint16_t* a, int64_t lda,
                    const uint32_t* b, int64_t ldb, float* c, int64_t ldc);

namespace {

// Register blocking per instruction set: kMr rows x kNv vectors of C stay in
// registers (AVX-512: 16 of 32 zmm; AVX2/SSE: 12 of 16).
struct Avx512 {
  typedef float V __attribute__((vector_size(64)));
  typedef int32_t VI __attribute__((vector_size(64)));
  static constexpr int kMr = 4;
  static constexpr int kNv = 4;
};
struct Avx2 {
  typedef float V __attribute__((vector_size(32)));
  typedef int32_t VI __attribute__((vector_size(32)));
  static constexpr int kMr = 6;
  static constexpr int kNv = 2;
};
struct Sse2 {
  typedef float V __attribute__((vector_size(16)));
  typedef int32_t VI __attribute__((vector_size(16)));
  static constexpr int kMr = 6;
  static constexpr int kNv = 2;
};

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <class Isa>
constexpr int kWidth = sizeof(typename Isa::V) / sizeof(float);

template <class V>
JAX_ROPE_INLINE void Load(V& v, const float* p) {
  std::memcpy(&v, p, sizeof(V));
}
template <class V>
JAX_ROPE_INLINE void Store(float* p, const V& v) {
  std::memcpy(p, &v, sizeof(V));
}

// exp(x) in place, about 1 ulp (Cephes expf: Cody-Waite reduction by ln 2 and a
// degree-6 polynomial). x < -87 (where exp is subnormal or 0, and -inf) gives 0;
// x is clamped at 88 so the result stays finite.
template <class Isa>
JAX_ROPE_INLINE void Exp(typename Isa::V& x) {
  using V = typename Isa::V;
  using VI = typename Isa::VI;
  const V lo = V{} - 87.0f;
  const V hi = V{} + 88.0f;
  V xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const V n = (xc * 1.44269504088896341f + magic) - magic;
  const V r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const V y = p * (r * r) + r + 1.0f;
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  const V result = y * (V)bits;  // a vector cast reinterprets the bits
  x = x < lo ? V{} : result;
}

template <class Isa>
JAX_ROPE_INLINE float HorizontalMax(const typename Isa::V& v) {
  float m = v[0];
  for (int i = 1; i < kWidth<Isa>; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

template <class Isa>
JAX_ROPE_INLINE float HorizontalSum(const typename Isa::V& v) {
  float s = 0.0f;
  for (int i = 0; i < kWidth<Isa>; ++i) s += v[i];
  return s;
}

// C[MR x NV vectors] (+)= A[MR x k] * B[k x NV vectors], C held in registers.
// A is read by scalar broadcasts, so any layout of it costs the same.
template <class Isa, int MR, int NV>
JAX_ROPE_INLINE void Micro(int64_t k, const float* a, int64_t a_row, int64_t a_col,
                           const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
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
    for (int j = 0; j < NV; ++j) Load(bv[j], b + p * ldb + j * w);
    const float* ap = a + p * a_col;
    for (int i = 0; i < MR; ++i) {
      const float av = ap[i * a_row];
      for (int j = 0; j < NV; ++j) acc[i][j] += av * bv[j];
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NV; ++j) Store(c + i * ldc + j * w, acc[i][j]);
  }
}

// Edge blocks: picks the instantiation for mr <= MR rows and nv <= NV vectors.
template <class Isa, int MR, int NV>
JAX_ROPE_INLINE void MicroEdge(int mr, int nv, int64_t k, const float* a, int64_t a_row,
                               int64_t a_col, const float* b, int64_t ldb, float* c, int64_t ldc,
                               bool accumulate) {
  if constexpr (MR > 1) {
    if (mr < MR) {
      MicroEdge<Isa, MR - 1, NV>(mr, nv, k, a, a_row, a_col, b, ldb, c, ldc, accumulate);
      return;
    }
  }
  if constexpr (NV > 1) {
    if (nv < NV) {
      MicroEdge<Isa, MR, NV - 1>(mr, nv, k, a, a_row, a_col, b, ldb, c, ldc, accumulate);
      return;
    }
  }
  Micro<Isa, MR, NV>(k, a, a_row, a_col, b, ldb, c, ldc, accumulate);
}

template <class Isa>
JAX_ROPE_INLINE void Gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_row,
                          int64_t a_col, const float* b, int64_t ldb, float* c, int64_t ldc,
                          bool accumulate) {
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
      const float* bj = b + j0 * w;
      float* cij = c + i0 * ldc + j0 * w;
      if (mr == mr_max && nv == nv_max) {
        Micro<Isa, mr_max, nv_max>(k, ai, a_row, a_col, bj, ldb, cij, ldc, accumulate);
      } else {
        MicroEdge<Isa, mr_max, nv_max>(mr, nv, k, ai, a_row, a_col, bj, ldb, cij, ldc,
                                       accumulate);
      }
    }
  }
}

template <class Isa>
JAX_ROPE_INLINE void SoftmaxStep(float* s, int64_t lds, int64_t keys, int64_t queries, float scale,
                                 float* q_max, float* q_sum, float* out, int64_t ldo,
                                 int64_t out_rows, int64_t out_cols) {
  using V = typename Isa::V;
  constexpr int w = kWidth<Isa>;
  const V neg_inf = V{} + kNegInf;
  for (int64_t c = 0; c < queries; c += w) {
    V tile_max = neg_inf;
    for (int64_t j = 0; j < keys; ++j) {
      V x;
      Load(x, s + j * lds + c);
      x = x == neg_inf ? x : x * scale;  // masked stays -inf whatever the scale's sign
      Store(s + j * lds + c, x);
      tile_max = x > tile_max ? x : tile_max;
    }
    V old_max;
    Load(old_max, q_max + c);
    const V new_max = tile_max > old_max ? tile_max : old_max;
    // Queries with nothing visible yet keep max -inf; subtracting 0 keeps their p at 0.
    const V shift = new_max == neg_inf ? V{} : new_max;
    V sum = V{};
    for (int64_t j = 0; j < keys; ++j) {
      V x;
      Load(x, s + j * lds + c);
      x -= shift;
      Exp<Isa>(x);
      Store(s + j * lds + c, x);
      sum += x;
    }
    V alpha = old_max - shift;  // exactly 1 when the max did not move
    Exp<Isa>(alpha);
    alpha = new_max == neg_inf ? V{} + 1.0f : alpha;
    V old_sum;
    Load(old_sum, q_sum + c);
    Store(q_sum + c, old_sum * alpha + sum);
    Store(q_max + c, new_max);
    for (int i = 0; i < w && c + i < out_rows; ++i) {
      const float a = alpha[i];
      if (a == 1.0f) continue;
      float* o = out + (c + i) * ldo;
      for (int64_t d = 0; d < out_cols; d += w) {
        V x;
        Load(x, o + d);
        Store(o + d, x * a);
      }
    }
  }
}

template <class Isa>
JAX_ROPE_INLINE void SoftmaxGrad(float* s, float* dp, int64_t ld, int64_t rows, int64_t cols,
                                 float scale, const float* max, const float* inv_sum,
                                 const float* delta, bool stats_by_column) {
  using V = typename Isa::V;
  constexpr int w = kWidth<Isa>;
  for (int64_t r = 0; r < rows; ++r) {
    float* srow = s + r * ld;
    float* dprow = dp + r * ld;
    V m = V{} + max[stats_by_column ? 0 : r];
    V il = V{} + inv_sum[stats_by_column ? 0 : r];
    V d = V{} + delta[stats_by_column ? 0 : r];
    for (int64_t j = 0; j < cols; j += w) {
      if (stats_by_column) {
        Load(m, max + j);
        Load(il, inv_sum + j);
        Load(d, delta + j);
      }
      V x;
      V g;
      Load(x, srow + j);
      Load(g, dprow + j);
      V p = x * scale - m;
      Exp<Isa>(p);
      p = x == kNegInf ? V{} : p * il;
      Store(srow + j, p);
      // A masked position's gradient is exactly 0, even where dp is NaN or Inf
      // (from a value row only masked positions reach): 0 * NaN would leak.
      Store(dprow + j, x == kNegInf ? V{} : p * (g - d));
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
                                      int64_t key_step, int64_t row_step) {
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
      V acc[w];
      for (int a = 0; a < w; ++a) acc[a] = V{};
      for (int64_t p = 0; p < dp; p += w) {
        V qv[RB];
        for (int r = 0; r < RB; ++r) Load(qv[r], qi + r * ldq + p);
        for (int kk = 0; kk < KB; ++kk) {
          V kv;
          Load(kv, kr[kk] + p);
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
                               int64_t key_step, int64_t row_step) {
  constexpr int w = kWidth<Isa>;
#define JAX_ROPE_DOT(RB) \
  return DotScoresBlocked<Isa, RB>(keys, rows, d, k, ldk, q, ldq, s, key_step, row_step)
  if (rows <= 1) JAX_ROPE_DOT(1);
  if (rows <= 2) JAX_ROPE_DOT(2);
  if (rows <= 4 || w == 4) JAX_ROPE_DOT(4);
  if constexpr (w >= 8) {
    if (rows <= 8 || w == 8) JAX_ROPE_DOT(8);
  }
  if constexpr (w >= 16) JAX_ROPE_DOT(16);
#undef JAX_ROPE_DOT
}

template <class Isa>
JAX_ROPE_INLINE void SoftmaxRows(float* s, int64_t lds, int64_t rows, int64_t keys, float scale,
                                 float* q_max, float* q_sum, float* out, int64_t ldo,
                                 int64_t out_cols) {
  using V = typename Isa::V;
  constexpr int w = kWidth<Isa>;
  const V neg_inf = V{} + kNegInf;
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * lds;
    V tile_max = neg_inf;
    for (int64_t j = 0; j < keys; j += w) {
      V x;
      Load(x, row + j);
      x = x == neg_inf ? x : x * scale;  // masked stays -inf whatever the scale's sign
      Store(row + j, x);
      tile_max = x > tile_max ? x : tile_max;
    }
    const float old_max = q_max[r];
    float new_max = HorizontalMax<Isa>(tile_max);
    new_max = new_max > old_max ? new_max : old_max;
    // Rows with nothing visible yet keep max -inf; subtracting 0 keeps their p at 0.
    const float shift = new_max == kNegInf ? 0.0f : new_max;
    V sum = V{};
    for (int64_t j = 0; j < keys; j += w) {
      V x;
      Load(x, row + j);
      x -= shift;
      Exp<Isa>(x);
      Store(row + j, x);
      sum += x;
    }
    V alpha = V{} + (old_max - shift);  // exactly 1 when the max did not move
    Exp<Isa>(alpha);
    const float a = new_max == kNegInf ? 1.0f : alpha[0];
    q_sum[r] = q_sum[r] * a + HorizontalSum<Isa>(sum);
    q_max[r] = new_max;
    if (a == 1.0f) continue;
    float* o = out + r * ldo;
    for (int64_t d = 0; d < out_cols; d += w) {
      V x;
      Load(x, o + d);
      Store(o + d, x * a);
    }
  }
}

#define JAX_ROPE_TILE_OPS(Isa, attr)                                                     \
  attr void Gemm##Isa(                                          \
      int64_t m, int64_t n, int64_t k, const float* a, int64_t a_row, int64_t a_col,           \
      const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {                   \
    Gemm<Isa>(m, n, k, a, a_row, a_col, b, ldb, c, ldc, accumulate);                           \
  }                                                                                            \
  attr void SoftmaxStep##Isa(                                   \
      float* s, int64_t lds, int64_t keys, int64_t queries, float scale, float* q_max,         \
      float* q_sum, float* out, int64_t ldo, int64_t out_rows, int64_t out_cols) {             \
    SoftmaxStep<Isa>(s, lds, keys, queries, scale, q_max, q_sum, out, ldo, out_rows, out_cols); \
  }                                                                                            \
  attr void SoftmaxGrad##Isa(                                   \
      float* s, float* dp, int64_t ld, int64_t rows, int64_t cols, float scale,                \
      const float* max, const float* inv_sum, const float* delta, bool stats_by_column) {      \
    SoftmaxGrad<Isa>(s, dp, ld, rows, cols, scale, max, inv_sum, delta, stats_by_column);      \
  }                                                                                            \
  attr void DotScores##Isa(int64_t keys, int64_t rows, int64_t d, const float* k, int64_t ldk, \
                           const float* q, int64_t ldq, float* s, int64_t key_step,            \
                           int64_t row_step) {                                                 \
    DotScores<Isa>(keys, rows, d, k, ldk, q, ldq, s, key_step, row_step);                      \
  }                                                                                            \
  attr void SoftmaxRows##Isa(float* s, int64_t lds, int64_t rows, int64_t keys, float scale,   \
                             float* q_max, float* q_sum, float* out, int64_t ldo,              \
                             int64_t out_cols) {                                               \
    SoftmaxRows<Isa>(s, lds, rows, keys, scale, q_max, q_sum, out, ldo, out_cols);             \
  }                                                                                            \
  constexpr TileOps k##Isa##Ops = {Gemm##Isa,      SoftmaxStep##Isa, SoftmaxGrad##Isa,         \
                                   DotScores##Isa, SoftmaxRows##Isa, nullptr};

JAX_ROPE_TILE_OPS(Avx512, __attribute__((target("avx512f,avx2,fma"))))
JAX_ROPE_TILE_OPS(Avx2, __attribute__((target("avx2,fma"))))
JAX_ROPE_TILE_OPS(Sse2, )
#undef JAX_ROPE_TILE_OPS

// AVX-512 routines plus the bf16 GEMM (attention_bf16.cc).
constexpr TileOps kAvx512Bf16Ops = {GemmAvx512,      SoftmaxStepAvx512, SoftmaxGradAvx512,
                                    DotScoresAvx512, SoftmaxRowsAvx512, Bf16GemmAvx512};

}  // namespace

const TileOps* TileOpsFor(TileIsa isa) {
  __builtin_cpu_init();
  const bool fma = __builtin_cpu_supports("fma");
  switch (isa) {
    case TileIsa::kAvx512:
      if (!fma || !__builtin_cpu_supports("avx512f")) return nullptr;
      return __builtin_cpu_supports("avx512bf16") ? &kAvx512Bf16Ops : &kAvx512Ops;
    case TileIsa::kAvx2:
      return fma && __builtin_cpu_supports("avx2") ? &kAvx2Ops : nullptr;
    case TileIsa::kBaseline:
      return &kSse2Ops;
  }
  return nullptr;
}

const TileOps& GetTileOps() {
  static const TileOps& ops = [] {
    const TileOps* found = TileOpsFor(TileIsa::kAvx512);
    if (found == nullptr) found = TileOpsFor(TileIsa::kAvx2);
    return found != nullptr ? *found : *TileOpsFor(TileIsa::kBaseline);
  }();
  return ops;
}

}  // namespace jax_rope::cpu
