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
#include "device_kernels/cpu/float_convert.h"

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

// exp(x) in place, about 1 ulp (Cephes expf: Cody-Waite reduction by ln 2 and a
// degree-6 polynomial). x < -87 (where exp is subnormal or 0, and -inf) gives 0;
// x is clamped at 88 so the result stays finite.
template <class Isa>
JAX_ROPE_INLINE void Exp(typename Isa::V& x) {
  using V = typename Isa::V;
  using VI = typename Isa::VI;
  const V lo = V{} - 87.0f;
  const V hi = V{} + 88.0f;
  V xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const V n = (xc * 1.44269504088896341f + magic) - magic;
  const V r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const V y = p * (r * r) + r + 1.0f;
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  const V result = y * (V)bits;  // a vector cast reinterprets the bits
  x = x < lo ? V{} : result;
}

// 16-bit floats (T: BFloat16 or Float16, given as bits) to float32 with
// float_convert.h's ToFloat, zero padded to RoundUpToTile(cols): plain loops
// that the compiler vectorizes at each instruction set's width.
template <class T>
JAX_ROPE_INLINE void WidenRows(const uint16_t* src, int64_t stride, int64_t rows, int64_t cols,
                               float* dst, int64_t ld) {
  const int64_t padded = RoundUpToTile(cols);
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* in = src + r * stride;
    float* out = dst + r * ld;
    for (int64_t c = 0; c < cols; ++c) out[c] = ToFloat(T{in[c]});
    for (int64_t c = cols; c < padded; ++c) out[c] = 0.0f;
  }
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
