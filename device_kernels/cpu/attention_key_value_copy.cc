// The head-major copy of K and V that the forward reads where one head's rows
// lie apart (attention_kernels.h: HeadMajorKeyValue, CopyKeyValueFirst,
// CopyKeyValue).
#include <algorithm>
#include <vector>

#include "device_kernels/cpu/attention_blocks.h"
#include "device_kernels/cpu/attention_kernels.h"

namespace jax_rope::cpu {
namespace {

using namespace attention;

// Rows [first, last) of the key and value rows of sequence b that the head-major
// copy holds: one span per sequence, or one for all of them where K and V have no
// batch stride (their rows are shared: the union).
struct CopySpan {
  int64_t b, first, last;
};

std::vector<CopySpan> CopySpans(const AttentionGeometry& g, const SequenceBand* seqs) {
  std::vector<CopySpan> spans;
  for (int64_t b = 0; b < g.batch; ++b) {
    const Band band(seqs[b]);
    if (band.kv_len == 0) continue;
    const CopySpan span{b, band.kv_start, band.kv_start + band.kv_len};
    if (g.k.batch != 0 || spans.empty()) {
      spans.push_back(g.k.batch != 0 ? span : CopySpan{0, span.first, span.last});
    } else {
      spans[0].first = std::min(spans[0].first, span.first);
      spans[0].last = std::max(spans[0].last, span.last);
    }
  }
  return spans;
}

// Rows per copy item: each copies whole source rows (all kv heads), which lie
// one after the other, where one head's rows would be a page apart.
constexpr int64_t kCopyRows = 256;

}  // namespace

KeyValueCopy HeadMajorKeyValue(const AttentionGeometry& g, const SequenceBand* seqs) {
  KeyValueCopy plan;
  if (!ValidGeometry(g) || (g.k.batch == 0) != (g.v.batch == 0)) return plan;
  int64_t rows = 0, items = 0;
  for (const CopySpan& span : CopySpans(g, seqs)) {
    rows = std::max(rows, span.last);
    items += CeilDiv(span.last - span.first, kCopyRows);
  }
  if (rows == 0) return plan;
  const int64_t copies = g.k.batch == 0 ? 1 : g.batch;  // sets of rows
  const int64_t d = g.head_dim, dv = g.value_dim, heads = g.kv_heads;
  plan.items = items;
  plan.rows = rows;
  plan.k = {g.k.batch == 0 ? 0 : heads * rows * d, d, rows * d};
  plan.v = {g.v.batch == 0 ? 0 : heads * rows * dv, dv, rows * dv};
  plan.value_offset = copies * heads * rows * d;
  plan.elements = plan.value_offset + copies * heads * rows * dv;
  return plan;
}

bool CopyKeyValueFirst(const AttentionGeometry& g, const SequenceBand* seqs,
                       int64_t element_bytes) {
  if (!ValidGeometry(g) || (g.k.seq <= g.head_dim && g.v.seq <= g.value_dim)) return false;
  const KeyValueCopy plan = HeadMajorKeyValue(g, seqs);
  if (plan.items == 0 || plan.elements > kMaxKeyValueCopyBytes / element_bytes) return false;
  // Key rows the forward's items read, against the rows copied.
  int64_t copied = 0;
  for (const CopySpan& span : CopySpans(g, seqs)) copied += span.last - span.first;
  constexpr int64_t kMinReadsPerRow = 3;
  return copied > 0 && ForwardKeyRowReads(g, seqs) >= kMinReadsPerRow * copied;
}

template <typename T>
void CopyKeyValue(const AttentionGeometry& g, const SequenceBand* seqs, const KeyValueCopy& plan,
                  const T* key, const T* value, T* copy, int64_t begin, int64_t end) {
  T* keys = copy;
  T* values = copy + plan.value_offset;
  int64_t t0 = 0;  // the first item of a span
  for (const CopySpan& span : CopySpans(g, seqs)) {
    const int64_t chunks = CeilDiv(span.last - span.first, kCopyRows);
    for (int64_t t = std::max(begin, t0); t < std::min(end, t0 + chunks); ++t) {
      const int64_t first = span.first + (t - t0) * kCopyRows;
      for (int64_t row = first; row < std::min(span.last, first + kCopyRows); ++row) {
        for (int64_t h = 0; h < g.kv_heads; ++h) {
          std::copy_n(key + Offset(g.k, span.b, row, h), g.head_dim,
                      keys + Offset(plan.k, span.b, row, h));
          std::copy_n(value + Offset(g.v, span.b, row, h), g.value_dim,
                      values + Offset(plan.v, span.b, row, h));
        }
      }
    }
    t0 += chunks;
  }
}

#define JAX_ROPE_INSTANTIATE(T)                                                               \
  template void CopyKeyValue<T>(const AttentionGeometry&, const SequenceBand*,               \
                                const KeyValueCopy&, const T*, const T*, T*, int64_t, int64_t);
JAX_ROPE_FOR_EACH_ELEMENT_TYPE(JAX_ROPE_INSTANTIATE)
#undef JAX_ROPE_INSTANTIATE

}  // namespace jax_rope::cpu
