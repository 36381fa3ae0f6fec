// The one-pass attention backward over (sequence, kv head) items: the two-pass
// backward's key-block loop (attention_backward.cc) with dquery added inside it,
// the same products in the same order (same bits). Orientation and tile
// conventions as in attention_kernels.cc.
#include <algorithm>
#include <optional>
#include <vector>

#include "device_kernels/cpu/attention_backward_tile.h"
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
// up to this size, on every instruction set (the B operands of the dK and dV
// products); larger groups read them per tile as the two-pass backward does.
// Once per item: the causal B1 S2048 N8 D128 backward 151-154 -> 140-141 ms on
// two AVX2 cores (the per-tile copies read each query block again for every
// key block that sees it). AVX-512 reads B blocks in place elsewhere
// (TileOps::copy_b_blocks), but here, in the BSND layout (one head's rows 4 KiB
// apart, all in the same few L1 sets), the copies once per item, with the key
// block copied for dQ as well, took that backward from 114-120 to 106-112 ms on
// two Zen 4 cores (BNSD, rows 512 bytes apart: 104-108 either way).
constexpr int64_t kMaxPackedRowsBytes = int64_t{16} << 20;

// Key blocks per step: a step loads this many consecutive key blocks and
// visits each (query head, query block) tile of them in turn, so that the
// query block's rows (query, dout, and the dquery accumulator, which stream
// from L3 once a head group's rows outgrow L2) serve them all while cached.
// Each accumulator still takes its sums in the same order (dquery over key
// blocks ascending, dkey and dvalue over the group's tiles as before), so the
// bits do not change. Against one key block per step, jitted float32
// forward+backward on two Zen 4 cores, best of three interleaved runs: GQA B1
// S1024 N32/8 D128 361 -> 312 ms, B16 S512 N16 D256 causal 760 -> 736, causal
// B1 S2048 N8 D128 164 -> 162, B16 S512 N16 D64 the same (196); eight blocks
// a step: GQA 327 ms.
constexpr int64_t kKeyBlocksPerStep = 4;

// Floats of one key block's buffers in a step: KeyBlockBuffers, then the key
// rows dquery's product reads (kBlockK rows of ws.ldp floats).
int64_t StepBlockFloats(const AttentionGeometry& g, const Workspace& ws) {
  return RoundUpToTile(g.head_dim * kBlockK) + RoundUpToTile(g.value_dim * kBlockK) +
         kBlockK * ws.ldp + kBlockK * ws.ldvp + kBlockK * ws.ldp;
}

