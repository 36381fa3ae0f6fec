// The simulated FlashAttentionScore family: every argument checked against the
// documented contract of aclnnFlashAttentionScore / ...ScoreGrad / ...VarLenScore
// / ...UnpaddingScoreGrad (CANN ops-transformer docs and sources, torch_npu's
// calls) as far as jax_rope's glue uses it, then planned for jax_rope's CPU
// attention kernels (attention_compute.cc) over a band table built from
// sparseMode, preTokens/nextTokens, prefix and the sequence lengths as the
// operator applies them: in mode 0 with a mask only the mask (the band only
// skips blocks); mode 5 with B > 1 only with a B1SS/BNSS mask; the varlen
// statistics as [N1, T, 8]. What the glue never passes (pse, dropout, padding
// mask, element masks with TND) is rejected as "not simulated" rather than guessed.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "device_kernels/common/layout_roles.h"
#include "device_kernels/cpu/attention_kernels.h"
#include "device_kernels/npu/acl_api.h"
#include "tests/npu_sim/bias_dropout.h"
#include "tests/npu_sim/sim.h"

namespace jax_rope_sim {

using jax_rope::cpu::SequenceBand;


namespace {

constexpr int64_t kStats = 8;         // softmaxMax/Sum: trailing axis of 8 copies
constexpr int64_t kUnlimited = 1 << 30;  // sparse_modes.py's UNLIMITED
constexpr int64_t kCompressed = 2048, kPrefixRows = 3072;

std::string S(int64_t v) { return std::to_string(v); }

bool IsFloat(int32_t t) { return t == kAclFloat || t == kAclFloat16 || t == kAclBFloat16; }

// The documented compressed masks: M0[r][c] = c > r (2048x2048); mode 6 adds
// 1024 rows of [0]*1024 + [1]*1024 (3072x2048).
const std::vector<uint8_t>& CompressedMask(bool prefix) {
  static const std::vector<uint8_t> masks[2] = {
      [] {
        std::vector<uint8_t> m(kCompressed * kCompressed);
        for (int64_t r = 0; r < kCompressed; ++r)
          for (int64_t c = 0; c < kCompressed; ++c) m[r * kCompressed + c] = c > r;
        return m;
      }(),
      [] {
        std::vector<uint8_t> m(kPrefixRows * kCompressed);
        for (int64_t r = 0; r < kPrefixRows; ++r)
          for (int64_t c = 0; c < kCompressed; ++c)
            m[r * kCompressed + c] = r < kCompressed ? c > r : c >= 1024;
        return m;
      }()};
  return masks[prefix ? 1 : 0];
}

// A layout string's reading of query/key/value: sizes and the kernels' view.
struct Sizes {
  int64_t batch = 1, q_rows = 0, kv_rows = 0, n1 = 0, n2 = 0, d = 0, dv = 0;
  jax_rope::Layout kernel_layout = jax_rope::Layout::kBSND;  // the kernels' layout
  std::vector<int64_t> q_view, k_view, v_view, out_view;  // with an explicit head axis
};

std::string ReadLayout(const std::string& layout, const AttentionArgs& a, Sizes* s) {
  const auto &q = a.query->dims, &k = a.key->dims, &v = a.value->dims;
  const bool hidden = layout == "BSH" || layout == "SBH";
  const size_t rank = (hidden || layout == "TND") ? 3 : 4;
  for (const Tensor* t : {a.query, a.key, a.value}) {
    if (t->dims.size() != rank) return "inputLayout " + layout + " needs " + S(rank) + "-D query/key/value, got " + Shape(t);
  }
  if (a.head_num <= 0) return "headNum must be positive, got " + S(a.head_num);
  if (hidden) {
    const int b = layout == "BSH" ? 0 : 1, seq = 1 - b;
    if (q[2] % a.head_num != 0) return "query H=" + S(q[2]) + " is not a multiple of headNum=" + S(a.head_num);
    s->n1 = a.head_num;
    s->d = q[2] / s->n1;
    if (s->d == 0 || k[2] % s->d != 0) return "key H must be a multiple of D=" + S(s->d);
    s->n2 = k[2] / s->d;
    if (s->n2 == 0 || v[2] % s->n2 != 0) return "value H must be a multiple of N2=" + S(s->n2);
    s->dv = v[2] / s->n2;
    s->batch = q[b];
    s->q_rows = q[seq];
    s->kv_rows = k[seq];
    if (k[b] != s->batch || v[b] != s->batch || v[seq] != s->kv_rows) return "key/value must match query's B and each other's S";
    s->kernel_layout = layout == "BSH" ? jax_rope::Layout::kBSND : jax_rope::Layout::kSBND;
    auto split = [&](const std::vector<int64_t>& x, int64_t n) { return std::vector<int64_t>{x[0], x[1], n, x[2] / n}; };
    s->q_view = split(q, s->n1);
    s->k_view = split(k, s->n2);
    s->v_view = split(v, s->n2);
    s->out_view = {s->q_view[0], s->q_view[1], s->n1, s->dv};
    return "";
  }
  s->kernel_layout = layout == "BSND"   ? jax_rope::Layout::kBSND
            : layout == "BNSD" ? jax_rope::Layout::kBNSD
                               : jax_rope::Layout::kTND;
  const jax_rope::AxisRoles roles = jax_rope::LayoutRoles(s->kernel_layout);
  s->batch = jax_rope::RoleSize(q, roles.batch);
  s->q_rows = q[roles.seq];
  s->kv_rows = k[roles.seq];
  s->n1 = q[roles.head];
  s->n2 = k[roles.head];
  s->d = q.back();
  s->dv = v.back();
  if (s->n1 != a.head_num) return "headNum=" + S(a.head_num) + " but query has N=" + S(s->n1);
  if (jax_rope::RoleSize(k, roles.batch) != s->batch || jax_rope::RoleSize(v, roles.batch) != s->batch) {
    return "query, key and value must share B";
  }
  if (v[roles.seq] != s->kv_rows || v[roles.head] != s->n2) return "key and value must match except on D";
  s->q_view = q;
  s->k_view = k;
  s->v_view = v;
  s->out_view = q;
  s->out_view.back() = s->dv;
  return "";
}

jax_rope::Strides StridesOf(const std::vector<int64_t>& dims, jax_rope::Layout layout) {
  return jax_rope::StridesOf(dims, jax_rope::LayoutRoles(layout));
}

// attention.md's band rule (top-left pre'/next'), as the operator documents it:
// "band场景，preTokens和nextTokens之间必须要有交集".
std::string CheckBand(int64_t pre, int64_t nxt, int64_t sq, int64_t skv) {
  if (pre < 0 && nxt < 0) return "preTokens and nextTokens are both negative";
  if (pre < 0 && (nxt < -pre || -pre >= skv)) return "the band (preTokens < 0) selects no key";
  if (nxt < 0 && (-nxt > pre || -nxt >= sq)) return "the band (nextTokens < 0) selects no key";
  return "";
}

std::string CheckSequences(const AttentionArgs& a, const Sizes& s, std::vector<SequenceBand>* seqs) {
  if (!a.varlen) {
    seqs->assign(s.batch, SequenceBand{0, static_cast<int32_t>(s.q_rows), 0, static_cast<int32_t>(s.kv_rows), 0, 0, 0});
    return "";
  }
  const auto &q = *a.seq_q, &kv = *a.seq_kv;
  if (q.empty() || q.size() != kv.size() || q.size() > 2048) {
    return "actualSeqQLen/actualSeqKvLen must have one equal length in 1..2048, got " + S(q.size()) + " and " + S(kv.size());
  }
  int64_t q_end = 0, kv_end = 0;
  for (size_t b = 0; b < q.size(); ++b) {
    const int64_t lq = q[b] - q_end, lkv = kv[b] - kv_end;
    if (lq < 0 || lkv < 0 || lq > 1000000 || lkv > 1000000) {
      return "actualSeqQLen/actualSeqKvLen must be cumulative (non-decreasing) with lengths <= 1M, entry " + S(b);
    }
    // CANN 8.0's tiling (2024) refuses a sequence with query tokens and no key;
    // the later ones (ops-transformer 2025) take it.
    if (Shared().generation < 85 && lq > 0 && lkv == 0) {
      return "Batch(" + S(b) + ") seqLen is not 0 and sekvLen is 0, this scene is not supported";
    }
    seqs->push_back(SequenceBand{static_cast<int32_t>(q_end), static_cast<int32_t>(lq), static_cast<int32_t>(kv_end),
                                 static_cast<int32_t>(lkv), 0, 0, 0});
    q_end = q[b];
    kv_end = kv[b];
  }
  // TND: CANN 8.0's tiling wants T to be the sum of the sequence lengths
  // (tokens packed tightly); the 2025 one takes more rows ("EOD+Padding") and
  // never writes the outputs' rows after the last sequence.
  const bool padded = Shared().generation >= 85;
  if (padded ? q_end > s.q_rows || kv_end > s.kv_rows : q_end != s.q_rows || kv_end != s.kv_rows) {
    return "TND tokens must be " + std::string(padded ? "at least" : "exactly") +
           " the sequences: last actualSeqQLen/KvLen " + S(q_end) + "/" + S(kv_end) +
           " but query/key have T=" + S(s.q_rows) + "/" + S(s.kv_rows);
  }
  return "";
}

// True when `data` is a block aclrtMalloc gave on the device the process is on
// now (the real device faults on another device's memory, or on freed memory).
// Planning runs under Shared().mutex.
bool OnThisDevice(const void* data) {
  auto it = Shared().device_blocks.find(data);
  return it != Shared().device_blocks.end() && it->second == Shared().device;
}

// Modes and masks: which mask each mode needs, the token rules, the band table.
std::string CheckMaskAndBands(const AttentionArgs& a, const Sizes& s, AttentionPlan* p) {
  const int64_t mode = a.sparse_mode;
  const Tensor* m = a.atten_mask;
  if (m != nullptr && m->dtype != kAclUint8 && m->dtype != kAclBool) return "attenMask must be BOOL or UINT8";
  const bool compressed = mode == 2 || mode == 3 || mode == 4 || mode >= 6;
  if (compressed) {
    const bool prefix = mode == 6;
    const std::vector<int64_t> want = {prefix ? kPrefixRows : kCompressed, kCompressed};
    if (m == nullptr) return "sparseMode " + S(mode) + " needs the compressed attenMask (without one the operator computes full attention)";
    if (m->dims != want) return "sparseMode " + S(mode) + " needs the " + S(want[0]) + "x2048 compressed attenMask, got " + Shape(m);
    if (!OnThisDevice(m->data)) {
      return "the compressed attenMask is not device memory of this device";
    }
    const auto& expect = CompressedMask(prefix);
    if (std::memcmp(m->data, expect.data(), expect.size()) != 0) return "the compressed attenMask has the wrong contents";
  } else if (m != nullptr) {
    if (a.varlen) return "an element attenMask with TND is not simulated (jax_rope never passes one)";
    const auto& d = m->dims;
    const bool two = d.size() == 2, four = d.size() == 4;
    if (!(two || four) || d[d.size() - 2] != s.q_rows || d.back() != s.kv_rows ||
        (four && ((d[0] != 1 && d[0] != s.batch) || (d[1] != 1 && d[1] != s.n1) || (d[0] == 1 && d[1] != 1)))) {
      return "attenMask must be [B,N,Sq,Skv], [B,1,Sq,Skv], [1,1,Sq,Skv] or [Sq,Skv], got " + Shape(m);
    }
    auto& em = p->g.mask;
    em.data = static_cast<const uint8_t*>(m->data);
    em.batch = four && d[0] != 1 ? d[1] * d[2] * d[3] : 0;
    em.head = four && d[1] != 1 ? d[2] * d[3] : 0;
    em.row = s.kv_rows;
    em.col = 1;
  } else if (mode == 1 || mode == 5) {
    return "sparseMode " + S(mode) + " needs the caller's attenMask";
  }
  if (mode == 5 && s.batch != 1 && (m->dims.size() != 4 || m->dims[0] != s.batch)) {
    return "Prefix mode get invalid atten_mask shape, should be [BNSS] or [B1SS], got " + Shape(m);
  }
  p->invalid_line = a.inner_precise == 2 || !(mode == 1 || mode == 5 || (mode == 0 && m != nullptr));
  // prefix: modes 5 and 6 only, one entry per batch.
  const bool wants_prefix = mode == 5 || mode == 6;
  const size_t batch = p->seqs.size();
  if (wants_prefix && (a.prefix == nullptr || a.prefix->size() != batch)) {
    return "sparseMode " + S(mode) + " needs prefix with one entry per batch (" + S(batch) + ")";
  }
  if (!wants_prefix && a.prefix != nullptr && !a.prefix->empty()) return "prefix is only for sparseMode 5/6";
  int64_t first = -1, last = -1;
  for (size_t b = 0; b < batch; ++b) {
    if (p->seqs[b].q_len > 0) { if (first < 0) first = b; last = b; }
  }
  const int64_t pre = std::min(a.pre_tokens, kUnlimited);
  const int64_t nxt = std::clamp(a.next_tokens, -kUnlimited, kUnlimited);
  for (size_t b = 0; b < batch; ++b) {
    SequenceBand& q = p->seqs[b];
    const int64_t sq = q.q_len, skv = q.kv_len, delta = skv - sq;
    int64_t lo = -kUnlimited, hi = kUnlimited, floor = -kUnlimited;
    std::string band;
    if (mode == 0 && m != nullptr) {
      // The operator applies only the mask element by element; pre/next only
      // let it skip whole blocks ("attenMask must match preTokens/nextTokens").
      band = CheckBand(a.pre_tokens, a.next_tokens, sq, skv);
    } else if (mode == 2) {
      hi = 0;
    } else if (mode == 3) {
      if (a.varlen && sq > skv) return "sparseMode 3 with TND needs Sq <= Skv in every batch (batch " + S(b) + ")";
      hi = delta;
    } else if (mode == 4) {
      band = CheckBand(a.pre_tokens - delta, a.next_tokens + delta, sq, skv);
      lo = delta - pre, hi = nxt + delta;
    } else if (wants_prefix) {
      const int64_t n = (*a.prefix)[b];
      if (n < std::max<int64_t>(skv - sq, 0) || n > skv) {
        return "prefix[" + S(b) + "]=" + S(n) + " outside [max(Skv-Sq,0), Skv] = [" + S(std::max<int64_t>(skv - sq, 0)) + ", " + S(skv) + "]";
      }
      hi = delta, floor = n - 1;
    } else if (mode == 7 || mode == 8) {
      const bool is_band = static_cast<int64_t>(b) == (mode == 7 ? last : first);
      if (is_band && mode == 7 && (a.pre_tokens < skv || a.next_tokens > 0 || a.next_tokens < sq - skv)) {
        return "sparseMode 7 needs preTokens >= last Skv and last Sq - last Skv <= nextTokens <= 0";
      }
      if (is_band && mode == 8 && (a.pre_tokens < skv || a.next_tokens < sq - skv)) {
        return "sparseMode 8 needs preTokens >= first Skv and nextTokens >= first Sq - first Skv";
      }
      hi = is_band ? nxt + delta : (mode == 7 ? delta : 0);
    }
    if (!band.empty() && sq > 0) return "sparseMode " + S(mode) + ", batch " + S(b) + ": " + band;
    auto clip = [](int64_t x) { return static_cast<int32_t>(std::clamp(x, -kUnlimited, kUnlimited)); };
    q.lo_off = clip(lo);
    q.hi_off = clip(hi);
    q.hi_floor = clip(floor);
  }
  return "";
}

std::string Require(const Tensor* t, const std::vector<int64_t>& dims, int32_t dtype, const char* name) {
  if (t->dims != dims || t->dtype != dtype) {
    Tensor want{dims, dtype, nullptr};
    return std::string(name) + " must be " + Shape(&want) + " of aclDataType " + S(dtype) + ", got " +
           Shape(t) + " of " + S(t->dtype);
  }
  return "";
}

std::string Check(const AttentionArgs& a, AttentionPlan* p, bool* null_argument) {
  *null_argument = true;
  const std::string op = a.op;
  if (!a.query || !a.key || !a.value || !a.layout || !a.softmax_max || !a.softmax_sum || !a.attention) {
    return "a required tensor (query, key, value, softmaxMax, softmaxSum, attention) or inputLayout is null";
  }
  if (!a.backward && !a.softmax_io) return "softmaxOutOut is a required output (pass an empty tensor)";
  if (a.backward && (!a.dy || !a.dq || !a.dk || !a.dv || !a.dpse)) return "dy, dqOut, dkOut, dvOut and dpseOut are required";
  if (a.varlen && (!a.seq_q || !a.seq_kv)) return "actualSeqQLen and actualSeqKvLen are required";
  *null_argument = false;
  if (a.padding_mask) return "paddingMask is not simulated (jax_rope never passes one)";
  if (!(a.keep_prob > 0.0 && a.keep_prob <= 1.0)) return "keepProb must be in (0, 1], got " + std::to_string(a.keep_prob);
  if (!std::isfinite(a.scale)) return "scaleValue must be finite";
  if (a.inner_precise < 0 || a.inner_precise > 2) return "innerPrecise must be 0, 1 or 2, got " + S(a.inner_precise);
  const std::string layout = a.layout;
  if (a.varlen ? layout != "TND" : (layout != "BSH" && layout != "SBH" && layout != "BSND" && layout != "BNSD")) {
    return "inputLayout '" + layout + "' is not one of " + (a.varlen ? "TND" : "BSH, SBH, BSND, BNSD");
  }
  const int64_t mode = a.sparse_mode;
  if (mode < 0 || mode > 8 || (!a.varlen && mode > 6) || (a.varlen && mode == 5)) {
    return "sparseMode " + S(mode) + (a.varlen ? " (TND: 0-4, 6-8)" : " (0-6 without TND)");
  }
  const int32_t dtype = a.query->dtype;
  if (!IsFloat(dtype)) return "query must be FLOAT16, BFLOAT16 or FLOAT32";
  for (const Tensor* t : {a.key, a.value, a.dy, a.dq, a.dk, a.dv}) {
    if (t && t->dtype != dtype) return "query, key, value (and dy, dq, dk, dv) must share one dtype";
  }
  Sizes s;
  if (auto e = ReadLayout(layout, a, &s); !e.empty()) return e;
  if (s.n2 <= 0 || s.n1 % s.n2 != 0) return "query N=" + S(s.n1) + " must be a multiple of key/value N=" + S(s.n2);
  if (s.n1 > 256) return "N must be <= 256, got " + S(s.n1);
  if (s.d < 1 || s.d > 768) return "D must be in 1..768, got " + S(s.d);
  if (s.dv > s.d || (layout != "BSH" && layout != "SBH" && a.key->dims.back() != s.d)) return "need qD == kD >= vD";
  if (s.batch < 1 || s.q_rows < 1 || s.kv_rows < 1) return "empty B or S";
  // Outputs (forward) or saved forward results (backward).
  std::vector<int64_t> out_dims = a.query->dims;
  out_dims.back() = (layout == "BSH" || layout == "SBH") ? s.n1 * s.dv : s.dv;
  // VarLen: [N, T, 8] in the operator's docs, per batch [N1, S_b, 8] blocks
  // in its kernel (the NTD order); the same element count as (T, N1, 8).
  const std::vector<int64_t> stats = a.varlen ? std::vector<int64_t>{s.n1, s.q_rows, kStats}
                                              : std::vector<int64_t>{s.batch, s.n1, s.q_rows, kStats};
  if (auto e = Require(a.softmax_max, stats, kAclFloat, "softmaxMax"); !e.empty()) return e;
  if (auto e = Require(a.softmax_sum, stats, kAclFloat, "softmaxSum"); !e.empty()) return e;
  if (auto e = Require(a.attention, out_dims, dtype, a.backward ? "attentionIn" : "attentionOut"); !e.empty()) return e;
  if (a.softmax_io && a.softmax_io->elements() != 0) {
    return a.backward ? "softmaxIn is not simulated (jax_rope passes none)" : "softmaxOutOut is reserved: pass an empty tensor";
  }
  if (a.backward) {
    if (auto e = Require(a.dy, out_dims, dtype, "dy"); !e.empty()) return e;
    if (auto e = Require(a.dq, a.query->dims, dtype, "dqOut"); !e.empty()) return e;
    if (auto e = Require(a.dk, a.key->dims, dtype, "dkOut"); !e.empty()) return e;
    if (auto e = Require(a.dv, a.value->dims, dtype, "dvOut"); !e.empty()) return e;
  }
  if (auto e = CheckSequences(a, s, &p->seqs); !e.empty()) return e;
  auto& g = p->g;
  g.batch = static_cast<int64_t>(p->seqs.size());
  g.q_heads = s.n1;
  g.kv_heads = s.n2;
  g.head_dim = s.d;
  g.value_dim = s.dv;
  g.scale = static_cast<float>(a.scale);
  g.q = StridesOf(s.q_view, s.kernel_layout);
  g.k = StridesOf(s.k_view, s.kernel_layout);
  g.v = StridesOf(s.v_view, s.kernel_layout);
  g.out = StridesOf(s.out_view, s.kernel_layout);
  p->n1 = s.n1;
  p->q_rows = s.q_rows;
  g.stats = a.varlen ? jax_rope::Strides{0, s.n1 * kStats, kStats}  // a (T, N1, 8) scratch
                     : jax_rope::Strides{s.n1 * s.q_rows * kStats, kStats, s.q_rows * kStats};
  if (auto e = CheckMaskAndBands(a, s, p); !e.empty()) return e;
  const int64_t sequences = a.varlen ? static_cast<int64_t>(p->seqs.size()) : s.batch;
  return BiasCheck(a, BiasSizes{sequences, s.n1, s.q_rows, s.kv_rows, a.varlen}, p->seqs, &p->bias);
}

}  // namespace

std::string PlanAttention(const AttentionArgs& args, std::shared_ptr<AttentionPlan>* plan, bool* null_argument) {
  auto p = std::make_shared<AttentionPlan>();
  p->a = args;
  if (std::string e = Check(args, p.get(), null_argument); !e.empty()) return std::string(args.op) + ": " + e;
  *plan = std::move(p);
  return "";
}

std::vector<const Tensor*> PlanTensors(const AttentionPlan& plan) {
  const AttentionArgs& a = plan.a;
  return {a.query, a.key, a.value, a.dy, a.atten_mask, a.softmax_max, a.softmax_sum,
          a.softmax_io, a.attention, a.dq, a.dk, a.dv, a.dpse, a.pse, a.drop_mask};
}

}  // namespace jax_rope_sim
