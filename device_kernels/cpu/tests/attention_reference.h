// The test problems (the cases below) and their double-precision reference,
// written from spec/attention.md (no kernel code): part of attention_kernel_test.cc.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "device_kernels/cpu/attention_kernels.h"
#include "device_kernels/cpu/threefry.h"

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
  // Positional bias and dropout (spec/attention_bias_dropout.md), in the
  // canonical operand forms of the kernels (attention_kernels.h).
  BiasKind bias = BiasKind::kNone;
  bool after_scale = false;   // pse_type 0 and ALiBi; pse_type 1 otherwise
  int64_t bias_batch = 1;     // 1 or B: tensor/compressed Bp, ALiBi slope rows
  bool bias_rows = true;      // batched kTensor: R = Sq (false: row-broadcast R = 1)
  std::vector<int32_t> offsets;  // ALiBi: per table row (q_start_idx, kv_start_idx)
  DropoutMode dropout = DropoutMode::kNone;
  double keep_prob = 1.0;
};

struct Tensors {
  AttentionGeometry g;
  std::vector<float> q, k, v, dout;      // values exactly representable in the dtype
  std::vector<uint8_t> mask;
  std::vector<float> bias;              // values exactly representable in the dtype
  std::vector<int64_t> seq_base;
  std::vector<int32_t> offsets;
  std::vector<uint32_t> drop_keys, drop_rows;
  std::vector<uint8_t> drop_mask;
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

bool Visible(const AttentionGeometry& g, const SequenceBand& s, int64_t b, int64_t n, int64_t i,
             int64_t j);

// Bias operand, ALiBi slopes/offsets and dropout operands of a problem. Tensor
// entries that only invisible positions read hold NaN or Inf: they must have
// no effect. The caller points g.bias.data at the typed copy of t.bias.
template <typename T>
void MakeBiasDropout(const Problem& p, Tensors& t, std::mt19937& rng) {
  AttentionGeometry& g = t.g;
  const int64_t nb = static_cast<int64_t>(p.seqs.size()), n1 = p.n1;
  PositionBias& pb = g.bias;
  pb.kind = p.bias;
  pb.after_scale = p.after_scale;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int64_t size = 0, c_total = 0, max_kv = 1;
  for (const SequenceBand& s : p.seqs) {
    c_total += int64_t{s.q_len} * s.kv_len;
    max_kv = std::max<int64_t>(max_kv, s.kv_len);
  }
  t.seq_base.assign(nb, 0);
  const bool unique = p.bias == BiasKind::kPacked ||
                      (p.bias == BiasKind::kTensor && !p.packed && p.bias_rows &&
                       p.bias_batch == nb && (p.mask_kind == 0 || p.mask_kind == 1));
  int64_t c_b = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const SequenceBand& s = p.seqs[b];
    const int64_t bb = p.bias_batch == 1 ? 0 : b;
    switch (p.bias) {
      case BiasKind::kTensor:
        if (p.packed) {  // (N1, Tkv)
          t.seq_base[b] = s.kv_start;
          pb.head = p.skv;
          size = n1 * p.skv;
        } else {         // (Bp, N1, R, Skv)
          const int64_t rows = p.bias_rows ? p.sq : 1;
          t.seq_base[b] = bb * n1 * rows * p.skv;
          pb.head = rows * p.skv;
          pb.row = p.bias_rows ? p.skv : 0;
          size = p.bias_batch * n1 * rows * p.skv;
        }
        break;
      case BiasKind::kPacked:  // (N1, C)
        t.seq_base[b] = c_b;
        c_b += int64_t{s.q_len} * s.kv_len;
        pb.head = c_total;
        pb.row_is_kv_len = true;
        size = n1 * c_total;
        break;
      case BiasKind::kCompressed:  // (Bp, N1, 1024, W)
        pb.width = p.packed ? max_kv : p.skv;
        t.seq_base[b] = bb * n1 * 1024 * pb.width;
        pb.head = 1024 * pb.width;
        size = p.bias_batch * n1 * 1024 * pb.width;
        break;
      case BiasKind::kAlibi:
      case BiasKind::kAlibiSqrt:
        size = p.bias_batch * n1;  // slopes (Bs, N1)
        pb.slope_batch = p.bias_batch == 1 ? 0 : n1;
        break;
      case BiasKind::kNone:
        break;
    }
  }
  t.bias.resize(size);
  const bool alibi = p.bias == BiasKind::kAlibi || p.bias == BiasKind::kAlibiSqrt;
  for (float& x : t.bias) {
    x = alibi ? 0.05f + 0.4f * std::abs(normal(rng)) : RoundTo<T>(normal(rng));
  }
  if (unique) {
    int64_t poison = 0;
    for (int64_t b = 0; b < nb; ++b) {
      const SequenceBand& s = p.seqs[b];
      for (int64_t n = 0; n < n1; ++n) {
        for (int64_t i = 0; i < s.q_len; ++i) {
          for (int64_t j = 0; j < s.kv_len; ++j) {
            if (Visible(g, s, b, n, i, j)) continue;
            const float bad[3] = {NAN, INFINITY, -INFINITY};
            t.bias[t.seq_base[b] + n * pb.head + i * (p.packed ? s.kv_len : pb.row) + j] =
                bad[poison++ % 3];
          }
        }
      }
    }
  }
  pb.seq_base = t.seq_base.data();
  if (alibi) {
    t.offsets = p.offsets;
    t.offsets.resize(2 * nb, 0);
    pb.offsets = t.offsets.data();
    pb.data = t.bias.data();
  }
  // Dropout: position words as the Python side makes them (spec section 3.3).
  Dropout& dr = g.dropout;
  dr.mode = p.dropout;
  if (p.dropout == DropoutMode::kNone) return;
  dr.threshold = static_cast<uint32_t>(std::floor(p.keep_prob * 4294967296.0));
  dr.keep_scale = static_cast<float>(1.0 / p.keep_prob);
  std::uniform_int_distribution<uint32_t> words;
  t.drop_keys.resize(2 * nb);
  for (uint32_t& k : t.drop_keys) k = words(rng);
  t.drop_rows.resize(nb * n1);
  int64_t q_b = 0, e_b = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const SequenceBand& s = p.seqs[b];
    for (int64_t n = 0; n < n1; ++n) {
      const int64_t rows = p.packed ? n1 * q_b + n * s.q_len : (b * n1 + n) * p.sq;
      const int64_t bits = p.packed ? n1 * e_b + n * s.q_len * s.kv_len : rows * p.skv;
      t.drop_rows[b * n1 + n] = static_cast<uint32_t>(p.dropout == DropoutMode::kKey ? rows : bits);
    }
    q_b += s.q_len;
    e_b += int64_t{s.q_len} * s.kv_len;
  }
  if (p.dropout == DropoutMode::kMask) {
    const int64_t numel = p.packed ? n1 * e_b : nb * n1 * p.sq * p.skv;
    t.drop_mask.resize((numel + 7) / 8 + 3);
    std::bernoulli_distribution keep(p.keep_prob);
    for (uint8_t& byte : t.drop_mask) {
      byte = 0;
      for (int bit = 0; bit < 8; ++bit) byte |= keep(rng) ? 1 << bit : 0;
    }
  }
  dr.keys = t.drop_keys.data();
  dr.rows = t.drop_rows.data();
  dr.mask = t.drop_mask.data();
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
  MakeBiasDropout<T>(p, t, rng);
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

