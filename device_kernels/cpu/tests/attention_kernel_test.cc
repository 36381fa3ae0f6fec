// Standalone check of the CPU attention kernels against a double-precision
// reference written from spec/attention.md (no JAX). Build and run:
//   g++ -std=c++17 -O3 -fno-math-errno -fno-trapping-math -ffp-contract=off -I.
//     device_kernels/cpu/tests/attention_kernel_test.cc device_kernels/cpu/attention_kernels.cc
//     device_kernels/cpu/attention_tiles.cc -lpthread -o /tmp/attention_kernel_test
//   /tmp/attention_kernel_test          # correctness, exit status 1 on failure
//   /tmp/attention_kernel_test --bench  # causal B=1 N=8 D=128 timings, float32
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "device_kernels/cpu/attention_kernels.h"
#include "device_kernels/cpu/attention_tiles.h"

namespace {

using namespace jax_rope::cpu;

constexpr int32_t kInf = 1 << 30;
int g_failures = 0;
int g_checks = 0;

void Fail(const std::string& what) {
  if (++g_failures <= 30) std::printf("FAIL: %s\n", what.c_str());
}

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

Strides3 TensorStrides(const Problem& p, int64_t seq_len, int64_t heads, int64_t dim) {
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
  g.stats = p.packed ? Strides3{0, p.n1, 1} : Strides3{p.n1 * p.sq, 1, p.sq};
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

int64_t Off(const Strides3& s, int64_t b, int64_t row, int64_t head) {
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
// Running the kernels the way the FFI handlers do.

// Rows inside some sequence (the kernels must write them; the caller fills the rest).
std::vector<char> RowsInside(const Problem& p, const Strides3& s, int64_t size, int64_t heads,
                             int64_t dim, bool kv) {
  std::vector<char> inside(size, 0);
  for (size_t b = 0; b < p.seqs.size(); ++b) {
    const int64_t start = kv ? p.seqs[b].kv_start : p.seqs[b].q_start;
    const int64_t len = kv ? p.seqs[b].kv_len : p.seqs[b].q_len;
    for (int64_t i = 0; i < len; ++i) {
      for (int64_t n = 0; n < heads; ++n) {
        for (int64_t e = 0; e < dim; ++e) inside[Off(s, b, start + i, n) + e] = 1;
      }
    }
  }
  return inside;
}

// Caller's pre-fill outside sequences, garbage inside (which the kernels must overwrite).
template <typename T>
std::vector<T> Prefilled(const std::vector<char>& inside, float outside) {
  std::vector<T> x(inside.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = FromFloat<T>(inside[i] ? 777.0f : outside);
  return x;
}

// Runs fn over [0, n) in uneven chunks, in reverse order (items must be independent).
void RunChunks(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  std::vector<std::pair<int64_t, int64_t>> chunks;
  for (int64_t b = 0, step = 1; b < n; b += step, step = step * 2 + 1) {
    chunks.push_back({b, std::min(n, b + step)});
  }
  std::reverse(chunks.begin(), chunks.end());
  for (auto [b, e] : chunks) fn(b, e);
  fn(n, n + 5);  // empty and out-of-range ranges are no-ops
}

template <typename T>
std::vector<float> ToFloats(const std::vector<T>& x) {
  std::vector<float> f(x.size());
  for (size_t i = 0; i < x.size(); ++i) f[i] = ToFloat(x[i]);
  return f;
}

// |got - ref| <= tol * (max |ref| + |ref|), and no NaN/inf.
void Compare(const std::string& what, const std::vector<float>& got,
             const std::vector<double>& ref, double tol) {
  ++g_checks;
  double scale = 1e-3;
  for (double r : ref) {
    if (std::abs(r) < 1e37) scale = std::max(scale, std::abs(r));
  }
  double worst = 0.0;
  int64_t worst_at = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i]) && std::isfinite(ref[i])) {
      Fail(what + ": non-finite at " + std::to_string(i));
      return;
    }
    const double err = std::abs(got[i] - ref[i]) / (scale + std::abs(ref[i]));
    if (err > worst) {
      worst = err;
      worst_at = static_cast<int64_t>(i);
    }
  }
  if (worst > tol) {
    Fail(what + ": error " + std::to_string(worst) + " at " + std::to_string(worst_at) +
         " got " + std::to_string(got[worst_at]) + " want " + std::to_string(ref[worst_at]));
  }
}

