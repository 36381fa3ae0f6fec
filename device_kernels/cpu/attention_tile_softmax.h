// The softmax steps over score tiles: the forward's online step on transposed
// tiles (TileOps::softmax_step) and on row tiles (TileOps::softmax_rows), and
// the backward's p and dS (TileOps::softmax_grad).
// Private to attention_tiles.cc, which includes it after its fp-contract
// pragma and instantiates these templates once per instruction set.
#pragma once

#include <cstdint>

#include "device_kernels/cpu/attention_tile_vectors.h"

namespace jax_rope::cpu::tile_simd {

// s[j] = exp(s[j] - shift) for the keys of one vector of queries, added to
// sum; with kScale, ScaledTerm's exp(scale * s[j] - shift).
template <class Isa, bool kScale>
JAX_ROPE_INLINE void Exps(float* s, int64_t lds, int64_t keys, float scale,
                          const typename Isa::V& shift, typename Isa::V& sum) {
  using V = typename Isa::V;
  for (int64_t j = 0; j < keys; ++j) {
    V x;
    Load(x, s + j * lds);
    if constexpr (kScale) {
      x = ScaledTerm<Isa>(x, scale, shift);
    } else {
      x -= shift;
      Exp<Isa>(x);
    }
    Store(s + j * lds, x);
    sum += x;
  }
}

template <class Isa>
JAX_ROPE_INLINE void SoftmaxStep(float* s, int64_t lds, int64_t keys, int64_t queries, float scale,
                                 const float* raw_max, float* q_max, float* q_sum, float* out,
                                 int64_t ldo, int64_t out_rows, int64_t out_cols) {
  using V = typename Isa::V;
  constexpr int w = kWidth<Isa>;
  const V neg_inf = V{} + kNegInf;
  for (int64_t c = 0; c < queries; c += w) {
    V tile_max = neg_inf;
    if (raw_max != nullptr) {
      // No position masked and scale > 0: rounding is monotonic, so the
      // largest scaled score is the largest product scaled.
      Load(tile_max, raw_max + c);
      tile_max *= scale;
    } else {
      for (int64_t j = 0; j < keys; ++j) {
        V x;
        Load(x, s + j * lds + c);
        x = x == neg_inf ? x : x * scale;  // masked stays -inf whatever the scale's sign
        Store(s + j * lds + c, x);
        tile_max = x > tile_max ? x : tile_max;
      }
    }
    V old_max;
    Load(old_max, q_max + c);
    const V new_max = tile_max > old_max ? tile_max : old_max;
    // Queries with nothing visible yet keep max -inf; subtracting 0 keeps their p at 0.
    const V shift = new_max == neg_inf ? V{} : new_max;
    V sum = V{};
    if (raw_max != nullptr) {
      Exps<Isa, true>(s + c, lds, keys, scale, shift, sum);
    } else {
      Exps<Isa, false>(s + c, lds, keys, scale, shift, sum);
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

}  // namespace jax_rope::cpu::tile_simd
