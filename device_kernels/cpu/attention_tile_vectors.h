// The vector vocabulary of the tile routines: GCC vector types and register
// blocking per instruction set, unaligned loads/stores, exp and horizontal
// reductions, written once and inlined (JAX_ROPE_INLINE) into one wrapper per
// instruction set; vectors never cross a call boundary, so no vector ABI is
// involved.
// Private to attention_tiles.cc, which includes it after its fp-contract
// pragma and instantiates these templates once per instruction set.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include "device_kernels/cpu/attention_tiles.h"

#define JAX_ROPE_INLINE inline __attribute__((always_inline))

namespace jax_rope::cpu::tile_simd {

// Register blocking per instruction set: kMr rows x kNv vectors of C stay in
// registers (AVX-512: 16 of 32 zmm; AVX2/SSE: 12 of 16).
struct Avx512 {
  typedef float V __attribute__((vector_size(64)));
  typedef int32_t VI __attribute__((vector_size(64)));
  static constexpr int kMr = 4;
  static constexpr int kNv = 4;
};
struct Avx2 {
  typedef float V __attribute__((vector_size(32)));
  typedef int32_t VI __attribute__((vector_size(32)));
  static constexpr int kMr = 6;
  static constexpr int kNv = 2;
};
struct Sse2 {
  typedef float V __attribute__((vector_size(16)));
  typedef int32_t VI __attribute__((vector_size(16)));
  static constexpr int kMr = 6;
  static constexpr int kNv = 2;
};

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <class Isa>
constexpr int kWidth = sizeof(typename Isa::V) / sizeof(float);

// Unaligned loads and stores of float vectors, through a float-aligned alias of
// the vector type: each one instruction, where memcpy let GCC 12 copy a
// register-blocked tile out through the stack in 16-byte pieces.
template <size_t Bytes>
struct UnalignedFloats {
  typedef float type __attribute__((vector_size(Bytes), aligned(alignof(float)), may_alias));
};

template <class V>
JAX_ROPE_INLINE void Load(V& v, const float* p) {
  v = *reinterpret_cast<const typename UnalignedFloats<sizeof(V)>::type*>(p);
}
template <class V>
JAX_ROPE_INLINE void Store(float* p, const V& v) {
  *reinterpret_cast<typename UnalignedFloats<sizeof(V)>::type*>(p) = v;
}

// exp(x) in place, for the softmax's arguments (x - max <= 0, and the
// backward's recomputed ones, at most a rounding above 0): within 2.2 ulp on
// [-87, 0]. Cody-Waite reduction by ln 2 (its high part's product exact, with
// or without FMA), e^r by a degree-5 polynomial on [-ln 2 / 2, ln 2 / 2]
// fitted for relative error with c0 = c1 = 1 (1.05e-7 before rounding), 2^n
// from the bits of t. x < -87 (where exp is subnormal or 0, and -inf) gives 0
// through the final select; NaN stays NaN (through r); x > 88 takes n = 127
// and the polynomial carries the rest (inf past float's range). 13 vector
// operations where clamps, a degree-6 polynomial and the 2^n arithmetic took
// 17: on Zen 4 these vectors go through about one operation a cycle, and the
// causal S4096 forward's softmax steps took 6% of its time.
template <class Isa>
JAX_ROPE_INLINE void Exp(typename Isa::V& x) {
  using V = typename Isa::V;
  using VI = typename Isa::VI;
  // 1.5 * 2^23 + 127: adding it rounds to an integer n, which t holds in its
  // low mantissa bits as n + 127 (|n| <= 127), so t's bits shifted up by 23
  // are those of 2^n.
  const V magic = V{} + 12583039.0f;
  const V xc = x < 88.0f ? x : V{} + 88.0f;  // only n sees the clamp (NaN: r is NaN)
  const V t = xc * 1.44269504088896341f + magic;
  const V n = t - magic;
  const V r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  V p = V{} + 8.312533609569073e-3f;
  p = p * r + 4.189012944698334e-2f;
  p = p * r + 1.6667114198207855e-1f;
  p = p * r + 4.99992311000824e-1f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const VI two_n = (VI)t << 23;  // vector casts reinterpret the bits
  x = x < -87.0f ? V{} : p * (V)two_n;
}

template <class Isa>
JAX_ROPE_INLINE float HorizontalMax(const typename Isa::V& v) {
  float m = v[0];
  for (int i = 1; i < kWidth<Isa>; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

template <class Isa>
JAX_ROPE_INLINE float HorizontalSum(const typename Isa::V& v) {
  float s = 0.0f;
  for (int i = 0; i < kWidth<Isa>; ++i) s += v[i];
  return s;
}

}  // namespace jax_rope::cpu::tile_simd
