// Masking steps shared by the attention kernels (attention_kernels.cc,
// attention_split.cc): masked positions of a score tile to -inf, and the
// products that must not let NaN/Inf of a masked key or value row leak.
// Internal to the kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "device_kernels/cpu/attention_blocks.h"
#include "device_kernels/cpu/attention_staging.h"
#include "device_kernels/cpu/attention_tiles.h"

namespace jax_rope::cpu::attention {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// What the element mask holds in a tile's rectangle (rows [r0, r0 + nr) x
// columns [c0, c0 + nc) of head n of sequence b): nothing masked (or no mask),
// every position masked, or some of each. A kAll tile adds nothing to any
// result and is skipped (what a skipped tile would add is exactly zero); the
// band alone masks a kClear one. A pass over the tile's mask bytes, small
// next to its products.
enum class TileMask { kClear, kAll, kSome };

inline TileMask ElementMaskOf(const ElementMask& mask, int64_t b, int64_t n, int64_t r0,
                              int64_t nr, int64_t c0, int64_t nc) {
  if (mask.data == nullptr) return TileMask::kClear;
  const uint8_t* base = mask.data + b * mask.batch + n * mask.head + r0 * mask.row + c0 * mask.col;
  bool some_masked = false, some_clear = false;
  for (int64_t i = 0; i < nr && !(some_masked && some_clear); ++i) {
    const uint8_t* m = base + i * mask.row;
    uint8_t any = 0, all = 1;
    for (int64_t j = 0; j < nc; ++j) {
      const uint8_t masked = m[j * mask.col] != 0;
      any |= masked;
      all &= masked;
    }
    some_masked |= any != 0;
    some_clear |= all == 0;
  }
  if (!some_masked) return TileMask::kClear;
  return some_clear ? TileMask::kSome : TileMask::kAll;
}

// The largest tile side MaskTile takes (every kernel's blocks are 64).
inline constexpr int64_t kMaxTile = 64;

// Sets the masked positions of a tile of rows [r0, r0 + nr) x columns
// [c0, c0 + nc) (nr, nc <= kMaxTile) to -inf, and its padding (along the stored rows, up to
// RoundUpToTile) too unless !pad (a head's columns inside a packed tile).
// transposed: keys along the stored rows. elements: whether the element mask
// is applied (false for a tile it leaves clear, ElementMaskOf).
inline void MaskTile(const Band& band, const AttentionGeometry& g, int64_t b, int64_t n,
                     int64_t r0, int64_t nr, int64_t c0, int64_t nc, float* s, int64_t ld,
                     bool transposed, bool pad = true, bool elements = true) {
  const int64_t stored_rows = transposed ? nc : nr;
  const int64_t used = transposed ? nr : nc;
  for (int64_t r = 0; r < stored_rows && pad; ++r) {
    std::fill(s + r * ld + used, s + r * ld + RoundUpToTile(used), kNegInf);
  }
  const ElementMask& mask = g.mask;
  const bool by_elements = elements && mask.data != nullptr;
  if (band.Covers(r0, nr, c0, nc) && !by_elements) return;
  // Row i sees columns [lo(i), hi(i)), both non-decreasing in i.
  const auto lo = [&](int64_t i) { return std::clamp<int64_t>(band.Lo(r0 + i) - c0, 0, nc); };
  const auto hi = [&](int64_t i) {
    return std::clamp<int64_t>(band.Hi(r0 + i) - c0 + 1, lo(i), nc);
  };
  // Masked positions by stored row, each in vectors (TileOps::mask_row: bit
  // operations, no branch for an irregular mask to mispredict). A stored row
  // reads its mask bytes in place when they lie along it (a tile by query rows,
  // mask.col == 1); otherwise the tile's mask block is first copied into
  // stored-row order (a transposed tile: keys x queries). Done element by
  // element down the forward's transposed tiles, a random mask had the S2048
  // forward take 114-124 ms against 86-88 without it.
  const TileOps& ops = GetTileOps();
  const uint8_t* mask_rows =
      by_elements ? mask.data + b * mask.batch + n * mask.head + r0 * mask.row + c0 * mask.col
                  : nullptr;
  const bool in_place = !transposed && mask.col == 1;
  uint8_t stored[kMaxTile * kMaxTile];
  if (by_elements && !in_place) {
    for (int64_t i = 0; i < nr; ++i) {
      const uint8_t* m = mask_rows + i * mask.row;
      for (int64_t j = 0; j < nc; ++j) {
        stored[transposed ? j * nr + i : i * nc + j] = m[j * mask.col];
      }
    }
  }
  if (transposed) {  // by stored (key) rows: column j is seen by rows [first, end)
    for (int64_t j = 0, first = 0, end = 0; j < nc; ++j) {
      while (first < nr && hi(first) <= j) ++first;
      while (end < nr && lo(end) <= j) ++end;
      float* row = s + j * ld;
      std::fill(row, row + first, kNegInf);
      std::fill(row + std::max(first, end), row + nr, kNegInf);
      if (by_elements && first < end) {
        ops.mask_row(row + first, stored + j * nr + first, end - first);
      }
    }
    return;
  }
  for (int64_t i = 0; i < nr; ++i) {
    const int64_t row_lo = lo(i), row_hi = hi(i);
    float* row = s + i * ld;
    std::fill(row, row + row_lo, kNegInf);
    std::fill(row + row_hi, row + nc, kNegInf);
    if (!by_elements) continue;
    const uint8_t* m = in_place ? mask_rows + i * mask.row : stored + i * nc;
    ops.mask_row(row + row_lo, m + row_lo, row_hi - row_lo);
  }
}

// Whether rows x cols of `x` (row stride ld) are all finite: no float with all
// exponent bits set (integer tests on the bits, which vectorize; a row at a time).
inline bool AllFinite(const float* x, int64_t rows, int64_t cols, int64_t ld) {
  constexpr uint32_t kExponent = 0x7f800000u;
  for (int64_t p = 0; p < rows; ++p) {
    const float* row = x + p * ld;
    uint32_t non_finite = 0;
    for (int64_t d = 0; d < cols; ++d) {
      uint32_t bits;
      std::memcpy(&bits, row + d, sizeof bits);
      non_finite |= (bits & kExponent) == kExponent;
    }
    if (non_finite != 0) return false;
  }
  return true;
}

// C += A * B (TileOps::gemm's operands, m x k times k x n) where A holds
// probabilities or their gradients, 0 at masked positions, and B is a block of
// data: a masked position must contribute nothing even where B holds NaN or
// Inf (0 * NaN is NaN). When every position is visible, or B is finite (known
// from its copy, or looked at here), the GEMM is exact as it is; otherwise B's
// non-finite entries are zeroed for the GEMM and added back for the visible
// positions only. visible(i, p): A(i, p) is a visible position.
template <typename VisibleFn>
inline void MaskedGemm(const TileOps& ops, int64_t m, int64_t n, int64_t k, const float* a,
                       int64_t a_row, int64_t a_col, const Operand& b_block, float* c,
                       int64_t ldc, bool all_visible, const VisibleFn& visible, float* scratch) {
  const float* b = b_block.data;
  const int64_t ldb = b_block.ld;
  if (all_visible || b_block.finite || AllFinite(b, k, n, ldb)) {
    ops.gemm(m, n, k, a, a_row, a_col, b, ldb, c, ldc, true);
    return;
  }
  const int64_t np = RoundUpToTile(n);
  for (int64_t p = 0; p < k; ++p) {
    for (int64_t d = 0; d < np; ++d) {
      const float x = d < n ? b[p * ldb + d] : 0.0f;
      scratch[p * np + d] = std::isfinite(x) ? x : 0.0f;
    }
  }
  ops.gemm(m, n, k, a, a_row, a_col, scratch, np, c, ldc, true);
  for (int64_t p = 0; p < k; ++p) {
    for (int64_t d = 0; d < n; ++d) {
      const float x = b[p * ldb + d];
      if (std::isfinite(x)) continue;
      for (int64_t i = 0; i < m; ++i) {
        if (visible(i, p)) c[i * ldc + d] += a[i * a_row + p * a_col] * x;
      }
    }
  }
}

// C (query rows, row stride ldc) += P^T B for a transposed tile P (keys x
// queries, row stride ld) of query head n: the forward's P V and the two-pass
// backward's dS K, strip by strip over the keys each strip of query rows sees
// (ForEachVisibleStrip), each strip a MaskedGemm. elements as for MaskTile.
inline void TransposedTileProduct(const TileOps& ops, const Band& band, const AttentionGeometry& g,
                                  int64_t b, int64_t n, int64_t r0, int64_t nr, int64_t c0,
                                  int64_t nc, const float* tile, int64_t ld, const Operand& rows,
                                  int64_t cols, float* c, int64_t ldc, float* scratch,
                                  bool elements = true) {
  const bool full = band.Covers(r0, nr, c0, nc) && (!elements || g.mask.data == nullptr);
  ForEachVisibleStrip(band, r0, nr, c0, nc, false, false, [&](int64_t i0, int64_t ni,
                                                               int64_t p0, int64_t np) {
    MaskedGemm(ops, ni, cols, np, tile + i0 + p0 * ld, 1, ld, rows.Rows(p0), c + i0 * ldc, ldc,
               full,
               [&](int64_t i, int64_t p) {
                 return Visible(band, g.mask, b, n, r0 + i0 + i, c0 + p0 + p);
               },
               scratch);
  });
}

// The pairs a strip of depth [p0, p0 + np) of a tile `depth` deep takes in
// the bf16 products: widened to whole pairs; the positions it takes in besides
// its own are zeros of the tile (masked, or past `depth`).
struct PairSpan {
  int64_t first, count;
};
inline PairSpan PairsOf(int64_t p0, int64_t np, int64_t depth) {
  const int64_t first = p0 / 2;
  return {first, (std::min(p0 + np, depth) + 1) / 2 - first};
}

// TransposedTileProduct on bfloat16 pairs (TileOps::bf16_pairs_gemm): the
// tile (keys x queries, every masked position an exact 0) rounded into pairs of
// keys in `pairs` (row stride ld), times a finite value block as row pairs
// (LoadRowPairs, row stride ldv), a strip's keys widened to whole pairs
// (PairsOf).
inline void PairsTileProduct(const TileOps& ops, const Band& band, int64_t r0, int64_t nr,
                             int64_t c0, int64_t nc, const float* tile, int64_t ld,
                             uint32_t* pairs, const uint32_t* values, int64_t ldv, int64_t cols,
                             float* c, int64_t ldc) {
  ops.pack_bf16_pairs(tile, ld, nc, nr, pairs, ld);
  ForEachVisibleStrip(band, r0, nr, c0, nc, false, false, [&](int64_t i0, int64_t ni,
                                                               int64_t p0, int64_t np) {
    const PairSpan p = PairsOf(p0, np, nc);
    ops.bf16_pairs_gemm(ni, cols, p.count, pairs + p.first * ld + i0, 1, ld,
                        values + p.first * ldv, ldv, c + i0 * ldc, ldc, true);
  });
}

}  // namespace jax_rope::cpu::attention