template <typename T>
double Tolerance() {
  if (std::is_same_v<T, float>) return 2e-5;
  if (std::is_same_v<T, Float16>) return 4e-3;
  return 3e-2;
}

template <typename T>
void RunProblem(const Problem& p, uint32_t seed) {
  std::mt19937 rng(seed);
  Tensors t = MakeTensors<T>(p, rng);
  const AttentionGeometry& g = t.g;
  const Reference ref = ComputeReference(p, t);
  const std::string name = p.name + (std::is_same_v<T, float> ? " f32" :
                                     std::is_same_v<T, Float16> ? " f16" : " bf16");
  auto typed = [](const std::vector<float>& x) {
    std::vector<T> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = FromFloat<T>(x[i]);
    return y;
  };
  const std::vector<T> q = typed(t.q), k = typed(t.k), v = typed(t.v), dout = typed(t.dout);
  const auto o_inside = RowsInside(p, g.out, t.o_size, p.n1, p.dv, false);
  const auto s_inside = RowsInside(p, g.stats, t.stat_size, p.n1, 1, false);
  std::vector<T> out = Prefilled<T>(o_inside, 0.0f);
  std::vector<float> smax = Prefilled<float>(s_inside, kMaskValue);
  std::vector<float> ssum = Prefilled<float>(s_inside, kDeadRowSum);

  const int64_t items = ForwardWorkItems(g, p.seqs.data());
  AttentionForwardArgs<T> fa{q.data(), k.data(), v.data(), out.data(), smax.data(), ssum.data()};
  RunChunks(items, [&](int64_t b, int64_t e) { AttentionForward(g, p.seqs.data(), fa, b, e); });
  const double tol = Tolerance<T>();
  Compare(name + " out", ToFloats(out), ref.out, tol);
  Compare(name + " softmax_max", smax, ref.max, p.stat_tol);
  Compare(name + " softmax_sum", ssum, ref.sum, std::is_same_v<T, float> ? p.stat_tol : tol);
  for (int64_t i = 0; i < t.stat_size; ++i) {
    if (!ref.live[i] && (smax[i] != kMaskValue || ssum[i] != kDeadRowSum)) {
      Fail(name + ": dead row statistics at " + std::to_string(i));
      break;
    }
  }

  std::vector<float> scores(t.score_size, kMaskValue);
  RunChunks(items, [&](int64_t b, int64_t e) {
    AttentionScores(g, p.seqs.data(), q.data(), k.data(), scores.data(), t.score_strides, b, e);
  });
  Compare(name + " scores", scores, ref.scores, std::is_same_v<T, float> ? 2e-6 : 2e-5);
  for (int64_t i = 0; i < t.score_size; ++i) {
    if ((ref.scores[i] == kMaskValue) != (scores[i] == kMaskValue)) {
      Fail(name + ": scores mask pattern at " + std::to_string(i));
      break;
    }
  }

  const auto q_inside = RowsInside(p, g.q, t.q_size, p.n1, p.d, false);
  const auto k_inside = RowsInside(p, g.k, t.k_size, p.n2, p.d, true);
  const auto v_inside = RowsInside(p, g.v, t.v_size, p.n2, p.dv, true);
  std::vector<T> dq = Prefilled<T>(q_inside, 0.0f), dk = Prefilled<T>(k_inside, 0.0f);
  std::vector<T> dv = Prefilled<T>(v_inside, 0.0f);
  std::vector<float> delta(t.stat_size, 0.0f);
  AttentionBackwardArgs<T> ba{q.data(),    k.data(),    v.data(),  out.data(), dout.data(),
                              smax.data(), ssum.data(), dq.data(), dk.data(),  dv.data()};
  RunChunks(items, [&](int64_t b, int64_t e) {
    AttentionRowDelta(g, p.seqs.data(), ba, delta.data(), b, e);
  });
  RunChunks(KeyBlockWorkItems(g, p.seqs.data()), [&](int64_t b, int64_t e) {
    AttentionBackwardKeyValue(g, p.seqs.data(), ba, delta.data(), b, e);
  });
  RunChunks(items, [&](int64_t b, int64_t e) {
    AttentionBackwardQuery(g, p.seqs.data(), ba, delta.data(), b, e);
  });
  // One chunk instead of many: bitwise the same (no atomics, fixed summation order).
  std::vector<T> dq2 = dq, dk2 = dk, dv2 = dv;
  AttentionBackwardArgs<T> ba2 = ba;
  ba2.dquery = dq2.data();
  ba2.dkey = dk2.data();
  ba2.dvalue = dv2.data();
  AttentionBackwardKeyValue(g, p.seqs.data(), ba2, delta.data(), 0, 1 << 30);
  AttentionBackwardQuery(g, p.seqs.data(), ba2, delta.data(), 0, 1 << 30);
  ++g_checks;
  if (std::memcmp(dq.data(), dq2.data(), dq.size() * sizeof(T)) != 0 ||
      std::memcmp(dk.data(), dk2.data(), dk.size() * sizeof(T)) != 0 ||
      std::memcmp(dv.data(), dv2.data(), dv.size() * sizeof(T)) != 0) {
    Fail(name + ": gradients depend on the chunking");
  }
  const double gtol = std::is_same_v<T, float> ? 1e-4 : 2 * tol;
  Compare(name + " dq", ToFloats(dq), ref.dq, gtol);
  Compare(name + " dk", ToFloats(dk), ref.dk, gtol);
  Compare(name + " dv", ToFloats(dv), ref.dv, gtol);
  // Rows without a visible key: exactly zero gradient.
  for (size_t b = 0; b < p.seqs.size(); ++b) {
    for (int64_t i = 0; i < p.seqs[b].q_len; ++i) {
      for (int64_t n = 0; n < p.n1; ++n) {
        if (ref.live[Off(g.stats, b, p.seqs[b].q_start + i, n)]) continue;
        const int64_t qo = Off(g.q, b, p.seqs[b].q_start + i, n);
        for (int64_t e = 0; e < p.d; ++e) {
          if (ToFloat(dq[qo + e]) != 0.0f) {
            Fail(name + ": dead row with nonzero dq");
            return;
          }
        }
      }
    }
  }
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

// softmax_step and softmax_grad of one instruction set against double precision
// on a tile with masked (-inf) entries, fully masked columns and prior state.
void CheckSoftmaxOps(const TileOps& ops, const char* isa, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const int64_t keys = 37, cols = 48, ld = 64, out_cols = 32;
  const float scale = 7.0f, inf = INFINITY;
  std::vector<float> s(keys * ld), q_max(cols), q_sum(cols), out(cols * out_cols);
  for (int64_t j = 0; j < keys; ++j) {
    for (int64_t c = 0; c < cols; ++c) {
      s[j * ld + c] = (c % 7 == 3 || u(rng) < -0.6f) ? -inf : 3.0f * u(rng);
    }
  }
  s[5 * ld + 6] = -3.0e38f;  // far below the max: exp underflows to exactly 0
  for (int64_t c = 0; c < cols; ++c) {
    q_max[c] = c % 3 == 0 ? -inf : 10.0f * u(rng);
    q_sum[c] = c % 3 == 0 ? 0.0f : 2.0f + u(rng);
  }
  for (float& x : out) x = u(rng);
  const std::vector<float> s0 = s, max0 = q_max, sum0 = q_sum, out0 = out;
  ops.softmax_step(s.data(), ld, keys, cols, scale, q_max.data(), q_sum.data(), out.data(),
                   out_cols, 40, out_cols);
  double worst = 0.0;
  for (int64_t c = 0; c < cols; ++c) {
    double m = max0[c];
    for (int64_t j = 0; j < keys; ++j) {
      if (s0[j * ld + c] != -inf) m = std::max(m, double(scale * s0[j * ld + c]));
    }
    const double alpha = m == -inf ? 1.0 : std::exp(max0[c] - m);
    double sum = sum0[c] * alpha;
    for (int64_t j = 0; j < keys; ++j) {
      const double x = s0[j * ld + c];
      const double p = x == -inf || m == -inf ? 0.0 : std::exp(double(scale * float(x)) - m);
      sum += p;
      worst = std::max(worst, std::abs(s[j * ld + c] - p) / std::max(1e-30, p));
      if (p == 0.0 && s[j * ld + c] != 0.0f) Fail(std::string("softmax_step zero ") + isa);
    }
    if (m != double(q_max[c])) Fail(std::string("softmax_step max ") + isa);
    worst = std::max(worst, std::abs(q_sum[c] - sum) / std::max(1e-30, sum));
    for (int64_t e = 0; e < out_cols && c < 40; ++e) {
      const double want = out0[c * out_cols + e] * (m == -inf ? 1.0 : alpha);
      worst = std::max(worst, std::abs(out[c * out_cols + e] - want) / (1e-30 + std::abs(want)));
    }
  }
  ++g_checks;
  if (worst > 5e-6) Fail(std::string("softmax_step ") + isa + " " + std::to_string(worst));

  for (bool by_column : {false, true}) {
    const int64_t rows = 21;
    std::vector<float> st(rows * ld), dp(rows * ld), mx(cols), inv(cols), delta(cols);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        st[r * ld + c] = u(rng) < -0.5f ? -inf : u(rng);
        dp[r * ld + c] = u(rng);
      }
    }
    for (int64_t c = 0; c < cols; ++c) {
      const bool dead = c % 5 == 0;  // dead rows come as max 0, 1/sum 0
      mx[c] = dead ? 0.0f : 3.0f + u(rng);
      inv[c] = dead ? 0.0f : 0.5f + 0.25f * u(rng);
      delta[c] = u(rng);
    }
    const std::vector<float> st0 = st, dp0 = dp;
    ops.softmax_grad(st.data(), dp.data(), ld, rows, cols, scale, mx.data(), inv.data(),
                     delta.data(), by_column);
    double err = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t k = by_column ? c : r;
        const double x = st0[r * ld + c];
        const double p = x == -inf ? 0.0 : std::exp(scale * x - mx[k]) * inv[k];
        const double ds = p * (dp0[r * ld + c] - delta[k]);
        err = std::max(err, std::abs(st[r * ld + c] - p) / (1e-6 + p));
        err = std::max(err, std::abs(dp[r * ld + c] - ds) / (1e-6 + std::abs(ds)));
      }
    }
    ++g_checks;
    if (err > 2e-5) Fail(std::string("softmax_grad ") + isa + " " + std::to_string(err));
  }
  std::printf("tile ops %s: checked (softmax_step max rel err %.2e)\n", isa, worst);
}

