// The work items of the flash-decoding forward (attention_split.cc, pass 1)
// and the scratch slots they fill for the merge (attention_split_merge.cc):
// the shapes both passes share. Internal to the kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "device_kernels/cpu/attention_blocks.h"
#include "device_kernels/cpu/attention_kernels.h"
#include "device_kernels/cpu/attention_tiles.h"

namespace jax_rope::cpu::split_forward {

using attention::Band;
using attention::CeilDiv;
using attention::ValidGeometry;

// Packed rows per tile (the cap on q_len * G) and keys per key block.
constexpr int64_t kBlock = 64;
static_assert(kSplitKeys % kBlock == 0, "chunks hold whole key blocks");
constexpr int64_t kRunHeads = 8;

// Whether a key row's kv heads lie next to each other in memory (BSND, TND),
// rather than each head's rows (BNSD): the order the decode reads rows in.
inline bool RowHeadsAdjacent(const Strides& st) { return st.head < st.seq; }

// Pass 1 items (sequence, chunk, kv head) in that order; item t owns slot t of
// the scratch: padded_rows() maxima, padded_rows() sums, then rows() x dvp
// outputs.
class SplitItems {
 public:
  struct Item {
    int64_t seq, head, chunk;
  };

  SplitItems(const AttentionGeometry& g, const SequenceBand* seqs)
      : group_(ValidGeometry(g) ? g.q_heads / g.kv_heads : 0),
        kv_heads_(g.kv_heads),
        run_heads_(RowHeadsAdjacent(g.k) && RowHeadsAdjacent(g.v) ? kRunHeads : 1) {
    if (group_ == 0 || g.batch <= 0) return;
    int64_t max_q = 0;
    for (int64_t b = 0; b < g.batch; ++b) max_q = std::max(max_q, Band(seqs[b]).q_len);
    if (max_q == 0 || group_ * max_q > kBlock) return;
    rows_ = group_ * max_q;
    slot_ = 2 * RoundUpToTile(rows_) + rows_ * RoundUpToTile(g.value_dim);
    int64_t total = 0;
    for (int64_t b = 0; b < g.batch; ++b) {
      chunks_.push_back(CeilDiv(Band(seqs[b]).kv_len, kSplitKeys));
      total += kv_heads_ * chunks_.back();
      ends_.push_back(total);
    }
  }
  bool applicable() const { return rows_ > 0; }
  int64_t size() const { return ends_.empty() ? 0 : ends_.back(); }
  int64_t padded_rows() const { return RoundUpToTile(rows_); }
  int64_t slot() const { return slot_; }
  int64_t group() const { return group_; }
  int64_t chunks(int64_t seq) const { return chunks_[seq]; }
  // Chunk-major within a sequence: consecutive items (one thread's run) read
  // the same key rows of neighbouring heads, which share pages.
  int64_t Index(int64_t seq, int64_t head, int64_t chunk) const {
    return (seq == 0 ? 0 : ends_[seq - 1]) + chunk * kv_heads_ + head;
  }
  Item operator[](int64_t t) const {
    const int64_t seq = std::upper_bound(ends_.begin(), ends_.end(), t) - ends_.begin();
    const int64_t rem = t - (seq == 0 ? 0 : ends_[seq - 1]);
    return {seq, rem % kv_heads_, rem / kv_heads_};
  }
  // The end of the run from item t (< end): the next items of the same
  // sequence and chunk, kRunHeads at most where a key row's heads are adjacent
  // in memory (BSND, TND), one where each head's rows are (BNSD).
  int64_t RunEnd(int64_t t, int64_t end) const {
    return std::min({end, t + kv_heads_ - (*this)[t].head, t + run_heads_});
  }

 private:
  int64_t group_, kv_heads_, run_heads_, rows_ = 0, slot_ = 0;
  std::vector<int64_t> chunks_, ends_;
};

}  // namespace jax_rope::cpu::split_forward
