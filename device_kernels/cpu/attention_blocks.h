// Building blocks of the CPU attention kernels (attention_kernels.cc): the
// band geometry of one sequence, which tiles of it the kernels visit and which
// strips of a tile they compute, the work-item lists and the per-call
// workspace (the staging of tensor blocks is in attention_staging.h). Internal
// to the kernels; the tile rules are tested against a dense mask in
// tests/attention_blocks_test.cc.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <new>
#include <vector>

#include "device_kernels/cpu/attention_kernels.h"
#include "device_kernels/cpu/attention_tiles.h"
#include "device_kernels/cpu/thread_scratch.h"

namespace jax_rope::cpu::attention {

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int64_t Offset(const Strides& s, int64_t b, int64_t row, int64_t head) {
  return b * s.batch + row * s.seq + head * s.head;
}

inline bool ValidGeometry(const AttentionGeometry& g) {
  return g.batch >= 0 && g.q_heads > 0 && g.kv_heads > 0 && g.q_heads % g.kv_heads == 0 &&
         g.head_dim > 0 && g.value_dim > 0;
}

// The softmax_max the forward stores for a row, from the largest of its visible
// scores (-inf: none) and its sum: kMaskValue for a row with no visible key, NaN
// where the sum is NaN (a NaN or Inf reached the row's scores: its output is NaN
// and LoadStats gives it NaN probabilities), as the fallback stores them.
inline float RowMax(float max, float sum) {
  if (std::isnan(sum)) return std::numeric_limits<float>::quiet_NaN();
  return max == -std::numeric_limits<float>::infinity() ? kMaskValue : max;
}

// Block-aligned starts of the blocks that hold indices [first, last]:
// start, start + block, ... while < end (none when first > last).
struct BlockSpan {
  int64_t start = 0;
  int64_t end = 0;
};

// The smallest span holding both; an empty span adds nothing.
inline BlockSpan Join(const BlockSpan& a, const BlockSpan& b) {
  if (a.start >= a.end) return b;
  if (b.start >= b.end) return a;
  return {std::min(a.start, b.start), std::max(a.end, b.end)};
}

inline BlockSpan BlocksHolding(int64_t first, int64_t last, int64_t block) {
  return first > last ? BlockSpan{} : BlockSpan{first / block * block, last + 1};
}

// One sequence's band in int64, so offsets of +-2^30 never overflow. A tile of
// rows [r0, r0 + nr) x columns [c0, c0 + nc) is visited only when its key
// block is in KeyBlocks (forward, dquery, scores) or its query block in
// QueryBlocks (dkey/dvalue), and masked only when Covers is false.
struct Band {
  int64_t q_start, q_len, kv_start, kv_len, lo_off, hi_off, hi_floor;

