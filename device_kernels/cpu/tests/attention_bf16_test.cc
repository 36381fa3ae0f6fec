// The bfloat16 tile routines (attention_tiles.h) of each instruction set that
// has them: the bf16 GEMMs (bf16_gemm, bf16_pairs_gemm) and dot scores against
// double-precision evaluations, the rounding and pairing routines
// (round_bf16, pack_bf16_pairs, narrow_bf16, pair_rows_bf16) bit for bit
// against float_convert.h, and the kernel test's emulation of the GEMMs (for
// CPUs without AVX512_BF16). Built and run by ctest (CMake option
// JAX_ROPE_BUILD_TESTS); exit status 1 on failure.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "device_kernels/cpu/attention_staging.h"
#include "device_kernels/cpu/attention_tiles.h"
#include "device_kernels/cpu/float_convert.h"
#include "device_kernels/cpu/tests/bf16_gemm_emulated.h"
#include "device_kernels/cpu/tests/check_count.h"
#include "device_kernels/cpu/tests/each_tile_isa.h"

namespace {

using namespace jax_rope::cpu;
using namespace jax_rope::cpu::check_count;

// The larger of worst and diff, a NaN diff (a NaN result) the worst of all.
double Worse(double worst, double diff) { return std::isnan(diff) ? 1e9 : std::max(worst, diff); }

// A TileOps::bf16_gemm (bf16 inputs: exact products, float32 sums) against a
// double-precision evaluation.
void CheckBf16Gemm(decltype(TileOps::bf16_gemm) bf16_gemm, const std::string& name,
                   std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  // (m 24: a second 16-row AMX tile short of rows; kp 200: more pairs than
  // attention_amx.cc packs at once, the last chunk short.)
  for (int64_t m : {1, 4, 7, 24, 64}) {
    for (int64_t n : {1, 16, 33, 64}) {
      for (int64_t kp : {0, 1, 20, 64, 200}) {
        const int64_t lda = 2 * kp + 6, ldb = RoundUpToTile(n) + 16, ldc = RoundUpToTile(n);
        std::vector<BFloat16> a(m * lda);
        std::vector<BFloat16> bt(2 * kp * ldb, FromFloat<BFloat16>(0.0f));
        for (BFloat16& x : a) x = FromFloat<BFloat16>(u(rng));
        for (int64_t p = 0; p < 2 * kp; ++p) {
          for (int64_t j = 0; j < n; ++j) bt[p * ldb + j] = FromFloat<BFloat16>(u(rng));
        }
        std::vector<uint32_t> pairs(kp * ldb);
        for (int64_t p = 0; p < kp; ++p) {
          for (int64_t j = 0; j < ldb; ++j) {
            pairs[p * ldb + j] = uint32_t{bt[2 * p * ldb + j].bits} |
                                 uint32_t{bt[(2 * p + 1) * ldb + j].bits} << 16;
          }
        }
        std::vector<float> c((m + 1) * ldc, 7.0f);  // row m: a guard, never written
        bf16_gemm(m, n, kp, reinterpret_cast<const uint16_t*>(a.data()), lda, pairs.data(), ldb,
                  c.data(), ldc);
        double worst = 0.0;
        for (int64_t j = 0; j < ldc; ++j) {
          worst = Worse(worst, std::abs(double(c[m * ldc + j]) - 7.0));
        }
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            double want = 0.0;
            for (int64_t p = 0; p < 2 * kp; ++p) {
              want += double(ToFloat(a[i * lda + p])) * ToFloat(bt[p * ldb + j]);
            }
            worst = Worse(worst, std::abs(want - c[i * ldc + j]));
          }
          for (int64_t j = n; j < ldc; ++j) {  // B's zero columns up to RoundUpToTile(n)
            worst = Worse(worst, double(std::abs(c[i * ldc + j])));
          }
        }
        ++g_checks;
        if (worst > 1e-4) Fail("bf16_gemm " + name);
      }
    }
  }
  std::printf("bf16_gemm %s: checked\n", name.c_str());
}

