// Threefry-2x32 with 20 rounds (Random123; what jax.extend.random.threefry_2x32
// computes), the hash behind the attention dropout keep bits
// (spec/attention_bias_dropout.md section 3.3). Header-only and free of XLA.
#pragma once

#include <cstdint>

namespace jax_rope::cpu {

struct ThreefryOut {
  uint32_t y0, y1;
};

constexpr uint32_t RotL32(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

// Known answer: key (0, 0), counter (0, 0) -> y0 0x6b200159.
inline ThreefryOut Threefry2x32(uint32_t k0, uint32_t k1, uint32_t c0, uint32_t c1) {
  constexpr int kRot[8] = {13, 15, 26, 6, 17, 29, 16, 24};
  const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
  uint32_t x0 = c0 + ks[0];
  uint32_t x1 = c1 + ks[1];
  for (int s = 1; s <= 5; ++s) {  // 5 groups of 4 rounds, a key injection after each
    for (int r = 0; r < 4; ++r) {
      x0 += x1;
      x1 = RotL32(x1, kRot[(s - 1) % 2 * 4 + r]);
      x1 ^= x0;
    }
    x0 += ks[s % 3];
    x1 += ks[(s + 1) % 3] + static_cast<uint32_t>(s);
  }
  return {x0, x1};
}

}  // namespace jax_rope::cpu
