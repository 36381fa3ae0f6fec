// The test problems (the cases below) and their double-precision reference,
// written from spec/attention.md (no kernel code): part of attention_kernel_test.cc.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "device_kernels/cpu/attention_kernels.h"

namespace jax_rope::cpu::test {

constexpr int32_t kInf = 1 << 30;

// ---------------------------------------------------------------------------
// Problem description and reference.

struct Problem {
  std::string name;
  bool packed = false;        // TND: batch stride 0, rows at q_start / kv_start
  bool heads_major = false;   // batched BNSD instead of BSND
  int64_t n1 = 2, n2 = 2, d = 32, dv = 32;
  int64_t sq = 0, skv = 0;    // batched: padded lengths; packed: totals
  std::vector<SequenceBand> seqs;
  int mask_kind = 0;          // 0 none, 1 per (b, n), 2 broadcast over b and n, 3 per b
  double mask_density = 0.3;
  float scale = 0.0f;         // 0: 1/sqrt(d)
  double stat_tol = 1e-5;     // float32 statistics (large scores lose relative precision)
};

struct Tensors {
  AttentionGeometry g;
  std::vector<float> q, k, v, dout;      // values exactly representable in the dtype
  std::vector<uint8_t> mask;
  int64_t q_size = 0, k_size = 0, v_size = 0, o_size = 0, stat_size = 0;
  int64_t score_strides[3] = {0, 0, 0};
  int64_t score_size = 0;
};

Strides TensorStrides(const Problem& p, int64_t seq_len, int64_t heads, int64_t dim) {
  if (p.packed) return {0, heads * dim, dim};
  if (p.heads_major) return {heads * seq_len * dim, dim, seq_len * dim};
  return {seq_len * heads * dim, heads * dim, dim};
}

template <typename T>
float RoundTo(float x) {
  return ToFloat(FromFloat<T>(x));
}

template <typename T>
Tensors MakeTensors(const Problem& p, std::mt19937& rng) {
  Tensors t;
  const int64_t b = static_cast<int64_t>(p.seqs.size());
  AttentionGeometry& g = t.g;
  g.batch = b;
  g.q_heads = p.n1;
  g.kv_heads = p.n2;
  g.head_dim = p.d;
  g.value_dim = p.dv;
  g.scale = p.scale != 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(p.d));
  g.q = TensorStrides(p, p.sq, p.n1, p.d);
  g.k = TensorStrides(p, p.skv, p.n2, p.d);
  g.v = TensorStrides(p, p.skv, p.n2, p.dv);
  g.out = TensorStrides(p, p.sq, p.n1, p.dv);
  g.stats = p.packed ? Strides{0, p.n1, 1} : Strides{p.n1 * p.sq, 1, p.sq};
  const int64_t nb = p.packed ? 1 : b;
  t.q_size = nb * p.sq * p.n1 * p.d;
  t.k_size = nb * p.skv * p.n2 * p.d;
  t.v_size = nb * p.skv * p.n2 * p.dv;
  t.o_size = nb * p.sq * p.n1 * p.dv;
  t.stat_size = nb * p.sq * p.n1;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto fill = [&](std::vector<float>& x, int64_t n, float s) {
    x.resize(n);
    for (float& e : x) e = RoundTo<T>(normal(rng) * s);
  };
  fill(t.q, t.q_size, 1.5f);
  fill(t.k, t.k_size, 1.5f);
  fill(t.v, t.v_size, 1.0f);
  fill(t.dout, t.o_size, 1.0f);
  if (p.packed) {
    t.score_strides[0] = 0;
    t.score_strides[1] = p.sq * p.skv;
    t.score_strides[2] = p.skv;
    t.score_size = p.n1 * p.sq * p.skv;
  } else {
    t.score_strides[0] = p.n1 * p.sq * p.skv;
    t.score_strides[1] = p.sq * p.skv;
    t.score_strides[2] = p.skv;
    t.score_size = b * p.n1 * p.sq * p.skv;
  }
  if (p.mask_kind != 0) {
    // Window size: per-sequence rows/cols up to the padded or the largest length.
    int64_t rows = p.sq, cols = p.skv;
    if (p.packed) {
      rows = cols = 1;
      for (const SequenceBand& s : p.seqs) {
        rows = std::max<int64_t>(rows, s.q_len);
        cols = std::max<int64_t>(cols, s.kv_len);
      }
    }
    const int64_t mb = p.mask_kind == 1 || p.mask_kind == 3 ? b : 1;
    const int64_t mh = p.mask_kind == 1 ? p.n1 : 1;
    t.mask.resize(mb * mh * rows * cols);
    std::bernoulli_distribution masked(p.mask_density);
    for (auto& m : t.mask) m = masked(rng) ? 1 : 0;
    // One fully masked row per window to exercise dead rows from the mask alone.
    for (int64_t w = 0; w < mb * mh; ++w) {
      std::fill_n(t.mask.begin() + (w * rows + rows / 3) * cols, cols, 1);
    }
    g.mask.data = t.mask.data();
    g.mask.col = 1;
    g.mask.row = cols;
    g.mask.head = mh == 1 ? 0 : rows * cols;
    g.mask.batch = mb == 1 ? 0 : mh * rows * cols;
  }
  return t;
}

