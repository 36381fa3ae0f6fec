// Each instruction set's softmax tile routines (attention_tiles.h:
// softmax_step, softmax_rows, softmax_grad, and their exp) against naive
// double-precision evaluations, on tiles with masked (-inf) entries, fully
// masked columns and prior softmax state, with either sign of scale, and
// softmax_step given its column maxima bit for bit against the step that finds
// them, and gemm_col_max's softmax terms (CheckGemmTerms). An instruction set
// this CPU lacks is reported and left out. Built and run by ctest (CMake
// option JAX_ROPE_BUILD_TESTS); exit status 1 on failure.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "device_kernels/cpu/attention_tiles.h"
#include "device_kernels/cpu/tests/check_count.h"
#include "device_kernels/cpu/tests/each_tile_isa.h"

namespace {

using namespace jax_rope::cpu;
using namespace jax_rope::cpu::check_count;

// The tile routines' exp, through softmax_grad (scale 1, max 0, 1 / sum 1):
// within 1.5 ulp of exp(x) on [-87, 0.5] (relative 1.5 * 2^-23), exp(88) from
// 88 up (the clamp), 0 below -87 (and for -inf), NaN for NaN.
void CheckExp(const TileOps& ops, const char* isa) {
  const int64_t cols = 4096 + 16;
  std::vector<float> x(cols), dp(cols, 1.0f);
  for (int64_t i = 0; i < 4096; ++i) x[i] = -87.0f + 87.5f * float(i) / 4095.0f;
  const float specials[16] = {-87.01f, -100.0f, -3.0e38f, -INFINITY, NAN,  88.0f,
                              88.5f,   88.7f,   89.0f,    INFINITY,  0.0f, -0.0f,
                              1e-30f,  -1e-30f, 0.25f,    -0.125f};
  std::copy(specials, specials + 16, x.begin() + 4096);
  std::vector<float> p = x;
  const float zero = 0.0f, one = 1.0f;
  ops.softmax_grad(p.data(), dp.data(), cols, 1, cols, 1.0f, &zero, &one, &zero, false);
  double worst = 0.0;
  for (int64_t i = 0; i < cols; ++i) {
    const double want = x[i] < -87.0f ? 0.0 : std::exp(std::min(double(x[i]), 88.0));
    const bool ok = std::isnan(x[i]) ? std::isnan(p[i])
                    : want == 0.0    ? p[i] == 0.0f
                                     : std::abs(p[i] - want) <= 1.5 * 0x1p-23 * want;
    if (!ok) Fail(std::string("exp ") + isa + " at " + std::to_string(x[i]));
    if (want > 0.0 && x[i] <= 0.5f) worst = std::max(worst, std::abs(p[i] - want) / want);
  }
  ++g_checks;
  std::printf("tile ops %s: exp checked (max rel err %.2e on [-87, 0.5])\n", isa, worst);
}

// softmax_step (transposed tiles) and softmax_rows (the same tile by rows) of
// one instruction set, and softmax_grad, against double precision on a tile
// with masked (-inf) entries, fully masked columns and prior state, with a
// positive and a negative scale (masked entries stay -inf either way).
void CheckSoftmaxOps(const TileOps& ops, const char* isa, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const int64_t keys = 37, cols = 48, ld = 64, out_cols = 32, kp = RoundUpToTile(keys);
  const float inf = INFINITY;
  std::vector<float> s0(keys * ld), max0(cols), sum0(cols), out0(cols * out_cols);
  for (int64_t j = 0; j < keys; ++j) {
    for (int64_t c = 0; c < cols; ++c) {
      s0[j * ld + c] = (c % 7 == 3 || u(rng) < -0.6f) ? -inf : 3.0f * u(rng);
    }
  }
  s0[5 * ld + 6] = -3.0e38f;  // far below the max: exp underflows to exactly 0
  for (int64_t c = 0; c < cols; ++c) {
    max0[c] = c % 3 == 0 ? -inf : 10.0f * u(rng);
    sum0[c] = c % 3 == 0 ? 0.0f : 2.0f + u(rng);
  }
  for (float& x : out0) x = u(rng);
  double worst = 0.0;
  for (const float scale : {7.0f, -0.75f}) {
    for (const bool by_rows : {false, true}) {
      const std::string what = std::string(by_rows ? "softmax_rows " : "softmax_step ") + isa +
                               " scale " + std::to_string(scale);
      std::vector<float> s = s0, q_max = max0, q_sum = sum0, out = out0;
      const int64_t out_rows = by_rows ? cols : 40;
      if (by_rows) {  // rows of kp keys, padded with -inf
        std::vector<float> rows(cols * kp, -inf);
        for (int64_t j = 0; j < keys; ++j) {
          for (int64_t c = 0; c < cols; ++c) rows[c * kp + j] = s0[j * ld + c];
        }
        ops.softmax_rows(rows.data(), kp, cols, kp, scale, q_max.data(), q_sum.data(),
                         out.data(), out_cols, out_cols);
        for (int64_t j = 0; j < keys; ++j) {
          for (int64_t c = 0; c < cols; ++c) s[j * ld + c] = rows[c * kp + j];
        }
      } else {
        ops.softmax_step(s.data(), ld, keys, cols, scale, nullptr, q_max.data(), q_sum.data(),
                         out.data(), out_cols, out_rows, out_cols);
      }
      double err = 0.0;
      for (int64_t c = 0; c < cols; ++c) {
        double m = max0[c];
        for (int64_t j = 0; j < keys; ++j) {
          if (s0[j * ld + c] != -inf) m = std::max(m, double(scale * s0[j * ld + c]));
        }
        const double alpha = m == -inf ? 1.0 : std::exp(max0[c] - m);
        double sum = sum0[c] * alpha;
        for (int64_t j = 0; j < keys; ++j) {
          const double x = s0[j * ld + c];
          const double p =
              x == -inf || m == -inf ? 0.0 : std::exp(double(scale * float(x)) - m);
          sum += p;
          err = std::max(err, std::abs(s[j * ld + c] - p) / std::max(1e-30, p));
          if (p == 0.0 && s[j * ld + c] != 0.0f) Fail(what + " zero");
        }
        if (m != double(q_max[c])) Fail(what + " max");
        err = std::max(err, std::abs(q_sum[c] - sum) / std::max(1e-30, sum));
        for (int64_t e = 0; e < out_cols; ++e) {
          const double want = out0[c * out_cols + e] * (m == -inf || c >= out_rows ? 1.0 : alpha);
          err = std::max(err, std::abs(out[c * out_cols + e] - want) / (1e-30 + std::abs(want)));
        }
      }
      ++g_checks;
      if (err > 5e-6) Fail(what + " " + std::to_string(err));
      worst = std::max(worst, err);
    }
  }

  // softmax_step given the raw products' column maxima (gemm_col_max's; a
  // tile with nothing masked, scale > 0): the bits of the step that finds them
  // itself, checked above, and the largest scaled score as the new maximum. One
  // product is NaN, which the maxima skip.
  for (const float scale : {7.0f, 0.125f}) {
    const std::string what = std::string("softmax_step raw_max ") + isa + " scale " +
                             std::to_string(scale);
    std::vector<float> raw(keys * ld), raw_max(cols, -inf);
    for (int64_t j = 0; j < keys; ++j) {
      for (int64_t c = 0; c < cols; ++c) {
        raw[j * ld + c] = j == 2 && c == 5 ? NAN : 3.0f * u(rng);
        if (!std::isnan(raw[j * ld + c])) raw_max[c] = std::max(raw_max[c], raw[j * ld + c]);
      }
    }
    std::vector<float> s1 = raw, m1 = max0, sum1 = sum0, out1 = out0;
    std::vector<float> s2 = raw, m2 = max0, sum2 = sum0, out2 = out0;
    ops.softmax_step(s1.data(), ld, keys, cols, scale, nullptr, m1.data(), sum1.data(),
                     out1.data(), out_cols, 40, out_cols);
    ops.softmax_step(s2.data(), ld, keys, cols, scale, raw_max.data(), m2.data(), sum2.data(),
                     out2.data(), out_cols, 40, out_cols);
    ++g_checks;
    const auto same = [](const std::vector<float>& x, const std::vector<float>& y) {
      return std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
    };
    if (!same(s1, s2) || !same(m1, m2) || !same(sum1, sum2) || !same(out1, out2)) {
      Fail(what + " bits");
    }
    for (int64_t c = 0; c < cols; ++c) {
      if (m2[c] != std::max(max0[c], scale * raw_max[c])) Fail(what + " max");
    }
  }

  for (bool by_column : {false, true}) {
    const int64_t rows = 21;
    const float scale = 7.0f;
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
  std::printf("tile ops %s: checked (softmax step and rows max rel err %.2e)\n", isa, worst);
}

// gemm_col_max leaving the softmax terms under given shifts (ExpTerms): each
// term exp(float(scale * product) - shift) within 1.5 ulp of the double exp of
// that float argument, column sums added to what sum held, the column maxima
// as without terms; where every shift lies at or above its column's scaled
// maximum and the sums start at 0, the bits of softmax_step on the plain
// products (the step that keeps the shift), sums included. Shifts below the
// maximum give terms above 1.
void CheckGemmTerms(const TileOps& ops, const char* isa, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int64_t m : {1, 7, 64}) {
    for (int64_t n : {5, 33, 64}) {
      for (int64_t k : {9, 128}) {
        for (bool above : {true, false}) {
          const std::string what = std::string("gemm_col_max terms ") + isa + " m " +
                                   std::to_string(m) + " n " + std::to_string(n) + " k " +
                                   std::to_string(k) + (above ? " shift above" : " shift below");
          const int64_t np = RoundUpToTile(n), ldb = np, ldc = np + 3;
          const float scale = 0.18f;  // not a power of 2: the product rounds
          std::vector<float> a(m * k), b(k * ldb, 0.0f), c(m * ldc), raw_max(np, -INFINITY);
          for (float& x : a) x = u(rng);
          for (int64_t p = 0; p < k; ++p) {
            for (int64_t j = 0; j < n; ++j) b[p * ldb + j] = 2.0f * u(rng);
          }
          ops.gemm_col_max(m, n, k, a.data(), k, 1, b.data(), ldb, c.data(), ldc,
                           raw_max.data(), nullptr);
          std::vector<float> shift(np), sum0(np), terms_max(np, -INFINITY), terms_c(m * ldc);
          for (int64_t j = 0; j < np; ++j) {
            const float top = scale * raw_max[j];
            shift[j] = above ? top + (j % 3) * 0.5f : top - 5.0f * (j % 4) / 3.0f;
            sum0[j] = above ? 0.0f : 2.0f + u(rng);  // from 0, as softmax_step sums a tile
          }
          std::vector<float> sum = sum0;
          const ExpTerms terms{scale, shift.data(), sum.data()};
          ops.gemm_col_max(m, n, k, a.data(), k, 1, b.data(), ldb, terms_c.data(), ldc,
                           terms_max.data(), &terms);
          ++g_checks;
          bool ok = std::memcmp(terms_max.data(), raw_max.data(), np * sizeof(float)) == 0;
          for (int64_t j = 0; j < n; ++j) {
            double want_sum = sum0[j];
            for (int64_t i = 0; i < m; ++i) {
              const double want = std::exp(double(scale * c[i * ldc + j] - shift[j]));
              want_sum += want;
              ok = ok && std::abs(terms_c[i * ldc + j] - want) <= 1.5 * 0x1p-23 * want;
            }
            ok = ok && std::abs(sum[j] - want_sum) <= 1e-6 * want_sum;
          }
          if (!ok) Fail(what);
          if (!above) continue;
          std::vector<float> step_max = shift, step_sum = sum0;
          ops.softmax_step(c.data(), ldc, m, np, scale, raw_max.data(), step_max.data(),
                           step_sum.data(), nullptr, 0, 0, 0);
          ++g_checks;
          for (int64_t i = 0; i < m; ++i) {
            if (std::memcmp(&c[i * ldc], &terms_c[i * ldc], n * sizeof(float)) != 0) ok = false;
          }
          if (!ok || std::memcmp(step_sum.data(), sum.data(), n * sizeof(float)) != 0 ||
              step_max != shift) {
            Fail(what + " bits of softmax_step");
          }
        }
      }
    }
  }
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  ForEachTileIsa([&](const TileOps& ops, const char* name) {
    CheckSoftmaxOps(ops, name, rng);
    CheckExp(ops, name);
    CheckGemmTerms(ops, name, rng);
  });
  return Finish();
}
