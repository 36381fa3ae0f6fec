// The attention kernels' own tile classification (attention_blocks.h), checked
// against a dense mask computed position by position from the band definition
// of attention_kernels.h, for random bands and shapes (the sparse modes' bands,
// the +-2^30 "no limit" offsets, prefixes, empty and inverted bands):
//   - Band::Covers (a full tile skips masking) holds exactly when every
//     position of the tile is visible;
//   - no visible position lies in a tile the kernels skip, along query blocks
//     (KeyBlocks: forward, dquery, scores) or key blocks (QueryBlocks:
//     dkey/dvalue), and KeyRange/QueryRange contain every visible position;
//   - when every row of a query block sees some key, the kernels skip every
//     empty tile of it (the ranges are tight);
//   - ForEachVisibleStrip (the products of a partial tile) cuts the tile into
//     strips of kTileAlign in order, each visible position lies in its strip's
//     span, aligned spans keep the products' vector writes inside the tile, a
//     covered tile is one product, and a causal diagonal tile computes 5/8 of
//     itself;
//   - WorkItems lists every (sequence, head, block) once, sequence by sequence
//     and head by head, each head's blocks costliest first: a causal band's
//     last query block (and first key block) first, a band that narrows
//     towards the end its first, uniform bands in block order;
//   - Join (the union of two key or query block spans) against enumeration;
//   - the float32 transposes (TransposeRows, LoadTransposed: 4 x 4 vector
//     blocks and element-wise edges) against the definition, for every shape
//     up to 21 x 21, with LoadTransposed's zero padding and nothing else written.
// Built and run by ctest (CMake option JAX_ROPE_BUILD_TESTS); exit status 1 on failure.
#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "device_kernels/cpu/attention_blocks.h"
#include "device_kernels/cpu/attention_staging.h"

