// float16 row routines of the RoPE kernels (rope_rows_f16c.h), compiled for
// F16C and chosen at run time. Like rope_kernels.cc, built with
// -ffp-contract=off: no product is fused into a sum.
#include "device_kernels/cpu/rope_rows_f16c.h"

#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace jax_rope::cpu {

void UseF16cForTesting(bool use) { rope_f16c::g_use_f16c.store(use, std::memory_order_relaxed); }

namespace rope_f16c {

std::atomic<bool> g_use_f16c{true};

bool CpuHasF16c() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

#if defined(__x86_64__)
__attribute__((target("avx,f16c"))) void WidenF16c(const Float16* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  if (i < n) {  // the tail through a zero-padded vector
    uint16_t h[8] = {};
    float f[8];
    std::memcpy(h, src + i, (n - i) * sizeof(uint16_t));
    _mm256_storeu_ps(f, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))));
    std::memcpy(dst + i, f, (n - i) * sizeof(float));
  }
}

// 8 float16 values to float32 and back (round to nearest even), one instruction each.
static __attribute__((target("avx,f16c"))) __m256 Widen8(const Float16* src) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}

static __attribute__((target("avx,f16c"))) void Narrow8(__m256 v, Float16* dst) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

__attribute__((target("avx,f16c"))) void RotateHalfF16c(const Float16* x, Float16* out,
                                                         const float* c, const float* s,
                                                         int64_t h) {
  int64_t i = 0;
  for (; i + 8 <= h; i += 8) {
    const __m256 x1 = Widen8(x + i), x2 = Widen8(x + i + h);
    const __m256 o1 = _mm256_sub_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + i)),
                                    _mm256_mul_ps(x2, _mm256_loadu_ps(s + i)));
    const __m256 o2 = _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + i + h)),
                                    _mm256_mul_ps(x1, _mm256_loadu_ps(s + i + h)));
    Narrow8(o1, out + i);
    Narrow8(o2, out + i + h);
  }
  for (; i < h; ++i) {
    const float x1 = ToFloat(x[i]), x2 = ToFloat(x[i + h]);
    out[i] = FromFloat<Float16>(x1 * c[i] - x2 * s[i]);
    out[i + h] = FromFloat<Float16>(x2 * c[i + h] + x1 * s[i + h]);
  }
}

// Each pair swapped in registers and the odd value's sign flipped (as the
// scalar negation does) before the products.
__attribute__((target("avx,f16c"))) void RotateInterleaveF16c(const Float16* x, Float16* out,
                                                               const float* c, const float* s,
                                                               int64_t r) {
  const __m256 negate_even = _mm256_setr_ps(-0.0f, 0.0f, -0.0f, 0.0f, -0.0f, 0.0f, -0.0f, 0.0f);
  int64_t i = 0;
  for (; i + 8 <= r; i += 8) {
    const __m256 v = Widen8(x + i);
    const __m256 swapped = _mm256_xor_ps(_mm256_permute_ps(v, 0xB1), negate_even);
    Narrow8(_mm256_add_ps(_mm256_mul_ps(v, _mm256_loadu_ps(c + i)),
                          _mm256_mul_ps(swapped, _mm256_loadu_ps(s + i))),
            out + i);
  }
  for (; i < r; i += 2) {
    const float even = ToFloat(x[i]), odd = ToFloat(x[i + 1]);
    out[i] = FromFloat<Float16>(even * c[i] + (-odd) * s[i]);
    out[i + 1] = FromFloat<Float16>(odd * c[i + 1] + even * s[i + 1]);
  }
}

__attribute__((target("avx,f16c"))) void RotateHalfAdjointF16c(const Float16* g, const Float16* x,
                                                                Float16* dx, const float* c,
                                                                const float* s, float* dcos,
                                                                float* dsin, int64_t h) {
  int64_t i = 0;
  for (; i + 8 <= h; i += 8) {
    const __m256 g1 = Widen8(g + i), g2 = Widen8(g + i + h);
    const __m256 c1 = _mm256_loadu_ps(c + i), c2 = _mm256_loadu_ps(c + i + h);
    const __m256 s1 = _mm256_loadu_ps(s + i), s2 = _mm256_loadu_ps(s + i + h);
    const __m256 d1 = _mm256_add_ps(_mm256_mul_ps(c1, g1), _mm256_mul_ps(s2, g2));
    const __m256 d2 = _mm256_sub_ps(_mm256_mul_ps(c2, g2), _mm256_mul_ps(s1, g1));
    if (x != nullptr) {
      const __m256 x1 = Widen8(x + i), x2 = Widen8(x + i + h);
      _mm256_storeu_ps(dcos + i, _mm256_add_ps(_mm256_loadu_ps(dcos + i), _mm256_mul_ps(g1, x1)));
      _mm256_storeu_ps(dcos + i + h,
                       _mm256_add_ps(_mm256_loadu_ps(dcos + i + h), _mm256_mul_ps(g2, x2)));
      _mm256_storeu_ps(dsin + i, _mm256_sub_ps(_mm256_loadu_ps(dsin + i), _mm256_mul_ps(g1, x2)));
      _mm256_storeu_ps(dsin + i + h,
                       _mm256_add_ps(_mm256_loadu_ps(dsin + i + h), _mm256_mul_ps(g2, x1)));
    }
    Narrow8(d1, dx + i);
    Narrow8(d2, dx + i + h);
  }
  for (; i < h; ++i) {
    const float g1 = ToFloat(g[i]), g2 = ToFloat(g[i + h]);
    if (x != nullptr) {
      const float x1 = ToFloat(x[i]), x2 = ToFloat(x[i + h]);
      dcos[i] += g1 * x1;
      dcos[i + h] += g2 * x2;
      dsin[i] -= g1 * x2;
      dsin[i + h] += g2 * x1;
    }
    dx[i] = FromFloat<Float16>(c[i] * g1 + s[i + h] * g2);
    dx[i + h] = FromFloat<Float16>(c[i + h] * g2 - s[i] * g1);
  }
}
#else
void WidenF16c(const Float16*, int64_t, float*) {}
void RotateHalfF16c(const Float16*, Float16*, const float*, const float*, int64_t) {}
void RotateInterleaveF16c(const Float16*, Float16*, const float*, const float*, int64_t) {}
void RotateHalfAdjointF16c(const Float16*, const Float16*, Float16*, const float*, const float*,
                           float*, float*, int64_t) {}
#endif

}  // namespace rope_f16c
}  // namespace jax_rope::cpu
