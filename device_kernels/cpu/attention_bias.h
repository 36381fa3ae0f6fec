// Positional bias and dropout keep factors of the CPU attention kernels
// (spec/attention_bias_dropout.md), evaluated per score tile: the bias is
// read from the caller's operand or, for ALiBi, computed in the tile, and the
// keep bits are hashed (or read from the packed mask) for the tile's band
// positions only. Nothing of size S x S is ever built. Internal to
// attention_kernels.cc; the kernel test checks it against a dense reference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "device_kernels/cpu/attention_bias_rows.h"
#include "device_kernels/cpu/attention_blocks.h"
#include "device_kernels/cpu/dropout_keep.h"
#include "device_kernels/cpu/threefry.h"

// The biased score is specified with two roundings, f32(f32(scale * x) + P):
// never fused into one multiply-add, whatever the build flags.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace jax_rope::cpu::attention {

// P(i, j) of one (table row, query head) for sequence-local row i, column j.
template <BiasKind K, typename T>
class BiasReader {
 public:
  BiasReader(const PositionBias& p, const Band& band, int64_t b, int64_t n) {
    if constexpr (K == BiasKind::kAlibi || K == BiasKind::kAlibiSqrt) {
      neg_slope_ = -static_cast<const float*>(p.data)[b * p.slope_batch + n];
      shift_ = int64_t{p.offsets[2 * b + 1]} - int64_t{p.offsets[2 * b]};
    } else {
      base_ = static_cast<const T*>(p.data) + p.seq_base[b] + n * p.head;
      row_ = p.row_is_kv_len ? band.kv_len : p.row;
      width_ = p.width;
    }
  }

  float operator()(int64_t i, int64_t j) const {
    if constexpr (K == BiasKind::kTensor) {
      return ToFloat(base_[i * row_ + j]);
    } else if constexpr (K == BiasKind::kCompressed) {
      const int64_t d = i - j;
      if (d >= 0) return ToFloat(base_[1023 * width_ + width_ - 1 - d]);
      if (d >= -1023) return ToFloat(base_[(1023 + d) * width_ + width_ - 1]);
      return 0.0f;
    } else {
      const int64_t dist = j - i + shift_;
      float a = static_cast<float>(dist < 0 ? -dist : dist);
      if constexpr (K == BiasKind::kAlibiSqrt) a = std::sqrt(a);
      return neg_slope_ * a;
    }
  }

 private:
  const T* base_ = nullptr;
  int64_t row_ = 0, width_ = 0, shift_ = 0;
  float neg_slope_ = 0.0f;
};

// fn(r, lo, hi) for each stored row r of a tile of rows [r0, r0 + nr) x
// columns [c0, c0 + nc) with the row's band positions at elements [lo, hi).
// transposed: keys along the stored rows (stored row r is key c0 + r, element
// e query r0 + e); else stored row r is query r0 + r, element e key c0 + e.
template <typename Fn>
inline void ForBandRows(const Band& band, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                        bool transposed, const Fn& fn) {
  if (!transposed) {
    for (int64_t i = 0; i < nr; ++i) {
      const int64_t lo = std::clamp<int64_t>(band.Lo(r0 + i) - c0, 0, nc);
      fn(i, lo, std::clamp<int64_t>(band.Hi(r0 + i) - c0 + 1, lo, nc));
    }
    return;
  }
  for (int64_t j = 0; j < nc; ++j) {
    int64_t first, last;
    band.QueryRange(c0 + j, 1, &first, &last);
    const int64_t lo = std::clamp<int64_t>(first - r0, 0, nr);
    fn(j, lo, std::clamp<int64_t>(last - r0 + 1, lo, nr));
  }
}

// fn(i, j, element) for the positions of the tile inside the band (i, j local
// to the tile), by query rows whatever the tile's layout: what fn reads per
// position (a bias tensor, the packed dropout mask) is stored by query rows, so
// each of its rows is read in order. (By the stored rows of a transposed tile,
// each step went to another query row: the causal S2048 forward with a dense
// bias spent 17% of its samples adding it, 8% now.)
template <typename Fn>
inline void ForBandPositions(const Band& band, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                             float* s, int64_t ld, bool transposed, const Fn& fn) {
  ForBandRows(band, r0, nr, c0, nc, false, [&](int64_t i, int64_t lo, int64_t hi) {
    if (transposed) {  // element (i, j) at stored row j
      for (int64_t j = lo; j < hi; ++j) fn(i, j, s[j * ld + i]);
    } else {
      float* row = s + i * ld;
      for (int64_t j = lo; j < hi; ++j) fn(i, j, row[j]);
    }
  });
}

