// The two-pass attention backward over work items (spec/attention.md, bias and
// dropout per spec/attention_bias_dropout.md section 4): row deltas, then dkey
// and dvalue over key-block items and dquery over query items. The one-pass
// backward is in attention_backward_fused.cc, the tile both run in
// attention_backward_tile.h. Orientation and tile conventions as in
// attention_kernels.cc.
#include <algorithm>
#include <cmath>

#include "device_kernels/cpu/attention_backward_tile.h"
#include "device_kernels/cpu/attention_bias.h"
#include "device_kernels/cpu/attention_blocks.h"
#include "device_kernels/cpu/attention_items.h"
#include "device_kernels/cpu/attention_kernels.h"
#include "device_kernels/cpu/attention_masking.h"
#include "device_kernels/cpu/attention_staging.h"
#include "device_kernels/cpu/attention_tiles.h"

namespace jax_rope::cpu {
namespace {

using namespace attention;

template <typename T>
void KeyValueItem(const AttentionGeometry& g, const SequenceBand* seqs,
                  const AttentionBackwardArgs<T>& a, const float* row_delta,
                  const WorkItems::Item& it, const TileOps& ops, Workspace& ws) {
  const Band band(seqs[it.seq]);
  const int64_t b = it.seq, h = it.head, group = g.q_heads / g.kv_heads, c0 = it.block * kBlockK;
  const bool bf16 = Bf16Products<T>(g, ops);
  const KeyBlock<T> block(g, band, a, b, h, c0, bf16, ws, KeyBlockBuffers::Of(ws));
  const BlockSpan queries = band.QueryBlocks(c0, block.nc, kBlockQ);
  for (int64_t n = h * group; n < (h + 1) * group; ++n) {
    for (int64_t r0 = queries.start; r0 < queries.end; r0 += kBlockQ) {
      const int64_t nr = std::min(kBlockQ, band.q_len - r0);
      const TileMask tile_mask = ElementMaskOf(g.mask, b, n, r0, nr, c0, block.nc);
      if (tile_mask == TileMask::kAll) continue;
      KeyBlockTile(g, band, a, row_delta, b, n, r0, queries.end, c0, block.nc, ops, ws, bf16,
                   nullptr, tile_mask == TileMask::kSome, block.buffers);
    }
  }
  block.Store(g, a, ws);
}

template <typename T>
void QueryItem(const AttentionGeometry& g, const SequenceBand* seqs,
               const AttentionBackwardArgs<T>& a, const float* row_delta,
               const WorkItems::Item& it, const TileOps& ops, Workspace& ws) {
  const Band band(seqs[it.seq]);
  const int64_t b = it.seq, n = it.head, kvh = n / (g.q_heads / g.kv_heads);
  const int64_t r0 = it.block * kBlockQ, nr = std::min(kBlockQ, band.q_len - r0);
  const int64_t nrp = RoundUpToTile(nr), d = g.head_dim, dv = g.value_dim;
  const int64_t q_off = Offset(g.q, b, band.q_start + r0, n);
  const float scale = ScoreScale(g);
  const int64_t do_off = Offset(g.out, b, band.q_start + r0, n);
  const bool bf16 = Bf16Products<T>(g, ops);
  uint32_t* q_pairs = reinterpret_cast<uint32_t*>(ws.t1);
  uint32_t* do_pairs = reinterpret_cast<uint32_t*>(ws.t2);
  if (bf16) {
    LoadPairsTransposed(a.query + q_off, g.q.seq, nr, d, q_pairs, kBlockQ);
    LoadPairsTransposed(a.dout + do_off, g.out.seq, nr, dv, do_pairs, kBlockQ);
  } else {
    LoadTransposed(a.query + q_off, g.q.seq, nr, d, ws.t1, kBlockQ);
    LoadTransposed(a.dout + do_off, g.out.seq, nr, dv, ws.t2, kBlockQ);
  }
  LoadStats(g, band, a, row_delta, b, n, r0, nr, ws);
  float* dq = ws.acc1;
  std::fill(dq, dq + nr * ws.ldp, 0.0f);
  const BlockSpan keys = band.KeyBlocks(r0, nr, kBlockK);
  for (int64_t c0 = keys.start; c0 < keys.end; c0 += kBlockK) {
    const int64_t nc = std::min(kBlockK, band.kv_len - c0);
    const TileMask tile_mask = ElementMaskOf(g.mask, b, n, r0, nr, c0, nc);
    if (tile_mask == TileMask::kAll) continue;
    const bool elements = tile_mask == TileMask::kSome;
    const T* key = a.key + Offset(g.k, b, band.kv_start + c0, kvh);
    const T* value = a.value + Offset(g.v, b, band.kv_start + c0, kvh);
    const RowsAhead ahead = KeyBlockAhead(g, band, a.key, a.value, b, kvh, c0 + kBlockK,
                                          keys.end);
    // dQ's B: row pairs for the bf16 dot products (finite keys), else float32.
    uint32_t* key_pairs = reinterpret_cast<uint32_t*>(ws.n1);
    bool pairs = bf16 && ops.bf16_pairs_gemm != nullptr;
    if (pairs) {
      ahead.FetchAll();
      pairs = LoadRowPairs(key, g.k.seq, nc, d, key_pairs, ws.ldp);
    }
    const Operand k = pairs ? Operand{nullptr, 0}
                            : BOperand(ops, key, g.k.seq, nc, d, ws.n1, ws.ldp, ahead);
    if (bf16) {
      ops.bf16_gemm(nc, nr, d / 2, reinterpret_cast<const uint16_t*>(key), g.k.seq, q_pairs,
                    kBlockQ, ws.s, kBlockQ);
      ops.bf16_gemm(nc, nr, dv / 2, reinterpret_cast<const uint16_t*>(value), g.v.seq, do_pairs,
                    kBlockQ, ws.dprob, kBlockQ);
    } else {
      const Operand v = View(value, g.v.seq, nc, dv, false, ws.n2, ws.ldvp);
      ForEachVisibleStrip(band, r0, nr, c0, nc, true, true, [&](int64_t j, int64_t nj,
                                                                int64_t i, int64_t ni) {
        ops.gemm(nj, ni, d, k.data + j * k.ld, k.ld, 1, ws.t1 + i, kBlockQ,
                 ws.s + j * kBlockQ + i, kBlockQ, false);
        ops.gemm(nj, ni, dv, v.data + j * v.ld, v.ld, 1, ws.t2 + i, kBlockQ,
                 ws.dprob + j * kBlockQ + i, kBlockQ, false);
      });
    }
    AddBias<T>(g, band, b, n, r0, nr, c0, nc, ws.s, kBlockQ, true);
    MaskTile(band, g, b, n, r0, nr, c0, nc, ws.s, kBlockQ, true, true, elements);
    if (g.dropout.mode != DropoutMode::kNone) {
      KeepTile(g, band, b, n, r0, nr, c0, nc, ws.keep, kBlockQ, true);
      ApplyKeep(band, r0, nr, c0, nc, ws.dprob, ws.keep, kBlockQ, true);
    }
    ops.softmax_grad(ws.s, ws.dprob, kBlockQ, nc, nrp, scale, ws.max, ws.sum, ws.delta, true);
    // bfloat16: dS rounded to bfloat16 for dS K, as in KeyBlockTile.
    if (pairs) {
      PairsTileProduct(ops, band, r0, nr, c0, nc, ws.dprob, kBlockQ,
                       reinterpret_cast<uint32_t*>(ws.s), key_pairs, ws.ldp, d, dq, ws.ldp);
      continue;
    }
    if constexpr (std::is_same_v<T, BFloat16>) ops.round_bf16(ws.dprob, kBlockQ, nc, nr);
    TransposedTileProduct(ops, band, g, b, n, r0, nr, c0, nc, ws.dprob, kBlockQ, k, d, dq,
                          ws.ldp, ws.finite, elements);
  }
  StoreRows(dq, ws.ldp, nr, d, g.scale, a.dquery + q_off, g.q.seq);
}

}  // namespace

template <typename T>
void AttentionRowDelta(const AttentionGeometry& g, const SequenceBand* seqs,
                       const AttentionBackwardArgs<T>& a, float* row_delta, int64_t begin,
                       int64_t end) {
  // A row's dot product needs no tiles: the items without a workspace.
  const WorkItems items(g, seqs, false, kBlockQ);
  for (int64_t t = std::max<int64_t>(begin, 0); t < std::min(end, items.size()); ++t) {
    const WorkItems::Item it = items[t];
    const Band band(seqs[it.seq]);
    const int64_t r0 = it.block * kBlockQ, nr = std::min(kBlockQ, band.q_len - r0);
    for (int64_t row = band.q_start + r0; row < band.q_start + r0 + nr; ++row) {
      const int64_t off = Offset(g.out, it.seq, row, it.head);
      row_delta[Offset(g.stats, it.seq, row, it.head)] =
          RowDot(a.dout + off, a.out + off, g.value_dim);
    }
  }
}

template <typename T>
void AttentionBackwardKeyValue(const AttentionGeometry& g, const SequenceBand* seqs,
                               const AttentionBackwardArgs<T>& args, const float* row_delta,
                               int64_t begin, int64_t end) {
  ForEachItem(g, seqs, true, begin, end, [&](const WorkItems::Item& it, const TileOps& ops,
                                             Workspace& ws) {
    KeyValueItem(g, seqs, args, row_delta, it, ops, ws);
  });
}

template <typename T>
void AttentionBackwardQuery(const AttentionGeometry& g, const SequenceBand* seqs,
                            const AttentionBackwardArgs<T>& args, const float* row_delta,
                            int64_t begin, int64_t end) {
  ForEachItem(g, seqs, false, begin, end, [&](const WorkItems::Item& it, const TileOps& ops,
                                              Workspace& ws) {
    QueryItem(g, seqs, args, row_delta, it, ops, ws);
  });
}

#define JAX_ROPE_INSTANTIATE(T)                                                               \
  template void AttentionRowDelta<T>(const AttentionGeometry&, const SequenceBand*,          \
                                     const AttentionBackwardArgs<T>&, float*, int64_t,       \
                                     int64_t);                                               \
  template void AttentionBackwardKeyValue<T>(const AttentionGeometry&, const SequenceBand*,  \
                                             const AttentionBackwardArgs<T>&, const float*,  \
                                             int64_t, int64_t);                              \
  template void AttentionBackwardQuery<T>(const AttentionGeometry&, const SequenceBand*,     \
                                          const AttentionBackwardArgs<T>&, const float*,     \
                                          int64_t, int64_t);
JAX_ROPE_FOR_EACH_ELEMENT_TYPE(JAX_ROPE_INSTANTIATE)
#undef JAX_ROPE_INSTANTIATE

}  // namespace jax_rope::cpu
