// Flash-decoding forward for short query blocks, pass 1 (attention_kernels.h:
// PlanSplitForward; the plan and the merge are in attention_split_merge.cc).
// The G = N1 / N2 query heads of a kv head share one tile whose columns are
// (head, row) pairs, head-major, so each K/V block is read
// (and converted) once per group; bias, mask and dropout run per head on that
// head's columns. Short groups (at most kTileAlign rows) take the dot-product
// score routine, longer ones the GEMM over the transposed rows (for bfloat16
// both on the CPU's bf16 dot products over K in place, where it has them).
// Decode reads every K/V byte once and is bound by memory: the tile products
// read K and V in place, in the order they lie in memory, which the hardware
// prefetchers follow; the dot scores ask for their own V rows and the products
// then for the next key block's K, so that memory is busy in both phases (where
// V is not asked for, the dot scores ask for K rows a few steps ahead instead,
// NextKeyRows).
// Where a key row's kv heads are adjacent (BSND, TND) a thread runs the items
// of up to kRunHeads neighbouring kv heads of one chunk together, kSubRows rows
// of each head in turn; walking one head's rows a page apart, they do not
// (AVX2 Zen 3, B8 Skv8192 N1=32 N2=8 decode, two cores: 40 -> 30 ms; one core
// 60 -> 42 ms; with a copy of each block in memory order 38 ms).
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#if __has_include(<unistd.h>)
#include <unistd.h>  // sysconf: the L2 size
#endif

#include "device_kernels/cpu/attention_bias.h"
#include "device_kernels/cpu/attention_blocks.h"
#include "device_kernels/cpu/attention_items.h"
#include "device_kernels/cpu/attention_kernels.h"
#include "device_kernels/cpu/attention_masking.h"
#include "device_kernels/cpu/attention_split_items.h"
#include "device_kernels/cpu/attention_staging.h"
#include "device_kernels/cpu/attention_tiles.h"