// Each instruction set's tile routines against a naive evaluation.
void CheckTileOps() {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const char* names[] = {"avx512", "avx2", "baseline"};
  const TileIsa isas[] = {TileIsa::kAvx512, TileIsa::kAvx2, TileIsa::kBaseline};
  for (int which = 0; which < 3; ++which) {
    const TileOps* ops = TileOpsFor(isas[which]);
    if (ops == nullptr) {
      std::printf("tile ops %s: not supported here, skipped\n", names[which]);
      continue;
    }
    for (int64_t m : {1, 3, 4, 7, 13, 64}) {
      for (int64_t n : {1, 5, 16, 24, 33, 64, 130}) {
        for (int64_t k : {1, 9, 64}) {
          for (bool transposed_a : {false, true}) {
            const int64_t ldb = RoundUpToTile(n) + 16, ldc = RoundUpToTile(n) + 3;
            std::vector<float> a(m * k), b(k * ldb, 0.0f), c(m * ldc);
            for (float& x : a) x = u(rng);
            for (int64_t p = 0; p < k; ++p) {
              for (int64_t j = 0; j < n; ++j) b[p * ldb + j] = u(rng);
            }
            for (float& x : c) x = u(rng);
            std::vector<float> c0 = c;
            const int64_t a_row = transposed_a ? 1 : k, a_col = transposed_a ? m : 1;
            for (bool accumulate : {false, true}) {
              c = c0;
              ops->gemm(m, n, k, a.data(), a_row, a_col, b.data(), ldb, c.data(), ldc, accumulate);
              double worst = 0.0;
              for (int64_t i = 0; i < m; ++i) {
                for (int64_t j = 0; j < n; ++j) {
                  double want = accumulate ? c0[i * ldc + j] : 0.0;
                  for (int64_t p = 0; p < k; ++p) {
                    want += double(a[i * a_row + p * a_col]) * b[p * ldb + j];
                  }
                  worst = std::max(worst, std::abs(want - c[i * ldc + j]));
                }
              }
              ++g_checks;
              if (worst > 1e-4) Fail(std::string("gemm ") + names[which]);
            }
          }
        }
      }
    }
    CheckSoftmaxOps(*ops, names[which], rng);
  }
}

