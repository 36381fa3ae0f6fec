// Building blocks of the CPU attention kernels (attention_kernels.cc): the
// band geometry of one sequence and which tiles of it the kernels visit, the
// work-item lists, and float32 staging of tensor blocks for the tile
// routines. Internal to the kernels; the tile rules are tested against a dense
// mask in tests/attention_blocks_test.cc.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>
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

// Block-aligned starts of the blocks that hold indices [first, last]:
// start, start + block, ... while < end (none when first > last).
struct BlockSpan {
  int64_t start = 0;
  int64_t end = 0;
};

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

// Items are (sequence, head, block) with blocks of `block` query (or key) rows;
// within one (sequence, head) the blocks go 0, last, 1, last - 1, ... so that
// any run of consecutive items mixes cheap and expensive blocks of a causal
// band and parallel chunks stay balanced.
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
    int64_t total = 0;
    for (int64_t b = 0; b < g.batch; ++b) {
      const Band band(seqs[b]);
      total += heads_ * CeilDiv(key_blocks ? band.kv_len : band.q_len, block);
      ends_.push_back(total);
    }
  }
  int64_t size() const { return ends_.empty() ? 0 : ends_.back(); }
  Item operator[](int64_t t) const {
    const int64_t seq = std::upper_bound(ends_.begin(), ends_.end(), t) - ends_.begin();
    const int64_t start = seq == 0 ? 0 : ends_[seq - 1];
    const int64_t blocks = (ends_[seq] - start) / heads_;
    const int64_t k = (t - start) % blocks;
    return {seq, (t - start) / blocks, k % 2 == 0 ? k / 2 : blocks - 1 - k / 2};
  }

 private:
  int64_t heads_;
  std::vector<int64_t> ends_;  // cumulative item counts per sequence
};

// Float32 scratch of one call (undefined contents, 64-byte aligned, O(block x head_dim)),
// kept by the thread for its next call (thread_scratch.h).
class Workspace {
 public:
  Workspace(const AttentionGeometry& g, int64_t block)
      : dp(RoundUpToTile(g.head_dim)), dvp(RoundUpToTile(g.value_dim)),
        scratch_(ScratchRole::kWorkspace, Total(g, block, dp, dvp)) {
    float** slots[] = {&t1, &t2, &n1, &n2, &s, &dprob, &acc1, &acc2, &max, &sum, &delta,
                       &finite, &keep, &key_rows};
    const auto sizes = Sizes(g, block, dp, dvp);
    float* p = scratch_.data();
    for (int i = 0; i < kSlots; ++i) {
      *slots[i] = p;
      p += RoundUpToTile(sizes[i]);
    }
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  const int64_t dp, dvp;  // head_dim and value_dim rounded up to kTileAlign
  float *t1, *t2;         // transposed blocks (dim x block)
  float *n1, *n2;         // blocks converted to float32 (block x dim)
  float *s, *dprob;       // score tiles
  float *acc1, *acc2;     // float32 accumulators of the outputs
  float *max, *sum, *delta;
  float* finite;          // a block with its non-finite entries zeroed (MaskedGemm)
  float* keep;            // dropout: keep / keep_prob per position of a score tile
  float* key_rows;        // a key block as float32 rows (block x dp): fused backward's dQ

 private:
  static constexpr int kSlots = 14;
  static std::array<int64_t, kSlots> Sizes(const AttentionGeometry& g, int64_t block, int64_t dp,
                                           int64_t dvp) {
    return {g.head_dim * block, g.value_dim * block, block * dp, block * dvp,
            block * block,      block * block,       block * dp, block * dvp,
            block,              block,               block,
            block * std::max(dp, dvp), block * block, block * dp};
  }
  static int64_t Total(const AttentionGeometry& g, int64_t block, int64_t dp, int64_t dvp) {
    int64_t total = 0;
    for (int64_t size : Sizes(g, block, dp, dvp)) total += RoundUpToTile(size);
    return total;
  }

  ThreadScratch scratch_;
};

// rows x cols of `src` (row stride `stride`) to float32 rows of `ld`, zero
// columns up to RoundUpToTile(cols).
template <typename T>
void LoadBlock(const T* src, int64_t stride, int64_t rows, int64_t cols, float* dst, int64_t ld) {
  const int64_t padded = RoundUpToTile(cols);
  for (int64_t r = 0; r < rows; ++r) {
    const T* in = src + r * stride;
    float* out = dst + r * ld;
    for (int64_t c = 0; c < cols; ++c) out[c] = ToFloat(in[c]);
    for (int64_t c = cols; c < padded; ++c) out[c] = 0.0f;
  }
}

// 16-bit rows widen at the CPU's widest vectors (TileOps::widen_bf16 and
// widen_f16): the kernels convert each key/value block for every query block
// that reads it.
inline void LoadBlock(const BFloat16* src, int64_t stride, int64_t rows, int64_t cols, float* dst,
                      int64_t ld) {
  GetTileOps().widen_bf16(reinterpret_cast<const uint16_t*>(src), stride, rows, cols, dst, ld);
}
inline void LoadBlock(const Float16* src, int64_t stride, int64_t rows, int64_t cols, float* dst,
                      int64_t ld) {
  GetTileOps().widen_f16(reinterpret_cast<const uint16_t*>(src), stride, rows, cols, dst, ld);
}

// dst[l * ld + r] = element(r, l) for source rows r < rows and lines l <
// lines, zero for r from rows up to RoundUpToTile(rows) when `pad`.
template <typename Out, typename Element>
void TransposeBlock(int64_t rows, int64_t lines, Out* dst, int64_t ld, bool pad,
                    const Element& element) {
  // Eight source rows at a time: rows a page apart share L1 sets, and a
  // line-by-line walk down all of them would miss on every element (as would
  // a row-by-row walk writing one element to each of `lines` cache lines).
  constexpr int64_t kRows = 8;
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t nr = std::min(kRows, rows - r0);
    for (int64_t l = 0; l < lines; ++l) {
      Out* out = dst + l * ld + r0;
      for (int64_t r = 0; r < nr; ++r) out[r] = element(r0 + r, l);
    }
  }
  const int64_t padded = pad ? RoundUpToTile(rows) : rows;
  for (int64_t l = 0; l < lines; ++l) {
    for (int64_t r = rows; r < padded; ++r) dst[l * ld + r] = Out{0};
  }
}

