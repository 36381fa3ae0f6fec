// The attention backward over work items (spec/attention.md, bias and dropout
// per spec/attention_bias_dropout.md section 4): row deltas, then either the
// two passes (dkey/dvalue over key-block items, dquery over query items) or the
// one pass over (sequence, kv head) items that adds dquery inside the key-block
// loop with the same products in the same order (same bits). Orientation and
// tile conventions as in attention_kernels.cc.
#include <algorithm>
#include <cmath>
#include <vector>

#include "device_kernels/cpu/attention_bias.h"
#include "device_kernels/cpu/attention_blocks.h"
#include "device_kernels/cpu/attention_items.h"
#include "device_kernels/cpu/attention_kernels.h"
#include "device_kernels/cpu/attention_masking.h"
#include "device_kernels/cpu/attention_staging.h"
#include "device_kernels/cpu/attention_tiles.h"
#include "device_kernels/cpu/thread_scratch.h"

namespace jax_rope::cpu {
namespace {

using namespace attention;

// The fused backward copies a head group's query and dout rows once per item
// (where the instruction set copies B operands) up to this size; larger groups
// copy them per tile as the two-pass backward does. Once per item: the causal
// B1 S2048 N8 D128 backward 151-154 -> 140-141 ms on two AVX2 cores (the per-tile
// copies read each query block again for every key block that sees it).
constexpr int64_t kMaxPackedRowsBytes = int64_t{16} << 20;

// sum_c a[c] * b[c] in float32, as kLanes partial sums (element c into sum c %
// kLanes) added in a fixed order at the end: independent chains the compiler
// vectorizes, where one running sum waits on each add in turn (D = 256: a
// thousand cycles a row, 8% of a small training step's kernel time).
template <typename T>
float RowDot(const T* a, const T* b, int64_t n) {
  constexpr int64_t kLanes = 8;
  float part[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) part[j] += ToFloat(a[c + j]) * ToFloat(b[c + j]);
  }
  for (; c < n; ++c) part[c % kLanes] += ToFloat(a[c]) * ToFloat(b[c]);
  static_assert(kLanes == 8, "the fixed-order sum below adds eight partial sums");
  return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
}

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

// The query and dout rows of a head as B operands copied once for all the key
// blocks that read them (the fused backward, where the instruction set copies
// B blocks): rows q_len x dp and q_len x dvp.
struct PackedRows {
  Operand query, dout;
};

// One (query head n, query block r0) tile of a key block [c0, c0 + nc) in the
// backward: recomputes P and dS (bias, masks, dropout as in the forward) into
// ws.s / ws.dprob and adds P^T dO to dval and dS^T Q to dk (unscaled). K and V
// of the block are in ws.t1 / ws.t2 (pairs for the bf16 products); the head's
// query and dout rows in `packed` when given, else copied here. Returns
// whether the tile is fully visible (for a dS K product the caller adds).
template <typename T>
bool KeyBlockTile(const AttentionGeometry& g, const Band& band, const AttentionBackwardArgs<T>& a,
                  const float* row_delta, int64_t b, int64_t n, int64_t r0, int64_t q_end,
                  int64_t c0, int64_t nc, const TileOps& ops, Workspace& ws, bool bf16,
                  const PackedRows* packed, float* dk, float* dval) {
  const int64_t nr = std::min(kBlockQ, band.q_len - r0), row = band.q_start + r0;
  const int64_t ncp = RoundUpToTile(nc), d = g.head_dim, dv = g.value_dim;
  const float scale = ScoreScale(g);
  const bool dropout = g.dropout.mode != DropoutMode::kNone;
  const uint32_t* k_pairs = reinterpret_cast<const uint32_t*>(ws.t1);
  const uint32_t* v_pairs = reinterpret_cast<const uint32_t*>(ws.t2);
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
  const Operand q = packed != nullptr
                        ? packed->query.Rows(r0)
                        : BOperand(ops, query, g.q.seq, nr, d, ws.n1, ws.dp, next_query);
  const Operand dout = packed != nullptr
                           ? packed->dout.Rows(r0)
                           : BOperand(ops, dout_rows, g.out.seq, nr, dv, ws.n2, ws.dvp, next_dout);
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
      ops.gemm(ni, nj, d, q.data + i * q.ld, q.ld, 1, ws.t1 + j, kBlockK,
               ws.s + i * kBlockK + j, kBlockK, false);
      ops.gemm(ni, nj, dv, dout.data + i * dout.ld, dout.ld, 1, ws.t2 + j, kBlockK,
               ws.dprob + i * kBlockK + j, kBlockK, false);
    });
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
  ForEachVisibleStrip(band, r0, nr, c0, nc, true, false, [&](int64_t j0, int64_t nj,
                                                              int64_t i0, int64_t ni) {
    const auto visible = [&](int64_t j, int64_t i) {
      return Visible(band, g.mask, b, n, r0 + i0 + i, c0 + j0 + j);
    };
    MaskedGemm(ops, nj, dv, ni, ws.s + j0 + i0 * kBlockK, 1, kBlockK, dout.Rows(i0),
               dval + j0 * ws.dvp, ws.dvp, full, visible, ws.finite);
    MaskedGemm(ops, nj, d, ni, ws.dprob + j0 + i0 * kBlockK, 1, kBlockK, q.Rows(i0),
               dk + j0 * ws.dp, ws.dp, full, visible, ws.finite);
  });
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
  const BlockSpan queries = band.QueryBlocks(c0, nc, kBlockQ);
  for (int64_t n = h * group; n < (h + 1) * group; ++n) {
    for (int64_t r0 = queries.start; r0 < queries.end; r0 += kBlockQ) {
      KeyBlockTile(g, band, a, row_delta, b, n, r0, queries.end, c0, nc, ops, ws, bf16, nullptr,
                   dk, dval);
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
  const BlockSpan keys = band.KeyBlocks(r0, nr, kBlockK);
  for (int64_t c0 = keys.start; c0 < keys.end; c0 += kBlockK) {
    const int64_t nc = std::min(kBlockK, band.kv_len - c0);
    const T* key = a.key + Offset(g.k, b, band.kv_start + c0, kvh);
    const T* value = a.value + Offset(g.v, b, band.kv_start + c0, kvh);
    const Operand k = BOperand(ops, key, g.k.seq, nc, d, ws.n1, ws.dp,  // dQ's B
                               KeyBlockAhead(g, band, a.key, a.value, b, kvh, c0 + kBlockK,
                                             keys.end));
    if (bf16) {
      ops.bf16_gemm(nc, nr, d / 2, reinterpret_cast<const uint16_t*>(key), g.k.seq, q_pairs,
                    kBlockQ, ws.s, kBlockQ);
      ops.bf16_gemm(nc, nr, dv / 2, reinterpret_cast<const uint16_t*>(value), g.v.seq, do_pairs,
                    kBlockQ, ws.dprob, kBlockQ);
    } else {
      const Operand v = View(value, g.v.seq, nc, dv, false, ws.n2, ws.dvp);
      ForEachVisibleStrip(band, r0, nr, c0, nc, true, true, [&](int64_t j, int64_t nj,
                                                                int64_t i, int64_t ni) {
        ops.gemm(nj, ni, d, k.data + j * k.ld, k.ld, 1, ws.t1 + i, kBlockQ,
                 ws.s + j * kBlockQ + i, kBlockQ, false);
        ops.gemm(nj, ni, dv, v.data + j * v.ld, v.ld, 1, ws.t2 + i, kBlockQ,
                 ws.dprob + j * kBlockQ + i, kBlockQ, false);
      });
    }
    AddBias<T>(g, band, b, n, r0, nr, c0, nc, ws.s, kBlockQ, true);
    MaskTile(band, g, b, n, r0, nr, c0, nc, ws.s, kBlockQ, true);
    if (g.dropout.mode != DropoutMode::kNone) {
      KeepTile(g, band, b, n, r0, nr, c0, nc, ws.keep, kBlockQ, true);
      ApplyKeep(band, r0, nr, c0, nc, ws.dprob, ws.keep, kBlockQ, true);
    }
    ops.softmax_grad(ws.s, ws.dprob, kBlockQ, nc, nrp, scale, ws.max, ws.sum, ws.delta, true);
    TransposedTileProduct(ops, band, g, b, n, r0, nr, c0, nc, ws.dprob, kBlockQ, k, d, dq,
                          ws.dp, ws.finite);
  }
  StoreRows(dq, ws.dp, nr, d, g.scale, a.dquery + q_off, g.q.seq);
}

// dquery, dkey and dvalue of one (sequence, kv head) in one pass: the row
// deltas of the group's rows (AttentionRowDelta's), then the key-block loop of
// KeyValueItem, with dS K of each tile also added to a float32 dquery
// accumulator of the group's rows (dq, group x q_len rows of ws.dp). Key blocks
// go in ascending order and each tile's products are those of QueryItem (same
// sums in the same order), so dquery has the bits of the two-pass path
// whatever the threads.
template <typename T>
void FusedBackwardItem(const AttentionGeometry& g, const SequenceBand* seqs,
                       const AttentionBackwardArgs<T>& a, float* row_delta, int64_t b,
                       int64_t h, const TileOps& ops, Workspace& ws, float* dq_acc,
                       float* pack, std::vector<PackedRows>& packed) {
  const Band band(seqs[b]);
  const int64_t group = g.q_heads / g.kv_heads, d = g.head_dim, dv = g.value_dim;
  const bool bf16 = Bf16Products<T>(g, ops);
  const int64_t ldq = ws.dp;
  for (int64_t n = h * group; n < (h + 1) * group; ++n) {  // the group's row deltas
    for (int64_t row = band.q_start; row < band.q_start + band.q_len; ++row) {
      const int64_t off = Offset(g.out, b, row, n);
      row_delta[Offset(g.stats, b, row, n)] = RowDot(a.dout + off, a.out + off, dv);
    }
  }
  std::fill(dq_acc, dq_acc + group * band.q_len * ldq, 0.0f);
  if (pack != nullptr) {
    for (int64_t j = 0; j < group; ++j) {
      const int64_t n = h * group + j, rows = band.q_len;
      float* q_rows = pack + j * rows * (ws.dp + ws.dvp);
      float* dout_rows = q_rows + rows * ws.dp;
      packed[j] = {BOperand(ops, a.query + Offset(g.q, b, band.q_start, n), g.q.seq, rows, d,
                            q_rows, ws.dp, RowsAhead{}),
                   BOperand(ops, a.dout + Offset(g.out, b, band.q_start, n), g.out.seq, rows, dv,
                            dout_rows, ws.dvp, RowsAhead{})};
    }
  }
  for (int64_t c0 = 0; c0 < band.kv_len; c0 += kBlockK) {
    const int64_t nc = std::min(kBlockK, band.kv_len - c0);
    const int64_t k_off = Offset(g.k, b, band.kv_start + c0, h);
    const int64_t v_off = Offset(g.v, b, band.kv_start + c0, h);
    LoadKeyBlock(g, a, k_off, v_off, nc, bf16, ws);
    const Operand kb =
        BOperand(ops, a.key + k_off, g.k.seq, nc, d, ws.key_rows, ws.dp, RowsAhead{});  // dQ's B
    float* dk = ws.acc1;
    float* dval = ws.acc2;
    std::fill(dk, dk + nc * ws.dp, 0.0f);
    std::fill(dval, dval + nc * ws.dvp, 0.0f);
    const BlockSpan queries = band.QueryBlocks(c0, nc, kBlockQ);
    for (int64_t n = h * group; n < (h + 1) * group; ++n) {
      float* dq_head = dq_acc + (n - h * group) * band.q_len * ldq;
      for (int64_t r0 = queries.start; r0 < queries.end; r0 += kBlockQ) {
        const bool full =
            KeyBlockTile(g, band, a, row_delta, b, n, r0, queries.end, c0, nc, ops, ws, bf16,
                         pack != nullptr ? &packed[n - h * group] : nullptr, dk, dval);
        const int64_t nr = std::min(kBlockQ, band.q_len - r0);
        ForEachVisibleStrip(band, r0, nr, c0, nc, false, false, [&](int64_t i0, int64_t ni,
                                                                     int64_t j0, int64_t nj) {
          const auto visible = [&](int64_t i, int64_t j) {
            return Visible(band, g.mask, b, n, r0 + i0 + i, c0 + j0 + j);
          };
          MaskedGemm(ops, ni, d, nj, ws.dprob + i0 * kBlockK + j0, kBlockK, 1,
                     kb.Rows(j0), dq_head + (r0 + i0) * ldq, ldq, full, visible,
                     ws.finite);
        });
      }
    }
    StoreRows(dk, ws.dp, nc, d, g.scale, a.dkey + k_off, g.k.seq);
    StoreRows(dval, ws.dvp, nc, dv, 1.0f, a.dvalue + v_off, g.v.seq);
  }
  for (int64_t n = h * group; n < (h + 1) * group; ++n) {
    const float* dq_head = dq_acc + (n - h * group) * band.q_len * ldq;
    for (int64_t i = 0; i < band.q_len; ++i) {
      StoreRows(dq_head + i * ldq, ldq, 1, d, g.scale,
                a.dquery + Offset(g.q, b, band.q_start + i, n), 0);
    }
  }
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

int64_t FusedBackwardWorkItems(const AttentionGeometry& g) {
  return ValidGeometry(g) ? g.batch * g.kv_heads : 0;
}

template <typename T>
void AttentionBackwardFused(const AttentionGeometry& g, const SequenceBand* seqs,
                            const AttentionBackwardArgs<T>& args, float* row_delta,
                            int64_t begin, int64_t end) {
  begin = std::max<int64_t>(begin, 0);
  end = std::min(end, FusedBackwardWorkItems(g));
  if (begin >= end) return;
  const TileOps& ops = GetTileOps();
  Workspace ws(g, kBlockMax);
  int64_t longest = 0;
  for (int64_t t = begin; t < end; ++t) {
    longest = std::max(longest, Band(seqs[t / g.kv_heads]).q_len);
  }
  const int64_t group = g.q_heads / g.kv_heads;
  const ThreadScratch dq_acc(ScratchRole::kAccumulator, group * longest * ws.dp);
  const int64_t pack_floats = group * longest * (ws.dp + ws.dvp);
  const bool pack = ops.copy_b_blocks && !Bf16Products<T>(g, ops) &&
                    pack_floats * int64_t{sizeof(float)} <= kMaxPackedRowsBytes;
  const ThreadScratch pack_rows(ScratchRole::kPackedRows, pack ? pack_floats : 0);
  std::vector<PackedRows> packed(group);
  for (int64_t t = begin; t < end; ++t) {
    FusedBackwardItem(g, seqs, args, row_delta, t / g.kv_heads, t % g.kv_heads, ops, ws,
                      dq_acc.data(), pack ? pack_rows.data() : nullptr, packed);
  }
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
                                          int64_t, int64_t);                                 \
  template void AttentionBackwardFused<T>(const AttentionGeometry&, const SequenceBand*,     \
                                          const AttentionBackwardArgs<T>&, float*, int64_t,  \
                                          int64_t);
JAX_ROPE_INSTANTIATE(float)
JAX_ROPE_INSTANTIATE(BFloat16)
JAX_ROPE_INSTANTIATE(Float16)
#undef JAX_ROPE_INSTANTIATE

}  // namespace jax_rope::cpu