namespace {

using jax_rope::cpu::kTileAlign;
using jax_rope::cpu::RoundUpToTile;
using jax_rope::cpu::SequenceBand;
using jax_rope::cpu::attention::Band;
using jax_rope::cpu::attention::BlockSpan;
using jax_rope::cpu::attention::Join;
using jax_rope::cpu::attention::ForEachVisibleStrip;
using jax_rope::cpu::attention::LoadTransposed;
using jax_rope::cpu::attention::TransposeRows;
using jax_rope::cpu::attention::WorkItems;

constexpr int32_t kNoLimit = 1 << 30;

int g_failures = 0;
int64_t g_tiles = 0, g_tight_tiles = 0;

void Fail(const SequenceBand& s, int64_t bq, int64_t bk, int64_t r0, int64_t c0,
          const std::string& what) {
  if (++g_failures <= 30) {
    std::printf("FAIL: band {q_len %d, kv_len %d, lo %d, hi %d, floor %d} blocks %ldx%ld, "
                "tile (%ld, %ld): %s\n",
                s.q_len, s.kv_len, s.lo_off, s.hi_off, s.hi_floor, long(bq), long(bk), long(r0),
                long(c0), what.c_str());
  }
}

// attention_kernels.h: row i sees column j when lo(i) <= j <= hi(i).
std::vector<std::vector<bool>> DenseMask(const SequenceBand& s) {
  std::vector<std::vector<bool>> visible(s.q_len, std::vector<bool>(s.kv_len, false));
  for (int64_t i = 0; i < s.q_len; ++i) {
    const int64_t lo = std::max<int64_t>(0, i + int64_t{s.lo_off});
    const int64_t hi = std::min<int64_t>(s.kv_len - 1,
                                         std::max<int64_t>(i + int64_t{s.hi_off}, s.hi_floor));
    for (int64_t j = 0; j < s.kv_len; ++j) visible[i][j] = lo <= j && j <= hi;
  }
  return visible;
}

bool Holds(const BlockSpan& span, int64_t start) { return start >= span.start && start < span.end; }

// The strips of tile rows [r0, r0 + nr) x columns [c0, c0 + nc) along keys
// (by_keys) or queries; returns the fraction of the tile their products cover.
double CheckStrips(const SequenceBand& s, const std::vector<std::vector<bool>>& visible,
                   int64_t bq, int64_t bk, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                   bool by_keys, bool aligned) {
  const Band band(s);
  const int64_t rows = by_keys ? nc : nr, cols = by_keys ? nr : nc;
  const bool covered = band.Covers(r0, nr, c0, nc);
  std::vector<int64_t> span_start(rows, 0), span_end(rows, 0);  // none: an empty span
  int64_t next = 0, calls = 0, area = 0;
  const std::string what =
      std::string(by_keys ? "key" : "query") + (aligned ? " aligned" : "") + " strips: ";
  ForEachVisibleStrip(band, r0, nr, c0, nc, by_keys, aligned,
                      [&](int64_t start, int64_t count, int64_t first, int64_t length) {
    ++calls;
    const bool whole = start == 0 && count == rows && first == 0 && length == cols;
    if (covered && !whole) Fail(s, bq, bk, r0, c0, what + "a covered tile cut");
    if (!covered && (start < next || start % kTileAlign != 0 ||
                     count != std::min(kTileAlign, rows - start))) {
      Fail(s, bq, bk, r0, c0, what + "strip out of order or of the wrong size");
    }
    if (first < 0 || length <= 0 || first + length > cols) {
      Fail(s, bq, bk, r0, c0, what + "span outside the tile");
    }
    if (aligned &&
        (first % kTileAlign != 0 || first + RoundUpToTile(length) > RoundUpToTile(cols))) {
      Fail(s, bq, bk, r0, c0, what + "span not aligned or written past the tile");
    }
    for (int64_t r = std::max<int64_t>(start, 0); r < std::min(start + count, rows); ++r) {
      span_start[r] = first;
      span_end[r] = first + length;
    }
    next = start + count;
    area += count * length;
  });
  if (covered && calls != 1) Fail(s, bq, bk, r0, c0, what + "a covered tile not one product");
  for (int64_t i = 0; i < nr; ++i) {
    for (int64_t j = 0; j < nc; ++j) {
      if (!visible[r0 + i][c0 + j]) continue;
      const int64_t r = by_keys ? j : i, c = by_keys ? i : j;
      if (c < span_start[r] || c >= span_end[r]) {
        Fail(s, bq, bk, r0, c0, what + "visible position outside its strip's span");
      }
    }
  }
  return rows * cols == 0 ? 0.0 : double(area) / double(rows * cols);
}

void CheckBand(const SequenceBand& s, int64_t bq, int64_t bk) {
  const Band band(s);
  const auto visible = DenseMask(s);
  std::vector<bool> row_alive(s.q_len, false);
  for (int64_t i = 0; i < s.q_len; ++i) {
    for (int64_t j = 0; j < s.kv_len; ++j) row_alive[i] = row_alive[i] || visible[i][j];
  }
  for (int64_t r0 = 0; r0 < s.q_len; r0 += bq) {
    const int64_t nr = std::min<int64_t>(bq, s.q_len - r0);
    bool block_alive = true;
    for (int64_t i = r0; i < r0 + nr; ++i) block_alive = block_alive && row_alive[i];
    int64_t first, last;
    band.KeyRange(r0, nr, &first, &last);
    const BlockSpan keys = band.KeyBlocks(r0, nr, bk);
    for (int64_t c0 = 0; c0 < s.kv_len; c0 += bk) {
      const int64_t nc = std::min<int64_t>(bk, s.kv_len - c0);
      bool any = false, all = true;
      for (int64_t i = r0; i < r0 + nr; ++i) {
        for (int64_t j = c0; j < c0 + nc; ++j) {
          any = any || visible[i][j];
          all = all && visible[i][j];
          if (visible[i][j] && (j < first || j > last)) Fail(s, bq, bk, r0, c0, "outside KeyRange");
        }
      }
      ++g_tiles;
      for (bool by_keys : {false, true}) {
        for (bool aligned : {false, true}) {
          CheckStrips(s, visible, bq, bk, r0, nr, c0, nc, by_keys, aligned);
        }
      }
      if (band.Covers(r0, nr, c0, nc) != all) {
        Fail(s, bq, bk, r0, c0, all ? "full tile not covered" : "covered tile not full");
      }
      const bool forward_visits = Holds(keys, c0);
      const bool backward_visits = Holds(band.QueryBlocks(c0, nc, bq), r0);
      if (any && !forward_visits) Fail(s, bq, bk, r0, c0, "visible tile outside KeyBlocks");
      if (any && !backward_visits) Fail(s, bq, bk, r0, c0, "visible tile outside QueryBlocks");
      if (block_alive) {
        ++g_tight_tiles;
        if (!any && forward_visits) Fail(s, bq, bk, r0, c0, "empty tile inside KeyBlocks");
        if (!any && backward_visits) Fail(s, bq, bk, r0, c0, "empty tile inside QueryBlocks");
      }
    }
  }
  // QueryRange holds every row that sees a column of each key block.
  for (int64_t c0 = 0; c0 < s.kv_len; c0 += bk) {
    const int64_t nc = std::min<int64_t>(bk, s.kv_len - c0);
    int64_t first, last;
    band.QueryRange(c0, nc, &first, &last);
    for (int64_t i = 0; i < s.q_len; ++i) {
      for (int64_t j = c0; j < c0 + nc; ++j) {
        if (visible[i][j] && (i < first || i > last)) Fail(s, bq, bk, i, c0, "outside QueryRange");
      }
    }
  }
}

SequenceBand Seq(int32_t q_len, int32_t kv_len, int32_t lo, int32_t hi, int32_t floor) {
  return SequenceBand{0, q_len, 0, kv_len, lo, hi, floor};
}

// The fraction of tiles a causal sequence visits (forward).
double CausalVisited(int32_t len, int64_t block) {
  const Band band(Seq(len, len, -kNoLimit, 0, -kNoLimit));
  int64_t visited = 0, tiles = 0;
  for (int64_t r0 = 0; r0 < len; r0 += block) {
    const BlockSpan keys = band.KeyBlocks(r0, std::min<int64_t>(block, len - r0), block);
    for (int64_t c0 = 0; c0 < len; c0 += block, ++tiles) visited += Holds(keys, c0);
  }
  return double(visited) / double(tiles);
}

// WorkItems over `seqs` with `heads` heads: every (sequence, head, block)
// exactly once, sequences and then heads in order, and where `expected` is
// given, each head's blocks in that order.
void CheckWorkItems(const std::vector<SequenceBand>& seqs, int64_t heads, bool key_blocks,
                    int64_t block, const std::vector<int64_t>* expected = nullptr) {
  jax_rope::cpu::AttentionGeometry g;
  g.batch = int64_t(seqs.size());
  g.q_heads = g.kv_heads = heads;
  g.head_dim = g.value_dim = 16;
  const WorkItems items(g, seqs.data(), key_blocks, block);
  int64_t t = 0;
  bool ok = true;
  for (int64_t b = 0; b < g.batch; ++b) {
    const int64_t len = key_blocks ? seqs[b].kv_len : seqs[b].q_len;
    const int64_t blocks = (std::max<int64_t>(len, 0) + block - 1) / block;
    for (int64_t h = 0; h < heads; ++h) {
      std::vector<int64_t> order;
      for (int64_t k = 0; k < blocks && t < items.size(); ++k, ++t) {
        const WorkItems::Item it = items[t];
        ok &= it.seq == b && it.head == h;
        order.push_back(it.block);
      }
      std::vector<int64_t> sorted = order;
      std::sort(sorted.begin(), sorted.end());
      for (int64_t k = 0; k < int64_t(sorted.size()); ++k) ok &= sorted[k] == k;
      ok &= int64_t(order.size()) == blocks && (expected == nullptr || order == *expected);
    }
  }
  if (!ok || t != items.size()) {
    Fail(seqs.front(), key_blocks ? 0 : block, key_blocks ? block : 0, 0, 0,
         "work items of " + std::to_string(seqs.size()) + " sequences out of order");
  }
}

// dst (cols lines of ld) after TransposeRows (pad: LoadTransposed) of a rows x
// cols block with row stride cols + 3: element (r, l) at line l, column r;
// columns rows..RoundUpToTile(rows) zero when padded; the rest untouched.
void CheckTranspose(int64_t rows, int64_t cols, bool pad) {
  const int64_t stride = cols + 3, ld = RoundUpToTile(rows) + 5;
  std::vector<float> src(std::max<int64_t>(rows * stride, 1));
  for (size_t i = 0; i < src.size(); ++i) src[i] = float(i) + 0.5f;
  constexpr float kUntouched = -7.0f;
  std::vector<float> dst(std::max<int64_t>(cols * ld, 1), kUntouched);
  if (pad) {
    LoadTransposed(src.data(), stride, rows, cols, dst.data(), ld);
  } else {
    TransposeRows(src.data(), stride, rows, cols, dst.data(), ld);
  }
  const int64_t padded = pad ? RoundUpToTile(rows) : rows;
  for (int64_t l = 0; l < cols; ++l) {
    for (int64_t r = 0; r < ld; ++r) {
      const float want = r < rows ? src[r * stride + l] : r < padded ? 0.0f : kUntouched;
      if (dst[l * ld + r] != want) {
        ++g_failures;
        std::printf("FAIL: %s of %ldx%ld: line %ld column %ld is %g, not %g\n",
                    pad ? "LoadTransposed" : "TransposeRows", long(rows), long(cols), long(l),
                    long(r), dst[l * ld + r], want);
        return;
      }
    }
  }
}

}  // namespace

