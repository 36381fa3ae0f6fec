// Shared by the tiled attention kernels (attention_kernels.cc: forward and
// scores; attention_backward.cc): block sizes, the bf16 product choice, the
// key-block prefetch and the loop over one work-item list. Internal.
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

// The K and V rows of the key block at c0 (when c0 < end), for the next step.
template <typename T>
void PrefetchKeyBlock(const AttentionGeometry& g, const Band& band, const T* key, const T* value,
                      int64_t b, int64_t kvh, int64_t c0, int64_t end) {
  if (c0 >= end) return;
  const int64_t nc = std::min(kBlockK, band.kv_len - c0);
  Prefetch(key + Offset(g.k, b, band.kv_start + c0, kvh), g.k.seq, nc, g.head_dim);
  Prefetch(value + Offset(g.v, b, band.kv_start + c0, kvh), g.v.seq, nc, g.value_dim);
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
