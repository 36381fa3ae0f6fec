// Masked attention on the CPU (spec/attention.md): scores, a tiled
// online-softmax forward and a recomputing backward that visit only tiles with
// at least one visible position. Free of XLA.
//
// Every sparse_mode reduces to, per sequence, a visible column interval per
// query row plus an optional element mask:
//   row i (0-based within its sequence) sees key column j (0-based) when
//     lo(i) <= j <= hi(i), with
//     lo(i) = max(0, i + lo_off)
//     hi(i) = min(kv_len - 1, max(i + hi_off, hi_floor))
//   and, when an element mask is given, mask(b, n, i, j) == 0.
// lo(i) and hi(i) never decrease with i, which makes tile classification O(1):
// a (query block, key block) tile is empty, full (every position visible by the
// interval and no element mask) or partial. The Python side fills one
// SequenceBand per sequence (jax_rope/attention/masks.py).
#pragma once

#include <cstdint>

#include "device_kernels/common/layout_roles.h"
#include "device_kernels/cpu/float_convert.h"

namespace jax_rope::cpu {

// One row of the int32 sequence table (7 int32 values, in this order).
struct SequenceBand {
  int32_t q_start;   // first query row of the sequence along the sequence axis
  int32_t q_len;     // query rows (0: empty sequence)
  int32_t kv_start;  // first key row along the key sequence axis
  int32_t kv_len;
  int32_t lo_off;    // see above; very negative (-2^30) for "no lower limit"
  int32_t hi_off;    // very positive (2^30) for "no upper limit"
  int32_t hi_floor;  // -2^30 unless a prefix keeps columns [0, prefix) visible
};

// Element mask (uint8, nonzero = masked) seen as (batch, head, row, col) with
// row/col local to the sequence; stride 0 on broadcast axes. data == nullptr:
// no element mask.
struct ElementMask {
  const uint8_t* data = nullptr;
  int64_t batch = 0;
  int64_t head = 0;
  int64_t row = 0;
  int64_t col = 1;
};

// Positional score bias (spec/attention_bias_dropout.md section 2), read or
// computed tile by tile. P(b, n, i, j) for table row b, query head n and
// sequence-local row i, column j:
//   kTensor, kPacked: data[seq_base[b] + n * head + i * row + j], with
//     row = kv_len of the sequence when row_is_kv_len (the TND packed full form);
//   kCompressed (d = i - j): d >= 0: data[seq_base[b] + n * head + 1023 * width + width - 1 - d],
//     -1023 <= d < 0: data[seq_base[b] + n * head + (1023 + d) * width + width - 1], else 0;
//   kAlibi, kAlibiSqrt: (-slope) * a with slope = data[b * slope_batch + n] (float32),
//     a = float(|dist|) (sqrtf of it for kAlibiSqrt),
//     dist = (j + offsets[2b + 1]) - (i + offsets[2b]) exactly.
// Tensor kinds hold the query's dtype. The score is f32(f32(x + P) * scale)
// (pse_type 1) or f32(f32(scale * x) + P) (after_scale: pse_type 0, ALiBi).
enum class BiasKind : int32_t {
  kNone = 0, kTensor = 1, kCompressed = 2, kPacked = 3, kAlibi = 4, kAlibiSqrt = 5
};

struct PositionBias {
  BiasKind kind = BiasKind::kNone;
  bool after_scale = false;
  const void* data = nullptr;
  const int64_t* seq_base = nullptr;  // tensor kinds: one offset per table row
  int64_t head = 0;
  int64_t row = 0;
  bool row_is_kv_len = false;
  int64_t width = 0;
  int64_t slope_batch = 0;            // ALiBi: 0 for slopes shared by every table row
  const int32_t* offsets = nullptr;   // ALiBi: (B, 2) = [q_start_idx, kv_start_idx]
};

// Dropout of the normalized probabilities (section 3): keep(b, n, i, j) is
//   kKey:  Threefry2x32(key = (keys[2b], keys[2b + 1]),
//                       counter = (uint32(rows[b * N1 + n] + i), uint32(j))).y0 < threshold;
//   kMask: bit e & 7 of mask[e >> 3], e = rows[b * N1 + n] + i * kv_len + j (64-bit).
// Kept probabilities are multiplied by keep_scale; the statistics stay undropped.
enum class DropoutMode : int32_t { kNone = 0, kKey = 1, kMask = 2 };

struct Dropout {
  DropoutMode mode = DropoutMode::kNone;
  const uint32_t* keys = nullptr;  // (B, 2)
  const uint32_t* rows = nullptr;  // (B, N1)
  const uint8_t* mask = nullptr;   // kMask: bit-packed, LSB first
  uint32_t threshold = 0;          // floor(keep_prob * 2^32)
  float keep_scale = 1.0f;         // float32(1 / keep_prob)
};

struct AttentionGeometry {
  int64_t batch = 0;       // number of sequences (rows of the sequence table)
  int64_t q_heads = 0;     // N1
  int64_t kv_heads = 0;    // N2; N1 % N2 == 0, query head n uses kv head n / (N1 / N2)
  int64_t head_dim = 0;    // D of query and key
  int64_t value_dim = 0;   // Dv of value and output
  float scale = 1.0f;
  // Strides (layout_roles.h); packed TND tensors have batch 0 and address rows
  // through q_start/kv_start.
  Strides q, k, v, out;    // out: also for dout; dq/dk/dv use q/k/v strides
  Strides stats;           // softmax_max / softmax_sum (float32): dim axis absent
  ElementMask mask;
  PositionBias bias;       // masked positions never read its value's effect
  Dropout dropout;         // forward and backward only (scores ignore it)
  int64_t workers = 1;     // threads the work items run on: the forward's item shape
                           // depends on it, never its results
};

// Float32 constants of the spec.
constexpr float kMaskValue = -3.4028235e38f;   // masked score, and max of a dead row
constexpr float kDeadRowSum = 3.4028235e38f;   // softmax_sum of a row with no visible key

template <typename T>
struct AttentionForwardArgs {
  const T* query;
  const T* key;
  const T* value;
  T* out;                 // rows of dead or out-of-sequence positions: zeros
  float* softmax_max;
  float* softmax_sum;
};

template <typename T>
struct AttentionBackwardArgs {
  const T* query;
  const T* key;
  const T* value;
  const T* out;
  const T* dout;
  const float* softmax_max;
  const float* softmax_sum;
  T* dquery;
  T* dkey;
  T* dvalue;
};

// Query-block work items (sequence, query head, query block) of AttentionRowDelta,
// AttentionBackwardQuery and AttentionScores. The list depends on
// the run-time sequence table; callers run [begin, end) of it in parallel.
// Rows outside every sequence (TND padding beyond the last cumulative length)
// are the caller's: it pre-fills out/dquery/dkey/dvalue with zeros and the
// statistics with kMaskValue / kDeadRowSum there. The kernels write every row
// inside a sequence, dead rows included.
int64_t ForwardWorkItems(const AttentionGeometry& g, const SequenceBand* seqs);

// Items of AttentionForward (at most ForwardWorkItems; a larger end is fine):
// each takes up to four (query head, query block) pairs of one kv head's group,
// heads of the group first, then consecutive query blocks, so that a K/V block
// is read once for all of them.
int64_t AttentionForwardWorkItems(const AttentionGeometry& g, const SequenceBand* seqs);

template <typename T>
void AttentionForward(const AttentionGeometry& g, const SequenceBand* seqs,
                      const AttentionForwardArgs<T>& args, int64_t begin, int64_t end);

// A copy of key and value with the rows of each kv head adjacent (head-major),
// for AttentionForward to read instead of K and V: it reads every key block
// once per work item that sees the block, and where one head's rows lie far
// apart (BSND: N2 x D elements, a page for N2 = 8, D = 128) those reads come
// from memory row by row and the rows of a block evict each other in the
// caches (the rows of one head fall into an eighth of the L2's sets). Rows keep
// their indices: the copy holds `rows` rows per head (the largest kv_start +
// kv_len), and the rows of a sequence are copied where it reads them; with a
// batch stride of 0 (packed TND, or K/V broadcast over the batch) the copy has
// none either and holds the union of the sequences' rows once.
struct KeyValueCopy {
  int64_t items = 0;         // copy work items (runs of rows, every kv head); 0: none
  int64_t rows = 0;          // rows per kv head in the copy
  int64_t value_offset = 0;  // elements of the copy before its values (its keys)
  int64_t elements = 0;      // elements of the copy: keys, then values
  Strides k, v;              // the copy's strides, in place of g.k and g.v
};

// The head-major copy of this call's K and V.
KeyValueCopy HeadMajorKeyValue(const AttentionGeometry& g, const SequenceBand* seqs);

// Whether AttentionForward should read a head-major copy of K and V
// (HeadMajorKeyValue) instead of K and V: when their rows are not adjacent
// already and its work items read every key row three times or more, so that
// the copy (the bytes read and written once, plus the page faults of a fresh
// buffer) costs less than what it saves (AVX2 Zen 3, two cores, jitted calls
// with the copy against without: causal B1 S4096 N8 D128 2.5% and chunked
// prefill B1 Sq256 Skv8192 N1=32 N2=8 3% faster; with BNSD inputs, nothing to
// copy, that prefill was faster still). Not for calls whose copy would exceed
// kMaxKeyValueCopyBytes (`element_bytes` per element).
inline constexpr int64_t kMaxKeyValueCopyBytes = int64_t{1} << 30;
bool CopyKeyValueFirst(const AttentionGeometry& g, const SequenceBand* seqs,
                       int64_t element_bytes);

// Key rows that AttentionForward's items read, summed over its items (each
// item reads its key blocks once for all its lanes): what CopyKeyValueFirst
// weighs against the rows a copy would write.
int64_t ForwardKeyRowReads(const AttentionGeometry& g, const SequenceBand* seqs);

// Copies items [begin, end) of `plan` (HeadMajorKeyValue(g, seqs)) from key and
// value into `copy` (plan.elements elements).
template <typename T>
void CopyKeyValue(const AttentionGeometry& g, const SequenceBand* seqs, const KeyValueCopy& plan,
                  const T* key, const T* value, T* copy, int64_t begin, int64_t end);

// Flash-decoding forward for short query blocks (decode, speculative or
// chunked verification): when every sequence has q_len * (N1 / N2) <= 64, the
// query rows of the N1 / N2 heads sharing a kv head form one tile, so K and V
// are read once per group, and the key axis is cut into fixed chunks of
// kSplitKeys columns. Pass 1 runs (sequence, chunk, kv head) items, each
// leaving its chunk's row max, row sum and unnormalised output in `scratch`;
// pass 2 runs (sequence, kv head) items merging the chunks in chunk order and
// writing out and the statistics as AttentionForward does. Neither the split
// nor the merge order depends on how the items are divided among threads.
// groups == 0: not applicable, or nothing to gain (N1 == N2 and every sequence
// within one chunk); use AttentionForward.
constexpr int64_t kSplitKeys = 1024;

struct SplitForwardPlan {
  int64_t items = 0;    // pass 1 work items
  int64_t groups = 0;   // pass 2 work items
  int64_t scratch = 0;  // float32 elements of the caller's scratch
};

SplitForwardPlan PlanSplitForward(const AttentionGeometry& g, const SequenceBand* seqs);

template <typename T>
void AttentionForwardSplit(const AttentionGeometry& g, const SequenceBand* seqs,
                           const AttentionForwardArgs<T>& args, float* scratch, int64_t begin,
                           int64_t end);

template <typename T>
void AttentionForwardMerge(const AttentionGeometry& g, const SequenceBand* seqs,
                           const AttentionForwardArgs<T>& args, const float* scratch,
                           int64_t begin, int64_t end);

// Backward in three race-free passes over the same recomputed tiles:
//   1. row_delta[b, n, i] = sum_d dout * out (laid out like softmax_max, through
//      g.stats), over the forward's items;
//   2. dkey and dvalue over (sequence, kv head, key block) items, each summing
//      over the query heads of its group and the query blocks that see it;
//   3. dquery over the forward's items.
int64_t KeyBlockWorkItems(const AttentionGeometry& g, const SequenceBand* seqs);

template <typename T>
void AttentionRowDelta(const AttentionGeometry& g, const SequenceBand* seqs,
                       const AttentionBackwardArgs<T>& args, float* row_delta, int64_t begin,
                       int64_t end);

template <typename T>
void AttentionBackwardKeyValue(const AttentionGeometry& g, const SequenceBand* seqs,
                               const AttentionBackwardArgs<T>& args, const float* row_delta,
                               int64_t begin, int64_t end);

template <typename T>
void AttentionBackwardQuery(const AttentionGeometry& g, const SequenceBand* seqs,
                            const AttentionBackwardArgs<T>& args, const float* row_delta,
                            int64_t begin, int64_t end);

// Passes 1, 2 and 3 in one, over (sequence, kv head) items (item t: sequence
// t / kv_heads, kv head t % kv_heads): dkey and dvalue block by block as in
// pass 2 (four key blocks a step, each query block's tiles of them in turn),
// and dquery of the group's rows summed in a float32 accumulator (q_len x
// group x head_dim per item) over the key blocks in ascending order.
// Five products per tile instead of seven; the results have the bits of passes
// 2 and 3 (the same sums in the same order). Each item computes pass 1's
// row_delta for its group's rows first (same bits; row_delta is then scratch
// laid out like softmax_max, written before it is read). An item copies its
// group's query and dout rows once (up to 16 MiB per thread; float32 products
// only) and each key block once, the B operands of its products, whatever the
// instruction set.
int64_t FusedBackwardWorkItems(const AttentionGeometry& g);

template <typename T>
void AttentionBackwardFused(const AttentionGeometry& g, const SequenceBand* seqs,
                            const AttentionBackwardArgs<T>& args, float* row_delta,
                            int64_t begin, int64_t end);

// Masked scaled scores (float32): position (i, j) of sequence b and query head
// n is scores[b * s[0] + n * s[1] + (q_start + i) * s[2] + (kv_start + j)]
// with s = score_strides (s[0] == 0 for packed TND). The caller pre-fills the
// whole output with kMaskValue; items are the forward's.
template <typename T>
void AttentionScores(const AttentionGeometry& g, const SequenceBand* seqs, const T* query,
                     const T* key, float* scores, const int64_t score_strides[3],
                     int64_t begin, int64_t end);

}  // namespace jax_rope::cpu
