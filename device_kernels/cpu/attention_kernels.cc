// Orchestration of the attention kernels over work items; the arithmetic is in
// attention_tiles.cc. Orientation: each item transposes only its own fixed
// block (queries for the forward and dquery items, keys/values for dkey/dvalue
// items) once, and the blocks it loops over are GEMM operands in their stored
// row-major layout (float32 keys in place; the forward copies value blocks
// into contiguous rows), so no tile is ever transposed:
//   forward, dquery: scores^T = K_blk Q^T, with the row statistics along vectors;
//   dkey/dvalue:     scores = Q_blk K^T; dV += P^T dO and dK += dS^T Q read P
//                    and dS transposed through the GEMM's A strides.
// A positional bias is added to each tile before masking (attention_bias.h),
// so masked positions never see it; dropout multiplies the probabilities of a
// tile by keep / keep_prob after the softmax step. Without either, the tile
// code is the plain path (one branch per tile).
// The products of a tile the band cuts (the diagonal of a causal band) leave
// out the strips of it that are masked throughout (ForEachVisibleStrip).
// The rows of the next key block (dkey/dvalue items: query block) are
// prefetched while a block is computed: one head's rows lie a page apart, where
// hardware prefetchers stop. bfloat16 runs every product on the CPU's bf16 dot
// products where it has them (TileOps::bf16_gemm for scores, keys read in
// place; bf16_pairs_gemm for P V, dV, dK and dQ, the probabilities and dS
// rounded to bfloat16 as the NPU's kernel rounds them); elsewhere the float32
// products take the same rounded values.
// Short query blocks have their own forward (attention_split.cc); the backward
// items are in attention_backward.cc and attention_backward_fused.cc, what all
// use in attention_items.h.
#include "device_kernels/cpu/attention_kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "device_kernels/cpu/attention_bias.h"
#include "device_kernels/cpu/attention_blocks.h"
#include "device_kernels/cpu/attention_items.h"
#include "device_kernels/cpu/attention_masking.h"
#include "device_kernels/cpu/attention_staging.h"
#include "device_kernels/cpu/attention_tiles.h"
#include "device_kernels/cpu/thread_scratch.h"