// The bias value P(b, n, i, j) of spec section 2.1 in the canonical forms.
double ReferenceBias(const Problem& p, const Tensors& t, int64_t b, int64_t n, int64_t i,
                     int64_t j) {
  const PositionBias& pb = t.g.bias;
  const SequenceBand& s = p.seqs[b];
  const int64_t bb = p.bias_batch == 1 ? 0 : b;
  switch (p.bias) {
    case BiasKind::kNone:
      return 0.0;
    case BiasKind::kTensor:
      if (p.packed) return t.bias[n * p.skv + s.kv_start + j];
      return t.bias[((bb * p.n1 + n) * (p.bias_rows ? p.sq : 1) + (p.bias_rows ? i : 0)) * p.skv +
                    j];
    case BiasKind::kPacked:
      return t.bias[n * pb.head + t.seq_base[b] + i * s.kv_len + j];
    case BiasKind::kCompressed: {
      const int64_t w = pb.width, d = i - j;
      const int64_t base = (bb * p.n1 + n) * 1024 * w;
      if (d >= 0) return t.bias[base + 1023 * w + w - 1 - d];
      if (d >= -1023) return t.bias[base + (1023 + d) * w + w - 1];
      return 0.0;
    }
    case BiasKind::kAlibi:
    case BiasKind::kAlibiSqrt: {
      const double dist = double(j + t.offsets[2 * b + 1]) - double(i + t.offsets[2 * b]);
      const double a = p.bias == BiasKind::kAlibi ? std::abs(dist) : std::sqrt(std::abs(dist));
      return -double(t.bias[bb * p.n1 + n]) * a;
    }
  }
  return 0.0;
}

