// What both attention backwards run (attention_backward.cc: two passes;
// attention_backward_fused.cc: one): row dot products, saved statistics, a key
// block's transposed K and V, and the key-block tile that recomputes P and dS
// and adds dV and dK. Internal.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "device_kernels/cpu/attention_bias.h"
#include "device_kernels/cpu/attention_blocks.h"
#include "device_kernels/cpu/attention_items.h"
#include "device_kernels/cpu/attention_kernels.h"
#include "device_kernels/cpu/attention_masking.h"
#include "device_kernels/cpu/attention_staging.h"
#include "device_kernels/cpu/attention_tiles.h"

namespace jax_rope::cpu::attention {

static_assert(kBlockMax <= kMaxTile, "MaskTile copies a tile's mask block of kMaxTile^2 bytes");

// sum_c a[c] * b[c] in float32, as kLanes partial sums (element c into sum c %
// kLanes) added in a fixed order at the end: independent chains the compiler
// vectorizes, where one running sum waits on each add in turn (D = 256: a
// thousand cycles a row, 8% of a small training step's kernel time). float32
// rows go to TileOps::row_dot, the same sums at the CPU's widest vectors.
template <typename T>
float RowDot(const T* a, const T* b, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return GetTileOps().row_dot(a, b, n);
  } else {
    constexpr int64_t kLanes = 8;
    float part[kLanes] = {};
    int64_t c = 0;
    for (; c + kLanes <= n; c += kLanes) {
      for (int64_t j = 0; j < kLanes; ++j) part[j] += ToFloat(a[c + j]) * ToFloat(b[c + j]);
    }
    for (; c < n; ++c) part[c % kLanes] += ToFloat(a[c]) * ToFloat(b[c]);
    static_assert(kLanes == 8, "the fixed-order sum below adds eight partial sums");
    return ((part[0] + part[4]) + (part[1] + part[5])) +
           ((part[2] + part[6]) + (part[3] + part[7]));
  }
}

// Saved statistics of rows [r0, r0 + nr) as exp shift, 1 / sum and row delta;
// rows without a visible key (or unusable statistics) get p = 0, rows whose sum
// is NaN (a NaN or Inf reached their scores: NaN output) NaN at every visible
// position (softmax_grad keeps masked ones 0), so that their gradient reaches
// every key they see. Zero padded to RoundUpToTile(nr).
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
    if (std::isnan(sm)) {
      ws.sum[i] = sm;
    } else if (mx > kMaskValue && std::isfinite(mx) && sm > 0.0f && std::isfinite(sm)) {
      ws.max[i] = mx;
      ws.sum[i] = 1.0f / sm;
      ws.delta[i] = row_delta[idx];
    }
  }
}

// Where a key block of the backward lives: its K and V rows transposed
// (head_dim x kBlockK and value_dim x kBlockK floats, as bf16 pairs when the
// products use the bf16 dot instruction) and its dK and dV accumulators
// (kBlockK rows of Workspace::ldp and ldvp floats). Of(ws): the workspace's
// (t1, t2, acc1, acc2).
struct KeyBlockBuffers {
  float *keys_t, *values_t, *dkey, *dvalue;
  static KeyBlockBuffers Of(const Workspace& ws) { return {ws.t1, ws.t2, ws.acc1, ws.acc2}; }
};

// Key block [c0, c0 + nc) of kv head h of sequence b in the backward, in
// `buffers`: K and V transposed, the dK and dV accumulators zeroed; Store
// writes the accumulators out.
template <typename T>
struct KeyBlock {
  int64_t k_off, v_off, nc;
  KeyBlockBuffers buffers;

  KeyBlock(const AttentionGeometry& g, const Band& band, const AttentionBackwardArgs<T>& a,
           int64_t b, int64_t h, int64_t c0, bool bf16, const Workspace& ws,
           const KeyBlockBuffers& into)
      : k_off(Offset(g.k, b, band.kv_start + c0, h)),
        v_off(Offset(g.v, b, band.kv_start + c0, h)),
        nc(std::min(kBlockK, band.kv_len - c0)),
        buffers(into) {
    const int64_t d = g.head_dim, dv = g.value_dim;
    if (bf16) {
      LoadPairsTransposed(a.key + k_off, g.k.seq, nc, d,
                          reinterpret_cast<uint32_t*>(buffers.keys_t), kBlockK);
      LoadPairsTransposed(a.value + v_off, g.v.seq, nc, dv,
                          reinterpret_cast<uint32_t*>(buffers.values_t), kBlockK);
    } else {
      LoadTransposed(a.key + k_off, g.k.seq, nc, d, buffers.keys_t, kBlockK);
      LoadTransposed(a.value + v_off, g.v.seq, nc, dv, buffers.values_t, kBlockK);
    }
    std::fill(buffers.dkey, buffers.dkey + nc * ws.ldp, 0.0f);
    std::fill(buffers.dvalue, buffers.dvalue + nc * ws.ldvp, 0.0f);
  }
  void Store(const AttentionGeometry& g, const AttentionBackwardArgs<T>& a,
             const Workspace& ws) const {
    StoreRows(buffers.dkey, ws.ldp, nc, g.head_dim, g.scale, a.dkey + k_off, g.k.seq);
    StoreRows(buffers.dvalue, ws.ldvp, nc, g.value_dim, 1.0f, a.dvalue + v_off, g.v.seq);
  }
};