// dquery, dkey and dvalue of one (sequence, kv head) in one pass: the row
// deltas of the group's rows (AttentionRowDelta's), then the key-block loop of
// KeyValueItem, kKeyBlocksPerStep blocks a step (in `steps`, StepBlockFloats
// each), with dS K of each tile also added to a float32 dquery accumulator of
// the group's rows (dq, group x q_len rows of ws.ldp). Each query block takes
// the key blocks in ascending order and each tile's products are those of
// QueryItem (same sums in the same order), so dquery has the bits of the
// two-pass path whatever the threads.
template <typename T>
void FusedBackwardItem(const AttentionGeometry& g, const SequenceBand* seqs,
                       const AttentionBackwardArgs<T>& a, float* row_delta, int64_t b,
                       int64_t h, const TileOps& ops, Workspace& ws, float* dq_acc,
                       float* pack, std::vector<PackedRows>& packed, float* steps) {
  const Band band(seqs[b]);
  const int64_t group = g.q_heads / g.kv_heads, d = g.head_dim, dv = g.value_dim;
  const bool bf16 = Bf16Products<T>(g, ops);
  const int64_t ldq = ws.ldp;
  for (int64_t n = h * group; n < (h + 1) * group; ++n) {  // the group's row deltas
    for (int64_t row = band.q_start; row < band.q_start + band.q_len; ++row) {
      const int64_t off = Offset(g.out, b, row, n);
      row_delta[Offset(g.stats, b, row, n)] = RowDot(a.dout + off, a.out + off, dv);
    }
  }
  std::fill(dq_acc, dq_acc + group * band.q_len * ldq, 0.0f);
  bool packed_rows = pack != nullptr;
  if (pack != nullptr && bf16) {  // row pairs for the bf16 dot products, if all finite
    const int64_t half = (band.q_len + 1) / 2;
    for (int64_t j = 0; j < group && packed_rows; ++j) {
      const int64_t n = h * group + j;
      uint32_t* q_pairs = reinterpret_cast<uint32_t*>(pack) + j * half * (ws.ldp + ws.ldvp);
      uint32_t* dout_pairs = q_pairs + half * ws.ldp;
      packed_rows = LoadRowPairs(a.query + Offset(g.q, b, band.q_start, n), g.q.seq, band.q_len,
                                 d, q_pairs, ws.ldp) &&
                    LoadRowPairs(a.dout + Offset(g.out, b, band.q_start, n), g.out.seq,
                                 band.q_len, dv, dout_pairs, ws.ldvp);
      packed[j] = {Operand{nullptr, 0}, Operand{nullptr, 0}, q_pairs, dout_pairs};
    }
  } else if (pack != nullptr) {
    for (int64_t j = 0; j < group; ++j) {
      const int64_t n = h * group + j, rows = band.q_len;
      float* q_rows = pack + j * rows * (ws.ldp + ws.ldvp);
      float* dout_rows = q_rows + rows * ws.ldp;
      packed[j] = {CopiedOperand(ops, a.query + Offset(g.q, b, band.q_start, n), g.q.seq, rows,
                                 d, q_rows, ws.ldp, RowsAhead{}),
                   CopiedOperand(ops, a.dout + Offset(g.out, b, band.q_start, n), g.out.seq,
                                 rows, dv, dout_rows, ws.ldvp, RowsAhead{})};
    }
  }
  // One step's key blocks: each block's buffers, its key rows for dquery's
  // product (row pairs for the bf16 dot products where the keys are finite,
  // else float32 rows) and the query blocks that see it.
  struct StepBlock {
    std::optional<KeyBlock<T>> block;
    uint32_t* key_pairs;
    Operand keys;
    bool pairs;
    BlockSpan queries;
  };
  StepBlock step[kKeyBlocksPerStep];
  // dquery's product of a tile (query head n, rows [r0, r0 + nr) of dq) once
  // KeyBlockTile has left its dS in ws.dprob: dS rounded to bfloat16 rows of
  // key pairs (ws.keep, free now) against the block's key pairs, else dS (as
  // float32, or rounded in place for bfloat16) against its key rows.
  const auto add_query_tile = [&](const StepBlock& sb, int64_t n, int64_t r0, int64_t nr,
                                  int64_t c0, bool full, float* dq) {
    const int64_t nc = sb.block->nc;
    if (sb.pairs) {
      uint16_t* ds_rows = reinterpret_cast<uint16_t*>(ws.keep);
      ops.narrow_bf16(ws.dprob, kBlockK, nr, nc, ds_rows, kBlockK);
      ForEachVisibleStrip(band, r0, nr, c0, nc, false, false, [&](int64_t i0, int64_t ni,
                                                                   int64_t j0, int64_t nj) {
        const PairSpan p = PairsOf(j0, nj, nc);
        ops.bf16_pairs_gemm(ni, d, p.count,
                            reinterpret_cast<const uint32_t*>(ds_rows + i0 * kBlockK) + p.first,
                            kBlockK / 2, 1, sb.key_pairs + p.first * ws.ldp, ws.ldp,
                            dq + i0 * ldq, ldq, true);
      });
      return;
    }
    if constexpr (std::is_same_v<T, BFloat16>) ops.round_bf16(ws.dprob, kBlockK, nr, nc);
    ForEachVisibleStrip(band, r0, nr, c0, nc, false, false, [&](int64_t i0, int64_t ni,
                                                                 int64_t j0, int64_t nj) {
      const auto visible = [&](int64_t i, int64_t j) {
        return Visible(band, g.mask, b, n, r0 + i0 + i, c0 + j0 + j);
      };
      MaskedGemm(ops, ni, d, nj, ws.dprob + i0 * kBlockK + j0, kBlockK, 1, sb.keys.Rows(j0),
                 dq + i0 * ldq, ldq, full, visible, ws.finite);
    });
  };
  const int64_t step_floats = StepBlockFloats(g, ws);
  for (int64_t s0 = 0; s0 < band.kv_len; s0 += kKeyBlocksPerStep * kBlockK) {
    int64_t blocks = 0;
    BlockSpan seen_queries;  // the union of their query blocks
    for (int64_t c0 = s0; c0 < band.kv_len && blocks < kKeyBlocksPerStep; c0 += kBlockK) {
      StepBlock& sb = step[blocks];
      float* keys_t = steps + blocks++ * step_floats;
      float* values_t = keys_t + RoundUpToTile(d * kBlockK);
      float* dkey = values_t + RoundUpToTile(dv * kBlockK);
      float* dvalue = dkey + kBlockK * ws.ldp;
      float* key_rows = dvalue + kBlockK * ws.ldvp;
      sb.block.emplace(g, band, a, b, h, c0, bf16, ws,
                       KeyBlockBuffers{keys_t, values_t, dkey, dvalue});
      const int64_t nc = sb.block->nc;
      sb.key_pairs = reinterpret_cast<uint32_t*>(key_rows);
      sb.pairs = bf16 && ops.bf16_pairs_gemm != nullptr &&
                 LoadRowPairs(a.key + sb.block->k_off, g.k.seq, nc, d, sb.key_pairs, ws.ldp);
      sb.keys = sb.pairs ? Operand{nullptr, 0}
                         : CopiedOperand(ops, a.key + sb.block->k_off, g.k.seq, nc, d, key_rows,
                                         ws.ldp, RowsAhead{});
      sb.queries = band.QueryBlocks(c0, nc, kBlockQ);
      seen_queries = Join(seen_queries, sb.queries);
    }
    for (int64_t n = h * group; n < (h + 1) * group; ++n) {
      float* dq_head = dq_acc + (n - h * group) * band.q_len * ldq;
      for (int64_t r0 = seen_queries.start; r0 < seen_queries.end; r0 += kBlockQ) {
        for (int64_t j = 0; j < blocks; ++j) {
          const StepBlock& sb = step[j];
          if (r0 < sb.queries.start || r0 >= sb.queries.end) continue;
          const int64_t c0 = s0 + j * kBlockK, nc = sb.block->nc;
          const int64_t nr = std::min(kBlockQ, band.q_len - r0);
          const TileMask tile_mask = ElementMaskOf(g.mask, b, n, r0, nr, c0, nc);
          if (tile_mask == TileMask::kAll) continue;
          const bool full = KeyBlockTile(g, band, a, row_delta, b, n, r0, sb.queries.end, c0,
                                         nc, ops, ws, bf16,
                                         packed_rows ? &packed[n - h * group] : nullptr,
                                         tile_mask == TileMask::kSome, sb.block->buffers);
          add_query_tile(sb, n, r0, nr, c0, full, dq_head + r0 * ldq);
        }
      }
    }
    for (int64_t j = 0; j < blocks; ++j) step[j].block->Store(g, a, ws);
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
  const ThreadScratch dq_acc(ScratchRole::kAccumulator, group * longest * ws.ldp);
  // bfloat16: row pairs (half the rows) where the bf16 dot products run them;
  // otherwise the rows read per tile as bfloat16.
  const bool pairs = Bf16Products<T>(g, ops) && ops.bf16_pairs_gemm != nullptr;
  const int64_t pack_rows_per_head = pairs ? (longest + 1) / 2 : longest;
  const int64_t pack_floats = group * pack_rows_per_head * (ws.ldp + ws.ldvp);
  const bool pack = (pairs || !Bf16Products<T>(g, ops)) &&
                    pack_floats * int64_t{sizeof(float)} <= kMaxPackedRowsBytes;
  const ThreadScratch pack_rows(ScratchRole::kPackedRows, pack ? pack_floats : 0);
  std::vector<PackedRows> packed(group);
  const ThreadScratch steps(ScratchRole::kKeyBlocks, kKeyBlocksPerStep * StepBlockFloats(g, ws));
  for (int64_t t = begin; t < end; ++t) {
    FusedBackwardItem(g, seqs, args, row_delta, t / g.kv_heads, t % g.kv_heads, ops, ws,
                      dq_acc.data(), pack ? pack_rows.data() : nullptr, packed, steps.data());
  }
}

#define JAX_ROPE_INSTANTIATE(T)                                                               \
  template void AttentionBackwardFused<T>(const AttentionGeometry&, const SequenceBand*,     \
                                          const AttentionBackwardArgs<T>&, float*, int64_t,  \
                                          int64_t);
JAX_ROPE_FOR_EACH_ELEMENT_TYPE(JAX_ROPE_INSTANTIATE)
#undef JAX_ROPE_INSTANTIATE

}  // namespace jax_rope::cpu