// A TileOps::bf16_pairs_gemm against a double-precision evaluation, A read
// three ways (rows of pairs, pack_bf16_pairs of a transposed float32 tile, and
// rows with a pair in every other word),
// accumulating or not.
void CheckBf16PairsGemm(const TileOps& ops, decltype(TileOps::bf16_pairs_gemm) gemm,
                        const std::string& name, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int64_t m : {1, 5, 24, 64}) {
    for (int64_t n : {1, 16, 33, 128}) {
      for (int64_t k : {1, 2, 7, 64, 301}) {  // depth; odd: the last pair's partner is 0
        const int64_t kp = (k + 1) / 2, ld = RoundUpToTile(m) + 16;
        const int64_t ldb = RoundUpToTile(n) + 16, ldc = RoundUpToTile(n);
        std::vector<float> at(k * ld);  // A transposed (k x m), rounded to bfloat16
        for (float& x : at) x = ToFloat(FromFloat<BFloat16>(u(rng)));
        std::vector<BFloat16> bv(2 * kp * ldb, FromFloat<BFloat16>(0.0f));
        for (int64_t p = 0; p < k; ++p) {
          for (int64_t j = 0; j < n; ++j) bv[p * ldb + j] = FromFloat<BFloat16>(u(rng));
        }
        std::vector<uint32_t> b(kp * ldb);
        const bool finite = attention::LoadRowPairs(bv.data(), ldb, k, n, b.data(), ldb);
        std::vector<uint32_t> packed(kp * ld), rows(m * kp);
        ops.pack_bf16_pairs(at.data(), ld, k, m, packed.data(), ld);
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t p = 0; p < kp; ++p) rows[i * kp + p] = packed[p * ld + i];
        }
        // And every other word of wider rows (a_col 2), NaN pairs between them.
        std::vector<uint32_t> spread(m * 2 * kp, 0x7fc07fc0u);
        for (int64_t i = 0; i < m * kp; ++i) spread[2 * i] = rows[i];
        for (bool accumulate : {false, true}) {
          for (int layout = 0; layout < 3; ++layout) {
            std::vector<float> c((m + 1) * ldc, 0.5f);  // row m: a guard, never written
            if (layout == 0) {
              gemm(m, n, kp, rows.data(), kp, 1, b.data(), ldb, c.data(), ldc, accumulate);
            } else if (layout == 1) {
              gemm(m, n, kp, packed.data(), 1, ld, b.data(), ldb, c.data(), ldc, accumulate);
            } else {
              gemm(m, n, kp, spread.data(), 2 * kp, 2, b.data(), ldb, c.data(), ldc,
                   accumulate);
            }
            double worst = 0.0;
            for (int64_t j = 0; j < ldc; ++j) {
              worst = Worse(worst, std::abs(c[m * ldc + j] - 0.5));
            }
            for (int64_t i = 0; i < m; ++i) {
              for (int64_t j = 0; j < ldc; ++j) {
                double want = accumulate ? 0.5 : 0.0;
                for (int64_t p = 0; p < k && j < n; ++p) {
                  want += double(at[p * ld + i]) * ToFloat(bv[p * ldb + j]);
                }
                worst = Worse(worst, std::abs(want - c[i * ldc + j]));
              }
            }
            ++g_checks;
            if (worst > 1e-4 || !finite) {
              Fail("bf16_pairs_gemm " + name + " m " + std::to_string(m) + " n " +
                   std::to_string(n) + " k " + std::to_string(k));
            }
          }
        }
      }
    }
  }
  std::printf("bf16_pairs_gemm %s: checked\n", name.c_str());
}