template <BiasKind K, typename T>
void AddBiasTile(const AttentionGeometry& g, const Band& band, int64_t b, int64_t n, int64_t r0,
                 int64_t nr, int64_t c0, int64_t nc, float* s, int64_t ld, bool transposed) {
  if constexpr (K == BiasKind::kAlibi || K == BiasKind::kAlibiSqrt) {
    // dist = key - query + shift: in int32 lanes when every distance of the tile fits
    // (ALiBi is added after scaling; the FFI decoder refuses anything else).
    const int64_t shift = int64_t{g.bias.offsets[2 * b + 1]} - int64_t{g.bias.offsets[2 * b]};
    const int64_t low = c0 - (r0 + nr) + shift, high = c0 + nc - r0 + shift;
    constexpr int64_t kFits = int64_t{1} << 30;
    if (g.bias.after_scale && -kFits < low && high < kFits) {
      const float neg_slope = -static_cast<const float*>(g.bias.data)[b * g.bias.slope_batch + n];
      ForBandRows(band, r0, nr, c0, nc, transposed, [&](int64_t r, int64_t lo, int64_t hi) {
        float* row = s + r * ld;
        // The distances along the stored row: base + step * e (AlibiRow).
        if (transposed) {  // key c0 + r, queries r0 + e
          AlibiRow(row, int32_t(lo), int32_t(hi), int32_t(c0 + r - r0 + shift), -1, neg_slope,
                   g.scale, K == BiasKind::kAlibiSqrt);
        } else {  // query r0 + r, keys c0 + e
          AlibiRow(row, int32_t(lo), int32_t(hi), int32_t(c0 - (r0 + r) + shift), 1, neg_slope,
                   g.scale, K == BiasKind::kAlibiSqrt);
        }
      });
      return;
    }
  }
  const BiasReader<K, T> bias(g.bias, band, b, n);
  if (g.bias.after_scale) {
    const float scale = g.scale;
    ForBandPositions(band, r0, nr, c0, nc, s, ld, transposed, [&](int64_t i, int64_t j, float& x) {
      x = scale * x + bias(r0 + i, c0 + j);
    });
  } else {
    ForBandPositions(band, r0, nr, c0, nc, s, ld, transposed, [&](int64_t i, int64_t j, float& x) {
      x = x + bias(r0 + i, c0 + j);
    });
  }
}

// Turns a tile of raw dot products x into what the tile routines scale by
// ScoreScale(g): x + P (pse_type 1) or the final score (after_scale). Masked
// positions are left to MaskTile, which runs afterwards and overwrites them,
// so bias values there (NaN, Inf) have no effect.
template <typename T>
void AddBias(const AttentionGeometry& g, const Band& band, int64_t b, int64_t n, int64_t r0,
             int64_t nr, int64_t c0, int64_t nc, float* s, int64_t ld, bool transposed) {
  switch (g.bias.kind) {
    case BiasKind::kNone:
      return;
    case BiasKind::kTensor:
    case BiasKind::kPacked:
      return AddBiasTile<BiasKind::kTensor, T>(g, band, b, n, r0, nr, c0, nc, s, ld, transposed);
    case BiasKind::kCompressed:
      return AddBiasTile<BiasKind::kCompressed, T>(g, band, b, n, r0, nr, c0, nc, s, ld,
                                                   transposed);
    case BiasKind::kAlibi:
      return AddBiasTile<BiasKind::kAlibi, T>(g, band, b, n, r0, nr, c0, nc, s, ld, transposed);
    case BiasKind::kAlibiSqrt:
      return AddBiasTile<BiasKind::kAlibiSqrt, T>(g, band, b, n, r0, nr, c0, nc, s, ld,
                                                  transposed);
  }
}

// The scale the tile routines apply to what AddBias left in the tile.
inline float ScoreScale(const AttentionGeometry& g) {
  return g.bias.kind != BiasKind::kNone && g.bias.after_scale ? 1.0f : g.scale;
}

// r = keep ? keep_scale : 0 at the band positions of the tile (same layout as
// the score tile); other positions are not written.
inline void KeepTile(const AttentionGeometry& g, const Band& band, int64_t b, int64_t n,
                     int64_t r0, int64_t nr, int64_t c0, int64_t nc, float* r, int64_t ld,
                     bool transposed) {
  const Dropout& dr = g.dropout;
  const uint32_t row_word = dr.rows[b * g.q_heads + n];
  const float kept = dr.keep_scale;
  if (dr.mode == DropoutMode::kKey) {
    // Whole stored rows in vector lanes (positions outside the band are written
    // too: only band positions are read).
    const uint32_t k0 = dr.keys[2 * b], k1 = dr.keys[2 * b + 1], threshold = dr.threshold;
    const uint32_t first_word = row_word + static_cast<uint32_t>(r0);
    if (transposed) {  // stored row j: key c0 + j, queries r0 .. r0 + nr - 1
      for (int64_t j = 0; j < nc; ++j) {
        KeepRun(k0, k1, first_word, static_cast<uint32_t>(c0 + j), true, nr, threshold, kept,
                r + j * ld);
      }
    } else {
      for (int64_t i = 0; i < nr; ++i) {
        KeepRun(k0, k1, first_word + static_cast<uint32_t>(i), static_cast<uint32_t>(c0), false,
                nc, threshold, kept, r + i * ld);
      }
    }
  } else {
    const uint64_t first = uint64_t{row_word} + uint64_t(r0) * uint64_t(band.kv_len) + uint64_t(c0);
    const uint64_t kv_len = uint64_t(band.kv_len);
    const uint8_t* mask = dr.mask;
    ForBandPositions(band, r0, nr, c0, nc, r, ld, transposed, [&](int64_t i, int64_t j, float& x) {
      const uint64_t e = first + uint64_t(i) * kv_len + uint64_t(j);
      x = (mask[e >> 3] >> (e & 7)) & 1 ? kept : 0.0f;
    });
  }
}

// s *= r at the band positions of the tile (r laid out as s).
inline void ApplyKeep(const Band& band, int64_t r0, int64_t nr, int64_t c0, int64_t nc, float* s,
                      const float* r, int64_t ld, bool transposed) {
  ForBandRows(band, r0, nr, c0, nc, transposed, [&](int64_t row, int64_t lo, int64_t hi) {
    MultiplyRow(s + row * ld, r + row * ld, lo, hi);
  });
}

}  // namespace jax_rope::cpu::attention

#pragma GCC pop_options
