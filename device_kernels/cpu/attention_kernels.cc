// Orchestration of the attention kernels over work items; the arithmetic is in
// attention_tiles.cc. Orientation: each item transposes only its own fixed
// block (queries for the forward and dquery items, keys/values for dkey/dvalue
// items) once, and the blocks it loops over are GEMM operands in their stored
// row-major layout (float32 in place), so no tile is ever transposed:
//   forward, dquery: scores^T = K_blk Q^T, with the row statistics along vectors;
//   dkey/dvalue:     scores = Q_blk K^T; dV += P^T dO and dK += dS^T Q read P
//                    and dS transposed through the GEMM's A strides.
// A positional bias is added to each tile before masking (attention_bias.h),
// so masked positions never see it; dropout multiplies the probabilities of a
// tile by keep / keep_prob after the softmax step. Without either, the tile
// code is the plain path (one branch per tile).
// The rows of the next key block (dkey/dvalue items: query block) are
// prefetched while a block is computed: one head's rows lie a page apart, where
// hardware prefetchers stop. bfloat16 forward scores use the CPU's bf16 dot
// products where it has them (TileOps::bf16_gemm, keys read in place).
// Short query blocks have their own forward (attention_split.cc).
#include "device_kernels/cpu/attention_kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "device_kernels/cpu/attention_bias.h"
#include "device_kernels/cpu/attention_blocks.h"
#include "device_kernels/cpu/attention_masking.h"
#include "device_kernels/cpu/attention_tiles.h"

