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
// registers (AVX-512: 16 of 32 zmm; AVX2/SSE: 12 of 16). Rounded(x) makes x a
// value the compiler cannot see through, so that the multiply that made it is
// rounded on its own (not contracted with what follows into an FMA).
// Clamp(x, lo, hi) sets x to min(hi, max(lo, x)), a NaN x passing through,
// with one max and one min instruction: GCC turns the same ternaries on
// vector types with a constant bound into compare-and-blend pairs.
// WidenBf16(x, p) loads a vector of bfloat16 bits from p (unaligned) as the
// bits of their float32 values (zero-extended, shifted up 16): vpmovzxwd from
// memory and vpslld, where GCC made six instructions of the same conversion
// (__builtin_convertvector; the halves loaded, widened and joined apart).
struct Avx512 {
  typedef float V __attribute__((vector_size(64)));
  typedef int32_t VI __attribute__((vector_size(64)));
  static constexpr int kMr = 4;
  static constexpr int kNv = 4;
  JAX_ROPE_INLINE static void Rounded(V& x) { asm("" : "+v"(x)); }
  JAX_ROPE_INLINE static void Clamp(V& x, const V& lo, const V& hi) {
    asm("vmaxps %[x], %[lo], %[x]\n\tvminps %[x], %[hi], %[x]"
        : [x] "+v"(x)
        : [lo] "v"(lo), [hi] "v"(hi));
  }
  JAX_ROPE_INLINE static void WidenBf16(VI& x, const uint16_t* p) {
    typedef uint16_t Halves __attribute__((vector_size(32), aligned(2), may_alias));
    asm("vpmovzxwd %[p], %[x]\n\tvpslld $16, %[x], %[x]"
        : [x] "=v"(x)
        : [p] "m"(*reinterpret_cast<const Halves*>(p)));
  }
};
struct Avx2 {
  typedef float V __attribute__((vector_size(32)));
  typedef int32_t VI __attribute__((vector_size(32)));
  static constexpr int kMr = 6;
  static constexpr int kNv = 2;
  JAX_ROPE_INLINE static void Rounded(V& x) { asm("" : "+x"(x)); }
  JAX_ROPE_INLINE static void Clamp(V& x, const V& lo, const V& hi) {
    asm("vmaxps %[x], %[lo], %[x]\n\tvminps %[x], %[hi], %[x]"
        : [x] "+x"(x)
        : [lo] "x"(lo), [hi] "x"(hi));
  }
  JAX_ROPE_INLINE static void WidenBf16(VI& x, const uint16_t* p) {
    typedef uint16_t Halves __attribute__((vector_size(16), aligned(2), may_alias));
    asm("vpmovzxwd %[p], %[x]\n\tvpslld $16, %[x], %[x]"
        : [x] "=x"(x)
        : [p] "m"(*reinterpret_cast<const Halves*>(p)));
  }
};
struct Sse2 {
  typedef float V __attribute__((vector_size(16)));
  typedef int32_t VI __attribute__((vector_size(16)));
  static constexpr int kMr = 6;
  static constexpr int kNv = 2;
  JAX_ROPE_INLINE static void Rounded(V& x) { asm("" : "+x"(x)); }
  JAX_ROPE_INLINE static void Clamp(V& x, const V& lo, const V& hi) {
    V l = lo, h = hi;  // two-operand forms: maxps b, a sets a to a > b ? a : b
    asm("maxps %[x], %[l]\n\tminps %[l], %[h]" : [l] "+x"(l), [h] "+x"(h) : [x] "x"(x));
    x = h;
  }
  JAX_ROPE_INLINE static void WidenBf16(VI& x, const uint16_t* p) {
    typedef uint16_t Halves __attribute__((vector_size(8), aligned(2), may_alias));
    x = __builtin_convertvector(*reinterpret_cast<const Halves*>(p), VI) << 16;
  }
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

// exp(x) in place, within about 1 ulp: Cody-Waite reduction by ln 2 and a
// degree-6 polynomial on [-ln 2 / 2, ln 2 / 2] fitted for relative error
// (3e-9 before rounding). x < -87 (where exp is subnormal or 0, and -inf)
// gives 0, applied to the bits of 2^n, off the polynomial's dependency chain;
// x is clamped to [-87, 88] so that every term stays finite; NaN stays NaN.
// 1.3x faster on AVX2 than Cephes' expf with its degree-7 polynomial and
// blended clamps. On Zen 4 no AVX-512 variant measured was worth its own bits:
// 2^n by vscalefps (2.76 ns a vector alone, 3.25 with vrndscaleps for n),
// 2^(j/32) from two registers and a degree-3 polynomial (2.98 ns), this one
// 3.15 ns; all the exps of the causal S4096 forward take 4% of its time.
template <class Isa>
JAX_ROPE_INLINE void Exp(typename Isa::V& x) {
  using V = typename Isa::V;
  using VI = typename Isa::VI;
  const V lo = V{} - 87.0f;
  V xc = x;
  Isa::Clamp(xc, lo, V{} + 88.0f);
  const V magic = V{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer n ...
  const V t = xc * 1.44269504088896341f + magic;
  const V n = t - magic;  // ... which t holds in its low mantissa bits (|n| <= 127)
  const V r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  V p = V{} + 1.3814611593e-3f;
  p = p * r + 8.3687100559e-3f;
  p = p * r + 4.1668388992e-2f;
  p = p * r + 1.6666521131e-1f;
  p = p * r + 4.9999994040e-1f;
  const V y = p * (r * r) + r + 1.0f;
  VI scale = ((VI)t - (VI)magic + 127) << 23;  // 2^n; vector casts reinterpret the bits
  scale = x < lo ? VI{} : scale;
  x = y * (V)scale;
}

// A softmax term exp(scale * x - shift), the product rounded to float32 before
// the subtraction as the scores are (Isa::Rounded keeps the two from
// contracting to an FMA): softmax_step's and the score product's terms share
// it, so that they have the same bits.
template <class Isa>
JAX_ROPE_INLINE typename Isa::V ScaledTerm(typename Isa::V x, float scale,
                                           const typename Isa::V& shift) {
  x = x * scale;
  Isa::Rounded(x);
  x -= shift;
  Exp<Isa>(x);
  return x;
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
