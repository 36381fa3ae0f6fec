// Branch-free conversions between float32 and the 16-bit storage formats.
// Written with selects instead of branches so loops over rows vectorise.
// float32 -> 16-bit rounds to nearest even; overflow goes to inf; NaN stays NaN
// with its sign and upper payload bits, made quiet (what the hardware
// conversions do: vcvtps2ph, AVX512_BF16's vcvtneps2bf16).
#pragma once

#include <cstdint>
#include <cstring>

namespace jax_rope::cpu {

struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};

// M(T) for each element type the kernels take: the one list their explicit
// instantiations expand.
#define JAX_ROPE_FOR_EACH_ELEMENT_TYPE(M) \
  M(float)                                \
  M(::jax_rope::cpu::BFloat16)            \
  M(::jax_rope::cpu::Float16)

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float ToFloat(float x) { return x; }
inline float ToFloat(BFloat16 x) { return BitsFloat(uint32_t{x.bits} << 16); }

inline float ToFloat(Float16 x) {
  // Shift exponent and mantissa into float position and rebias; subnormals are
  // normalised by one float subtraction (exact), inf/NaN get the max exponent.
  const uint32_t h = x.bits;
  const uint32_t shifted_exp = 0x7c00u << 13;
  uint32_t o = (h & 0x7fffu) << 13;
  const uint32_t exp = shifted_exp & o;
  o += (127u - 15u) << 23;
  const uint32_t inf_nan = o + ((128u - 16u) << 23);
  const float sub = BitsFloat(o + (1u << 23)) - BitsFloat(113u << 23);
  o = exp == shifted_exp ? inf_nan : (exp == 0 ? FloatBits(sub) : o);
  return BitsFloat(o | ((h & 0x8000u) << 16));
}

template <typename T>
T FromFloat(float f);

template <>
inline float FromFloat<float>(float f) {
  return f;
}

template <>
inline BFloat16 FromFloat<BFloat16>(float f) {
  // NaN keeps its upper bits and gets the quiet bit; the choice is made on the
  // 32-bit words so that one shift serves both (vectorised: no 16-bit select).
  const uint32_t u = FloatBits(f);
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  const uint32_t word = f != f ? (u | 0x400000u) : rounded;
  return BFloat16{static_cast<uint16_t>(word >> 16)};
}

template <>
inline Float16 FromFloat<Float16>(float f) {
  const uint32_t f32_inf = 255u << 23;
  const uint32_t f16_overflow = (127u + 16u) << 23;
  const uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  uint32_t u = FloatBits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  // |f|'s bits are below 2^31: compared as int32 (one vector instruction each;
  // unsigned compares take three).
  const int32_t a = static_cast<int32_t>(u);
  // Overflow to inf; NaN keeps its upper payload bits and gets the quiet bit
  // (as F16C's vcvtps2ph does).
  const uint32_t big = a > int32_t{f32_inf} ? 0x7e00u | ((u >> 13) & 0x3ffu) : 0x7c00u;
  // Subnormal results: let the float adder round at the right bit position.
  const uint32_t small = FloatBits(BitsFloat(u) + BitsFloat(denorm_magic)) - denorm_magic;
  // Normal results: rebias and round to nearest even on the dropped 13 bits.
  const uint32_t mant_odd = (u >> 13) & 1u;
  const uint32_t normal = (u + ((15u - 127u) << 23) + 0xfffu + mant_odd) >> 13;
  const uint32_t o = a >= int32_t{f16_overflow} ? big : (a < int32_t{113 << 23} ? small : normal);
  return Float16{static_cast<uint16_t>(o | (sign >> 16))};
}

}  // namespace jax_rope::cpu
