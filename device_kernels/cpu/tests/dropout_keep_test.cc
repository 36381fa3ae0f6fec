// The dropout keep hash on its own: the scalar Threefry-2x32-20 against known
// answers (Random123's KAT and jax.extend.random.threefry_2x32), the keep masks
// of spec/attention_bias_dropout.md section 3.3, and the vectorised keep runs of
// dropout_keep.cc on each instruction set against the scalar hash. Built and
// run by ctest (CMake option JAX_ROPE_BUILD_TESTS); exit status 1 on failure.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "device_kernels/cpu/dropout_keep.h"
#include "device_kernels/cpu/tests/check_count.h"
#include "device_kernels/cpu/threefry.h"

namespace {

using namespace jax_rope::cpu;
using namespace jax_rope::cpu::check_count;

// Threefry-2x32-20 known answers: Random123's KAT and values of
// jax.extend.random.threefry_2x32 (y0, y1), and the dropout keep masks of
// spec/attention_bias_dropout.md section 3.3.
void CheckThreefry() {
  struct Kat {
    uint32_t k0, k1, c0, c1, y0, y1;
  };
  const Kat kats[] = {
      {0, 0, 0, 0, 0x6b200159u, 0x99ba4efeu},
      {0, 42, 0, 0, 0x6d3e048fu, 0x1022172du},
      {0, 42, 5, 7, 0xb2f09ad1u, 0xa763eafbu},
      {0x13198a2eu, 0x03707344u, 0x243f6a88u, 0x85a308d3u, 0xc4923a9cu, 0x483df7a0u},
      {0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0x1cb996fcu, 0xbb002be7u},
      {0, 42, 0xfffffffeu, 123456, 0x1a1cd190u, 0xd3d2e71bu},
  };
  for (const Kat& k : kats) {
    const ThreefryOut y = Threefry2x32(k.k0, k.k1, k.c0, k.c1);
    ++g_checks;
    if (y.y0 != k.y0 || y.y1 != k.y1) {
      char buf[128];
      std::snprintf(buf, sizeof buf, "threefry key (%x, %x) counter (%x, %x): %08x %08x", k.k0,
                    k.k1, k.c0, k.c1, y.y0, y.y1);
      Fail(buf);
    }
  }
  // Packed keep bits (LSB first) for B x N1 x Sq x Skv, position words r = (b N1 + n) Sq + i.
  auto packed = [](uint32_t k1, int64_t bn, int64_t sq, int64_t skv, double keep_prob) {
    const uint32_t threshold = static_cast<uint32_t>(std::floor(keep_prob * 4294967296.0));
    std::vector<uint8_t> bytes((bn * sq * skv + 7) / 8, 0);
    for (int64_t r = 0; r < bn * sq; ++r) {
      for (int64_t j = 0; j < skv; ++j) {
        const int64_t e = r * skv + j;
        if (Threefry2x32(0, k1, uint32_t(r), uint32_t(j)).y0 < threshold) {
          bytes[e >> 3] |= uint8_t(1 << (e & 7));
        }
      }
    }
    return bytes;
  };
  // The vectorised keep runs of each instruction set (dropout_keep.cc: blocks
  // of counters, a tail) against the scalar hash, down a column and along a
  // row, counters wrapping.
  const char* names[] = {"avx512", "avx2", "baseline"};
  const TileIsa isas[] = {TileIsa::kAvx512, TileIsa::kAvx2, TileIsa::kBaseline};
  for (int which = 0; which < 3; ++which) {
    const KeepRunFn run = KeepRunFor(isas[which]);
    if (run == nullptr) {
      std::printf("keep run %s: not supported here, skipped\n", names[which]);
      continue;
    }
    std::mt19937 rng(7);
    for (int64_t count : {1, 7, 31, 32, 33, 63, 64, 65, 100, 129}) {
      for (bool down : {false, true}) {
        const uint32_t k0 = rng(), k1 = rng();
        const uint32_t row = rng() | 0xFFFFFFC0u, col = rng() | 0xFFFFFFC0u;  // within 64 of 2^32
        const uint32_t threshold = 0x9999999Au;
        std::vector<float> got(count + 1, -1.0f);
        run(k0, k1, row, col, down, count, threshold, 1.25f, got.data());
        ++g_checks;
        for (int64_t t = 0; t <= count; ++t) {
          float want = -1.0f;  // past the run: not written
          if (t < count) {
            const uint32_t step = static_cast<uint32_t>(t);
            const uint32_t r = down ? row + step : row, c = down ? col : col + step;
            want = Threefry2x32(k0, k1, r, c).y0 < threshold ? 1.25f : 0.0f;
          }
          if (got[t] != want) {
            Fail(std::string("keep run ") + names[which] + " of " + std::to_string(count) +
                 (down ? " down" : " along") + ": position " + std::to_string(t));
            break;
          }
        }
      }
    }
  }
  ++g_checks;
  if (packed(0, 1, 2, 5, 0.5) != std::vector<uint8_t>{0xA3, 0x03}) Fail("keep mask key(0)");
  ++g_checks;
  if (packed(42, 4, 3, 3, 0.9) != std::vector<uint8_t>{0xFF, 0xFF, 0xFD, 0xFC, 0x0F}) {
    Fail("keep mask key(42)");
  }
}

}  // namespace

int main() {
  CheckThreefry();
  return Finish();
}