bool Visible(const AttentionGeometry& g, const SequenceBand& s, int64_t b, int64_t n, int64_t i,
             int64_t j) {
  const int64_t lo = std::max<int64_t>(0, i + s.lo_off);
  const int64_t hi =
      std::min<int64_t>(s.kv_len - 1, std::max<int64_t>(i + s.hi_off, s.hi_floor));
  if (j < lo || j > hi) return false;
  if (g.mask.data == nullptr) return true;
  return g.mask.data[b * g.mask.batch + n * g.mask.head + i * g.mask.row + j * g.mask.col] == 0;
}

struct Reference {
  std::vector<double> out, max, sum, dq, dk, dv, scores;
  std::vector<char> live;  // per stat index: row inside a sequence with a visible key
};

int64_t Off(const Strides& s, int64_t b, int64_t row, int64_t head) {
  return b * s.batch + row * s.seq + head * s.head;
}

Reference ComputeReference(const Problem& p, const Tensors& t) {
  const AttentionGeometry& g = t.g;
  Reference r;
  r.out.assign(t.o_size, 0.0);
  r.max.assign(t.stat_size, kMaskValue);
  r.sum.assign(t.stat_size, kDeadRowSum);
  r.live.assign(t.stat_size, 0);
  r.dq.assign(t.q_size, 0.0);
  r.dk.assign(t.k_size, 0.0);
  r.dv.assign(t.v_size, 0.0);
  r.scores.assign(t.score_size, kMaskValue);
  const int64_t group = g.q_heads / g.kv_heads;
  for (int64_t b = 0; b < g.batch; ++b) {
    const SequenceBand& s = p.seqs[b];
    for (int64_t n = 0; n < g.q_heads; ++n) {
      const int64_t h = n / group;
      for (int64_t i = 0; i < s.q_len; ++i) {
        const int64_t qo = Off(g.q, b, s.q_start + i, n);
        const int64_t oo = Off(g.out, b, s.q_start + i, n);
        const int64_t so = Off(g.stats, b, s.q_start + i, n);
        std::vector<int64_t> cols;
        std::vector<double> sc;
        for (int64_t j = 0; j < s.kv_len; ++j) {
          if (!Visible(g, s, b, n, i, j)) continue;
          const int64_t ko = Off(g.k, b, s.kv_start + j, h);
          double dot = 0.0;
          for (int64_t c = 0; c < g.head_dim; ++c) dot += double(t.q[qo + c]) * t.k[ko + c];
          cols.push_back(j);
          sc.push_back(double(g.scale) * dot);
          r.scores[b * t.score_strides[0] + n * t.score_strides[1] +
                   (s.q_start + i) * t.score_strides[2] + s.kv_start + j] = g.scale * dot;
        }
        if (cols.empty()) continue;
        const double mx = *std::max_element(sc.begin(), sc.end());
        double sum = 0.0;
        for (double x : sc) sum += std::exp(x - mx);
        r.max[so] = mx;
        r.sum[so] = sum;
        r.live[so] = 1;
        std::vector<double> prob(cols.size()), dprob(cols.size());
        for (size_t c = 0; c < cols.size(); ++c) prob[c] = std::exp(sc[c] - mx) / sum;
        double delta = 0.0;
        for (size_t c = 0; c < cols.size(); ++c) {
          const int64_t vo = Off(g.v, b, s.kv_start + cols[c], h);
          double dp = 0.0;
          for (int64_t e = 0; e < g.value_dim; ++e) {
            r.out[oo + e] += prob[c] * t.v[vo + e];
            dp += double(t.dout[oo + e]) * t.v[vo + e];
          }
          dprob[c] = dp;
          delta += prob[c] * dp;
        }
        for (size_t c = 0; c < cols.size(); ++c) {
          const double ds = prob[c] * (dprob[c] - delta);
          const int64_t ko = Off(g.k, b, s.kv_start + cols[c], h);
          const int64_t vo = Off(g.v, b, s.kv_start + cols[c], h);
          for (int64_t e = 0; e < g.head_dim; ++e) {
            r.dq[qo + e] += g.scale * ds * t.k[ko + e];
            r.dk[ko + e] += g.scale * ds * t.q[qo + e];
          }
          for (int64_t e = 0; e < g.value_dim; ++e) r.dv[vo + e] += prob[c] * t.dout[oo + e];
        }
      }
    }
  }
  return r;
}

// ---------------------------------------------------------------------------
// Cases.

SequenceBand Seq(int32_t q_start, int32_t q_len, int32_t kv_start, int32_t kv_len,
                 int32_t lo_off = -kInf, int32_t hi_off = kInf, int32_t hi_floor = -kInf) {
  return {q_start, q_len, kv_start, kv_len, lo_off, hi_off, hi_floor};
}