// The query and dout rows of a head as B operands copied once for all the key
// blocks that read them (the fused backward): float32 rows q_len x dp and
// q_len x dvp, or for the bf16 dot products (pairs) finite row pairs
// (LoadRowPairs), row strides dp and dvp.
struct PackedRows {
  Operand query, dout;
  const uint32_t* query_pairs = nullptr;
  const uint32_t* dout_pairs = nullptr;
};

// One (query head n, query block r0) tile of a key block [c0, c0 + nc) in the
// backward: recomputes P and dS (bias, masks, dropout as in the forward) into
// ws.s / ws.dprob and adds P^T dO and dS^T Q (unscaled) to the block's dV and
// dK accumulators, its K and V read transposed from `block`; the head's query
// and dout rows in `packed` when given, else copied here. elements:
// whether the element mask applies to the tile (TileMask::kSome; the caller
// skips kAll tiles). Returns whether the tile is fully visible (for a dS K
// product the caller adds; bfloat16: dS in ws.dprob is not rounded yet).
template <typename T>
bool KeyBlockTile(const AttentionGeometry& g, const Band& band, const AttentionBackwardArgs<T>& a,
                  const float* row_delta, int64_t b, int64_t n, int64_t r0, int64_t q_end,
                  int64_t c0, int64_t nc, const TileOps& ops, Workspace& ws, bool bf16,
                  const PackedRows* packed, bool elements, const KeyBlockBuffers& block) {
  const int64_t nr = std::min(kBlockQ, band.q_len - r0), row = band.q_start + r0;
  const int64_t ncp = RoundUpToTile(nc), d = g.head_dim, dv = g.value_dim;
  const float scale = ScoreScale(g);
  const bool dropout = g.dropout.mode != DropoutMode::kNone;
  const uint32_t* k_pairs = reinterpret_cast<const uint32_t*>(block.keys_t);
  const uint32_t* v_pairs = reinterpret_cast<const uint32_t*>(block.values_t);
  float* const dk = block.dkey;
  float* const dval = block.dvalue;
  // The next query block's rows, asked for ahead.
  const int64_t next = r0 + kBlockQ < q_end ? std::min(kBlockQ, band.q_len - r0 - kBlockQ) : 0;
  const T* query = a.query + Offset(g.q, b, row, n);
  const T* dout_rows = a.dout + Offset(g.out, b, row, n);
  RowsAhead next_query, next_dout;
  if (next > 0 && packed == nullptr) {
    next_query.streams[0] = RowsAhead::Of(query + kBlockQ * g.q.seq, g.q.seq, d);
    next_dout.streams[0] = RowsAhead::Of(dout_rows + kBlockQ * g.out.seq, g.out.seq, dv);
    next_query.rows = next_dout.rows = next;
  }
  // bfloat16: P and dS go into the dV and dK products rounded to bfloat16 (as
  // the NPU's kernel rounds them for its matrix unit), on the bf16 dot products
  // when the query and dout rows are finite (as row pairs in ws.n1 / ws.n2).
  const uint32_t* q_pairs = reinterpret_cast<uint32_t*>(ws.n1);
  const uint32_t* dout_pairs = reinterpret_cast<uint32_t*>(ws.n2);
  bool pairs = packed != nullptr && packed->query_pairs != nullptr;
  if (pairs) {
    q_pairs = packed->query_pairs + r0 / 2 * ws.ldp;
    dout_pairs = packed->dout_pairs + r0 / 2 * ws.ldvp;
  } else if (bf16 && ops.bf16_pairs_gemm != nullptr && packed == nullptr) {
    next_query.FetchAll();
    next_dout.FetchAll();
    pairs = LoadRowPairs(query, g.q.seq, nr, d, reinterpret_cast<uint32_t*>(ws.n1), ws.ldp) &&
            LoadRowPairs(dout_rows, g.out.seq, nr, dv, reinterpret_cast<uint32_t*>(ws.n2),
                         ws.ldvp);
  }
  const Operand q = pairs ? Operand{nullptr, 0}
                    : packed != nullptr
                        ? packed->query.Rows(r0)
                        : BOperand(ops, query, g.q.seq, nr, d, ws.n1, ws.ldp, next_query);
  const Operand dout = pairs ? Operand{nullptr, 0}
                       : packed != nullptr
                           ? packed->dout.Rows(r0)
                           : BOperand(ops, dout_rows, g.out.seq, nr, dv, ws.n2, ws.ldvp, next_dout);
  LoadStats(g, band, a, row_delta, b, n, r0, nr, ws);
  if (bf16) {
    ops.bf16_gemm(nr, nc, d / 2,
                  reinterpret_cast<const uint16_t*>(a.query + Offset(g.q, b, row, n)),
                  g.q.seq, k_pairs, kBlockK, ws.s, kBlockK);
    ops.bf16_gemm(nr, nc, dv / 2,
                  reinterpret_cast<const uint16_t*>(a.dout + Offset(g.out, b, row, n)),
                  g.out.seq, v_pairs, kBlockK, ws.dprob, kBlockK);
  } else {
    ForEachVisibleStrip(band, r0, nr, c0, nc, false, true, [&](int64_t i, int64_t ni, int64_t j,
                                                               int64_t nj) {
      ops.gemm(ni, nj, d, q.data + i * q.ld, q.ld, 1, block.keys_t + j, kBlockK,
               ws.s + i * kBlockK + j, kBlockK, false);
      ops.gemm(ni, nj, dv, dout.data + i * dout.ld, dout.ld, 1, block.values_t + j, kBlockK,
               ws.dprob + i * kBlockK + j, kBlockK, false);
    });
  }
  AddBias<T>(g, band, b, n, r0, nr, c0, nc, ws.s, kBlockK, false);
  MaskTile(band, g, b, n, r0, nr, c0, nc, ws.s, kBlockK, false, true, elements);
  if (dropout) {  // dP = dZ * R before the softmax gradient, Z = P * R for dV after it
    KeepTile(g, band, b, n, r0, nr, c0, nc, ws.keep, kBlockK, false);
    ApplyKeep(band, r0, nr, c0, nc, ws.dprob, ws.keep, kBlockK, false);
  }
  ops.softmax_grad(ws.s, ws.dprob, kBlockK, nr, ncp, scale, ws.max, ws.sum, ws.delta, false);
  if (dropout) ApplyKeep(band, r0, nr, c0, nc, ws.s, ws.keep, kBlockK, false);
  const bool full = band.Covers(r0, nr, c0, nc) && !elements;
  if (pairs) {  // query pairs of P and dS (ws.keep, free now)
    uint32_t* p_pairs = reinterpret_cast<uint32_t*>(ws.keep);
    uint32_t* ds_pairs = p_pairs + kBlockQ / 2 * kBlockK;
    ops.pack_bf16_pairs(ws.s, kBlockK, nr, nc, p_pairs, kBlockK);
    ops.pack_bf16_pairs(ws.dprob, kBlockK, nr, nc, ds_pairs, kBlockK);
    ForEachVisibleStrip(band, r0, nr, c0, nc, true, false, [&](int64_t j0, int64_t nj,
                                                                int64_t i0, int64_t ni) {
      const PairSpan p = PairsOf(i0, ni, nr);
      ops.bf16_pairs_gemm(nj, dv, p.count, p_pairs + p.first * kBlockK + j0, 1, kBlockK,
                          dout_pairs + p.first * ws.ldvp, ws.ldvp, dval + j0 * ws.ldvp, ws.ldvp,
                          true);
      ops.bf16_pairs_gemm(nj, d, p.count, ds_pairs + p.first * kBlockK + j0, 1, kBlockK,
                          q_pairs + p.first * ws.ldp, ws.ldp, dk + j0 * ws.ldp, ws.ldp, true);
    });
    return full;
  }
  if constexpr (std::is_same_v<T, BFloat16>) {
    ops.round_bf16(ws.s, kBlockK, nr, nc);
    ops.round_bf16(ws.dprob, kBlockK, nr, nc);
  }
  ForEachVisibleStrip(band, r0, nr, c0, nc, true, false, [&](int64_t j0, int64_t nj,
                                                              int64_t i0, int64_t ni) {
    const auto visible = [&](int64_t j, int64_t i) {
      return Visible(band, g.mask, b, n, r0 + i0 + i, c0 + j0 + j);
    };
    MaskedGemm(ops, nj, dv, ni, ws.s + j0 + i0 * kBlockK, 1, kBlockK, dout.Rows(i0),
               dval + j0 * ws.ldvp, ws.ldvp, full, visible, ws.finite);
    MaskedGemm(ops, nj, d, ni, ws.dprob + j0 + i0 * kBlockK, 1, kBlockK, q.Rows(i0),
               dk + j0 * ws.ldp, ws.ldp, full, visible, ws.finite);
  });
  return full;
}

}  // namespace jax_rope::cpu::attention
