// Each instruction set's float32 tile routines (attention_tiles.h: the GEMM
// over float32 and bfloat16 B and with column maxima, the dot-product scores,
// 16-bit widening, the staging rows) against naive double-precision
// evaluations, on edge shapes of every register block; the softmax steps are
// attention_softmax_test's, the bfloat16 products and rounding
// attention_bf16_test's. An instruction set this CPU lacks is reported and
// left out. Built and run by ctest (CMake option JAX_ROPE_BUILD_TESTS); exit
// status 1 on failure.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "device_kernels/cpu/attention_tiles.h"
#include "device_kernels/cpu/float_convert.h"
#include "device_kernels/cpu/tests/check_count.h"
#include "device_kernels/cpu/tests/each_tile_isa.h"

namespace {

using namespace jax_rope::cpu;
using namespace jax_rope::cpu::check_count;

// widen_bf16 and widen_f16 against float_convert.h's scalar ToFloat, bit for
// bit: every 16-bit pattern (NaN, Inf, subnormal and negative zero included)
// on ragged rows, zero padding, nothing past it written.
template <class T>
void CheckWiden(void (*widen)(const uint16_t*, int64_t, int64_t, int64_t, float*, int64_t),
                const std::string& what, std::mt19937& rng) {
  for (int64_t cols : {1, 7, 16, 37, 128}) {
    const int64_t rows = 5, stride = cols + 3, ld = RoundUpToTile(cols) + 8;
    const bool every_pattern = cols == 128;
    std::vector<uint16_t> src(rows * stride);
    std::vector<float> dst(rows * ld, 7.0f);
    for (int64_t base = 0; base < (every_pattern ? 65536 : 1); base += rows * stride) {
      for (int64_t i = 0; i < rows * stride; ++i) {
        src[i] = static_cast<uint16_t>(every_pattern ? base + i : rng());
      }
      widen(src.data(), stride, rows, cols, dst.data(), ld);
      bool ok = true;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < ld; ++c) {
          const float want = c < cols ? ToFloat(T{src[r * stride + c]})
                                      : (c < RoundUpToTile(cols) ? 0.0f : 7.0f);
          ok = ok && std::memcmp(&dst[r * ld + c], &want, sizeof want) == 0;
        }
      }
      ++g_checks;
      if (!ok) Fail(what + " cols " + std::to_string(cols));
    }
  }
}

// copy_row, scale_rows and row_dot against scalar loops: the copy and the
// scaled rows bit for bit (zero padding, nothing past it written, the finite
// flag for NaN and Inf anywhere in the row), the dot product within float32
// rounding of a float64 sum, on ragged lengths.
void CheckRowOps(const TileOps& ops, const std::string& isa, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  // mask_row: -inf exactly where a mask byte is nonzero (any nonzero value), the
  // rest untouched bit for bit (NaN and Inf too), nothing past n.
  for (int64_t n : {1, 15, 16, 17, 64, 100}) {
    std::vector<float> x(n + 4), before;
    std::vector<uint8_t> masked(n + 4);
    for (size_t j = 0; j < x.size(); ++j) {
      x[j] = j % 7 == 3 ? std::numeric_limits<float>::quiet_NaN()
             : j % 11 == 5 ? std::numeric_limits<float>::infinity() : u(rng);
      masked[j] = static_cast<uint8_t>(rng() % 3 == 0 ? 1 + rng() % 255 : 0);
    }
    before = x;
    ops.mask_row(x.data(), masked.data(), n);
    bool ok = true;
    for (size_t j = 0; j < x.size(); ++j) {
      const bool hit = static_cast<int64_t>(j) < n && masked[j] != 0;
      ok &= FloatBits(x[j]) == (hit ? 0xff800000u : FloatBits(before[j]));
    }
    ++g_checks;
    if (!ok) Fail("mask_row " + isa + " n " + std::to_string(n));
  }
  for (int64_t cols : {1, 7, 8, 16, 37, 128, 257}) {
    const int64_t padded = RoundUpToTile(cols);
    std::vector<float> src(cols), dst(padded + 8);
    for (float& x : src) x = u(rng);
    for (int64_t bad = -1; bad < cols; bad += std::max<int64_t>(1, cols / 3)) {
      for (float special : {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity()}) {
        std::vector<float> row = src;
        if (bad >= 0) row[bad] = special;
        std::fill(dst.begin(), dst.end(), 7.0f);
        const bool finite = ops.copy_row(row.data(), cols, dst.data());
        bool ok = finite == (bad < 0);
        for (int64_t c = 0; c < padded + 8; ++c) {
          const float want = c < cols ? row[c] : (c < padded ? 0.0f : 7.0f);
          ok = ok && std::memcmp(&dst[c], &want, sizeof want) == 0;
        }
        ++g_checks;
        if (!ok) Fail("copy_row " + isa + " cols " + std::to_string(cols));
      }
    }
    const int64_t rows = 3, ld = padded + 5, stride = cols + 2;
    std::vector<float> in(rows * ld), out(rows * stride, 7.0f);
    for (float& x : in) x = u(rng) * 1e3f;
    const float factor = 0.37f;
    ops.scale_rows(in.data(), ld, rows, cols, factor, out.data(), stride);
    bool ok = true;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < stride; ++c) {
        const float want = c < cols ? in[r * ld + c] * factor : 7.0f;
        ok = ok && std::memcmp(&out[r * stride + c], &want, sizeof want) == 0;
      }
    }
    ++g_checks;
    if (!ok) Fail("scale_rows " + isa + " cols " + std::to_string(cols));
    std::vector<float> b(cols);
    for (float& x : b) x = u(rng);
    double want = 0.0, magnitude = 0.0;
    for (int64_t c = 0; c < cols; ++c) {
      want += double(src[c]) * b[c];
      magnitude += std::abs(double(src[c]) * b[c]);
    }
    ++g_checks;
    if (std::abs(ops.row_dot(src.data(), b.data(), cols) - want) > 1e-6 * (1.0 + magnitude)) {
      Fail("row_dot " + isa + " cols " + std::to_string(cols));
    }
  }
}

