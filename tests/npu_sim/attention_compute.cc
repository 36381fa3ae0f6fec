// The simulated FlashAttentionScore family's computation (tests only): a
// plan checked by attention.cc, run with jax_rope's CPU attention kernels the
// way the real operator computes: the VarLen statistics in NTD order, and
// fully masked rows handled only in the operator's invalid-line mode.
#include <algorithm>
#include <cstring>

#include "device_kernels/cpu/attention_kernels.h"
#include "device_kernels/cpu/float_convert.h"
#include "device_kernels/npu/acl_api.h"
#include "tests/npu_sim/bias_dropout.h"
#include "tests/npu_sim/sim.h"

namespace jax_rope_sim {

using jax_rope::cpu::SequenceBand;

namespace {

constexpr int64_t kStats = 8;  // softmaxMax/Sum: trailing axis of 8 copies

// VarLen statistics: the kernels use a (T, N1, 8) scratch; the operator's
// buffer is NTD, per batch [N1, S_b, 8] from offset q_start * N1 * 8.
void Ntd(const AttentionPlan& p, float* tnd, float* ntd, bool to_ntd) {
  for (const SequenceBand& q : p.seqs) {
    for (int64_t n = 0; n < p.n1; ++n) {
      for (int64_t i = 0; i < q.q_len; ++i) {
        float* a = tnd + ((q.q_start + i) * p.n1 + n) * kStats;
        float* b = ntd + (q.q_start * p.n1 + n * q.q_len + i) * kStats;
        if (to_ntd) std::copy(a, a + kStats, b); else std::copy(b, b + kStats, a);
      }
    }
  }
}

// Without the invalid-line mode a fully masked row is an ordinary softmax over
// equal (masked) scores: the mean of the value rows, max the mask value, sum Skv.
template <typename T>
void WithoutInvalidLine(const AttentionPlan& p, T* out, float* smax, float* ssum) {
  const auto& g = p.g;
  const int64_t group = g.q_heads / g.kv_heads;
  const T* value = static_cast<const T*>(p.a.value->data);
  for (int64_t b = 0; b < g.batch; ++b) {
    const SequenceBand& q = p.seqs[b];
    for (int64_t n = 0; n < g.q_heads; ++n) {
      for (int64_t i = 0; i < q.q_len; ++i) {
        const int64_t at = b * g.stats.batch + (q.q_start + i) * g.stats.seq + n * g.stats.head;
        if (ssum[at] != jax_rope::cpu::kDeadRowSum) continue;
        for (int64_t d = 0; d < g.value_dim; ++d) {
          float total = 0;
          for (int64_t j = 0; j < q.kv_len; ++j) {
            total += jax_rope::cpu::ToFloat(value[b * g.v.batch + (q.kv_start + j) * g.v.seq + (n / group) * g.v.head + d]);
          }
          out[b * g.out.batch + (q.q_start + i) * g.out.seq + n * g.out.head + d] =
              jax_rope::cpu::FromFloat<T>(total / static_cast<float>(q.kv_len));
        }
        std::fill(smax + at, smax + at + kStats, jax_rope::cpu::kMaskValue);
        std::fill(ssum + at, ssum + at + kStats, static_cast<float>(q.kv_len));
      }
    }
  }
}

// Calls with a pse or a dropMask run through the dense computation of
// bias_dropout.h (what the kernels compute, quirks included).
bool Dense(const AttentionPlan& p) { return p.bias.form != PseForm::kNone || p.bias.drop; }

template <typename T>
void Compute(const AttentionPlan& p) {
  const AttentionArgs& a = p.a;
  auto P = [](const Tensor* t) { return static_cast<T*>(t->data); };
  auto F = [](const Tensor* t) { return static_cast<float*>(t->data); };
  const auto& g = p.g;
  const SequenceBand* seqs = p.seqs.data();
  const int64_t rows = jax_rope::cpu::ForwardWorkItems(g, seqs);
  const int64_t stat_count = a.softmax_max->elements();
  std::vector<float> tnd_max, tnd_sum;  // varlen: the kernels' (T, N1, 8) order
  float* smax = F(a.softmax_max);
  float* ssum = F(a.softmax_sum);
  if (a.varlen) {
    tnd_max.assign(stat_count, jax_rope::cpu::kMaskValue);
    tnd_sum.assign(stat_count, jax_rope::cpu::kDeadRowSum);
    smax = tnd_max.data();
    ssum = tnd_sum.data();
  }
  if (!a.backward) {
    std::memset(a.attention->data, 0, a.attention->elements() * sizeof(T));
    std::fill(smax, smax + stat_count, jax_rope::cpu::kMaskValue);
    std::fill(ssum, ssum + stat_count, jax_rope::cpu::kDeadRowSum);
    if (Dense(p)) {
      dense::Forward<T>(p, smax, ssum);
    } else {
      jax_rope::cpu::AttentionForwardArgs<T> args{P(a.query), P(a.key), P(a.value),
                                                  P(a.attention), smax, ssum};
      jax_rope::cpu::AttentionForward(g, seqs, args, 0, rows);
    }
    for (float* x : {smax, ssum}) {  // the 8 copies
      for (int64_t r = 0; r < stat_count; r += kStats) std::fill(x + r + 1, x + r + kStats, x[r]);
    }
    if (!p.invalid_line) WithoutInvalidLine(p, P(a.attention), smax, ssum);
    if (a.varlen) {
      Ntd(p, smax, F(a.softmax_max), true);
      Ntd(p, ssum, F(a.softmax_sum), true);
    }
    return;
  }
  if (a.varlen) {
    Ntd(p, smax, F(a.softmax_max), false);
    Ntd(p, ssum, F(a.softmax_sum), false);
  }
  if (Dense(p)) {
    dense::Backward<T>(p, smax, ssum);
    return;
  }
  for (const Tensor* t : {a.dq, a.dk, a.dv}) std::memset(t->data, 0, t->elements() * sizeof(T));
  jax_rope::cpu::AttentionBackwardArgs<T> args{P(a.query), P(a.key), P(a.value), P(a.attention), P(a.dy),
                                               smax, ssum, P(a.dq), P(a.dk), P(a.dv)};
  std::vector<float> delta(stat_count, 0.0f);
  jax_rope::cpu::AttentionRowDelta(g, seqs, args, delta.data(), 0, rows);
  jax_rope::cpu::AttentionBackwardKeyValue(g, seqs, args, delta.data(), 0, jax_rope::cpu::KeyBlockWorkItems(g, seqs));
  jax_rope::cpu::AttentionBackwardQuery(g, seqs, args, delta.data(), 0, rows);
}

// The rows from `first` on of a TND tensor (T rows), which the operator never
// writes when T runs past the last sequence (CANN 8.5 on): whatever the buffer
// held, NaN here (all bits set, in every dtype) so that reading them shows.
void Unwritten(const Tensor* t, int64_t first) {
  const int64_t rows = t->dims[0], size = t->dtype == kAclFloat ? 4 : 2;  // float, (b)f16
  const int64_t row_bytes = rows == 0 ? 0 : t->elements() / rows * size;
  if (first < rows) std::memset(static_cast<char*>(t->data) + first * row_bytes, 0xff, (rows - first) * row_bytes);
}

}  // namespace

void RunAttention(const AttentionPlan& plan) {
  switch (plan.a.query->dtype) {
    case kAclFloat: Compute<float>(plan); break;
    case kAclFloat16: Compute<jax_rope::cpu::Float16>(plan); break;
    default: Compute<jax_rope::cpu::BFloat16>(plan); break;
  }
  const AttentionArgs& a = plan.a;
  if (!a.varlen || plan.seqs.empty()) return;
  const SequenceBand& last = plan.seqs.back();
  const int64_t q_end = last.q_start + last.q_len, kv_end = last.kv_start + last.kv_len;
  if (!a.backward) {
    Unwritten(a.attention, q_end);
    // NTD statistics [N1, T, 8]: the sequences' blocks fill the first N1 x q_end rows.
    Tensor flat_max{{a.softmax_max->elements() / kStats, kStats}, kAclFloat, a.softmax_max->data};
    Tensor flat_sum{{a.softmax_sum->elements() / kStats, kStats}, kAclFloat, a.softmax_sum->data};
    Unwritten(&flat_max, q_end * plan.n1);
    Unwritten(&flat_sum, q_end * plan.n1);
    return;
  }
  Unwritten(a.dq, q_end);
  Unwritten(a.dk, kv_end);
  Unwritten(a.dv, kv_end);
}

}  // namespace jax_rope_sim