  explicit Band(const SequenceBand& s)
      : q_start(s.q_start), q_len(std::max(s.q_len, 0)), kv_start(s.kv_start),
        kv_len(std::max(s.kv_len, 0)), lo_off(s.lo_off), hi_off(s.hi_off),
        hi_floor(s.hi_floor) {}
  int64_t Lo(int64_t i) const { return std::max<int64_t>(0, i + lo_off); }
  int64_t Hi(int64_t i) const { return std::min(kv_len - 1, std::max(i + hi_off, hi_floor)); }
  // Every position of rows [r0, r0 + nr) x columns [c0, c0 + nc) is inside the band.
  bool Covers(int64_t r0, int64_t nr, int64_t c0, int64_t nc) const {
    return Lo(r0 + nr - 1) <= c0 && Hi(r0) >= c0 + nc - 1;
  }
  // Key columns [first, last] that rows [r0, r0 + nr) can see (first > last: none);
  // Lo and Hi never decrease, so the ends come from the first and last row.
  void KeyRange(int64_t r0, int64_t nr, int64_t* first, int64_t* last) const {
    *first = Lo(r0);
    *last = Hi(r0 + nr - 1);
  }
  // Query rows [first, last] that see some key column of [c0, c0 + nc):
  // Hi(i) >= c0 (Hi is capped by kv_len - 1 >= c0) and Lo(i) <= c0 + nc - 1.
  void QueryRange(int64_t c0, int64_t nc, int64_t* first, int64_t* last) const {
    *first = hi_floor >= c0 ? 0 : std::max<int64_t>(0, c0 - hi_off);
    *last = std::min(q_len - 1, c0 + nc - 1 - lo_off);
  }
  // The key blocks (of `block` columns) that rows [r0, r0 + nr) visit.
  BlockSpan KeyBlocks(int64_t r0, int64_t nr, int64_t block) const {
    int64_t first, last;
    KeyRange(r0, nr, &first, &last);
    return BlocksHolding(first, last, block);
  }
  // The query blocks (of `block` rows) that columns [c0, c0 + nc) visit.
  BlockSpan QueryBlocks(int64_t c0, int64_t nc, int64_t block) const {
    int64_t first, last;
    QueryRange(c0, nc, &first, &last);
    return BlocksHolding(first, last, block);
  }
};

// Whether row `row` sees column `col` of sequence b for query head n: inside
// the band and not masked by the element mask.
inline bool Visible(const Band& band, const ElementMask& mask, int64_t b, int64_t n, int64_t row,
                    int64_t col) {
  if (col < band.Lo(row) || col > band.Hi(row)) return false;
  return mask.data == nullptr ||
         mask.data[b * mask.batch + n * mask.head + row * mask.row + col * mask.col] == 0;
}

// A tile's product in strips of kTileAlign along one axis (key rows when
// by_keys, else query rows), each with the span of the other axis that some row
// of the strip sees, so that the products of a diagonal tile skip what the band
// masks for the whole strip (a causal 64 x 64 tile computes 5/8 of itself).
// What a strip's span leaves out is masked in every row of the strip: the
// softmax routines give it -inf scores, zero probabilities and zero score
// gradients whatever a product left there, and an accumulating product adds
// exactly zero for it. fn(strip start, strip rows, span start, span length),
// relative to the tile; strips that see nothing are skipped, a covered tile is
// one strip with the whole span. aligned: span starts rounded down to a
// multiple of kTileAlign, for products that write whole vectors of C columns
// from there (their ends stay within RoundUpToTile of the tile).
template <class Fn>
void ForEachVisibleStrip(const Band& band, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                         bool by_keys, bool aligned, Fn&& fn) {
  const int64_t rows = by_keys ? nc : nr, cols = by_keys ? nr : nc;
  if (band.Covers(r0, nr, c0, nc)) {
    fn(int64_t{0}, rows, int64_t{0}, cols);
    return;
  }
  for (int64_t s = 0; s < rows; s += kTileAlign) {
    const int64_t ns = std::min(kTileAlign, rows - s);
    int64_t first, last;
    if (by_keys) {
      band.QueryRange(c0 + s, ns, &first, &last);
      first -= r0, last -= r0;
    } else {
      band.KeyRange(r0 + s, ns, &first, &last);
      first -= c0, last -= c0;
    }
    first = std::max<int64_t>(first, 0);
    last = std::min(last, cols - 1);
    if (first > last) continue;
    if (aligned) first = first / kTileAlign * kTileAlign;
    fn(s, ns, first, last + 1 - first);
  }
}

// Items are (sequence, head, block) with blocks of `block` query (or key) rows,
// sequence by sequence and head by head (consecutive items read the same
// head's rows of the other axis); within one (sequence, head) the blocks go in
// decreasing order of the positions they visit (the other axis's span of each
// kTileAlign strip, summed; ties in block order). Threads take chunks of
// consecutive items as they come free, so the last chunks, which decide when
// the call ends, are the last head's cheapest blocks: a causal band's first.
// Ordered 0, last, 1, last - 1, ... instead, the call ended on one thread while
// the other still ran a chunk of average items (causal forward on two Zen 4
// cores, N8 D128: at S4096 the threads finished 5-6 ms apart).
class WorkItems {
 public:
  struct Item {
    int64_t seq, head, block;
  };

