// The simulated FlashAttentionScore family's positional bias (realShift/pse,
// pseType, qStartIdx/kvStartIdx) and dropout (keepProb, dropMask), tests only:
// the checks the aclnn/tiling layer makes (attention.cc calls CheckBiasDropout)
// and a dense computation of what the kernels compute (attention_compute.cc
// runs every call with a pse or a dropMask through DenseForward/DenseBackward).
// Read from cannmirror/ops-transformer (05c401f9): the aclnn headers and docs
// of ScoreV2/VarLenScoreV2/ScoreGradV2/UnpaddingScoreGradV2, the arch32 tiling
// (AnalyzeOptionalInput, SetPseAlibiParams, SetQKVStartIdx) and the kernels'
// common/include/kernel/pse.h and dropmask.h. What the kernels do that a
// caller may not expect, reproduced here:
//   - only element 0 of qStartIdx/kvStartIdx is read, and only when both are
//     given (the tiling reads kvStartIdx after a present qStartIdx and keeps
//     neither otherwise); in TND sparse mode 8 only sequence 0 uses them;
//   - the compressed (1024-row) pse is read at other, d = i - j equivalent
//     entries than a plain expansion would (PseAlibiComputeOffset);
//   - dpseOut is never written.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "device_kernels/cpu/attention_kernels.h"
#include "device_kernels/cpu/float_convert.h"
#include "device_kernels/npu/acl_api.h"
#include "tests/npu_sim/sim.h"