// ---------------------------------------------------------------------------
// Timing: causal B=1, N=8, D=128, float32.

template <typename Fn>
void Parallel(int threads, int64_t n, const Fn& fn) {
  if (threads <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  // Like xla_ffi/parallel.h: 4 chunks per thread, claimed dynamically.
  const int64_t chunks = std::min<int64_t>(n, threads * 4);
  const int64_t chunk = (n + chunks - 1) / chunks;
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t i = next.fetch_add(1); i < chunks; i = next.fetch_add(1)) {
      fn(i * chunk, std::min(n, (i + 1) * chunk));
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
}

double Seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Bench() {
  for (int64_t s : {4096, 2048}) {
    const int64_t n = 8, d = 128;
    AttentionGeometry g;
    g.batch = 1;
    g.q_heads = g.kv_heads = n;
    g.head_dim = g.value_dim = d;
    g.scale = 1.0f / std::sqrt(float(d));
    g.q = g.k = g.v = g.out = Strides3{s * n * d, n * d, d};
    g.stats = Strides3{n * s, 1, s};
    const SequenceBand seq = Seq(0, int32_t(s), 0, int32_t(s), -kInf, 0, -kInf);
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> q(s * n * d), k(q.size()), v(q.size()), dout(q.size()), out(q.size());
    for (auto* x : {&q, &k, &v, &dout}) {
      for (float& e : *x) e = normal(rng);
    }
    std::vector<float> mx(n * s), sm(n * s), delta(n * s), dq(q.size()), dk(q.size()), dv(q.size());
    AttentionForwardArgs<float> fa{q.data(), k.data(), v.data(), out.data(), mx.data(), sm.data()};
    AttentionBackwardArgs<float> ba{q.data(),  k.data(),  v.data(),  out.data(), dout.data(),
                                    mx.data(), sm.data(), dq.data(), dk.data(),  dv.data()};
    const int64_t items = ForwardWorkItems(g, &seq);
    const int64_t key_items = KeyBlockWorkItems(g, &seq);
    for (int threads : {1, 2}) {
      double fwd = 1e9, bwd = 1e9;
      for (int rep = 0; rep < 3; ++rep) {
        fwd = std::min(fwd, Seconds([&] {
                         Parallel(threads, items, [&](int64_t b, int64_t e) {
                           AttentionForward(g, &seq, fa, b, e);
                         });
                       }));
        bwd = std::min(bwd, Seconds([&] {
                         Parallel(threads, items, [&](int64_t b, int64_t e) {
                           AttentionRowDelta(g, &seq, ba, delta.data(), b, e);
                         });
                         Parallel(threads, key_items, [&](int64_t b, int64_t e) {
                           AttentionBackwardKeyValue(g, &seq, ba, delta.data(), b, e);
                         });
                         Parallel(threads, items, [&](int64_t b, int64_t e) {
                           AttentionBackwardQuery(g, &seq, ba, delta.data(), b, e);
                         });
                       }));
      }
      const double flops = 2.0 * 2.0 * s * s / 2 * d * n;  // two causal GEMMs
      std::printf("causal S=%ld N=%ld D=%ld f32, %d thread(s): forward %.3f s (%.1f GFLOP/s), "
                  "backward %.3f s, forward+backward %.3f s\n",
                  long(s), long(n), long(d), threads, fwd, flops / fwd / 1e9, bwd, fwd + bwd);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--bench") == 0) {
    Bench();
    return 0;
  }
  CheckTileOps();
  uint32_t seed = 1;
  for (const Problem& p : Cases()) {
    RunProblem<float>(p, seed);
    RunProblem<Float16>(p, seed);
    RunProblem<BFloat16>(p, seed);
    ++seed;
  }
  std::printf("%d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
