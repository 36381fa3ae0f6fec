// The merge pass of the flash-decoding forward (attention_split.cc): per (sequence,
// kv head) group, each query row's chunk results from pass 1's scratch slots
// folded by log-sum-exp in chunk order, the same bits for any thread count;
// and the plan of both passes (PlanSplitForward).
#include <algorithm>
#include <cmath>
#include <vector>

#include "device_kernels/cpu/attention_blocks.h"
#include "device_kernels/cpu/attention_kernels.h"
#include "device_kernels/cpu/attention_masking.h"
#include "device_kernels/cpu/attention_split_items.h"
#include "device_kernels/cpu/attention_staging.h"
#include "device_kernels/cpu/attention_tiles.h"

namespace jax_rope::cpu {
namespace {

using namespace attention;
using namespace split_forward;

template <typename T>
void MergeGroup(const AttentionGeometry& g, const SequenceBand* seqs,
                const AttentionForwardArgs<T>& a, const SplitItems& items, int64_t u,
                const float* scratch, float* acc) {
  const int64_t b = u / g.kv_heads, kvh = u % g.kv_heads;
  const Band band(seqs[b]);
  const int64_t group = items.group(), nr = band.q_len, dv = g.value_dim;
  const int64_t dvp = RoundUpToTile(dv), rp = items.padded_rows();
  const int64_t chunks = items.chunks(b);
  auto slot_of = [&](int64_t c) { return scratch + items.Index(b, kvh, c) * items.slot(); };
  for (int64_t r = 0; r < group * nr; ++r) {
    const int64_t n = kvh * group + r / nr, row = band.q_start + r % nr;
    float mx = kNegInf;
    for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, slot_of(c)[r]);
    float sum = 0.0f;
    std::fill(acc, acc + dv, 0.0f);
    // A chunk whose visible scores are all NaN has max -inf and a NaN sum: the
    // row's output is NaN (the poison of a key row it sees), not zeros.
    for (int64_t c = 0; c < chunks; ++c) {
      if (std::isnan(slot_of(c)[rp + r])) sum = NAN;
    }
    for (int64_t c = 0; c < chunks && mx != kNegInf && sum == sum; ++c) {  // chunk order
      const float* slot = slot_of(c);
      if (slot[r] == kNegInf) continue;
      const float f = std::exp(slot[r] - mx);
      sum += f * slot[rp + r];
      const float* o = slot + 2 * rp + r * dvp;
      for (int64_t e = 0; e < dv; ++e) acc[e] += f * o[e];
    }
    const bool dead = mx == kNegInf && sum == 0.0f;
    StoreRows(acc, dvp, 1, dv, dead ? 0.0f : 1.0f / sum, a.out + Offset(g.out, b, row, n), 0);
    const int64_t idx = Offset(g.stats, b, row, n);
    a.softmax_max[idx] = RowMax(mx, sum);
    a.softmax_sum[idx] = dead ? kDeadRowSum : sum;
  }
}

}  // namespace

SplitForwardPlan PlanSplitForward(const AttentionGeometry& g, const SequenceBand* seqs) {
  const SplitItems items(g, seqs);
  if (!items.applicable()) return {};
  // One head per group and one chunk per sequence: nothing is shared or split,
  // the plain forward does the same work without the scratch and the merge.
  if (items.group() == 1 && items.size() == g.batch * g.kv_heads) return {};
  return {items.size(), g.batch * g.kv_heads, std::max<int64_t>(items.size() * items.slot(), 1)};
}

template <typename T>
void AttentionForwardMerge(const AttentionGeometry& g, const SequenceBand* seqs,
                           const AttentionForwardArgs<T>& args, const float* scratch,
                           int64_t begin, int64_t end) {
  const SplitItems items(g, seqs);
  if (!items.applicable()) return;
  begin = std::max<int64_t>(begin, 0);
  end = std::min(end, g.batch * g.kv_heads);
  if (begin >= end) return;
  std::vector<float> acc(RoundUpToTile(g.value_dim));
  for (int64_t u = begin; u < end; ++u) MergeGroup(g, seqs, args, items, u, scratch, acc.data());
}

#define JAX_ROPE_INSTANTIATE(T)                                                               \
  template void AttentionForwardMerge<T>(const AttentionGeometry&, const SequenceBand*,      \
                                         const AttentionForwardArgs<T>&, const float*,        \
                                         int64_t, int64_t);
JAX_ROPE_FOR_EACH_ELEMENT_TYPE(JAX_ROPE_INSTANTIATE)
#undef JAX_ROPE_INSTANTIATE

}  // namespace jax_rope::cpu