namespace jax_rope::cpu {
namespace {

using namespace attention;
using namespace split_forward;

static_assert(kBlock <= kMaxTile, "MaskTile copies a tile's mask block of kMaxTile^2 bytes");

// Rows of one head per step in memory order (decode: 8 and 16 as fast; with 8
// the GEMM scores of 32-row groups, Sq 8 x G 4, were 15% slower on one core).
constexpr int64_t kSubRows = 16;
static_assert(kBlock % kSubRows == 0, "a key block holds whole steps");
// Key rows of a step's P V per product call where the values are read in place
// and the products ask for the next key block's K (SplitRun, ask_next_keys).
constexpr int64_t kAskRows = 4;
// Largest V block of a run that the dot scores ask for ahead of its products:
// a quarter of a core's L2, so that it waits there for them beside the next
// block's K, which the products then ask for (ask_next_keys). One BNSD head is
// 32 KiB at D = 128, a BSND run of 8 kv heads 128 KiB in bfloat16 and 256 KiB in
// float32. B8 Sq1 Skv8192 N1=32 N2=8 D128 decode on two Zen 4 cores (1 MiB of
// L2), C harness, interleaved medians: with the 64 KiB of before, the bfloat16
// run's V came from memory as its products reached it; asked for, 15.8-16.3 ->
// 12.6-14.7 ms (two runs). Float32's 256 KiB asked for gained nothing while the
// products asked for nothing (20.1-21.1 ms either way), but with them asking
// for the next K 19.3-20.2 -> 18.5-19.0 ms (four runs; one thread 32.9 -> 29.1),
// Sq 2 28.9 -> 26.4 ms. Where sysconf does not say, 512 KiB of L2 is assumed.
int64_t AskValuesBytes() {
  static const int64_t bytes = [] {
    long l2 = 0;
#if defined(_SC_LEVEL2_CACHE_SIZE)
    l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return (l2 > 0 ? int64_t{l2} : int64_t{512} << 10) / 4;
  }();
  return bytes;
}

// Query rows of the group in q, zero padded to RoundUpToTile(m) rows: as
// float32 row-major, row stride dp (dot scores), or transposed, row stride
// kBlock (GEMM scores); with `pairs` (bfloat16 scores on the CPU's bf16 dot
// products) as bfloat16 pairs: row-major, row stride dp (LoadPairs), for
// TileOps::bf16_dot_scores, or transposed, d / 2 rows of kBlock
// (LoadPairsTransposed), for TileOps::bf16_gemm. q holds dp x kBlock floats.
template <typename T>
void PackGroupQuery(const AttentionGeometry& g, const Band& band, const T* query, int64_t b,
                    int64_t kvh, int64_t group, bool dot, bool pairs, int64_t dp, float* q) {
  const int64_t nr = band.q_len, m = group * nr, mp = RoundUpToTile(m), d = g.head_dim;
  uint32_t* qp = reinterpret_cast<uint32_t*>(q);
  for (int64_t h = 0; h < group; ++h) {
    const T* rows = query + Offset(g.q, b, band.q_start, kvh * group + h);
    if (pairs && dot) {
      LoadPairs(rows, g.q.seq, nr, d, qp + h * nr * dp, dp);
    } else if (pairs) {
      LoadPairsTransposed(rows, g.q.seq, nr, d, qp + h * nr, kBlock, false);
    } else if (dot) {
      LoadBlock(rows, g.q.seq, nr, d, q + h * nr * dp, dp);
    } else {
      TransposeRows(rows, g.q.seq, nr, d, q + h * nr, kBlock);
    }
  }
  if (dot) {  // zero rows (float32 zeros and zero pairs are the same bits)
    std::fill(q + m * dp, q + mp * dp, 0.0f);
  } else if (pairs) {
    for (int64_t p = 0; p < d / 2; ++p) std::fill(qp + p * kBlock + m, qp + p * kBlock + mp, 0u);
  } else {
    for (int64_t p = 0; p < d; ++p) std::fill(q + p * kBlock + m, q + p * kBlock + mp, 0.0f);
  }
}

// Calls fn(t, j0, nj) for the rows [j0, j0 + nj) of key block rows [0, rows)
// and run items t in [t0, t1) (neighbouring kv heads) in the order their rows
// lie in memory (strides st): kSubRows rows of each head in turn where a row's
// heads are adjacent (BSND, TND), all rows of one head after the other where
// each head's rows are adjacent (BNSD).
template <typename Fn>
void InMemoryOrder(const Strides& st, int64_t rows, int64_t t0, int64_t t1, const Fn& fn) {
  if (RowHeadsAdjacent(st)) {
    for (int64_t j0 = 0; j0 < rows; j0 += kSubRows) {
      for (int64_t t = t0; t < t1; ++t) fn(t, j0, std::min(kSubRows, rows - j0));
    }
  } else {
    for (int64_t t = t0; t < t1; ++t) fn(t, 0, rows);
  }
}

// The K rows of the step kKeyStepsAhead after (t, j0) of a run where a key
// row's heads are adjacent (InMemoryOrder: the next heads' rows j0.., then the
// first head's next rows, on into the next key block), for the dot scores to ask
// for as they read theirs; nothing where that step has fewer than nj rows or
// there is none. The dot scores take one key row at a time, and without this
// each row waited on memory in turn: float32, B2 Skv4096 N1=32 N2=8 D128 on two
// Zen 4 cores, Sq 4 (16 rows) 6.7-7.1 -> 5.5 ms, Sq 2 4.1-4.3 -> 3.8 ms, the B8
// Skv8192 decode 25.5-25.8 -> 24.4-25.3 ms; with the AVX2 routines 3-12% faster.
// Three steps ahead (12 KiB of float32 rows at D = 128) rather than the next:
// the B8 Skv8192 decode 21.1 -> 19.0 ms in float32, 14.7 -> 12.8 ms in bfloat16
// (C harness, interleaved medians); two steps did as well in bfloat16, five no
// better.
constexpr int64_t kKeyStepsAhead = 3;

template <typename T>
RowsAhead::Stream NextKeyRows(const AttentionGeometry& g, const Band& band, const T* key,
                              int64_t b, const SplitItems& items, int64_t t, int64_t t0,
                              int64_t t1, int64_t c0, int64_t j0, int64_t nj, int64_t last) {
  // Steps of a run go kSubRows rows of each head in turn, and its blocks are
  // whole multiples of kSubRows rows but the last, whose rows past it are past
  // kv_len: step s after (t0, c0) reads rows c0 + s / heads * kSubRows.. of head
  // t0 + s % heads.
  const int64_t heads = t1 - t0;
  const int64_t step = j0 / kSubRows * heads + (t - t0) + kKeyStepsAhead;
  const int64_t row = c0 + step / heads * kSubRows;
  if (row >= last || std::min(kSubRows, band.kv_len - row) < nj) return {};
  return RowsAhead::Of(key + Offset(g.k, b, band.kv_start + row, items[t0 + step % heads].head),
                       g.k.seq, g.head_dim);
}

// Rows [row0, row0 + rows) of kv heads [h0, h0 + heads) of `src` (strides st)
// as float32 rows (LoadBlock), head h's at dst + (h - h0) * head_size, row
// stride ld, converted in the order they lie in memory (row by row across the
// heads where a row's heads are adjacent).
template <typename T>
void LoadRunBlocks(const T* src, const Strides& st, int64_t b, int64_t row0, int64_t rows,
                   int64_t h0, int64_t heads, int64_t cols, float* dst, int64_t ld,
                   int64_t head_size) {
  if (RowHeadsAdjacent(st)) {
    for (int64_t r = 0; r < rows; ++r) {
      LoadBlock(src + Offset(st, b, row0 + r, h0), st.head, heads, cols, dst + r * ld, head_size);
    }
  } else {
    for (int64_t h = 0; h < heads; ++h) {
      LoadBlock(src + Offset(st, b, row0, h0 + h), st.seq, rows, cols, dst + h * head_size, ld);
    }
  }
}

// Items [t0, t1) of one run (RunEnd): the same sequence and chunk, neighbouring
// kv heads; each head's steps are those of the head alone, in the same order.
// Per key block, the scores of every head of the run (K rows in memory order,
// InMemoryOrder), their softmax steps, then their P V (V rows so). queries:
// kRunHeads x dp x kBlock floats; tiles: kRunHeads x kBlock x kBlock (a score
// tile per head); loaded: kRunHeads x kBlock x max(dp, dvp).
template <typename T>
void SplitRun(const AttentionGeometry& g, const SequenceBand* seqs,
              const AttentionForwardArgs<T>& a, const SplitItems& items, int64_t t0, int64_t t1,
              float* scratch, const TileOps& ops, Workspace& ws, float* queries, float* tiles,
              float* loaded) {
  const SplitItems::Item run = items[t0];
  const Band band(seqs[run.seq]);
  const int64_t b = run.seq, group = items.group(), nr = band.q_len;
  const int64_t m = group * nr, mp = RoundUpToTile(m), d = g.head_dim, dv = g.value_dim;
  if (m == 0) return;
  const float scale = ScoreScale(g);
  const bool dropout = g.dropout.mode != DropoutMode::kNone;
  const bool dot = m <= kTileAlign;
  const int64_t rp = items.padded_rows(), q_size = ws.dp * kBlock, tile_size = kBlock * kBlock;
  // Dot scores by query rows (keys along vectors: the softmax runs on whole
  // vectors however few the rows), GEMM scores transposed (queries along them).
  const int64_t key_step = dot ? 1 : kBlock, head_step = dot ? nr * kBlock : nr;
  // Dot scores ask for the V rows of their step, when the run's V block is small
  // enough to wait in L2 for its products (AskValuesBytes).
  const bool ask_values =
      dot && (t1 - t0) * kBlock * dv * int64_t(sizeof(T)) <= AskValuesBytes();
  // Float32 rows the products can read are read in place; others are converted
  // (LoadBlock) block by block for all the run's heads, in memory order too.
  // Dot scores read K rows up to RoundUpToTile(d), as a B operand would.
  // bfloat16 scores take the CPU's bf16 dot products where it has them
  // (TileOps::bf16_dot_scores, bf16_gemm), K read in place and the queries
  // packed in pairs, rather than K converted first. Jitted, N1=32 N2=8 D128
  // bottom-right causal on two Zen 4 cores, old and new builds alternated
  // three times: dot scores, B8 Skv8192 decode 22.3-23.4 -> 16.5-18.5 ms, B2
  // Skv4096 Sq 2 and 4 3.9-4.1 -> 2.2-2.5 and 5.7-6.5 -> 4.2-4.5 ms; GEMM
  // scores, B2 Skv4096 Sq 6, 8 and 16 8.2-8.6 -> 6.5-7.0, 9.0-9.4 -> 7.1-7.5
  // and 14.0-16.4 -> 10.8-11.2 ms. The GEMM for the dot scores' groups was
  // slower (B8 decode 34 ms).
  const bool pairs = std::is_same_v<T, BFloat16> && d % 2 == 0 &&
                     (dot ? ops.bf16_dot_scores != nullptr : ops.bf16_gemm != nullptr);
  const bool keys_in_place = InPlace<T>(d, dot) || pairs;
  // With its V rows asked for by the scores, the memory would idle while a
  // block's products run; where K is read in place and a row's heads are
  // adjacent, each product step asks for its rows of the next key block's K
  // (C harness, interleaved medians: the bfloat16 B8 Skv8192 N2=8 decode
  // 12.8 -> 11.2 ms; float32 N2=4, 128 KiB of V a run, 22.2-22.7 -> 20.5-20.8).
  // Those rows are then in L2 before the dot scores reach them, which ask for no
  // K rows ahead of their own (NextKeyRows) in that case: asking again cost
  // time (bfloat16 11.2-12.1 -> 11.2 ms, float32 18.9 -> 18.1, N2=1 7.0 -> 6.5).
  const bool ask_next_keys = ask_values && keys_in_place && RowHeadsAdjacent(g.k);
  const bool values_in_place = InPlace<T>(dv, true);
  const int64_t loaded_size = kBlock * std::max(ws.dp, ws.dvp);
  // Per head: its slot (maxima, sums, outputs) and packed query rows.
  for (int64_t t = t0; t < t1; ++t) {
    float* slot = scratch + t * items.slot();
    PackGroupQuery(g, band, a.query, b, items[t].head, group, dot, pairs, ws.dp,
                   queries + (t - t0) * q_size);
    std::fill(slot, slot + mp, kNegInf);
    std::fill(slot + rp, slot + rp + mp, 0.0f);
    std::fill(slot + 2 * rp, slot + 2 * rp + m * ws.dvp, 0.0f);
  }
  const BlockSpan keys = band.KeyBlocks(0, nr, kBlock);
  const int64_t first = std::max(keys.start, run.chunk * kSplitKeys);
  const int64_t last = std::min(keys.end, (run.chunk + 1) * kSplitKeys);
  for (int64_t c0 = first; c0 < last; c0 += kBlock) {
    const int64_t nc = std::min(kBlock, band.kv_len - c0);
    const int64_t ncp = RoundUpToTile(nc);
    // A block the element mask masks for every head of the run adds nothing
    // (ElementMaskOf): skipped, as a padding mask's keys past a sequence's end.
    bool seen = false, clear = true;
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < group; ++h) {
        const TileMask tm = ElementMaskOf(g.mask, b, items[t].head * group + h, 0, nr, c0, nc);
        seen |= tm != TileMask::kAll;
        clear &= tm == TileMask::kClear;
      }
    }
    if (!seen) continue;
    const bool full = band.Covers(0, nr, c0, nc) && clear;
    if (!keys_in_place) {
      LoadRunBlocks(a.key, g.k, b, band.kv_start + c0, nc, run.head, t1 - t0, d, loaded, ws.dp,
                    loaded_size);
    }
    InMemoryOrder(g.k, nc, t0, t1, [&](int64_t t, int64_t j0, int64_t nj) {
      const T* key = a.key + Offset(g.k, b, band.kv_start + c0 + j0, items[t].head);
      const float* q = queries + (t - t0) * q_size;
      float* s = tiles + (t - t0) * tile_size + j0 * key_step;
      if (!dot) {
        if (pairs) {
          ops.bf16_gemm(nj, m, d / 2, reinterpret_cast<const uint16_t*>(key), g.k.seq,
                        reinterpret_cast<const uint32_t*>(q), kBlock, s, kBlock);
        } else {
          const Operand k = keys_in_place
                                ? View(key, g.k.seq, nj, d, false, ws.n1, ws.dp)
                                : Operand{loaded + (t - t0) * loaded_size + j0 * ws.dp, ws.dp};
          ops.gemm(nj, m, d, k.data, k.ld, 1, q, kBlock, s, kBlock, false);
        }
        return;
      }
      RowsAhead ahead;  // asked for row by row as the dot scores read their key rows
      ahead.rows = nj;
      if (ask_values) {
        ahead.streams[0] = RowsAhead::Of(
            a.value + Offset(g.v, b, band.kv_start + c0 + j0, items[t].head), g.v.seq, dv);
      }
      if (keys_in_place && RowHeadsAdjacent(g.k) && !ask_next_keys) {
        ahead.streams[1] = NextKeyRows(g, band, a.key, b, items, t, t0, t1, c0, j0, nj, last);
      }
      if (pairs) {
        ops.bf16_dot_scores(nj, m, d / 2, reinterpret_cast<const uint16_t*>(key), g.k.seq,
                            reinterpret_cast<const uint32_t*>(q), ws.dp, s, 1, kBlock, ahead);
      } else {
        const Operand k = keys_in_place
                              ? View(key, g.k.seq, nj, d, true, ws.n1, ws.dp)
                              : Operand{loaded + (t - t0) * loaded_size + j0 * ws.dp, ws.dp};
        ops.dot_scores(nj, m, d, k.data, k.ld, q, ws.dp, s, 1, kBlock, ahead);
      }
    });
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t kvh = items[t].head;
      float* slot = scratch + t * items.slot();
      float* s = tiles + (t - t0) * tile_size;
      if (dot) {  // -inf padding: the keys of each query row, or the queries of each key row
        for (int64_t r = 0; r < m; ++r) {
          std::fill(s + r * kBlock + nc, s + r * kBlock + ncp, kNegInf);
        }
      } else {
        for (int64_t j = 0; j < nc; ++j) {
          std::fill(s + j * kBlock + m, s + j * kBlock + mp, kNegInf);
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        float* sh = s + h * head_step;
        AddBias<T>(g, band, b, kvh * group + h, 0, nr, c0, nc, sh, kBlock, !dot);
        MaskTile(band, g, b, kvh * group + h, 0, nr, c0, nc, sh, kBlock, !dot, false, !clear);
      }
      if (dot) {
        ops.softmax_rows(s, kBlock, m, ncp, scale, slot, slot + rp, slot + 2 * rp, ws.dvp,
                         ws.dvp);
      } else {
        ops.softmax_step(s, kBlock, nc, mp, scale, nullptr, slot, slot + rp, slot + 2 * rp,
                         ws.dvp, m, ws.dvp);
      }
      for (int64_t h = 0; h < group && dropout; ++h) {  // statistics stay undropped
        float* keep = ws.keep + h * head_step;
        KeepTile(g, band, b, kvh * group + h, 0, nr, c0, nc, keep, kBlock, !dot);
        ApplyKeep(band, 0, nr, c0, nc, s + h * head_step, keep, kBlock, !dot);
      }
      if constexpr (std::is_same_v<T, BFloat16>) {  // P V takes bfloat16 probabilities
        ops.round_bf16(s, kBlock, dot ? m : nc, dot ? nc : m);
      }
    }
    // For the dot scores' short groups, bfloat16 values of a block every row
    // sees all of go into P V in place, widened as the product loads them
    // (TileOps::gemm_bf16_b: the same float32 values, sums and bits), rather
    // than widened for the whole run first; a block with masked positions
    // needs B's copy (MaskedGemm), and longer groups would widen each value
    // once per kMr rows.
    const bool values_widened_in_product =
        std::is_same_v<T, BFloat16> && dot && full && dv % kTileAlign == 0;
    if (!values_in_place && !values_widened_in_product) {
      LoadRunBlocks(a.value, g.v, b, band.kv_start + c0, nc, run.head, t1 - t0, dv, loaded,
                    ws.dvp, loaded_size);
    }
    // The P V of rows [j, j + nj) of one head's step (the rows of one product call).
    const auto products = [&](int64_t t, int64_t j, int64_t nj) {
      const int64_t kvh = items[t].head;
      if (values_widened_in_product) {
        ops.gemm_bf16_b(m, dv, nj, tiles + (t - t0) * tile_size + j, kBlock, 1,
                        reinterpret_cast<const uint16_t*>(
                            a.value + Offset(g.v, b, band.kv_start + c0 + j, kvh)),
                        g.v.seq, scratch + t * items.slot() + 2 * rp, ws.dvp, true);
        return;
      }
      const Operand v =
          values_in_place
              ? View(a.value + Offset(g.v, b, band.kv_start + c0 + j, kvh), g.v.seq, nj, dv,
                     true, ws.n2, ws.dvp)
              : Operand{loaded + (t - t0) * loaded_size + j * ws.dvp, ws.dvp};
      MaskedGemm(ops, m, dv, nj, tiles + (t - t0) * tile_size + j * key_step, dot ? kBlock : 1,
                 dot ? 1 : kBlock, v, scratch + t * items.slot() + 2 * rp, ws.dvp, full,
                 [&](int64_t i, int64_t p) {
                   return Visible(band, g.mask, b, kvh * group + i / nr, i % nr, c0 + j + p);
                 },
                 ws.finite);
    };
    // Where values are read in place, a step's products run kAskRows key rows at a time,
    // each piece after asking for its rows of the next key block's K (ask_next_keys): the
    // requests go out as the products read V rather than 128 lines at once before them.
    // B8 Skv8192 decode on two Zen 5 cores, C harness, old and new builds alternated 18
    // times in both orders: medians 20.2 -> 19.0 and 21.4 -> 20.1 ms; the same bits, as
    // each piece adds its products to the output in key order. Pieces of 2 or 8 rows timed
    // alike; in bfloat16 pieces gained nothing (10.2 ms either way): its step asks first.
    InMemoryOrder(g.v, nc, t0, t1, [&](int64_t t, int64_t j0, int64_t nj) {
      RowsAhead next;  // this step's rows of the next key block's K, not its V
      if (ask_next_keys) {
        next = KeyBlockAhead(g, band, a.key, a.value, b, items[t].head, c0 + kBlock + j0,
                             std::min(last, band.kv_len), nj);
        next.streams[1] = {};
      }
      const int64_t piece = ask_next_keys && values_in_place ? kAskRows : nj;
      for (int64_t p0 = 0; p0 < nj; p0 += piece) {
        const int64_t np = std::min(piece, nj - p0);
        for (int64_t r = p0; r < p0 + np; ++r) next.Fetch(r);
        products(t, j0 + p0, np);
      }
    });
  }
}

}  // namespace

