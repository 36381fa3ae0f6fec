// Shared by the tiled attention kernels (attention_kernels.cc: forward and
// scores; attention_backward*.cc): block sizes, the bf16 product choice, the
// key-block rows asked for ahead and the loop over one work-item list. Internal.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "device_kernels/cpu/attention_blocks.h"
#include "device_kernels/cpu/attention_tiles.h"

namespace jax_rope::cpu::attention {

// Query rows per forward item and key rows per key-block item. The tile
// routines need multiples of kTileAlign.
inline constexpr int64_t kBlockQ = 64;
inline constexpr int64_t kBlockK = 64;
inline constexpr int64_t kBlockMax = std::max(kBlockQ, kBlockK);

// Whether the backward's score and dP products of T run on TileOps::bf16_gemm.
template <typename T>
bool Bf16Products(const AttentionGeometry& g, const TileOps& ops) {
  return std::is_same_v<T, BFloat16> && ops.bf16_gemm != nullptr && g.head_dim % 2 == 0 &&
         g.value_dim % 2 == 0;
}

// The K and V rows of the key block of kv head kvh at c0 (nothing when c0 >=
// end), to ask for while the step before it runs.
template <typename T>
RowsAhead KeyBlockAhead(const AttentionGeometry& g, const Band& band, const T* key,
                        const T* value, int64_t b, int64_t kvh, int64_t c0, int64_t end,
                        int64_t block = kBlockK) {
  RowsAhead ahead;
  if (c0 >= end) return ahead;
  ahead.streams[0] = RowsAhead::Of(key + Offset(g.k, b, band.kv_start + c0, kvh), g.k.seq,
                                   g.head_dim);
  ahead.streams[1] = RowsAhead::Of(value + Offset(g.v, b, band.kv_start + c0, kvh), g.v.seq,
                                   g.value_dim);
  ahead.rows = std::min(block, band.kv_len - c0);
  return ahead;
}

// Runs fn(item, ops, workspace) over items [begin, end) of one list.
template <typename Fn>
void ForEachItem(const AttentionGeometry& g, const SequenceBand* seqs, bool key_blocks,
                 int64_t begin, int64_t end, const Fn& fn) {
  const WorkItems items(g, seqs, key_blocks, key_blocks ? kBlockK : kBlockQ);
  begin = std::max<int64_t>(begin, 0);
  end = std::min(end, items.size());
  if (begin >= end) return;
  const TileOps& ops = GetTileOps();
  Workspace ws(g, kBlockMax);
  for (int64_t t = begin; t < end; ++t) fn(items[t], ops, ws);
}

}  // namespace jax_rope::cpu::attention
