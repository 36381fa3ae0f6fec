// The double-precision reference of a test problem (attention_problem.h),
// written from spec/attention.md and spec/attention_bias_dropout.md (no kernel
// code): part of attention_kernel_test.cc.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "device_kernels/cpu/tests/attention_problem.h"

namespace jax_rope::cpu::test {

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

}  // namespace jax_rope::cpu::test
