// The test problems of attention_kernel_test.cc: geometry, bands and operands
// (random tensors, bias, dropout) of one case, and which positions the spec
// (spec/attention.md) makes visible.
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
  // float32 outputs, where larger than the dtype's tolerance: a score's rounding
  // (relative to |q.k|) reaches exp() multiplied by the scale.
  double out_tol = 0.0;
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

}  // namespace jax_rope::cpu::test