// Each instruction set's tile routines against a naive evaluation.
void CheckTileOps() {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  ForEachTileIsa([&](const TileOps& isa_ops, const char* name) {
    const TileOps* ops = &isa_ops;
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
              if (worst > 1e-4) Fail(std::string("gemm ") + name);
              if (!accumulate) {
                // gemm_col_max: gemm's bits, and each column's largest result
                // folded into col_max (half the columns start at -inf).
                std::vector<float> col_max(RoundUpToTile(n)), c_max = c0;
                for (int64_t j = 0; j < n; ++j) col_max[j] = j % 2 ? u(rng) : -INFINITY;
                const std::vector<float> col_max0 = col_max;
                ops->gemm_col_max(m, n, k, a.data(), a_row, a_col, b.data(), ldb, c_max.data(),
                                  ldc, col_max.data(), nullptr);
                ++g_checks;
                bool same = std::memcmp(c_max.data(), c.data(), c.size() * sizeof(float)) == 0;
                for (int64_t j = 0; j < n; ++j) {
                  float want = col_max0[j];
                  for (int64_t i = 0; i < m; ++i) want = std::max(want, c[i * ldc + j]);
                  same = same && col_max[j] == want;
                }
                if (!same) {
                  Fail(std::string("gemm_col_max ") + name + " m " + std::to_string(m) + " n " +
                       std::to_string(n) + " k " + std::to_string(k));
                }
              }
              // The same product over B as bfloat16 bits (B's values rounded to
              // bfloat16 first): the widened values are exact, so the result
              // has gemm's bits on those values.
              std::vector<uint16_t> b16(b.size());
              std::vector<float> b_rounded(b.size());
              for (size_t e = 0; e < b.size(); ++e) {
                b16[e] = FromFloat<BFloat16>(b[e]).bits;
                b_rounded[e] = ToFloat(BFloat16{b16[e]});
              }
              std::vector<float> want_bits = c0;
              ops->gemm(m, n, k, a.data(), a_row, a_col, b_rounded.data(), ldb,
                        want_bits.data(), ldc, accumulate);
              c = c0;
              ops->gemm_bf16_b(m, n, k, a.data(), a_row, a_col, b16.data(), ldb, c.data(), ldc,
                               accumulate);
              ++g_checks;
              if (std::memcmp(c.data(), want_bits.data(), c.size() * sizeof(float)) != 0) {
                Fail(std::string("gemm_bf16_b ") + name + " m " + std::to_string(m) +
                     " n " + std::to_string(n) + " k " + std::to_string(k));
              }
            }
          }
        }
      }
    }
    // dot_scores: every row-block width, key and dim remainders (k padded with
    // finite junk past d: q's zero padding must cancel it).
    for (int64_t rows : {1, 2, 3, 4, 5, 8, 11, 16}) {
      for (int64_t keys : {1, 3, 17, 64}) {
        const bool by_rows = (rows + keys) % 2 == 1;  // s[i][j] instead of s[j][i]
        for (int64_t d : {8, 40, 64, 128, 256}) {
          const int64_t dp = RoundUpToTile(d), ldk = dp + 16, lds = 64;
          std::vector<float> kk(keys * ldk, 0.0f), q(RoundUpToTile(rows) * dp, 0.0f);
          for (int64_t j = 0; j < keys; ++j) {
            for (int64_t p = 0; p < ldk; ++p) kk[j * ldk + p] = p < d ? u(rng) : 1e3f;
          }
          for (int64_t i = 0; i < rows; ++i) {
            for (int64_t p = 0; p < d; ++p) q[i * dp + p] = u(rng);
          }
          std::vector<float> s(64 * lds, 12345.0f);
          // Rows asked for ahead (here q's, then k's) leave the scores alone.
          RowsAhead ahead;
          ahead.streams[0] = RowsAhead::Of(q.data(), dp, d);
          ahead.streams[1] = RowsAhead::Of(kk.data(), ldk, d);
          ahead.rows = d % 3 == 0 ? 0 : std::min(rows, keys);
          ops->dot_scores(keys, rows, d, kk.data(), ldk, q.data(), dp, s.data(),
                          by_rows ? 1 : lds, by_rows ? lds : 1, ahead);
          double worst = 0.0;
          bool untouched = true;
          for (int64_t j = 0; j < 64; ++j) {
            for (int64_t i = 0; i < 64; ++i) {
              const float got = by_rows ? s[i * lds + j] : s[j * lds + i];
              if (i >= rows || j >= keys) {
                untouched &= got == 12345.0f;
                continue;
              }
              double want = 0.0;
              for (int64_t p = 0; p < d; ++p) want += double(kk[j * ldk + p]) * q[i * dp + p];
              worst = std::max(worst, std::abs(want - got));
            }
          }
          ++g_checks;
          if (worst > 1e-4 || !untouched) {
            Fail(std::string("dot_scores ") + name + " rows " + std::to_string(rows) +
                 " keys " + std::to_string(keys) + " d " + std::to_string(d));
          }
        }
      }
    }
    CheckWiden<BFloat16>(ops->widen_bf16, std::string("widen_bf16 ") + name, rng);
    CheckWiden<Float16>(ops->widen_f16, std::string("widen_f16 ") + name, rng);
    CheckRowOps(*ops, name, rng);
  });
}

}  // namespace

int main() {
  CheckTileOps();
  return Finish();
}