int main() {
  const int64_t blocks[] = {1, 2, 3, 4, 8, 16, 64};
  std::vector<SequenceBand> bands = {
      Seq(13, 13, -kNoLimit, kNoLimit, -kNoLimit),  // no band (sparse_mode 0, 1)
      Seq(9, 17, -kNoLimit, 0, -kNoLimit),          // left-up causal
      Seq(9, 17, -kNoLimit, 8, -kNoLimit),          // right-down causal, Skv > Sq
      Seq(17, 9, -kNoLimit, -8, -kNoLimit),         // right-down causal, Sq > Skv: dead rows
      Seq(13, 13, -5, 2, -kNoLimit),                // band
      Seq(13, 13, 3, 9, -kNoLimit),                 // band below the diagonal
      Seq(9, 17, -kNoLimit, 8, 11),                 // prefix 12
      Seq(13, 13, 4, 1, -kNoLimit),                 // inverted: nothing visible
      Seq(0, 13, -kNoLimit, 0, -kNoLimit),          // empty sequences
      Seq(13, 0, -kNoLimit, 0, -kNoLimit),
  };
  std::mt19937 rng(7);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int n = 0; n < 600; ++n) {
    const int32_t q_len = uniform(0, 70), kv_len = uniform(0, 70);
    const int32_t lo = uniform(0, 3) == 0 ? -kNoLimit : uniform(-80, 80);
    const int32_t hi = uniform(0, 3) == 0 ? kNoLimit : uniform(-80, 80);
    const int32_t floor = uniform(0, 2) == 0 ? uniform(-1, kv_len) : -kNoLimit;
    bands.push_back(Seq(q_len, kv_len, lo, hi, floor));
  }
  for (const SequenceBand& s : bands) {
    for (int64_t bq : blocks) {
      for (int64_t bk : blocks) CheckBand(s, bq, bk);
    }
  }
  for (const SequenceBand& s : bands) {
    const std::vector<SequenceBand> three = {s, bands[1], s};
    for (int64_t block : {16, 64, 128}) {
      for (bool key_blocks : {false, true}) CheckWorkItems(three, 3, key_blocks, block);
    }
  }
  // 256 positions in blocks of 64: the order of each head's blocks.
  const std::vector<int64_t> backwards = {3, 2, 1, 0}, forwards = {0, 1, 2, 3};
  const std::vector<SequenceBand> causal256 = {Seq(256, 256, -kNoLimit, 0, -kNoLimit)};
  CheckWorkItems(causal256, 2, false, 64, &backwards);
  CheckWorkItems(causal256, 2, true, 64, &forwards);
  CheckWorkItems({Seq(256, 256, 0, kNoLimit, -kNoLimit)}, 2, false, 64, &forwards);
  CheckWorkItems({Seq(256, 256, -kNoLimit, kNoLimit, -kNoLimit)}, 2, false, 64, &forwards);
  CheckWorkItems({Seq(256, 256, -kNoLimit, kNoLimit, -kNoLimit)}, 2, true, 64, &forwards);
  // Causal 256 x 256 in 16 x 16 tiles: 16 partial diagonal tiles, 120 full, 120 skipped.
  const double visited = CausalVisited(256, 16);
  if (!(visited > 0.5 && visited < 0.56)) {
    ++g_failures;
    std::printf("FAIL: causal 256x256 visits %.3f of its 16x16 tiles, not about half\n", visited);
  }
  for (int64_t rows = 0; rows <= 21; ++rows) {
    for (int64_t cols = 0; cols <= 21; ++cols) {
      CheckTranspose(rows, cols, false);
      CheckTranspose(rows, cols, true);
    }
  }
  // Join: the smallest span holding every position of both (empty spans, start >= end,
  // hold none), for every pair of spans over [0, 6].
  for (int64_t a0 = 0; a0 <= 6; ++a0) {
    for (int64_t a1 = 0; a1 <= 6; ++a1) {
      for (int64_t b0 = 0; b0 <= 6; ++b0) {
        for (int64_t b1 = 0; b1 <= 6; ++b1) {
          int64_t lo = 7, hi = -1;  // the positions held, by enumeration
          for (int64_t p = 0; p <= 6; ++p) {
            if ((p >= a0 && p < a1) || (p >= b0 && p < b1)) lo = std::min(lo, p), hi = p;
          }
          const BlockSpan j = Join(BlockSpan{a0, a1}, BlockSpan{b0, b1});
          const bool ok = hi < 0 ? j.start >= j.end : (j.start == lo && j.end == hi + 1);
          if (!ok) {
            ++g_failures;
            std::printf("FAIL: Join([%ld, %ld), [%ld, %ld)) = [%ld, %ld)\n", long(a0), long(a1),
                        long(b0), long(b1), long(j.start), long(j.end));
          }
        }
      }
    }
  }
  // A causal 64 x 64 diagonal tile: strips of 16 see 64, 48, 32 and 16 of it.
  const SequenceBand causal = Seq(64, 64, -kNoLimit, 0, -kNoLimit);
  const auto causal_visible = DenseMask(causal);
  for (bool by_keys : {false, true}) {
    for (bool aligned : {false, true}) {
      const double area =
          CheckStrips(causal, causal_visible, 64, 64, 0, 64, 0, 64, by_keys, aligned);
      if (area != 0.625) {
        ++g_failures;
        std::printf("FAIL: a causal 64x64 tile's strips cover %.3f of it, not 5/8\n", area);
      }
    }
  }
  std::printf("%zu bands, %ld tiles (%ld in blocks without dead rows), causal visits %.3f: "
              "%d failures\n",
              bands.size(), long(g_tiles), long(g_tight_tiles), visited, g_failures);
  return g_failures == 0 ? 0 : 1;
}