template <typename T>
void AttentionForwardSplit(const AttentionGeometry& g, const SequenceBand* seqs,
                           const AttentionForwardArgs<T>& args, float* scratch, int64_t begin,
                           int64_t end) {
  const SplitItems items(g, seqs);
  begin = std::max<int64_t>(begin, 0);
  end = std::min(end, items.size());
  if (begin >= end) return;
  const TileOps& ops = GetTileOps();
  Workspace ws(g, kBlock);
  ThreadScratch queries(ScratchRole::kLanes, kRunHeads * ws.dp * kBlock);
  ThreadScratch tiles(ScratchRole::kPackedRows, kRunHeads * kBlock * kBlock);
  ThreadScratch loaded(ScratchRole::kAccumulator, kRunHeads * kBlock * std::max(ws.dp, ws.dvp));
  for (int64_t t = begin; t < end;) {
    const int64_t run_end = items.RunEnd(t, end);
    SplitRun(g, seqs, args, items, t, run_end, scratch, ops, ws, queries.data(), tiles.data(),
             loaded.data());
    t = run_end;
  }
}

#define JAX_ROPE_INSTANTIATE(T)                                                               \
  template void AttentionForwardSplit<T>(const AttentionGeometry&, const SequenceBand*,      \
                                         const AttentionForwardArgs<T>&, float*, int64_t,     \
                                         int64_t);
JAX_ROPE_FOR_EACH_ELEMENT_TYPE(JAX_ROPE_INSTANTIATE)
#undef JAX_ROPE_INSTANTIATE

}  // namespace jax_rope::cpu