namespace jax_rope::cpu {
namespace {

using namespace attention;

// Forward items: each runs up to kForwardLanes (query head, query block) lanes of
// one kv head's group over one key loop, so that each K/V block is read once
// for all of them (chunked prefill with G = 4: 1.5x). The lanes are heads of
// the group (a divisor of its size, at most kForwardHeads) over
// ForwardShape::blocks consecutive query blocks; per lane the steps are those
// of a lane alone, in the same order, so the lanes per item never change the
// bits. Where at most kWideLanes lanes hold every query block of a head group
// and sequence, and that leaves kWideItemsPerWorker items per worker, one item
// takes them all. Each key block's values are copied into contiguous rows
// once per item for its lanes (CopiedOperand). Against four lanes per item
// reading the values in place (from a head-major copy of K and V where
// CopyKeyValueFirst made one), on two Zen 4 cores: chunked prefill B1 Sq256
// Skv8192 N32/8 D128 3.7% faster (D256 6-9%), the causal S2048 N8 forward 3%,
// the S512 N16 forward 7-9% (D64 and D256), causal S4096 the same.
constexpr int64_t kForwardHeads = 4;
constexpr int64_t kForwardLanes = 8;
constexpr int64_t kWideLanes = 16;
constexpr int64_t kWideItemsPerWorker = 4;

struct ForwardShape {
  int64_t heads = 1;   // query heads per item
  int64_t blocks = 1;  // query blocks per item
  int64_t lanes() const { return heads * blocks; }
};

ForwardShape ForwardShapeOf(const AttentionGeometry& g, const SequenceBand* seqs) {
  ForwardShape f;
  if (!ValidGeometry(g)) return f;
  const int64_t group = g.q_heads / g.kv_heads;
  for (int64_t h = 1; h <= kForwardHeads; ++h) {
    if (group % h == 0) f.heads = h;
  }
  f.blocks = kForwardLanes / f.heads;
  int64_t most_blocks = 0;  // query blocks of the longest sequence
  for (int64_t b = 0; b < g.batch; ++b) {
    most_blocks = std::max(most_blocks, CeilDiv(Band(seqs[b]).q_len, kBlockQ));
  }
  const int64_t wide_items = g.batch * (g.q_heads / f.heads);
  if (most_blocks > f.blocks && f.heads * most_blocks <= kWideLanes &&
      wide_items >= kWideItemsPerWorker * std::max<int64_t>(g.workers, 1)) {
    f.blocks = most_blocks;
  }
  return f;
}

// Per-lane state beyond the workspace: query block (transposed), output
// accumulator and row statistics, in the thread's kept scratch. max is each
// query's shift, which the output and sum are relative to; top the largest
// score of the steps that kept the shift (KeepShifts), -inf if none did.
struct ForwardLanes {
  int64_t q_size, o_size;
  ThreadScratch scratch;
  float *q, *o, *max, *sum, *top;
  ForwardLanes(const AttentionGeometry& g, const Workspace& ws, int64_t lanes)
      : q_size(RoundUpToTile(g.head_dim) * kBlockQ), o_size(kBlockQ * ws.ldvp),
        scratch(ScratchRole::kLanes, lanes * (q_size + o_size + 3 * kBlockQ)),
        q(scratch.data()), o(q + lanes * q_size), max(o + lanes * o_size),
        sum(max + lanes * kBlockQ), top(sum + lanes * kBlockQ) {}
};

// How far above its shift a query's scores may be for a score product to
// leave its softmax terms under that shift (terms up to e^5.5, about 245,
// where float32 sums and outputs lose nothing): most tiles then take no
// softmax pass of their own.
constexpr float kShiftSlack = 5.5f;

// After gemm_col_max left the terms of a tile under the queries' shifts
// (tile_sum their column sums): whether every query's scaled maximum lies
// within kShiftSlack of its shift; if so, the sums are added (as
// softmax_step adds them when the maximum does not move) and top raised.
bool KeepShifts(const float* raw_max, float scale, const float* q_max, const float* tile_sum,
                int64_t queries, float* q_sum, float* top) {
  for (int64_t c = 0; c < queries; ++c) {
    if (!(raw_max[c] * scale <= q_max[c] + kShiftSlack)) return false;
  }
  for (int64_t c = 0; c < queries; ++c) {
    q_sum[c] += tile_sum[c];
    top[c] = std::max(top[c], raw_max[c] * scale);
  }
  return true;
}

template <typename T>
void ForwardItem(const AttentionGeometry& g, const SequenceBand* seqs,
                 const AttentionForwardArgs<T>& a, const WorkItems::Item& it, ForwardShape shape,
                 const TileOps& ops, Workspace& ws, ForwardLanes& fl) {
  const Band band(seqs[it.seq]);
  const int64_t b = it.seq, n0 = it.head * shape.heads, kvh = n0 / (g.q_heads / g.kv_heads);
  const int64_t d = g.head_dim, dv = g.value_dim;
  const float scale = ScoreScale(g);
  const bool dropout = g.dropout.mode != DropoutMode::kNone;
  // bfloat16 scores with the CPU's bf16 dot products: K read in place.
  const bool bf16 = std::is_same_v<T, BFloat16> && ops.bf16_gemm != nullptr && d % 2 == 0;
  // bfloat16 P V: the probabilities rounded to bfloat16 (as the NPU's kernel
  // rounds them for its matrix unit), on the bf16 dot products where the CPU
  // has them and the value block is finite; elsewhere rounded in place for the
  // float32 product, which then computes the same exact products.
  const bool bf16_values = std::is_same_v<T, BFloat16> && ops.bf16_pairs_gemm != nullptr;
  struct Lane {
    int64_t n, r0, nr;
    BlockSpan keys;
  };
  Lane lanes[kWideLanes];
  int64_t count = 0;
  BlockSpan seen_keys;  // the union of the lanes' key blocks
  for (int64_t blk = 0; blk < shape.blocks; ++blk) {
    const int64_t r0 = (it.block * shape.blocks + blk) * kBlockQ;
    if (r0 >= band.q_len) break;
    const int64_t nr = std::min(kBlockQ, band.q_len - r0);
    const BlockSpan keys = band.KeyBlocks(r0, nr, kBlockK);
    for (int64_t h = 0; h < shape.heads; ++h) {
      const int64_t j = count++;
      lanes[j] = {n0 + h, r0, nr, keys};
      const T* query = a.query + Offset(g.q, b, band.q_start + r0, n0 + h);
      float* qt = fl.q + j * fl.q_size;
      if (bf16) {
        LoadPairsTransposed(query, g.q.seq, nr, d, reinterpret_cast<uint32_t*>(qt), kBlockQ);
      } else {
        LoadTransposed(query, g.q.seq, nr, d, qt, kBlockQ);
      }
      std::fill(fl.o + j * fl.o_size, fl.o + j * fl.o_size + nr * ws.ldvp, 0.0f);
      const int64_t nrp = RoundUpToTile(nr);
      std::fill(fl.max + j * kBlockQ, fl.max + j * kBlockQ + nrp, kNegInf);
      std::fill(fl.sum + j * kBlockQ, fl.sum + j * kBlockQ + nrp, 0.0f);
      std::fill(fl.top + j * kBlockQ, fl.top + j * kBlockQ + nrp, kNegInf);
    }
    seen_keys = Join(seen_keys, keys);
  }
  for (int64_t c0 = seen_keys.start; c0 < seen_keys.end; c0 += kBlockK) {
    const int64_t nc = std::min(kBlockK, band.kv_len - c0);
    // What each lane sees of this key block (kAll: nothing, nor outside its key blocks).
    TileMask tile_masks[kWideLanes];
    bool seen = false;
    for (int64_t j = 0; j < count; ++j) {
      const Lane& l = lanes[j];
      const bool visits = c0 >= l.keys.start && c0 < l.keys.end;
      tile_masks[j] = visits ? ElementMaskOf(g.mask, b, l.n, l.r0, l.nr, c0, nc) : TileMask::kAll;
      seen |= tile_masks[j] != TileMask::kAll;
    }
    if (!seen) continue;
    const T* key = a.key + Offset(g.k, b, band.kv_start + c0, kvh);
    const T* value = a.value + Offset(g.v, b, band.kv_start + c0, kvh);
    const RowsAhead ahead =
        KeyBlockAhead(g, band, a.key, a.value, b, kvh, c0 + kBlockK, seen_keys.end);
    uint32_t* value_pairs = reinterpret_cast<uint32_t*>(ws.n2);
    bool pairs = false;
    if (bf16_values) {
      ahead.FetchAll();
      pairs = LoadRowPairs(value, g.v.seq, nc, dv, value_pairs, ws.ldvp);
    }
    const Operand v = pairs ? Operand{nullptr, 0}
                            : CopiedOperand(ops, value, g.v.seq, nc, dv, ws.n2, ws.ldvp,
                                            bf16_values ? RowsAhead{} : ahead);
    const Operand k = bf16 ? Operand{nullptr, 0} : View(key, g.k.seq, nc, d, false, ws.n1, ws.ldp);
    for (int64_t j = 0; j < count; ++j) {
      if (tile_masks[j] == TileMask::kAll) continue;
      const Lane& l = lanes[j];
      const int64_t n = l.n, r0 = l.r0, nr = l.nr;
      const bool elements = tile_masks[j] == TileMask::kSome;
      const float* qt = fl.q + j * fl.q_size;
      float* o = fl.o + j * fl.o_size;
      // Transposed scores (keys x queries): the statistics run along vectors.
      // Without a masked position, bias or a negative scale, the product finds
      // each query's largest score as it stores the tile.
      const bool col_max = !bf16 && scale > 0.0f && g.bias.kind == BiasKind::kNone &&
                           !elements && band.Covers(r0, nr, c0, nc);
      float* q_max = fl.max + j * kBlockQ;
      float* q_sum = fl.sum + j * kBlockQ;
      const int64_t nrp = RoundUpToTile(nr);
      alignas(64) float raw_max[kBlockQ];
      bool stepped = false;  // whether the product left the softmax terms (KeepShifts)
      if (bf16) {
        ops.bf16_gemm(nc, nr, d / 2, reinterpret_cast<const uint16_t*>(key), g.k.seq,
                      reinterpret_cast<const uint32_t*>(qt), kBlockQ, ws.s, kBlockQ);
      } else if (col_max) {
        // Once every query has a shift, the product leaves the terms under it;
        // a tile whose scores rise too far above it is multiplied again. (Not
        // for bfloat16, whose terms are rounded under the step's own maximum.)
        if (!std::is_same_v<T, BFloat16> &&
            std::all_of(q_max, q_max + nrp, [](float m) { return m != kNegInf; })) {
          alignas(64) float tile_sum[kBlockQ];
          std::fill(tile_sum, tile_sum + nrp, 0.0f);
          std::fill(raw_max, raw_max + nrp, kNegInf);
          const ExpTerms terms{scale, q_max, tile_sum};
          ops.gemm_col_max(nc, nr, d, k.data, k.ld, 1, qt, kBlockQ, ws.s, kBlockQ, raw_max,
                           &terms);
          stepped = KeepShifts(raw_max, scale, q_max, tile_sum, nrp, q_sum, fl.top + j * kBlockQ);
        }
        if (!stepped) {
          std::fill(raw_max, raw_max + nrp, kNegInf);
          ops.gemm_col_max(nc, nr, d, k.data, k.ld, 1, qt, kBlockQ, ws.s, kBlockQ, raw_max,
                           nullptr);
        }
      } else {
        ForEachVisibleStrip(band, r0, nr, c0, nc, true, true, [&](int64_t j, int64_t nj,
                                                                  int64_t i, int64_t ni) {
          ops.gemm(nj, ni, d, k.data + j * k.ld, k.ld, 1, qt + i, kBlockQ,
                   ws.s + j * kBlockQ + i, kBlockQ, false);
        });
      }
      AddBias<T>(g, band, b, n, r0, nr, c0, nc, ws.s, kBlockQ, true);
      MaskTile(band, g, b, n, r0, nr, c0, nc, ws.s, kBlockQ, true, true, elements);
      if (!stepped) {
        ops.softmax_step(ws.s, kBlockQ, nc, nrp, scale, col_max ? raw_max : nullptr, q_max,
                         q_sum, o, ws.ldvp, nr, ws.dvp);
      }
      if (dropout) {  // the statistics above stay those of the undropped softmax
        KeepTile(g, band, b, n, r0, nr, c0, nc, ws.keep, kBlockQ, true);
        ApplyKeep(band, r0, nr, c0, nc, ws.s, ws.keep, kBlockQ, true);
      }
      if (pairs) {
        PairsTileProduct(ops, band, r0, nr, c0, nc, ws.s, kBlockQ,
                         reinterpret_cast<uint32_t*>(ws.dprob), value_pairs, ws.ldvp, dv, o,
                         ws.ldvp);
        continue;
      }
      if constexpr (std::is_same_v<T, BFloat16>) ops.round_bf16(ws.s, kBlockQ, nc, nr);
      TransposedTileProduct(ops, band, g, b, n, r0, nr, c0, nc, ws.s, kBlockQ, v, dv, o,
                            ws.ldvp, ws.finite, elements);
    }
  }
  for (int64_t j = 0; j < count; ++j) {
    const Lane& l = lanes[j];
    const float* o = fl.o + j * fl.o_size;
    const float* mx = fl.max + j * kBlockQ;
    const float* sm = fl.sum + j * kBlockQ;
    const float* top = fl.top + j * kBlockQ;
    for (int64_t i = 0; i < l.nr; ++i) {
      const int64_t row = band.q_start + l.r0 + i;
      const int64_t idx = Offset(g.stats, b, row, l.n);
      T* out = a.out + Offset(g.out, b, row, l.n);
      // A row whose visible scores are all NaN (a NaN key row it sees) keeps max
      // -inf but has a NaN sum: NaN output, not a dead row's zeros.
      const bool dead = mx[i] == kNegInf && sm[i] == 0.0f;
      StoreRows(o + i * ws.ldvp, ws.ldvp, 1, dv, dead ? 0.0f : 1.0f / sm[i], out, 0);
      // The statistics under the row's largest score (above its shift where a
      // step kept the shift).
      const float high = std::max(mx[i], top[i]);
      const float sum = high > mx[i] ? sm[i] * std::exp(mx[i] - high) : sm[i];
      a.softmax_max[idx] = RowMax(high, sum);
      a.softmax_sum[idx] = dead ? kDeadRowSum : sum;
    }
  }
}

template <typename T>
void ScoresItem(const AttentionGeometry& g, const SequenceBand* seqs, const T* query, const T* key,
                float* scores, const int64_t strides[3], const WorkItems::Item& it,
                const TileOps& ops, Workspace& ws) {
  const Band band(seqs[it.seq]);
  const int64_t b = it.seq, n = it.head, kvh = n / (g.q_heads / g.kv_heads);
  const int64_t r0 = it.block * kBlockQ, nr = std::min(kBlockQ, band.q_len - r0);
  const float scale = ScoreScale(g);
  LoadTransposed(query + Offset(g.q, b, band.q_start + r0, n), g.q.seq, nr, g.head_dim, ws.t1,
                 kBlockQ);
  const BlockSpan keys = band.KeyBlocks(r0, nr, kBlockK);
  for (int64_t c0 = keys.start; c0 < keys.end; c0 += kBlockK) {
    const int64_t nc = std::min(kBlockK, band.kv_len - c0);
    const TileMask tile_mask = ElementMaskOf(g.mask, b, n, r0, nr, c0, nc);
    if (tile_mask == TileMask::kAll) continue;  // every score stays kMaskValue
    const Operand k = View(key + Offset(g.k, b, band.kv_start + c0, kvh), g.k.seq, nc,
                           g.head_dim, false, ws.n1, ws.ldp);
    ForEachVisibleStrip(band, r0, nr, c0, nc, true, true, [&](int64_t j, int64_t nj,
                                                              int64_t i, int64_t ni) {
      ops.gemm(nj, ni, g.head_dim, k.data + j * k.ld, k.ld, 1, ws.t1 + i, kBlockQ,
               ws.s + j * kBlockQ + i, kBlockQ, false);
    });
    AddBias<T>(g, band, b, n, r0, nr, c0, nc, ws.s, kBlockQ, true);
    MaskTile(band, g, b, n, r0, nr, c0, nc, ws.s, kBlockQ, true, true,
             tile_mask == TileMask::kSome);
    for (int64_t i = 0; i < nr; ++i) {
      // Masked positions keep the caller's kMaskValue.
      float* out = scores + b * strides[0] + n * strides[1] +
                   (band.q_start + r0 + i) * strides[2] + band.kv_start + c0;
      for (int64_t j = 0; j < nc; ++j) {
        const float s = ws.s[j * kBlockQ + i];
        if (s != kNegInf) out[j] = scale * s;
      }
    }
  }
}

}  // namespace

int64_t ForwardWorkItems(const AttentionGeometry& g, const SequenceBand* seqs) {
  return WorkItems(g, seqs, false, kBlockQ).size();
}

int64_t AttentionForwardWorkItems(const AttentionGeometry& g, const SequenceBand* seqs) {
  const ForwardShape shape = ForwardShapeOf(g, seqs);
  return WorkItems(g, seqs, false, kBlockQ * shape.blocks, shape.heads).size();
}

int64_t KeyBlockWorkItems(const AttentionGeometry& g, const SequenceBand* seqs) {
  return WorkItems(g, seqs, true, kBlockK).size();
}

int64_t ForwardKeyRowReads(const AttentionGeometry& g, const SequenceBand* seqs) {
  if (!ValidGeometry(g)) return 0;
  const ForwardShape shape = ForwardShapeOf(g, seqs);
  const int64_t rows_per_item = kBlockQ * shape.blocks;
  const int64_t items_per_block = g.q_heads / g.kv_heads / shape.heads;
  int64_t reads = 0;
  for (int64_t b = 0; b < g.batch; ++b) {
    const Band band(seqs[b]);
    for (int64_t r0 = 0; r0 < band.q_len && band.kv_len > 0; r0 += rows_per_item) {
      const BlockSpan keys =
          band.KeyBlocks(r0, std::min(rows_per_item, band.q_len - r0), kBlockK);
      if (keys.end > keys.start) {
        reads += items_per_block * (std::min(keys.end, band.kv_len) - keys.start);
      }
    }
  }
  return reads;
}

template <typename T>
void AttentionForward(const AttentionGeometry& g, const SequenceBand* seqs,
                      const AttentionForwardArgs<T>& args, int64_t begin, int64_t end) {
  const ForwardShape shape = ForwardShapeOf(g, seqs);
  const WorkItems items(g, seqs, false, kBlockQ * shape.blocks, shape.heads);
  begin = std::max<int64_t>(begin, 0);
  end = std::min(end, items.size());
  if (begin >= end) return;
  const TileOps& ops = GetTileOps();
  Workspace ws(g, kBlockMax);
  ForwardLanes fl(g, ws, shape.lanes());
  for (int64_t t = begin; t < end; ++t) ForwardItem(g, seqs, args, items[t], shape, ops, ws, fl);
}
template <typename T>
void AttentionScores(const AttentionGeometry& g, const SequenceBand* seqs, const T* query,
                     const T* key, float* scores, const int64_t score_strides[3],
                     int64_t begin, int64_t end) {
  ForEachItem(g, seqs, false, begin, end, [&](const WorkItems::Item& it, const TileOps& ops,
                                              Workspace& ws) {
    ScoresItem(g, seqs, query, key, scores, score_strides, it, ops, ws);
  });
}
#define JAX_ROPE_INSTANTIATE(T)                                                               \
  template void AttentionForward<T>(const AttentionGeometry&, const SequenceBand*,           \
                                    const AttentionForwardArgs<T>&, int64_t, int64_t);       \
  template void AttentionScores<T>(const AttentionGeometry&, const SequenceBand*, const T*,  \
                                   const T*, float*, const int64_t[3], int64_t, int64_t);
JAX_ROPE_FOR_EACH_ELEMENT_TYPE(JAX_ROPE_INSTANTIATE)
#undef JAX_ROPE_INSTANTIATE

}  // namespace jax_rope::cpu