namespace jax_rope::cpu {
namespace {

using attention::AddBias;
using attention::ApplyKeep;
using attention::Band;
using attention::KeepTile;
using attention::ScoreScale;
using attention::LoadPairsTransposed;
using attention::LoadTransposed;
using attention::MaskedGemm;
using attention::MaskTile;
using attention::Offset;
using attention::Operand;
using attention::Prefetch;
using attention::StoreRows;
using attention::View;
using attention::Visible;
using attention::WorkItems;
using attention::Workspace;

// Query rows per forward item and key rows per key-block item. The tile
// routines need multiples of kTileAlign.
constexpr int64_t kBlockQ = 64;
constexpr int64_t kBlockK = 64;
constexpr int64_t kBlockMax = std::max(kBlockQ, kBlockK);
using attention::kNegInf;

// Saved statistics of rows [r0, r0 + nr) as exp shift, 1 / sum and row delta;
// rows without a visible key (or unusable statistics) get p = 0. Zero padded
// to RoundUpToTile(nr).
template <typename T>
void LoadStats(const AttentionGeometry& g, const Band& band, const AttentionBackwardArgs<T>& a,
               const float* row_delta, int64_t b, int64_t n, int64_t r0, int64_t nr,
               Workspace& ws) {
  for (int64_t i = 0; i < RoundUpToTile(nr); ++i) {
    ws.max[i] = ws.sum[i] = ws.delta[i] = 0.0f;
    if (i >= nr) continue;
    const int64_t idx = Offset(g.stats, b, band.q_start + r0 + i, n);
    const float mx = a.softmax_max[idx];
    const float sm = a.softmax_sum[idx];
    if (mx > kMaskValue && std::isfinite(mx) && sm > 0.0f && std::isfinite(sm)) {
      ws.max[i] = mx;
      ws.sum[i] = 1.0f / sm;
      ws.delta[i] = row_delta[idx];
    }
  }
}

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

// Forward items: each runs up to kForwardLanes (query head, query block) lanes
// of one kv head's group over one key loop, so that each K/V block is read
// once for all of them (chunked prefill with G = 4: 1.5x). The lanes are heads
// of the group (a divisor of its size) over ForwardShape::blocks consecutive
// query blocks; per lane the steps are those of a lane alone, in the same
// order, so the lanes per item never change the bits.
constexpr int64_t kForwardLanes = 4;

struct ForwardShape {
  int64_t heads = 1;   // query heads per item
  int64_t blocks = 1;  // query blocks per item
};

ForwardShape ForwardShapeOf(const AttentionGeometry& g) {
  ForwardShape f;
  if (!attention::ValidGeometry(g)) return f;
  const int64_t group = g.q_heads / g.kv_heads;
  for (int64_t h = 1; h <= kForwardLanes; ++h) {
    if (group % h == 0) f.heads = h;
  }
  // Consecutive query blocks of one head (G = 1) measured no faster: K/V reads
  // are not what limits the causal forward. One block per item.
  f.blocks = 1;
  return f;
}

// Per-lane state beyond the workspace: query block (transposed), output
// accumulator and row statistics.
struct ForwardLanes {
  std::vector<float> q, o, max, sum;
  int64_t q_size = 0, o_size = 0;
  ForwardLanes(const AttentionGeometry& g, const Workspace& ws)
      : q_size(RoundUpToTile(g.head_dim) * kBlockQ), o_size(kBlockQ * ws.dvp) {
    q.assign(kForwardLanes * q_size, 0.0f);
    o.assign(kForwardLanes * o_size, 0.0f);
    max.assign(kForwardLanes * kBlockQ, 0.0f);
    sum.assign(kForwardLanes * kBlockQ, 0.0f);
  }
};

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
  struct Lane {
    int64_t n, r0, nr;
    attention::BlockSpan keys;
  };
  Lane lanes[kForwardLanes];
  int64_t count = 0;
  int64_t first = 0, last = 0;  // the union of the lanes' key blocks
  for (int64_t blk = 0; blk < shape.blocks; ++blk) {
    const int64_t r0 = (it.block * shape.blocks + blk) * kBlockQ;
    if (r0 >= band.q_len) break;
    const int64_t nr = std::min(kBlockQ, band.q_len - r0);
    const attention::BlockSpan keys = band.KeyBlocks(r0, nr, kBlockK);
    for (int64_t h = 0; h < shape.heads; ++h) {
      const int64_t j = count++;
      lanes[j] = {n0 + h, r0, nr, keys};
      const T* query = a.query + Offset(g.q, b, band.q_start + r0, n0 + h);
      float* qt = fl.q.data() + j * fl.q_size;
      if (bf16) {
        LoadPairsTransposed(query, g.q.seq, nr, d, reinterpret_cast<uint32_t*>(qt), kBlockQ);
      } else {
        LoadTransposed(query, g.q.seq, nr, d, qt, kBlockQ);
      }
      std::fill(fl.o.data() + j * fl.o_size, fl.o.data() + j * fl.o_size + nr * ws.dvp, 0.0f);
      const int64_t nrp = RoundUpToTile(nr);
      std::fill(fl.max.data() + j * kBlockQ, fl.max.data() + j * kBlockQ + nrp, kNegInf);
      std::fill(fl.sum.data() + j * kBlockQ, fl.sum.data() + j * kBlockQ + nrp, 0.0f);
    }
    if (keys.start < keys.end) {
      first = first < last ? std::min(first, keys.start) : keys.start;
      last = std::max(last, keys.end);
    }
  }
  for (int64_t c0 = first; c0 < last; c0 += kBlockK) {
    const int64_t nc = std::min(kBlockK, band.kv_len - c0);
    PrefetchKeyBlock(g, band, a.key, a.value, b, kvh, c0 + kBlockK, last);
    const T* key = a.key + Offset(g.k, b, band.kv_start + c0, kvh);
    const Operand v = View(a.value + Offset(g.v, b, band.kv_start + c0, kvh), g.v.seq, nc, dv,
                           true, ws.n2, ws.dvp);
    const Operand k = bf16 ? Operand{nullptr, 0} : View(key, g.k.seq, nc, d, false, ws.n1, ws.dp);
    for (int64_t j = 0; j < count; ++j) {
      const Lane& l = lanes[j];
      if (c0 < l.keys.start || c0 >= l.keys.end) continue;
      const int64_t n = l.n, r0 = l.r0, nr = l.nr;
      const float* qt = fl.q.data() + j * fl.q_size;
      float* o = fl.o.data() + j * fl.o_size;
      // Transposed scores (keys x queries): the statistics run along vectors.
      if (bf16) {
        ops.bf16_gemm(nc, nr, d / 2, reinterpret_cast<const uint16_t*>(key), g.k.seq,
                      reinterpret_cast<const uint32_t*>(qt), kBlockQ, ws.s, kBlockQ);
      } else {
        ops.gemm(nc, nr, d, k.data, k.ld, 1, qt, kBlockQ, ws.s, kBlockQ, false);
      }
      AddBias<T>(g, band, b, n, r0, nr, c0, nc, ws.s, kBlockQ, true);
      MaskTile(band, g, b, n, r0, nr, c0, nc, ws.s, kBlockQ, true);
      ops.softmax_step(ws.s, kBlockQ, nc, RoundUpToTile(nr), scale, fl.max.data() + j * kBlockQ,
                       fl.sum.data() + j * kBlockQ, o, ws.dvp, nr, ws.dvp);
      if (dropout) {  // the statistics above stay those of the undropped softmax
        KeepTile(g, band, b, n, r0, nr, c0, nc, ws.keep, kBlockQ, true);
        ApplyKeep(band, r0, nr, c0, nc, ws.s, ws.keep, kBlockQ, true);
      }
      const bool full = band.Covers(r0, nr, c0, nc) && g.mask.data == nullptr;
      MaskedGemm(ops, nr, dv, nc, ws.s, 1, kBlockQ, v.data, v.ld, o, ws.dvp, full,
                 [&](int64_t i, int64_t p) { return Visible(band, g.mask, b, n, r0 + i, c0 + p); },
                 ws.finite);
    }
  }
  for (int64_t j = 0; j < count; ++j) {
    const Lane& l = lanes[j];
    const float* o = fl.o.data() + j * fl.o_size;
    const float* mx = fl.max.data() + j * kBlockQ;
    const float* sm = fl.sum.data() + j * kBlockQ;
    for (int64_t i = 0; i < l.nr; ++i) {
      const int64_t row = band.q_start + l.r0 + i;
      const int64_t idx = Offset(g.stats, b, row, l.n);
      T* out = a.out + Offset(g.out, b, row, l.n);
      // A row whose visible scores are all NaN (a NaN key row it sees) keeps max
      // -inf but has a NaN sum: NaN output, not a dead row's zeros.
      const bool dead = mx[i] == kNegInf && sm[i] == 0.0f;
      StoreRows(o + i * ws.dvp, ws.dvp, 1, dv, dead ? 0.0f : 1.0f / sm[i], out, 0);
      a.softmax_max[idx] = mx[i] == kNegInf ? kMaskValue : mx[i];
      a.softmax_sum[idx] = dead ? kDeadRowSum : sm[i];
    }
  }
}

// K and V rows [k_off, v_off) of one key block, transposed into ws.t1 / ws.t2
// (as bf16 pairs when the products use the bf16 dot instruction).
template <typename T>
void LoadKeyBlock(const AttentionGeometry& g, const AttentionBackwardArgs<T>& a, int64_t k_off,
                  int64_t v_off, int64_t nc, bool bf16, Workspace& ws) {
  const int64_t d = g.head_dim, dv = g.value_dim;
  if (bf16) {
    LoadPairsTransposed(a.key + k_off, g.k.seq, nc, d, reinterpret_cast<uint32_t*>(ws.t1),
                        kBlockK);
    LoadPairsTransposed(a.value + v_off, g.v.seq, nc, dv, reinterpret_cast<uint32_t*>(ws.t2),
                        kBlockK);
  } else {
    LoadTransposed(a.key + k_off, g.k.seq, nc, d, ws.t1, kBlockK);
    LoadTransposed(a.value + v_off, g.v.seq, nc, dv, ws.t2, kBlockK);
  }
}

// One (query head n, query block r0) tile of a key block [c0, c0 + nc) in the
// backward: recomputes P and dS (bias, masks, dropout as in the forward) into
// ws.s / ws.dprob and adds P^T dO to dval and dS^T Q to dk (unscaled). K and V
// of the block are in ws.t1 / ws.t2 (pairs for the bf16 products). Returns
// whether the tile is fully visible (for a dS K product the caller adds).
template <typename T>
bool KeyBlockTile(const AttentionGeometry& g, const Band& band, const AttentionBackwardArgs<T>& a,
                  const float* row_delta, int64_t b, int64_t n, int64_t r0, int64_t q_end,
                  int64_t c0, int64_t nc, const TileOps& ops, Workspace& ws, bool bf16,
                  float* dk, float* dval) {
  const int64_t nr = std::min(kBlockQ, band.q_len - r0), row = band.q_start + r0;
  const int64_t ncp = RoundUpToTile(nc), d = g.head_dim, dv = g.value_dim;
  const float scale = ScoreScale(g);
  const bool dropout = g.dropout.mode != DropoutMode::kNone;
  const uint32_t* k_pairs = reinterpret_cast<const uint32_t*>(ws.t1);
  const uint32_t* v_pairs = reinterpret_cast<const uint32_t*>(ws.t2);
  if (r0 + kBlockQ < q_end) {  // the next query block's rows
    const int64_t next = std::min(kBlockQ, band.q_len - r0 - kBlockQ);
    Prefetch(a.query + Offset(g.q, b, row + kBlockQ, n), g.q.seq, next, d);
    Prefetch(a.dout + Offset(g.out, b, row + kBlockQ, n), g.out.seq, next, dv);
  }
  const Operand q = View(a.query + Offset(g.q, b, row, n), g.q.seq, nr, d, true, ws.n1, ws.dp);
  const Operand dout =
      View(a.dout + Offset(g.out, b, row, n), g.out.seq, nr, dv, true, ws.n2, ws.dvp);
  LoadStats(g, band, a, row_delta, b, n, r0, nr, ws);
  if (bf16) {
    ops.bf16_gemm(nr, nc, d / 2,
                  reinterpret_cast<const uint16_t*>(a.query + Offset(g.q, b, row, n)),
                  g.q.seq, k_pairs, kBlockK, ws.s, kBlockK);
    ops.bf16_gemm(nr, nc, dv / 2,
                  reinterpret_cast<const uint16_t*>(a.dout + Offset(g.out, b, row, n)),
                  g.out.seq, v_pairs, kBlockK, ws.dprob, kBlockK);
  } else {
    ops.gemm(nr, nc, d, q.data, q.ld, 1, ws.t1, kBlockK, ws.s, kBlockK, false);
    ops.gemm(nr, nc, dv, dout.data, dout.ld, 1, ws.t2, kBlockK, ws.dprob, kBlockK, false);
  }
  AddBias<T>(g, band, b, n, r0, nr, c0, nc, ws.s, kBlockK, false);
  MaskTile(band, g, b, n, r0, nr, c0, nc, ws.s, kBlockK, false);
  if (dropout) {  // dP = dZ * R before the softmax gradient, Z = P * R for dV after it
    KeepTile(g, band, b, n, r0, nr, c0, nc, ws.keep, kBlockK, false);
    ApplyKeep(band, r0, nr, c0, nc, ws.dprob, ws.keep, kBlockK, false);
  }
  ops.softmax_grad(ws.s, ws.dprob, kBlockK, nr, ncp, scale, ws.max, ws.sum, ws.delta, false);
  if (dropout) ApplyKeep(band, r0, nr, c0, nc, ws.s, ws.keep, kBlockK, false);
  const bool full = band.Covers(r0, nr, c0, nc) && g.mask.data == nullptr;
  const auto visible = [&](int64_t j, int64_t i) {
    return Visible(band, g.mask, b, n, r0 + i, c0 + j);
  };
  MaskedGemm(ops, nc, dv, nr, ws.s, 1, kBlockK, dout.data, dout.ld, dval, ws.dvp, full,
             visible, ws.finite);
  MaskedGemm(ops, nc, d, nr, ws.dprob, 1, kBlockK, q.data, q.ld, dk, ws.dp, full, visible,
             ws.finite);
  return full;
}

template <typename T>
void KeyValueItem(const AttentionGeometry& g, const SequenceBand* seqs,
                  const AttentionBackwardArgs<T>& a, const float* row_delta,
                  const WorkItems::Item& it, const TileOps& ops, Workspace& ws) {
  const Band band(seqs[it.seq]);
  const int64_t b = it.seq, h = it.head, group = g.q_heads / g.kv_heads;
  const int64_t c0 = it.block * kBlockK, nc = std::min(kBlockK, band.kv_len - c0);
  const int64_t d = g.head_dim, dv = g.value_dim;
  const int64_t k_off = Offset(g.k, b, band.kv_start + c0, h);
  const int64_t v_off = Offset(g.v, b, band.kv_start + c0, h);
  const bool bf16 = Bf16Products<T>(g, ops);
  LoadKeyBlock(g, a, k_off, v_off, nc, bf16, ws);
  float* dk = ws.acc1;
  float* dval = ws.acc2;
  std::fill(dk, dk + nc * ws.dp, 0.0f);
  std::fill(dval, dval + nc * ws.dvp, 0.0f);
  const attention::BlockSpan queries = band.QueryBlocks(c0, nc, kBlockQ);
  for (int64_t n = h * group; n < (h + 1) * group; ++n) {
    for (int64_t r0 = queries.start; r0 < queries.end; r0 += kBlockQ) {
      KeyBlockTile(g, band, a, row_delta, b, n, r0, queries.end, c0, nc, ops, ws, bf16, dk,
                   dval);
    }
  }
  StoreRows(dk, ws.dp, nc, d, g.scale, a.dkey + k_off, g.k.seq);
  StoreRows(dval, ws.dvp, nc, dv, 1.0f, a.dvalue + v_off, g.v.seq);
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
  std::fill(dq, dq + nr * ws.dp, 0.0f);
  const attention::BlockSpan keys = band.KeyBlocks(r0, nr, kBlockK);
  for (int64_t c0 = keys.start; c0 < keys.end; c0 += kBlockK) {
    const int64_t nc = std::min(kBlockK, band.kv_len - c0);
    PrefetchKeyBlock(g, band, a.key, a.value, b, kvh, c0 + kBlockK, keys.end);
    const T* key = a.key + Offset(g.k, b, band.kv_start + c0, kvh);
    const T* value = a.value + Offset(g.v, b, band.kv_start + c0, kvh);
    const Operand k = View(key, g.k.seq, nc, d, true, ws.n1, ws.dp);  // dQ's B operand
    if (bf16) {
      ops.bf16_gemm(nc, nr, d / 2, reinterpret_cast<const uint16_t*>(key), g.k.seq, q_pairs,
                    kBlockQ, ws.s, kBlockQ);
      ops.bf16_gemm(nc, nr, dv / 2, reinterpret_cast<const uint16_t*>(value), g.v.seq, do_pairs,
                    kBlockQ, ws.dprob, kBlockQ);
    } else {
      const Operand v = View(value, g.v.seq, nc, dv, false, ws.n2, ws.dvp);
      ops.gemm(nc, nr, d, k.data, k.ld, 1, ws.t1, kBlockQ, ws.s, kBlockQ, false);
      ops.gemm(nc, nr, dv, v.data, v.ld, 1, ws.t2, kBlockQ, ws.dprob, kBlockQ, false);
    }
    AddBias<T>(g, band, b, n, r0, nr, c0, nc, ws.s, kBlockQ, true);
    MaskTile(band, g, b, n, r0, nr, c0, nc, ws.s, kBlockQ, true);
    if (g.dropout.mode != DropoutMode::kNone) {
      KeepTile(g, band, b, n, r0, nr, c0, nc, ws.keep, kBlockQ, true);
      ApplyKeep(band, r0, nr, c0, nc, ws.dprob, ws.keep, kBlockQ, true);
    }
    ops.softmax_grad(ws.s, ws.dprob, kBlockQ, nc, nrp, scale, ws.max, ws.sum, ws.delta, true);
    const bool full = band.Covers(r0, nr, c0, nc) && g.mask.data == nullptr;
    MaskedGemm(ops, nr, d, nc, ws.dprob, 1, kBlockQ, k.data, k.ld, dq, ws.dp, full,
               [&](int64_t i, int64_t p) { return Visible(band, g.mask, b, n, r0 + i, c0 + p); },
               ws.finite);
  }
  StoreRows(dq, ws.dp, nr, d, g.scale, a.dquery + q_off, g.q.seq);
}

// dquery, dkey and dvalue of one (sequence, kv head) in one pass: the
// key-block loop of KeyValueItem, with dS K of each tile also added to a
// float32 dquery accumulator of the group's rows (dq, group x q_len rows of
// ws.dp). Key blocks go in ascending order and each tile's products are those
// of QueryItem (same sums in the same order), so dquery has the bits of the
// two-pass path whatever the threads.
template <typename T>
void FusedBackwardItem(const AttentionGeometry& g, const SequenceBand* seqs,
                       const AttentionBackwardArgs<T>& a, const float* row_delta, int64_t b,
                       int64_t h, const TileOps& ops, Workspace& ws, std::vector<float>& dq_acc) {
  const Band band(seqs[b]);
  const int64_t group = g.q_heads / g.kv_heads, d = g.head_dim, dv = g.value_dim;
  const bool bf16 = Bf16Products<T>(g, ops);
  const int64_t ldq = ws.dp;
  dq_acc.assign(group * band.q_len * ldq, 0.0f);
  for (int64_t c0 = 0; c0 < band.kv_len; c0 += kBlockK) {
    const int64_t nc = std::min(kBlockK, band.kv_len - c0);
    const int64_t k_off = Offset(g.k, b, band.kv_start + c0, h);
    const int64_t v_off = Offset(g.v, b, band.kv_start + c0, h);
    LoadKeyBlock(g, a, k_off, v_off, nc, bf16, ws);
    const Operand kb = View(a.key + k_off, g.k.seq, nc, d, true, ws.group_q, ws.dp);  // dQ's B
    float* dk = ws.acc1;
    float* dval = ws.acc2;
    std::fill(dk, dk + nc * ws.dp, 0.0f);
    std::fill(dval, dval + nc * ws.dvp, 0.0f);
    const attention::BlockSpan queries = band.QueryBlocks(c0, nc, kBlockQ);
    for (int64_t n = h * group; n < (h + 1) * group; ++n) {
      float* dq_head = dq_acc.data() + (n - h * group) * band.q_len * ldq;
      for (int64_t r0 = queries.start; r0 < queries.end; r0 += kBlockQ) {
        const bool full = KeyBlockTile(g, band, a, row_delta, b, n, r0, queries.end, c0, nc,
                                       ops, ws, bf16, dk, dval);
        const auto visible = [&](int64_t i, int64_t j) {
          return Visible(band, g.mask, b, n, r0 + i, c0 + j);
        };
        const int64_t nr = std::min(kBlockQ, band.q_len - r0);
        MaskedGemm(ops, nr, d, nc, ws.dprob, kBlockK, 1, kb.data, kb.ld, dq_head + r0 * ldq, ldq,
                   full, visible, ws.finite);
      }
    }
    StoreRows(dk, ws.dp, nc, d, g.scale, a.dkey + k_off, g.k.seq);
    StoreRows(dval, ws.dvp, nc, dv, 1.0f, a.dvalue + v_off, g.v.seq);
  }
  for (int64_t n = h * group; n < (h + 1) * group; ++n) {
    const float* dq_head = dq_acc.data() + (n - h * group) * band.q_len * ldq;
    for (int64_t i = 0; i < band.q_len; ++i) {
      StoreRows(dq_head + i * ldq, ldq, 1, d, g.scale,
                a.dquery + Offset(g.q, b, band.q_start + i, n), 0);
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
  const attention::BlockSpan keys = band.KeyBlocks(r0, nr, kBlockK);
  for (int64_t c0 = keys.start; c0 < keys.end; c0 += kBlockK) {
    const int64_t nc = std::min(kBlockK, band.kv_len - c0);
    const Operand k = View(key + Offset(g.k, b, band.kv_start + c0, kvh), g.k.seq, nc,
                           g.head_dim, false, ws.n1, ws.dp);
    ops.gemm(nc, nr, g.head_dim, k.data, k.ld, 1, ws.t1, kBlockQ, ws.s, kBlockQ, false);
    AddBias<T>(g, band, b, n, r0, nr, c0, nc, ws.s, kBlockQ, true);
    MaskTile(band, g, b, n, r0, nr, c0, nc, ws.s, kBlockQ, true);
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

}  // namespace

int64_t ForwardWorkItems(const AttentionGeometry& g, const SequenceBand* seqs) {
  return WorkItems(g, seqs, false, kBlockQ).size();
}

int64_t AttentionForwardWorkItems(const AttentionGeometry& g, const SequenceBand* seqs) {
  const ForwardShape shape = ForwardShapeOf(g);
  return WorkItems(g, seqs, false, kBlockQ * shape.blocks, shape.heads).size();
}

int64_t KeyBlockWorkItems(const AttentionGeometry& g, const SequenceBand* seqs) {
  return WorkItems(g, seqs, true, kBlockK).size();
}

template <typename T>
void AttentionForward(const AttentionGeometry& g, const SequenceBand* seqs,
                      const AttentionForwardArgs<T>& args, int64_t begin, int64_t end) {
  const ForwardShape shape = ForwardShapeOf(g);
  const WorkItems items(g, seqs, false, kBlockQ * shape.blocks, shape.heads);
  begin = std::max<int64_t>(begin, 0);
  end = std::min(end, items.size());
  if (begin >= end) return;
  const TileOps& ops = GetTileOps();
  Workspace ws(g, kBlockMax);
  ForwardLanes fl(g, ws);
  for (int64_t t = begin; t < end; ++t) ForwardItem(g, seqs, args, items[t], shape, ops, ws, fl);
}

template <typename T>
void AttentionRowDelta(const AttentionGeometry& g, const SequenceBand* seqs,
                       const AttentionBackwardArgs<T>& a, float* row_delta, int64_t begin,
                       int64_t end) {
  ForEachItem(g, seqs, false, begin, end, [&](const WorkItems::Item& it, const TileOps&,
                                              Workspace&) {
    const Band band(seqs[it.seq]);
    const int64_t r0 = it.block * kBlockQ, nr = std::min(kBlockQ, band.q_len - r0);
    for (int64_t row = band.q_start + r0; row < band.q_start + r0 + nr; ++row) {
      const int64_t off = Offset(g.out, it.seq, row, it.head);
      float sum = 0.0f;
      for (int64_t c = 0; c < g.value_dim; ++c) {
        sum += ToFloat(a.dout[off + c]) * ToFloat(a.out[off + c]);
      }
      row_delta[Offset(g.stats, it.seq, row, it.head)] = sum;
    }
  });
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

int64_t FusedBackwardWorkItems(const AttentionGeometry& g) {
  return attention::ValidGeometry(g) ? g.batch * g.kv_heads : 0;
}

template <typename T>
void AttentionBackwardFused(const AttentionGeometry& g, const SequenceBand* seqs,
                            const AttentionBackwardArgs<T>& args, const float* row_delta,
                            int64_t begin, int64_t end) {
  begin = std::max<int64_t>(begin, 0);
  end = std::min(end, FusedBackwardWorkItems(g));
  if (begin >= end) return;
  const TileOps& ops = GetTileOps();
  Workspace ws(g, kBlockMax);
  std::vector<float> dq_acc;
  for (int64_t t = begin; t < end; ++t) {
    FusedBackwardItem(g, seqs, args, row_delta, t / g.kv_heads, t % g.kv_heads, ops, ws, dq_acc);
  }
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
  template void AttentionRowDelta<T>(const AttentionGeometry&, const SequenceBand*,          \
                                     const AttentionBackwardArgs<T>&, float*, int64_t,       \
                                     int64_t);                                               \
  template void AttentionBackwardKeyValue<T>(const AttentionGeometry&, const SequenceBand*,  \
                                             const AttentionBackwardArgs<T>&, const float*,  \
                                             int64_t, int64_t);                              \
  template void AttentionBackwardQuery<T>(const AttentionGeometry&, const SequenceBand*,     \
                                          const AttentionBackwardArgs<T>&, const float*,     \
                                          int64_t, int64_t);                                 \
  template void AttentionBackwardFused<T>(const AttentionGeometry&, const SequenceBand*,     \
                                          const AttentionBackwardArgs<T>&, const float*,     \
                                          int64_t, int64_t);                                 \
  template void AttentionScores<T>(const AttentionGeometry&, const SequenceBand*, const T*,  \
                                   const T*, float*, const int64_t[3], int64_t, int64_t);
JAX_ROPE_INSTANTIATE(float)
JAX_ROPE_INSTANTIATE(BFloat16)
JAX_ROPE_INSTANTIATE(Float16)
#undef JAX_ROPE_INSTANTIATE

}  // namespace jax_rope::cpu