Problem Batched(const std::string& name, int64_t b, int64_t sq, int64_t skv, int32_t lo_off,
                int32_t hi_off, int32_t hi_floor = -kInf) {
  Problem p;
  p.name = name;
  p.sq = sq;
  p.skv = skv;
  for (int64_t i = 0; i < b; ++i) p.seqs.push_back(Seq(0, sq, 0, skv, lo_off, hi_off, hi_floor));
  return p;
}

// Packed sequences of the given (q_len, kv_len), each with its own band.
Problem Packed(const std::string& name, const std::vector<SequenceBand>& bands,
              int32_t padding_rows = 3) {
  Problem p;
  p.name = name;
  p.packed = true;
  int32_t qs = 0, ks = 0;
  for (SequenceBand s : bands) {
    s.q_start = qs;
    s.kv_start = ks;
    qs += s.q_len;
    ks += s.kv_len;
    p.seqs.push_back(s);
  }
  p.sq = qs + padding_rows;  // rows beyond the last sequence
  p.skv = ks + padding_rows;
  return p;
}

std::vector<Problem> Cases() {
  std::vector<Problem> cases;
  cases.push_back(Batched("no limit", 2, 100, 90, -kInf, kInf));
  cases.push_back(Batched("causal", 2, 130, 130, -kInf, 0));
  cases.push_back(Batched("causal delta>0", 1, 70, 150, -kInf, 80));
  cases.push_back(Batched("causal delta<0", 1, 150, 70, -kInf, -80));
  cases.push_back(Batched("band", 2, 140, 140, -20, 5));
  cases.push_back(Batched("band negative hi", 1, 150, 130, -40, -7));
  cases.push_back(Batched("band wide lo", 1, 100, 200, 30, 90));
  cases.push_back(Batched("prefix", 2, 130, 150, -kInf, 20, 69));
  cases.push_back(Batched("causal long prefix", 1, 200, 200, -kInf, 0, 140));
  Problem m = Batched("mask per b,n + band", 2, 90, 110, -50, 30);
  m.mask_kind = 1;
  cases.push_back(m);
  m = Batched("mask broadcast", 2, 80, 75, -kInf, kInf);
  m.mask_kind = 2;
  m.mask_density = 0.6;
  cases.push_back(m);
  m = Batched("mask per b causal", 2, 70, 70, -kInf, 0);
  m.mask_kind = 3;
  cases.push_back(m);
  Problem p = Batched("bnsd gqa d=24 dv=16", 2, 77, 83, -kInf, 3);
  p.heads_major = true;
  p.n1 = 4;
  p.n2 = 2;
  p.d = 24;
  p.dv = 16;
  cases.push_back(p);
  p = Batched("d=128 causal", 1, 200, 200, -kInf, 0);
  p.d = p.dv = 128;
  p.n1 = 2;
  p.n2 = 1;
  cases.push_back(p);
  p = Batched("short rows in padded batch", 1, 90, 90, -kInf, 0);
  p.seqs[0].q_len = 61;
  p.seqs[0].kv_len = 70;
  p.dv = 20;
  cases.push_back(p);
  // Packed: empty sequences, kv_len 0, different bands per sequence (modes 7/8).
  p = Packed("packed varlen", {Seq(0, 5, 0, 7, -kInf, 2), Seq(0, 0, 0, 0), Seq(0, 70, 0, 66),
                               Seq(0, 3, 0, 0), Seq(0, 0, 0, 9), Seq(0, 130, 0, 140, -kInf, 10),
                               Seq(0, 9, 0, 12, -12, -2)});
  p.n1 = 4;
  p.n2 = 2;
  p.d = 24;
  p.dv = 8;
  cases.push_back(p);
  p = Packed("packed mask", {Seq(0, 33, 0, 40, -kInf, 7), Seq(0, 66, 0, 66, -kInf, 0),
                             Seq(0, 1, 0, 1)});
  p.mask_kind = 2;
  p.n1 = 2;
  p.n2 = 1;
  p.d = 40;
  p.dv = 40;
  cases.push_back(p);
  p = Packed("packed prefix + band", {Seq(0, 100, 0, 120, -kInf, 20, 49),
                                      Seq(0, 80, 0, 70, -30, 4), Seq(0, 64, 0, 64, -kInf, 0)});
  p.n1 = 3;
  p.n2 = 3;
  p.d = 16;
  p.dv = 16;
  p.scale = -0.3f;  // a negative scale must not flip masked positions
  cases.push_back(p);
  p = Packed("packed unpadded in-place", {Seq(0, 17, 0, 80, -kInf, 63), Seq(0, 64, 0, 64)}, 0);
  p.d = p.dv = 16;  // float32 operands used in place up to the tensors' last element
  cases.push_back(p);
  p = Batched("sharp scores", 1, 96, 96, -kInf, 0);
  p.scale = 40.0f;  // exp underflows for most keys; nothing may turn into NaN
  p.stat_tol = 1e-4;
  cases.push_back(p);
  cases.push_back(Batched("empty band", 1, 50, 50, 5, 2));
  cases.push_back(Batched("all visible via floor", 1, 70, 90, -kInf, -kInf + 5, kInf));
  return cases;
}

}  // namespace jax_rope::cpu::test