// TileOps::round_bf16, pack_bf16_pairs and narrow_bf16, bit for bit against
// FromFloat (ties, NaN, infinities, denormals among the values), and
// LoadRowPairs' finiteness.
void CheckBf16Rounding(const TileOps& ops, const std::string& name, std::mt19937& rng) {
  const float specials[] = {1.0f + 0x1p-8f, 1.0f + 0x3p-8f, -0.0f, 0x1p-130f,
                            std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(), BitsFloat(0x7f800001u),
                            3.4028235e38f};
  std::uniform_int_distribution<uint32_t> bits;
  for (int64_t rows : {1, 2, 5}) {
    for (int64_t cols : {1, 16, 21}) {
      const int64_t ld = RoundUpToTile(cols) + 16;
      std::vector<float> s(rows * ld);
      for (size_t i = 0; i < s.size(); ++i) {
        s[i] = i % 3 == 0 ? specials[(i / 3) % 8] : BitsFloat(bits(rng));
      }
      std::vector<uint32_t> pairs((rows + 1) / 2 * ld, 1u);
      ops.pack_bf16_pairs(s.data(), ld, rows, cols, pairs.data(), ld);
      std::vector<float> rounded = s;
      ops.round_bf16(rounded.data(), ld, rows, cols);
      std::vector<uint16_t> narrow(rows * ld, 1);
      ops.narrow_bf16(s.data(), ld, rows, cols, narrow.data(), ld);
      bool ok = true;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < ld; ++c) {
          const float x = s[r * ld + c];
          const uint16_t want = FromFloat<BFloat16>(x).bits;
          const float got = rounded[r * ld + c];
          if (c < cols) {
            ok &= FloatBits(got) == FloatBits(ToFloat(BFloat16{want}));
            ok &= narrow[r * ld + c] == want;
          } else {
            ok &= narrow[r * ld + c] == (c == cols && cols % 2 != 0 ? 0 : 1);
            ok &= FloatBits(got) == FloatBits(x);  // nothing past cols
          }
          if (c < RoundUpToTile(cols)) {
            const uint32_t pair = pairs[r / 2 * ld + c];
            ok &= (r % 2 == 0 ? pair & 0xffffu : pair >> 16) == want;
            if (r % 2 == 0 && r + 1 == rows) ok &= pair >> 16 == 0;
          }
        }
      }
      ++g_checks;
      if (!ok) Fail("bf16 rounding routines " + name + " rows " + std::to_string(rows));
    }
  }
  // pair_rows_bf16: 5 rows of 21 columns (stride 24) into pairs of stride 32.
  std::vector<uint16_t> v(5 * 24);
  for (uint16_t& x : v) x = FromFloat<BFloat16>(std::uniform_real_distribution<float>()(rng)).bits;
  std::vector<uint32_t> pairs(3 * 32, 1u);
  bool ok = ops.pair_rows_bf16(v.data(), 24, 5, 21, pairs.data(), 32);
  for (int64_t p = 0; p < 3; ++p) {
    for (int64_t c = 0; c < 32; ++c) {
      const uint32_t lo = c < 21 ? v[2 * p * 24 + c] : 0u;
      const uint32_t hi = c < 21 && 2 * p + 1 < 5 ? v[(2 * p + 1) * 24 + c] : 0u;
      ok &= pairs[p * 32 + c] == (c < RoundUpToTile(21) ? (lo | hi << 16) : 1u);
    }
  }
  ++g_checks;
  if (!ok) Fail("pair_rows_bf16 " + name);
  for (uint16_t special : {uint16_t{0x7f80}, uint16_t{0xff80}, uint16_t{0x7fc1}}) {
    std::vector<uint16_t> w = v;
    w[4 * 24 + 20] = special;  // the last row, alone in its pair
    ++g_checks;
    if (ops.pair_rows_bf16(w.data(), 24, 5, 21, pairs.data(), 32)) {
      Fail("pair_rows_bf16 " + name + " missed a non-finite value");
    }
  }
}