// TransposeBlock of float32 rows, 4 x 4 blocks at a time in 16-byte vectors
// (GCC vector extensions: SSE2 on x86-64) where element by element took an
// eighth of a small step's kernel time (B2 S32 N16 D256: the backward
// transposes each head's keys and values, the forward its queries). Eight
// source rows at a time, as TransposeBlock.
inline void TransposeFloats(const float* src, int64_t stride, int64_t rows, int64_t cols,
                            float* dst, int64_t ld, bool pad) {
  typedef float V4 __attribute__((vector_size(16)));
  typedef float U4 __attribute__((vector_size(16), aligned(alignof(float)), may_alias));
  typedef int32_t I4 __attribute__((vector_size(16)));
  constexpr int64_t kRows = 8;
  const int64_t cols4 = cols / 4 * 4;
  int64_t r0 = 0;
  for (; r0 + kRows <= rows; r0 += kRows) {
    const float* in = src + r0 * stride;
    for (int64_t l = 0; l < cols4; l += 4) {
      for (int64_t h = 0; h < kRows; h += 4) {
        const V4 a = *reinterpret_cast<const U4*>(in + h * stride + l);
        const V4 b = *reinterpret_cast<const U4*>(in + (h + 1) * stride + l);
        const V4 c = *reinterpret_cast<const U4*>(in + (h + 2) * stride + l);
        const V4 d = *reinterpret_cast<const U4*>(in + (h + 3) * stride + l);
        const V4 ab_lo = __builtin_shuffle(a, b, I4{0, 4, 1, 5});
        const V4 ab_hi = __builtin_shuffle(a, b, I4{2, 6, 3, 7});
        const V4 cd_lo = __builtin_shuffle(c, d, I4{0, 4, 1, 5});
        const V4 cd_hi = __builtin_shuffle(c, d, I4{2, 6, 3, 7});
        float* out = dst + l * ld + r0 + h;
        *reinterpret_cast<U4*>(out) = __builtin_shuffle(ab_lo, cd_lo, I4{0, 1, 4, 5});
        *reinterpret_cast<U4*>(out + ld) = __builtin_shuffle(ab_lo, cd_lo, I4{2, 3, 6, 7});
        *reinterpret_cast<U4*>(out + 2 * ld) = __builtin_shuffle(ab_hi, cd_hi, I4{0, 1, 4, 5});
        *reinterpret_cast<U4*>(out + 3 * ld) = __builtin_shuffle(ab_hi, cd_hi, I4{2, 3, 6, 7});
      }
    }
    for (int64_t l = cols4; l < cols; ++l) {
      for (int64_t r = 0; r < kRows; ++r) dst[l * ld + r0 + r] = in[r * stride + l];
    }
  }
  // The last rows, and the padding, as TransposeBlock does them.
  TransposeBlock(rows - r0, cols, dst + r0, ld, false,
                 [&](int64_t r, int64_t c) { return src[(r0 + r) * stride + c]; });
  const int64_t padded = pad ? RoundUpToTile(rows) : rows;
  for (int64_t l = 0; l < cols; ++l) {
    for (int64_t r = rows; r < padded; ++r) dst[l * ld + r] = 0.0f;
  }
}

