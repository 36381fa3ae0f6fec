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

// fn(i, j, element) for the positions of tile rows [r0, r0 + nr) x columns
// [c0, c0 + nc) inside the band (i, j local to the tile), by stored rows.
// transposed: keys along the stored rows.
template <typename Fn>
inline void ForBandPositions(const Band& band, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                             float* s, int64_t ld, bool transposed, const Fn& fn) {
  if (!transposed) {
    for (int64_t i = 0; i < nr; ++i) {
      const int64_t lo = std::clamp<int64_t>(band.Lo(r0 + i) - c0, 0, nc);
      const int64_t hi = std::clamp<int64_t>(band.Hi(r0 + i) - c0 + 1, lo, nc);
      float* row = s + i * ld;
      for (int64_t j = lo; j < hi; ++j) fn(i, j, row[j]);
    }
    return;
  }
  for (int64_t j = 0; j < nc; ++j) {
    int64_t first, last;
    band.QueryRange(c0 + j, 1, &first, &last);
    const int64_t lo = std::clamp<int64_t>(first - r0, 0, nr);
    const int64_t hi = std::clamp<int64_t>(last - r0 + 1, lo, nr);
    float* row = s + j * ld;
    for (int64_t i = lo; i < hi; ++i) fn(i, j, row[i]);
  }
}

template <BiasKind K, typename T>
void AddBiasTile(const AttentionGeometry& g, const Band& band, int64_t b, int64_t n, int64_t r0,
                 int64_t nr, int64_t c0, int64_t nc, float* s, int64_t ld, bool transposed) {
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

constexpr int64_t kMaxKeepRow = 256;

// r = keep ? keep_scale : 0 at the band positions of the tile (same layout as
// the score tile); other positions are not written.
inline void KeepTile(const AttentionGeometry& g, const Band& band, int64_t b, int64_t n,
                     int64_t r0, int64_t nr, int64_t c0, int64_t nc, float* r, int64_t ld,
                     bool transposed) {
  const Dropout& dr = g.dropout;
  const uint32_t row_word = dr.rows[b * g.q_heads + n];
  const float kept = dr.keep_scale;
  if (dr.mode == DropoutMode::kKey) {
    // Whole tile rows in vector lanes (positions outside the band are written too:
    // only band positions are read); transposed tiles through one row of scratch.
    const uint32_t k0 = dr.keys[2 * b], k1 = dr.keys[2 * b + 1], threshold = dr.threshold;
    float row[kMaxKeepRow];
    for (int64_t i = 0; i < nr; ++i) {
      const uint32_t word = row_word + static_cast<uint32_t>(r0 + i);
      if (!transposed && nc <= kMaxKeepRow) {
        KeepRow(k0, k1, word, static_cast<uint32_t>(c0), nc, threshold, kept, r + i * ld);
        continue;
      }
      for (int64_t j0 = 0; j0 < nc; j0 += kMaxKeepRow) {
        const int64_t count = std::min<int64_t>(kMaxKeepRow, nc - j0);
        KeepRow(k0, k1, word, static_cast<uint32_t>(c0 + j0), count, threshold, kept, row);
        for (int64_t j = 0; j < count; ++j) {
          r[transposed ? (j0 + j) * ld + i : i * ld + j0 + j] = row[j];
        }
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

// s *= r at the band positions of the tile.
inline void ApplyKeep(const Band& band, int64_t r0, int64_t nr, int64_t c0, int64_t nc, float* s,
                      const float* r, int64_t ld, bool transposed) {
  if (transposed) {
    ForBandPositions(band, r0, nr, c0, nc, s, ld, true,
                     [&](int64_t i, int64_t j, float& x) { x *= r[j * ld + i]; });
    return;
  }
  for (int64_t i = 0; i < nr; ++i) {  // a plain row loop: vectorised
    const int64_t lo = std::clamp<int64_t>(band.Lo(r0 + i) - c0, 0, nc);
    const int64_t hi = std::clamp<int64_t>(band.Hi(r0 + i) - c0 + 1, lo, nc);
    float* __restrict__ row = s + i * ld;
    const float* __restrict__ keep = r + i * ld;
    for (int64_t j = lo; j < hi; ++j) row[j] *= keep[j];
  }
}

}  // namespace jax_rope::cpu::attention

#pragma GCC pop_options