// A TileOps::bf16_dot_scores against a double-precision evaluation, scores
// stored both ways (by query rows and by keys), key rows read in place with NaN
// between them (a read past a row's 2 kp values shows) and query rows padded
// with zeros as the contract asks.
void CheckBf16DotScores(decltype(TileOps::bf16_dot_scores) dot, const std::string& name,
                        std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const BFloat16 nan = FromFloat<BFloat16>(std::numeric_limits<float>::quiet_NaN());
  for (int64_t rows : {1, 2, 3, 4, 7, 8, 13, 16}) {
    for (int64_t keys : {1, 5, 16, 33}) {
      for (int64_t kp : {1, 7, 16, 20, 64}) {
        const int64_t ldk = 2 * kp + 6, ldq = RoundUpToTile(kp) + 3;
        std::vector<BFloat16> k(keys * ldk, nan), qv(rows * 2 * kp);
        for (int64_t j = 0; j < keys; ++j) {
          for (int64_t p = 0; p < 2 * kp; ++p) k[j * ldk + p] = FromFloat<BFloat16>(u(rng));
        }
        for (BFloat16& x : qv) x = FromFloat<BFloat16>(u(rng));
        std::vector<uint32_t> q(RoundUpToTile(rows) * ldq, 0u);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t p = 0; p < kp; ++p) {
            q[r * ldq + p] = uint32_t{qv[r * 2 * kp + 2 * p].bits} |
                             uint32_t{qv[r * 2 * kp + 2 * p + 1].bits} << 16;
          }
        }
        for (bool by_rows : {true, false}) {
          const int64_t key_step = by_rows ? 1 : rows + 2, row_step = by_rows ? keys + 3 : 1;
          std::vector<float> s(std::max(rows * row_step, keys * key_step) + 8, 7.0f);
          dot(keys, rows, kp, reinterpret_cast<const uint16_t*>(k.data()), ldk, q.data(), ldq,
              s.data(), key_step, row_step, RowsAhead{});
          double worst = 0.0;
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t j = 0; j < keys; ++j) {
              double want = 0.0;
              for (int64_t p = 0; p < 2 * kp; ++p) {
                want += double(ToFloat(qv[r * 2 * kp + p])) * ToFloat(k[j * ldk + p]);
              }
              const double got = s[j * key_step + r * row_step];
              worst = std::isnan(got) ? 1e9 : std::max(worst, std::abs(want - got));
            }
          }
          ++g_checks;
          if (worst > 1e-4) {
            Fail("bf16_dot_scores " + name + " rows " + std::to_string(rows) + " keys " +
                 std::to_string(keys) + " kp " + std::to_string(kp));
          }
        }
      }
    }
  }
  std::printf("bf16_dot_scores %s: checked\n", name.c_str());
}

// Loads a tile configuration other than attention_amx.cc's (palette 1, every
// tile 8 rows of 32 bytes), as other AMX code on the same thread would.
__attribute__((target("amx-tile"), noinline)) void LoadForeignTileConfig() {
  struct alignas(64) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } static config = {};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 32;
    config.rows[t] = 8;
  }
  _tile_loadconfig(&config);
}

}  // namespace

int main() {
  std::mt19937 rng(13);
  if (const TileOps* amx = TileOpsFor(TileIsa::kAvx512Amx)) {
    // The AMX GEMMs keep their tile configuration between calls, and load it
    // again where other code on the thread has loaded its own.
    CheckBf16Gemm(amx->bf16_gemm, "avx512+amx (first call on this thread)", rng);
    LoadForeignTileConfig();
    CheckBf16Gemm(amx->bf16_gemm, "avx512+amx (after a foreign tile configuration)", rng);
  }
  ForEachTileIsa([&](const TileOps& ops, const char* name) {
    if (ops.bf16_gemm != nullptr) CheckBf16Gemm(ops.bf16_gemm, name, rng);
    if (ops.bf16_pairs_gemm != nullptr) CheckBf16PairsGemm(ops, ops.bf16_pairs_gemm, name, rng);
    CheckBf16Rounding(ops, name, rng);
    if (ops.bf16_dot_scores != nullptr) CheckBf16DotScores(ops.bf16_dot_scores, name, rng);
  });
  CheckBf16Gemm(test::EmulatedBf16Gemm, "emulated (attention_kernel_test's, for CPUs without it)",
                rng);
  CheckBf16PairsGemm(GetTileOps(), test::EmulatedBf16PairsGemm, "emulated", rng);
  return Finish();
}