// The transpose of rows x cols of `src` into dst (cols x rows, row stride ld);
// nothing past `rows` in dst's rows is written.
template <typename T>
void TransposeRows(const T* src, int64_t stride, int64_t rows, int64_t cols, float* dst,
                   int64_t ld) {
  if constexpr (std::is_same_v<T, float>) {
    TransposeFloats(src, stride, rows, cols, dst, ld, false);
  } else {
    TransposeBlock(rows, cols, dst, ld, false,
                   [&](int64_t r, int64_t c) { return ToFloat(src[r * stride + c]); });
  }
}

// The transpose (cols x rows, row stride ld), zero columns up to RoundUpToTile(rows).
template <typename T>
void LoadTransposed(const T* src, int64_t stride, int64_t rows, int64_t cols, float* dst,
                    int64_t ld) {
  if constexpr (std::is_same_v<T, float>) {
    TransposeFloats(src, stride, rows, cols, dst, ld, true);
  } else {
    TransposeBlock(rows, cols, dst, ld, true,
                   [&](int64_t r, int64_t c) { return ToFloat(src[r * stride + c]); });
  }
}

// The transpose of a block of rows x cols (cols even) as column pairs for
// TileOps::bf16_gemm: dst[p * ld + r] = bits(src[r][2p]) | bits(src[r][2p + 1]) << 16,
// zero columns up to RoundUpToTile(rows). Only for bfloat16 blocks.
template <typename T>
void LoadPairsTransposed(const T* src, int64_t stride, int64_t rows, int64_t cols, uint32_t* dst,
                         int64_t ld) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    TransposeBlock(rows, cols / 2, dst, ld, true, [&](int64_t r, int64_t p) {
      const T* in = src + r * stride + 2 * p;
      return uint32_t{in[0].bits} | uint32_t{in[1].bits} << 16;
    });
  }
}

// A block as a GEMM operand: float32 rows are used in place unless a B operand
// would read past `cols`; other types are converted into `scratch`. finite:
// every element is known to be finite (BOperand's copy looked), which spares
// MaskedGemm its own look.
struct Operand {
  const float* data;
  int64_t ld;
  bool finite = false;
  // The block from row `first` on.
  Operand Rows(int64_t first) const { return {data + first * ld, ld, finite}; }
};

// A float32 row copied to dst, zero columns up to RoundUpToTile(cols); returns
// whether it is finite (no float with all exponent bits set: integer tests on
// the bits, in the copy's own loop).
inline bool CopyRow(const float* src, int64_t cols, float* dst) {
  constexpr uint32_t kExponent = 0x7f800000u;
  uint32_t non_finite = 0;
  for (int64_t c = 0; c < cols; ++c) {
    uint32_t bits;
    std::memcpy(&bits, src + c, sizeof bits);
    non_finite |= (bits & kExponent) == kExponent;
    std::memcpy(dst + c, &bits, sizeof bits);
  }
  for (int64_t c = cols; c < RoundUpToTile(cols); ++c) dst[c] = 0.0f;
  return non_finite == 0;
}

template <typename T>
Operand View(const T* src, int64_t stride, int64_t rows, int64_t cols, bool b_operand,
             float* scratch, int64_t ld) {
  if constexpr (std::is_same_v<T, float>) {
    if (!b_operand || cols % kTileAlign == 0) return {src, stride};
  }
  LoadBlock(src, stride, rows, cols, scratch, ld);
  return {scratch, ld};
}

// A block a GEMM reads as its B operand, with the rows of `ahead` (blocks read
// after it) asked for. Where the instruction set copies B blocks
// (TileOps::copy_b_blocks) the block goes to `scratch` row by row and `ahead`
// is asked for along the copy, whose own rows arrive from memory anyway
// (AVX2: the forward 3-11% faster than without, the backward 3-8% faster than
// with a burst ahead), and a float32 copy finds out whether the block is finite;
// elsewhere `ahead` is asked for at once and the block is a View.
template <typename T>
Operand BOperand(const TileOps& ops, const T* src, int64_t stride, int64_t rows, int64_t cols,
                 float* scratch, int64_t ld, const RowsAhead& ahead) {
  if (!ops.copy_b_blocks) {
    ahead.FetchAll();
    return View(src, stride, rows, cols, true, scratch, ld);
  }
  bool finite = std::is_same_v<T, float>;
  for (int64_t r = 0; r < rows; ++r) {
    ahead.Fetch(r);
    if constexpr (std::is_same_v<T, float>) {
      finite &= CopyRow(src + r * stride, cols, scratch + r * ld);
    } else {
      LoadBlock(src + r * stride, 0, 1, cols, scratch + r * ld, ld);
    }
  }
  return {scratch, ld, finite};
}

template <typename T>
void StoreRows(const float* src, int64_t ld, int64_t rows, int64_t cols, float factor, T* dst,
               int64_t stride) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[r * stride + c] = FromFloat<T>(src[r * ld + c] * factor);
  }
}

}  // namespace jax_rope::cpu::attention