namespace jax_rope_sim {

struct BiasSizes {
  int64_t batch, n1, q_rows, kv_rows;
  bool varlen;
};

inline std::string BiasCheck(const AttentionArgs& a, const BiasSizes& s,
                             const std::vector<jax_rope::cpu::SequenceBand>& seqs,
                             BiasDropoutPlan* bp) {
  auto S = [](int64_t v) { return std::to_string(v); };
  const int64_t mode = a.sparse_mode, type = a.v2 ? a.pse_type : 1;
  if (a.v2 && (type < 0 || type > 3)) return "pseType must be 0, 1, 2 or 3, got " + S(type);
  bool equal = true, empty = false;
  int64_t acc_s2 = 0, acc_s1s2 = 0, max_s2 = 0;
  for (const auto& q : seqs) {
    equal = equal && q.q_len == q.kv_len;
    empty = empty || q.q_len == 0 || q.kv_len == 0;
    acc_s2 += q.kv_len;
    acc_s1s2 += int64_t{q.q_len} * q.kv_len;
    max_s2 = std::max<int64_t>(max_s2, q.kv_len);
  }
  // qStartIdx / kvStartIdx (SetQKVStartIdx): element 0 of both, or neither.
  auto first = [](const std::vector<int64_t>* v) { return v != nullptr && !v->empty(); };
  if (a.v2 && first(a.q_start_idx) && first(a.kv_start_idx)) {
    bp->q_start_idx = (*a.q_start_idx)[0];
    bp->kv_start_idx = (*a.kv_start_idx)[0];
  }
  const Tensor* p = a.pse;
  bp->pse_type = type;
  if (p == nullptr) {
    if (type != 1) return "Get PseInput is nullptr, but pseType is not default=1, now pseType=" + S(type);
  } else {
    const auto& d = p->dims;
    if (s.varlen && empty) return "pse with TND needs every sequence non-empty (the docs)";
    if (mode == 7) return "pse is not supported in sparseMode 7";
    if (type == 2 || type == 3) {
      if (p->dtype != kAclFloat) return "pseType 2/3 needs FLOAT32 slopes";
      if (!(d == std::vector<int64_t>{s.n1} || d == std::vector<int64_t>{s.batch, s.n1})) {
        return "pse inner mode, unsupported pse shape " + Shape(p) + " (need [N] or [B,N])";
      }
      bp->form = PseForm::kSlopes;
      bp->pse_batch = d.size() == 2 ? s.batch : 1;
      if (!s.varlen && s.q_rows != s.kv_rows) return "INNER Pse alibi is supported only when s1Size and s2Size are equal.";
      if (s.varlen) {
        for (size_t b = 0; b < seqs.size(); ++b) {
          const int64_t lq = seqs[b].q_len, lkv = seqs[b].kv_len;
          const bool ok = (mode == 8 && b == 0) ? lq + bp->q_start_idx == lkv + bp->kv_start_idx : lq == lkv;
          if (!ok) return "INNER Pse with TND needs equal actualSeqQLen/actualSeqKvLen (mode 8: sequence 0 with its start offsets), sequence " + S(b);
        }
      }
    } else {
      if (p->dtype != a.query->dtype) return "pse must have the query's dtype for pseType 0/1";
      if (mode == 8 && !equal) return "pse with sparseMode 8 needs every Sq == Skv (the docs)";
      if (s.varlen) {
        const int64_t first_dim = d.empty() ? 0 : d[0];
        if (d.size() == 1 && first_dim == acc_s2 * s.n1) {
          bp->form = PseForm::kTndRow;
        } else if (d.size() == 1 && first_dim == acc_s1s2 * s.n1) {
          bp->form = PseForm::kTndFull;
        } else if (d.size() == 4 && (d[0] == 1 || d[0] == s.batch) && d[1] == s.n1 && d[2] == 1024 && d[3] == max_s2) {
          if (!equal) return "Pse alibi only support when actualSeqQLen and actualSeqKvLen are equal.";
          if (mode != 2 && mode != 3) return "Pse alibi only support causal sparse type.";
          bp->form = PseForm::kTndCompressed;
          bp->pse_batch = d[0];
          bp->pse_rows = 1024;
          bp->pse_cols = d[3];
        } else {
          return "get unsupported pse shape " + Shape(p) + " (TND: [N*sum(Skv)], [N*sum(Sq*Skv)] or [B|1,N,1024,maxSkv])";
        }
      } else {
        if (d.size() != 4) return "pse dim should be 4, but got " + S(d.size());
        if (d[0] != s.batch && d[0] != 1) return "pse batchsize should be 1 or " + S(s.batch) + ", but got " + S(d[0]);
        if (d[1] != s.n1 || d[3] != s.kv_rows || !(d[2] == s.q_rows || d[2] == 1 || d[2] == 1024)) {
          return "get unsupported pse shape " + Shape(p);
        }
        bp->pse_batch = d[0];
        bp->pse_rows = d[2];
        bp->pse_cols = d[3];
        bp->form = d[2] == s.q_rows ? PseForm::kFull : d[2] == 1 ? PseForm::kRow : PseForm::kCompressed;
        if (bp->form == PseForm::kCompressed) {
          if (s.q_rows < 1024) return "get unsupported pse shape " + Shape(p) + " (1024 rows need Sq >= 1024)";
          if (s.q_rows != s.kv_rows) return "Pse alibi only support same S1 S2 when S1 lager than 1024";
          if (mode != 2 && mode != 3) return "Pse alibi only support causal sparse type.";
        }
      }
    }
  }
  // dropMask (AnalyzeOptionalInput): UINT8, at least ceil(numel / 8) bytes.
  if (a.drop_mask != nullptr) {
    if (a.drop_mask->dtype != kAclUint8) return "invalid dropMask dtype, only support uint8";
    const int64_t numel = s.varlen ? acc_s1s2 * s.n1 : s.batch * s.n1 * s.q_rows * s.kv_rows;
    if (a.drop_mask->elements() < (numel + 7) / 8) {
      return "Input dropMask shapeSize is invalid, it should not be less than " + S((numel + 7) / 8) +
             ", but got " + S(a.drop_mask->elements());
    }
    bp->drop = true;
    bp->keep_scale = static_cast<float>(1.0 / a.keep_prob);
  } else if (a.keep_prob != 1.0) {
    return "keepProb < 1 needs dropMaskOptional";
  }
  if (a.backward) {
    // dpseOut: torch_npu passes pse's shape and dtype (an empty tensor without pse).
    if (p != nullptr && (a.dpse->dims != p->dims || a.dpse->dtype != p->dtype)) {
      return "dpseOut must have pse's shape " + Shape(p) + " and dtype, got " + Shape(a.dpse);
    }
    if (p == nullptr && a.dpse->elements() != 0) return "dpseOut must be an empty tensor without pse";
  }
  return "";
}

// --- the computation -------------------------------------------------------------

namespace dense {

using jax_rope::cpu::SequenceBand;

// P (or, for ALiBi, the bias value itself) of sequence b, head n, local (i, j).
template <typename T>
float PseValue(const AttentionPlan& p, int64_t b, int64_t n, int64_t i, int64_t j, int64_t c_b,
               int64_t k_b) {
  const BiasDropoutPlan& bp = p.bias;
  const SequenceBand& q = p.seqs[b];
  const int64_t n1 = p.g.q_heads, bb = bp.pse_batch == 1 ? 0 : b, d = i - j;
  const T* t = static_cast<const T*>(p.a.pse->data);
  switch (bp.form) {
    case PseForm::kFull: return jax_rope::cpu::ToFloat(t[((bb * n1 + n) * bp.pse_rows + i) * bp.pse_cols + j]);
    case PseForm::kRow: return jax_rope::cpu::ToFloat(t[(bb * n1 + n) * bp.pse_cols + j]);
    case PseForm::kTndFull: return jax_rope::cpu::ToFloat(t[n1 * c_b + (n * q.q_len + i) * q.kv_len + j]);
    case PseForm::kTndRow: return jax_rope::cpu::ToFloat(t[n1 * k_b + n * q.kv_len + j]);
    case PseForm::kCompressed: {
      // PseAlibiComputeOffset (non-TND), per element: rows from the bottom.
      if (d < 0) return 0.0f;  // above the diagonal: masked in modes 2/3
      const int64_t s = p.q_rows, w = bp.pse_cols;
      const int64_t m = i >= s - 1024 ? i - (s - 1024) : i % 1024;
      return jax_rope::cpu::ToFloat(t[((bb * n1 + n) * 1024 + m) * w + (m + s - 1024 - d)]);
    }
    case PseForm::kTndCompressed: {
      if (d < 0) return 0.0f;
      const int64_t w = bp.pse_cols, threshold = w - 1024, pos = d - threshold;
      const int64_t m = (threshold < 0 || pos >= 0) ? pos : 0, k = (threshold < 0 || pos >= 0) ? 0 : -pos;
      return jax_rope::cpu::ToFloat(t[((bb * n1 + n) * 1024 + m) * w + k]);
    }
    case PseForm::kSlopes: {
      const bool offsets = !(p.a.varlen && p.a.sparse_mode == 8 && b != 0);
      const int64_t dist = (j + (offsets ? bp.kv_start_idx : 0)) - (i + (offsets ? bp.q_start_idx : 0));
      float a = static_cast<float>(dist < 0 ? -dist : dist);
      if (bp.pse_type == 3) a = std::sqrt(a);
      const float slope = static_cast<const float*>(p.a.pse->data)[bb * n1 + n];
      return -slope * a;
    }
    default: return 0.0f;
  }
}

// The score of one position (float32), -FLT_MAX when masked; false if masked.
template <typename T>
bool Score(const AttentionPlan& p, int64_t b, int64_t n, int64_t i, int64_t j, int64_t c_b,
           int64_t k_b, float* out) {
  const auto& g = p.g;
  const SequenceBand& q = p.seqs[b];
  const int64_t lo = std::max<int64_t>(0, i + q.lo_off);
  const int64_t hi = std::min<int64_t>(q.kv_len - 1, std::max<int64_t>(i + q.hi_off, q.hi_floor));
  bool visible = lo <= j && j <= hi;
  if (visible && g.mask.data != nullptr) {
    visible = g.mask.data[b * g.mask.batch + n * g.mask.head + i * g.mask.row + j * g.mask.col] == 0;
  }
  if (!visible) {
    *out = jax_rope::cpu::kMaskValue;
    return false;
  }
  const int64_t group = g.q_heads / g.kv_heads;
  const T* qp = static_cast<const T*>(p.a.query->data) + b * g.q.batch + (q.q_start + i) * g.q.seq + n * g.q.head;
  const T* kp = static_cast<const T*>(p.a.key->data) + b * g.k.batch + (q.kv_start + j) * g.k.seq + (n / group) * g.k.head;
  float x = 0.0f;
  for (int64_t e = 0; e < g.head_dim; ++e) x += jax_rope::cpu::ToFloat(qp[e]) * jax_rope::cpu::ToFloat(kp[e]);
  if (p.bias.form == PseForm::kNone) {
    *out = g.scale * x;
  } else if (p.bias.pse_type == 1) {
    *out = (x + PseValue<T>(p, b, n, i, j, c_b, k_b)) * g.scale;
  } else {
    *out = g.scale * x + PseValue<T>(p, b, n, i, j, c_b, k_b);
  }
  return true;
}

inline float Keep(const AttentionPlan& p, int64_t b, int64_t n, int64_t i, int64_t j, int64_t c_b) {
  if (!p.bias.drop) return 1.0f;
  const SequenceBand& q = p.seqs[b];
  const uint64_t e = static_cast<uint64_t>(p.g.q_heads * c_b + (n * q.q_len + i) * q.kv_len + j);
  const uint8_t byte = static_cast<const uint8_t*>(p.a.drop_mask->data)[e >> 3];
  return ((byte >> (e & 7)) & 1) ? p.bias.keep_scale : 0.0f;
}

// Visits every (sequence, head, row) with the sequence's C_b and K_b.
template <typename F>
void Rows(const AttentionPlan& p, F f) {
  int64_t c_b = 0, k_b = 0;
  for (int64_t b = 0; b < static_cast<int64_t>(p.seqs.size()); ++b) {
    const SequenceBand& q = p.seqs[b];
    for (int64_t n = 0; n < p.g.q_heads; ++n) {
      for (int64_t i = 0; i < q.q_len; ++i) f(b, n, i, c_b, k_b);
    }
    c_b += int64_t{q.q_len} * q.kv_len;
    k_b += q.kv_len;
  }
}

// Forward: statistics of the biased scores (undropped), out with dropout.
template <typename T>
void Forward(const AttentionPlan& p, float* smax, float* ssum) {
  const auto& g = p.g;
  const int64_t group = g.q_heads / g.kv_heads;
  T* out = static_cast<T*>(p.a.attention->data);
  const T* value = static_cast<const T*>(p.a.value->data);
  Rows(p, [&](int64_t b, int64_t n, int64_t i, int64_t c_b, int64_t k_b) {
    const SequenceBand& q = p.seqs[b];
    std::vector<float> s(q.kv_len);
    std::vector<bool> vis(q.kv_len);
    float m = jax_rope::cpu::kMaskValue;
    bool any = false;
    for (int64_t j = 0; j < q.kv_len; ++j) {
      vis[j] = Score<T>(p, b, n, i, j, c_b, k_b, &s[j]);
      if (vis[j]) { m = any ? std::max(m, s[j]) : s[j]; any = true; }
    }
    const int64_t at = b * g.stats.batch + (q.q_start + i) * g.stats.seq + n * g.stats.head;
    T* o = out + b * g.out.batch + (q.q_start + i) * g.out.seq + n * g.out.head;
    if (!any) {
      smax[at] = jax_rope::cpu::kMaskValue;
      ssum[at] = jax_rope::cpu::kDeadRowSum;
      for (int64_t e = 0; e < g.value_dim; ++e) o[e] = jax_rope::cpu::FromFloat<T>(0.0f);
      return;
    }
    float l = 0.0f;
    for (int64_t j = 0; j < q.kv_len; ++j) l += vis[j] ? std::exp(s[j] - m) : 0.0f;
    std::vector<float> acc(g.value_dim, 0.0f);
    for (int64_t j = 0; j < q.kv_len; ++j) {
      if (!vis[j]) continue;
      const float w = std::exp(s[j] - m) / l * Keep(p, b, n, i, j, c_b);
      if (w == 0.0f) continue;
      const T* v = value + b * g.v.batch + (q.kv_start + j) * g.v.seq + (n / group) * g.v.head;
      for (int64_t e = 0; e < g.value_dim; ++e) acc[e] += w * jax_rope::cpu::ToFloat(v[e]);
    }
    for (int64_t e = 0; e < g.value_dim; ++e) o[e] = jax_rope::cpu::FromFloat<T>(acc[e]);
    smax[at] = m;
    ssum[at] = l;
  });
}

// Backward from the saved statistics (spec section 4); dpseOut untouched.
template <typename T>
void Backward(const AttentionPlan& p, const float* smax, const float* ssum) {
  const auto& g = p.g;
  const AttentionArgs& a = p.a;
  const int64_t group = g.q_heads / g.kv_heads;
  auto F = [](const Tensor* t, int64_t at) { return jax_rope::cpu::ToFloat(static_cast<const T*>(t->data)[at]); };
  std::vector<float> dq(a.dq->elements(), 0.0f), dk(a.dk->elements(), 0.0f), dv(a.dv->elements(), 0.0f);
  Rows(p, [&](int64_t b, int64_t n, int64_t i, int64_t c_b, int64_t k_b) {
    const SequenceBand& q = p.seqs[b];
    const int64_t at = b * g.stats.batch + (q.q_start + i) * g.stats.seq + n * g.stats.head;
    const int64_t qi = b * g.q.batch + (q.q_start + i) * g.q.seq + n * g.q.head;
    const int64_t oi = b * g.out.batch + (q.q_start + i) * g.out.seq + n * g.out.head;
    float rd = 0.0f;
    for (int64_t e = 0; e < g.value_dim; ++e) rd += F(a.dy, oi + e) * F(a.attention, oi + e);
    for (int64_t j = 0; j < q.kv_len; ++j) {
      float s;
      if (!Score<T>(p, b, n, i, j, c_b, k_b, &s)) continue;
      const float pr = std::exp(s - smax[at]) / ssum[at];
      const float r = Keep(p, b, n, i, j, c_b);
      const int64_t kj = b * g.k.batch + (q.kv_start + j) * g.k.seq + (n / group) * g.k.head;
      const int64_t vj = b * g.v.batch + (q.kv_start + j) * g.v.seq + (n / group) * g.v.head;
      float dpv = 0.0f;
      for (int64_t e = 0; e < g.value_dim; ++e) {
        dpv += F(a.dy, oi + e) * F(a.value, vj + e);
        dv[vj + e] += pr * r * F(a.dy, oi + e);
      }
      const float ds = pr * (dpv * r - rd) * g.scale;
      for (int64_t e = 0; e < g.head_dim; ++e) {
        dq[qi + e] += ds * F(a.key, kj + e);
        dk[kj + e] += ds * F(a.query, qi + e);
      }
    }
  });
  auto store = [](const Tensor* t, const std::vector<float>& x) {
    T* out = static_cast<T*>(t->data);
    for (size_t e = 0; e < x.size(); ++e) out[e] = jax_rope::cpu::FromFloat<T>(x[e]);
  };
  store(a.dq, dq);
  store(a.dk, dk);
  store(a.dv, dv);
}

}  // namespace dense
}  // namespace jax_rope_sim