// keep(b, n, i, j) / keep_prob of spec section 3 (1 without dropout).
double ReferenceKeep(const Problem& p, const Tensors& t, int64_t b, int64_t n, int64_t i,
                     int64_t j) {
  if (p.dropout == DropoutMode::kNone) return 1.0;
  const uint32_t rows = t.drop_rows[b * p.n1 + n];
  bool keep;
  if (p.dropout == DropoutMode::kKey) {
    const uint32_t y0 = Threefry2x32(t.drop_keys[2 * b], t.drop_keys[2 * b + 1],
                                     uint32_t(rows + i), uint32_t(j)).y0;
    keep = y0 < uint64_t(std::floor(p.keep_prob * 4294967296.0));
  } else {
    const uint64_t e = rows + uint64_t(i) * p.seqs[b].kv_len + j;
    keep = (t.drop_mask[e / 8] >> (e % 8)) & 1;
  }
  return keep ? 1.0 / p.keep_prob : 0.0;
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
          const double bias = ReferenceBias(p, t, b, n, i, j);
          const double score =
              p.after_scale ? double(g.scale) * dot + bias : double(g.scale) * (dot + bias);
          cols.push_back(j);
          sc.push_back(score);
          r.scores[b * t.score_strides[0] + n * t.score_strides[1] +
                   (s.q_start + i) * t.score_strides[2] + s.kv_start + j] = score;
        }
        if (cols.empty()) continue;
        const double mx = *std::max_element(sc.begin(), sc.end());
        double sum = 0.0;
        for (double x : sc) sum += std::exp(x - mx);
        r.max[so] = mx;
        r.sum[so] = sum;
        r.live[so] = 1;
        std::vector<double> prob(cols.size()), dprob(cols.size()), keep(cols.size());
        for (size_t c = 0; c < cols.size(); ++c) {
          prob[c] = std::exp(sc[c] - mx) / sum;
          keep[c] = ReferenceKeep(p, t, b, n, i, cols[c]);
        }
        double delta = 0.0;
        for (size_t c = 0; c < cols.size(); ++c) {
          const int64_t vo = Off(g.v, b, s.kv_start + cols[c], h);
          double dp = 0.0;
          for (int64_t e = 0; e < g.value_dim; ++e) {
            r.out[oo + e] += prob[c] * keep[c] * t.v[vo + e];
            dp += double(t.dout[oo + e]) * t.v[vo + e];
          }
          dprob[c] = dp * keep[c];  // dP = dZ * R; delta = sum P dP = dO . O
          delta += prob[c] * dprob[c];
        }
        for (size_t c = 0; c < cols.size(); ++c) {
          const double ds = prob[c] * (dprob[c] - delta);
          const int64_t ko = Off(g.k, b, s.kv_start + cols[c], h);
          const int64_t vo = Off(g.v, b, s.kv_start + cols[c], h);
          for (int64_t e = 0; e < g.head_dim; ++e) {
            r.dq[qo + e] += g.scale * ds * t.k[ko + e];
            r.dk[ko + e] += g.scale * ds * t.q[qo + e];
          }
          for (int64_t e = 0; e < g.value_dim; ++e) {
            r.dv[vo + e] += prob[c] * keep[c] * t.dout[oo + e];
          }
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

  // Positional bias and dropout.
  p = Batched("pse full type 1 + mask per b,n + band", 2, 90, 110, -50, 30);
  p.mask_kind = 1;
  p.bias = BiasKind::kTensor;
  p.bias_batch = 2;
  cases.push_back(p);
  p = Batched("pse row type 0 causal gqa + dropout key", 2, 130, 130, -kInf, 0);
  p.n1 = 4;
  p.n2 = 2;
  p.bias = BiasKind::kTensor;
  p.bias_rows = false;
  p.after_scale = true;
  p.dropout = DropoutMode::kKey;
  p.keep_prob = 0.8;
  cases.push_back(p);
  p = Batched("pse compressed type 0", 2, 100, 100, -kInf, kInf);
  p.bias = BiasKind::kCompressed;
  p.after_scale = true;
  p.bias_batch = 2;
  cases.push_back(p);
  p = Batched("alibi offsets + dropout mask", 2, 70, 150, -kInf, 80);
  p.bias = BiasKind::kAlibi;
  p.after_scale = true;
  p.bias_batch = 2;
  p.offsets = {3, 5, -7, 2};
  p.dropout = DropoutMode::kMask;
  p.keep_prob = 0.7;
  cases.push_back(p);
  p = Packed("packed pse type 1 + dropout key", {Seq(0, 5, 0, 7, -kInf, 2), Seq(0, 0, 0, 0),
                                                 Seq(0, 70, 0, 66), Seq(0, 3, 0, 0),
                                                 Seq(0, 80, 0, 90, -kInf, 10)});
  p.n1 = 4;
  p.n2 = 2;
  p.d = 24;
  p.dv = 8;
  p.bias = BiasKind::kPacked;
  p.dropout = DropoutMode::kKey;
  p.keep_prob = 0.9;
  p.scale = -0.3f;
  cases.push_back(p);
  p = Packed("packed row pse type 0 + mask + dropout mask",
             {Seq(0, 33, 0, 40, -kInf, 7), Seq(0, 66, 0, 66, -kInf, 0), Seq(0, 1, 0, 1)});
  p.mask_kind = 2;
  p.n2 = 1;
  p.bias = BiasKind::kTensor;
  p.after_scale = true;
  p.dropout = DropoutMode::kMask;
  p.keep_prob = 0.5;
  cases.push_back(p);
  p = Packed("packed alibi sqrt, offsets of row 0 (mode 8)",
             {Seq(0, 20, 0, 30, -kInf, 10), Seq(0, 70, 0, 70, -kInf, 0)});
  p.bias = BiasKind::kAlibiSqrt;
  p.after_scale = true;
  p.offsets = {10, 0, 0, 0};
  cases.push_back(p);
  p = Packed("packed compressed type 1 + dropout key",
             {Seq(0, 40, 0, 40, -kInf, 0), Seq(0, 75, 0, 75, -kInf, 0)});
  p.bias = BiasKind::kCompressed;
  p.dropout = DropoutMode::kKey;
  p.keep_prob = 0.6;
  cases.push_back(p);
  // Short query blocks (the flash-decoding path): head groups of 1 to 8, more
  // than one key chunk (kSplitKeys), dot and GEMM score routines, odd D.
  p = Batched("decode gqa G=4 bottom-right", 2, 1, 2100, -kInf, 2099);
  p.n1 = 8;
  p.n2 = 2;
  p.d = p.dv = 128;
  cases.push_back(p);
  p = Batched("decode G=8 mask + alibi + dropout key", 2, 2, 1500, -kInf, 1498);
  p.n1 = 8;
  p.n2 = 1;
  p.mask_kind = 1;
  p.bias = BiasKind::kAlibi;
  p.after_scale = true;
  p.offsets = {0, 0, 3, -2};
  p.bias_batch = 2;
  p.dropout = DropoutMode::kKey;
  p.keep_prob = 0.9;
  cases.push_back(p);
  p = Batched("verify G=2 gemm scores d=40 dv=24", 1, 20, 1300, -kInf, 1280);
  p.n1 = 4;
  p.n2 = 2;
  p.d = 40;
  p.dv = 24;
  cases.push_back(p);
  p = Batched("decode G=1 band + prefix + pse type 1", 2, 3, 1100, -500, 1097, 10);
  p.n1 = p.n2 = 2;
  p.bias = BiasKind::kTensor;
  cases.push_back(p);
  p = Packed("packed decode G=4 + dropout mask",
             {Seq(0, 1, 0, 1500, -kInf, 1499), Seq(0, 0, 0, 5), Seq(0, 2, 0, 0),
              Seq(0, 3, 0, 40, -kInf, 37), Seq(0, 1, 0, 1030, -kInf, -kInf)});
  p.n1 = 4;
  p.n2 = 1;
  p.d = 64;
  p.dv = 48;
  p.dropout = DropoutMode::kMask;
  p.keep_prob = 0.7;
  cases.push_back(p);
  return cases;
}

}  // namespace jax_rope::cpu::test