  // heads_per_item > 1: item.head numbers groups of that many consecutive query
  // heads (it must divide q_heads).
  WorkItems(const AttentionGeometry& g, const SequenceBand* seqs, bool key_blocks, int64_t block,
            int64_t heads_per_item = 1)
      : heads_((key_blocks ? g.kv_heads : g.q_heads) / std::max<int64_t>(heads_per_item, 1)) {
    if (!ValidGeometry(g)) return;
    ends_.reserve(g.batch);
    first_block_.reserve(g.batch);
    int64_t total = 0;
    std::vector<int64_t> cost;
    for (int64_t b = 0; b < g.batch; ++b) {
      const Band band(seqs[b]);
      const int64_t len = key_blocks ? band.kv_len : band.q_len;
      const int64_t blocks = CeilDiv(len, block);
      cost.assign(blocks, 0);
      for (int64_t s = 0; s < len; s += kTileAlign) {
        int64_t first, last;
        const int64_t ns = std::min(kTileAlign, len - s);
        if (key_blocks) {
          band.QueryRange(s, ns, &first, &last);
        } else {
          band.KeyRange(s, ns, &first, &last);
        }
        cost[s / block] += std::max<int64_t>(last + 1 - first, 0);
      }
      first_block_.push_back(order_.size());
      for (int64_t k = 0; k < blocks; ++k) order_.push_back(k);
      std::stable_sort(order_.end() - blocks, order_.end(),
                       [&](int64_t x, int64_t y) { return cost[x] > cost[y]; });
      total += heads_ * blocks;
      ends_.push_back(total);
    }
  }
  int64_t size() const { return ends_.empty() ? 0 : ends_.back(); }
  Item operator[](int64_t t) const {
    const int64_t seq = std::upper_bound(ends_.begin(), ends_.end(), t) - ends_.begin();
    const int64_t start = seq == 0 ? 0 : ends_[seq - 1];
    const int64_t blocks = (ends_[seq] - start) / heads_;
    const int64_t k = t - start;
    return {seq, k / blocks, order_[first_block_[seq] + k % blocks]};
  }

 private:
  int64_t heads_;
  std::vector<int64_t> ends_;         // cumulative item counts per sequence
  std::vector<int64_t> first_block_;  // per sequence, where its blocks start in order_
  std::vector<int64_t> order_;        // each sequence's blocks, costliest first
};

// Row stride (floats) of a scratch block of `cols` columns that the tile
// products read or accumulate down its rows (B operands, output accumulators):
// RoundUpToTile(cols), plus one tile where rows would otherwise lie a multiple of
// 256 bytes apart. A GEMM's 16-column panel of such a block falls into 16 of the
// L1's 64 sets or fewer (8 for D = 128, 4 for D = 256), and its 64 rows then
// evict each other and whatever else the product reads there; one tile more
// spreads them over all the sets (AVX2 Zen 3: the causal S2048 forward 3-4%
// and its backward 7% faster).
inline int64_t PaddedLd(int64_t cols) {
  const int64_t ld = RoundUpToTile(cols);
  return ld % (4 * kTileAlign) == 0 ? ld + kTileAlign : ld;
}

// Float32 scratch of one call (undefined contents, 64-byte aligned, O(block x head_dim)),
// kept by the thread for its next call (thread_scratch.h).
class Workspace {
 public:
  Workspace(const AttentionGeometry& g, int64_t block)
      : dp(RoundUpToTile(g.head_dim)), dvp(RoundUpToTile(g.value_dim)),
        ldp(PaddedLd(g.head_dim)), ldvp(PaddedLd(g.value_dim)),
        scratch_(ScratchRole::kWorkspace, Total(g, block, ldp, ldvp)) {
    float** slots[] = {&t1, &t2, &n1, &n2, &s, &dprob, &acc1, &acc2, &max, &sum, &delta,
                       &finite, &keep};
    const auto sizes = Sizes(g, block, ldp, ldvp);
    float* p = scratch_.data();
    for (int i = 0; i < kSlots; ++i) {
      *slots[i] = p;
      p += RoundUpToTile(sizes[i]);
    }
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  const int64_t dp, dvp;    // head_dim and value_dim rounded up to kTileAlign
  const int64_t ldp, ldvp;  // PaddedLd(head_dim), PaddedLd(value_dim)
  float *t1, *t2;           // transposed blocks (dim x block)
  float *n1, *n2;           // blocks as float32 rows (block x ldp, block x ldvp)
  float *s, *dprob;         // score tiles
  float *acc1, *acc2;       // float32 accumulators of the outputs (row stride ldp / ldvp)
  float *max, *sum, *delta;
  float* finite;            // a block with its non-finite entries zeroed (MaskedGemm)
  float* keep;              // dropout: keep / keep_prob per position of a score tile

 private:
  static constexpr int kSlots = 13;
  static std::array<int64_t, kSlots> Sizes(const AttentionGeometry& g, int64_t block,
                                           int64_t ldp, int64_t ldvp) {
    return {g.head_dim * block, g.value_dim * block, block * ldp, block * ldvp,
            block * block,      block * block,       block * ldp, block * ldvp,
            block,              block,               block,
            block * std::max(ldp, ldvp), block * block};
  }
  static int64_t Total(const AttentionGeometry& g, int64_t block, int64_t ldp, int64_t ldvp) {
    int64_t total = 0;
    for (int64_t size : Sizes(g, block, ldp, ldvp)) total += RoundUpToTile(size);
    return total;
  }

  ThreadScratch scratch_;
};

}  // namespace jax_rope::cpu::attention
