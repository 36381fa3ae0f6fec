#include "device_kernels/cpu/attention_tiles.h"

#include <cmath>
#include <cstring>
#include <limits>

// The GEMM is built on fused multiply-adds whatever -ffp-contract the rest of
// the library uses (contraction only ever removes a rounding step).
#pragma GCC optimize("fp-contract=fast")

// The routines are written once over GCC vector types and inlined into one
// wrapper per instruction set (a `target` attribute each); vectors never cross
// a call boundary, so no vector ABI is involved.
#define JAX_ROPE_INLINE inline __attribute__((always_inline))

namespace jax_rope::cpu {
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
  constexpr TileOps k##Isa##Ops = {Gemm##Isa, SoftmaxStep##Isa, SoftmaxGrad##Isa};

JAX_ROPE_TILE_OPS(Avx512, __attribute__((target("avx512f,avx2,fma"))))
JAX_ROPE_TILE_OPS(Avx2, __attribute__((target("avx2,fma"))))
JAX_ROPE_TILE_OPS(Sse2, )
#undef JAX_ROPE_TILE_OPS

}  // namespace

const TileOps* TileOpsFor(TileIsa isa) {
  __builtin_cpu_init();
  const bool fma = __builtin_cpu_supports("fma");
  switch (isa) {
    case TileIsa::kAvx512:
      return fma && __builtin_cpu_supports("avx512f") ? &kAvx512Ops : nullptr;
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
