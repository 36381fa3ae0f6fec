#include "device_kernels/cpu/rope_kernels.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace jax_rope::cpu {
namespace {

// float16 rows and cos/sin rows convert with F16C's instructions where the CPU
// has them (8 values per instruction; the same values as float_convert.h's
// selects, which cost 30 vector instructions a vector on AVX2). Called from
// every clone below, so they are functions of their own, compiled for F16C,
// chosen at run time.
std::atomic<bool> g_use_f16c{true};

bool UseF16c() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return has && g_use_f16c.load(std::memory_order_relaxed);
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

// The rotations of float16 rows in one pass, 8 values a step with F16C's
// conversions (staged through float32 scratch they took three passes: widen,
// rotate, narrow), the rest pair by pair with the portable conversions, which
// give the same values. The arithmetic is that of RotateHalf,
// RotateHalfAdjointWithTables and RotateInterleave below, operation for
// operation (no fused products), so the bits are too; like them, each step
// reads only the elements it writes (alias-safe): [i, i + 8) and [i + h, i + h
// + 8) of the half rotations' rows, [i, i + 8) of the interleaved one's.
__attribute__((target("avx,f16c"))) __m256 Widen8(const Float16* src) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}

__attribute__((target("avx,f16c"))) void Narrow8(__m256 v, Float16* dst) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// out = x * c + rot(x) * s over one rotary block of width 2h.
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

// The interleaved rotation of r elements, pairs (2i, 2i + 1): even * c + (-odd)
// * s and odd * c + even * s, each pair swapped in registers and the odd
// value's sign flipped (as the scalar negation does) before the products.
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

// RotateHalfF16c's adjoint, dx = c * g + rot^T(s * g), and when x (the forward's
// input row) is given this row's dcos/dsin terms added to float32 sums.
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

// Helpers are inlined into each instruction-set clone of the entry points below
// (a call out of a clone would run baseline code).
#define JAX_ROPE_INLINE [[gnu::always_inline]] inline

// A token's cos or sin row: 16-bit tables are widened into scratch once per
// token (for all its heads); float tables are used in place.
template <typename T>
JAX_ROPE_INLINE const float* LoadRow(const T* src, int64_t n, float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    if constexpr (std::is_same_v<T, Float16>) {
      if (UseF16c()) {
        WidenF16c(src, n, scratch);
        return scratch;
      }
    }
    for (int64_t i = 0; i < n; ++i) scratch[i] = ToFloat(src[i]);
    return scratch;
  }
}

// The half-paired rotations work on rows straight in storage (T: float32 or a
// 16-bit type, float32 arithmetic, one rounding at the store), one vector of
// pairs at a time: iteration i reads only elements i and i + h of its inputs
// and writes only elements i and i + h of its output, so the output row may be
// the input row itself (in place; ivdep: no run-time overlap check, which an
// in-place call would fail and fall back to scalar code).

// out = x * c + rot(x) * s over one rotary block of width 2h.
template <typename T>
JAX_ROPE_INLINE void RotateHalf(const T* x, T* out, const float* __restrict__ c,
                                const float* __restrict__ s, int64_t h) {
#pragma GCC ivdep
  for (int64_t i = 0; i < h; ++i) {
    const float x1 = ToFloat(x[i]);
    const float x2 = ToFloat(x[i + h]);
    out[i] = FromFloat<T>(x1 * c[i] - x2 * s[i]);
    out[i + h] = FromFloat<T>(x2 * c[i + h] + x1 * s[i + h]);
  }
}

// Its adjoint: dx = c * g + rot^T(s * g).
template <typename T>
JAX_ROPE_INLINE void RotateHalfAdjoint(const T* g, T* dx, const float* __restrict__ c,
                                       const float* __restrict__ s, int64_t h) {
#pragma GCC ivdep
  for (int64_t i = 0; i < h; ++i) {
    const float g1 = ToFloat(g[i]);
    const float g2 = ToFloat(g[i + h]);
    dx[i] = FromFloat<T>(c[i] * g1 + s[i + h] * g2);
    dx[i + h] = FromFloat<T>(c[i + h] * g2 - s[i] * g1);
  }
}

// The adjoint and this row's dcos/dsin contributions (float32, summed over
// heads by the caller) in one pass; x is the forward's input row.
template <typename T>
JAX_ROPE_INLINE void RotateHalfAdjointWithTables(const T* g, const T* x, T* dx,
                                                 const float* __restrict__ c,
                                                 const float* __restrict__ s,
                                                 float* __restrict__ dcos,
                                                 float* __restrict__ dsin, int64_t h) {
#pragma GCC ivdep
  for (int64_t i = 0; i < h; ++i) {
    const float g1 = ToFloat(g[i]), g2 = ToFloat(g[i + h]);
    const float x1 = ToFloat(x[i]), x2 = ToFloat(x[i + h]);
    dx[i] = FromFloat<T>(c[i] * g1 + s[i + h] * g2);
    dx[i + h] = FromFloat<T>(c[i + h] * g2 - s[i] * g1);
    dcos[i] += g1 * x1;
    dcos[i + h] += g2 * x2;
    dsin[i] -= g1 * x2;
    dsin[i + h] += g2 * x1;
  }
}

// A half rotation of a row in storage, and its adjoint (with this row's
// dcos/dsin terms when x, the forward's input row, is given): float16 rows in
// one pass with F16C where the CPU has it.
template <typename T>
JAX_ROPE_INLINE void RotateHalfRow(const T* x, T* out, const float* c, const float* s,
                                   int64_t h) {
  if constexpr (std::is_same_v<T, Float16>) {
    if (UseF16c()) return RotateHalfF16c(x, out, c, s, h);
  }
  RotateHalf(x, out, c, s, h);
}

template <typename T>
JAX_ROPE_INLINE void RotateHalfAdjointRow(const T* g, const T* x, T* dx, const float* c,
                                          const float* s, float* dcos, float* dsin, int64_t h) {
  if constexpr (std::is_same_v<T, Float16>) {
    if (UseF16c()) return RotateHalfAdjointF16c(g, x, dx, c, s, dcos, dsin, h);
  }
  if (x != nullptr) {
    RotateHalfAdjointWithTables(g, x, dx, c, s, dcos, dsin, h);
  } else {
    RotateHalfAdjoint(g, dx, c, s, h);
  }
}

// The interleaved rotation of pairs (2i, 2i + 1), on rows in storage like the
// half rotations (alias-safe: step i reads and writes only its pair).
template <typename T>
JAX_ROPE_INLINE void RotateInterleave(const T* x, T* out, const float* __restrict__ c,
                                      const float* __restrict__ s, int64_t r) {
#pragma GCC ivdep
  for (int64_t i = 0; i < r; i += 2) {
    const float even = ToFloat(x[i]);
    const float odd = ToFloat(x[i + 1]);
    // (-odd) * s: even * c - odd * s exactly, written as a sum (see below).
    out[i] = FromFloat<T>(even * c[i] + (-odd) * s[i]);
    out[i + 1] = FromFloat<T>(odd * c[i + 1] + even * s[i + 1]);
  }
}

// Per-token float32 rows, each 64-byte aligned (no vector load split across
// cache lines): cos and sin widened from 16-bit tables, and the backward's
// dcos/dsin sums over heads.
class Scratch {
 public:
  explicit Scratch(int64_t rotary_dim)
      : table_(RoundUp(rotary_dim)), data_(new (std::align_val_t{64}) float[4 * table_]()) {}
  ~Scratch() { ::operator delete[](data_, std::align_val_t{64}); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  float* c() { return data_; }
  float* s() { return data_ + table_; }
  float* dcos() { return data_ + 2 * table_; }
  float* dsin() { return data_ + 3 * table_; }

 private:
  static int64_t RoundUp(int64_t n) { return (n + 15) / 16 * 16; }
  int64_t table_;
  float* data_;
};

// The first r elements of one row in any mode; x_row may be out_row.
template <typename T>
JAX_ROPE_INLINE void RotateRow(RotaryMode mode, const T* x_row, T* out_row, const float* c,
                               const float* s, int64_t r) {
  switch (mode) {
    case RotaryMode::kHalf:
      RotateHalfRow(x_row, out_row, c, s, r / 2);
      break;
    case RotaryMode::kQuarter:  // two independent half rotations
      RotateHalfRow(x_row, out_row, c, s, r / 4);
      RotateHalfRow(x_row + r / 2, out_row + r / 2, c + r / 2, s + r / 2, r / 4);
      break;
    case RotaryMode::kInterleave:
      if constexpr (std::is_same_v<T, Float16>) {
        if (UseF16c()) return RotateInterleaveF16c(x_row, out_row, c, s, r);
      }
      RotateInterleave(x_row, out_row, c, s, r);
      break;
  }
}

template <typename T>
JAX_ROPE_INLINE void ForwardHeads(const RopeGeometry& g, const T* in, T* out, int64_t heads,
                                  int64_t head_stride, const float* c, const float* s) {
  const int64_t d = g.head_dim;
  const int64_t r = g.rotary_dim;
  for (int64_t n = 0; n < heads; ++n) {
    const T* x_row = in + n * head_stride;
    T* out_row = out + n * head_stride;
    RotateRow(g.mode, x_row, out_row, c, s, r);
    if (r < d && out_row != x_row) std::memcpy(out_row + r, x_row + r, (d - r) * sizeof(T));
  }
}

template <typename T>
JAX_ROPE_INLINE void BackwardHeads(const RopeGeometry& g, const T* grad, const T* input,
                                   T* dinput, int64_t heads, int64_t head_stride, const float* c,
                                   const float* s, Scratch& scratch) {
  const int64_t d = g.head_dim;
  const int64_t r = g.rotary_dim;
  for (int64_t n = 0; n < heads; ++n) {
    const T* g_row = grad + n * head_stride;
    T* dx_row = dinput + n * head_stride;
    RotateHalfAdjointRow(g_row, input != nullptr ? input + n * head_stride : nullptr, dx_row, c,
                         s, scratch.dcos(), scratch.dsin(), r / 2);
    if (r < d && dx_row != g_row) std::memcpy(dx_row + r, g_row + r, (d - r) * sizeof(T));
  }
}

template <typename T>
JAX_ROPE_INLINE void RopeForwardImpl(const RopeGeometry& g,
                                                   const RopeForwardArgs<T>& a, int64_t begin,
                                                   int64_t end) {
  Scratch scratch(g.rotary_dim);
  const int64_t r = g.rotary_dim;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t b = t / g.seq;
    const int64_t pos = t % g.seq;
    const int64_t cos_offset = (g.cos_batch == 1 ? 0 : b) * g.cos.batch + pos * g.cos.seq;
    const float* c = LoadRow(a.cos + cos_offset, r, scratch.c());
    const float* s = LoadRow(a.sin + cos_offset, r, scratch.s());
    const int64_t q_offset = b * g.q.batch + pos * g.q.seq;
    const int64_t k_offset = b * g.k.batch + pos * g.k.seq;
    ForwardHeads(g, a.query + q_offset, a.query_out + q_offset, g.q_heads, g.q.head, c, s);
    ForwardHeads(g, a.key + k_offset, a.key_out + k_offset, g.k_heads, g.k.head, c, s);
  }
}

template <typename T>
JAX_ROPE_INLINE void RopeBackwardImpl(const RopeGeometry& g, const RopeBackwardArgs<T>& a,
                                      int64_t begin, int64_t end) {
  Scratch scratch(g.rotary_dim);
  const int64_t r = g.rotary_dim;
  const bool with_inputs = a.query != nullptr;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t b = t / g.seq;
    const int64_t pos = t % g.seq;
    const int64_t cos_offset = (g.cos_batch == 1 ? 0 : b) * g.cos.batch + pos * g.cos.seq;
    const float* c = LoadRow(a.cos + cos_offset, r, scratch.c());
    const float* s = LoadRow(a.sin + cos_offset, r, scratch.s());
    std::fill(scratch.dcos(), scratch.dcos() + r, 0.0f);
    std::fill(scratch.dsin(), scratch.dsin() + r, 0.0f);
    const int64_t q_offset = b * g.q.batch + pos * g.q.seq;
    const int64_t k_offset = b * g.k.batch + pos * g.k.seq;
    BackwardHeads(g, a.grad_query + q_offset, with_inputs ? a.query + q_offset : nullptr,
                  a.dquery + q_offset, g.q_heads, g.q.head, c, s, scratch);
    BackwardHeads(g, a.grad_key + k_offset, with_inputs ? a.key + k_offset : nullptr,
                  a.dkey + k_offset, g.k_heads, g.k.head, c, s, scratch);
    if (!with_inputs) continue;
    if (a.partial != nullptr) {  // cos broadcasts over the batch: pass 2 sums
      std::copy(scratch.dcos(), scratch.dcos() + r, a.partial + t * r);
      std::copy(scratch.dsin(), scratch.dsin() + r, a.partial + (g.tokens() + t) * r);
      continue;
    }
    for (int64_t i = 0; i < r; ++i) {
      a.dcos[cos_offset + i] = FromFloat<T>(scratch.dcos()[i]);
      a.dsin[cos_offset + i] = FromFloat<T>(scratch.dsin()[i]);
    }
  }
}

template <typename T>
JAX_ROPE_INLINE void RopeReduceTablesImpl(const RopeGeometry& g, const RopeBackwardArgs<T>& a,
                                          int64_t begin, int64_t end) {
  if (a.partial == nullptr || a.dcos == nullptr) return;
  const int64_t r = g.rotary_dim;
  std::vector<float> dcos(r), dsin(r);
  for (int64_t pos = begin; pos < end; ++pos) {
    std::fill(dcos.begin(), dcos.end(), 0.0f);
    std::fill(dsin.begin(), dsin.end(), 0.0f);
    for (int64_t b = 0; b < g.batch; ++b) {
      const float* pc = a.partial + (b * g.seq + pos) * r;
      const float* ps = a.partial + (g.tokens() + b * g.seq + pos) * r;
      for (int64_t i = 0; i < r; ++i) dcos[i] += pc[i];
      for (int64_t i = 0; i < r; ++i) dsin[i] += ps[i];
    }
    for (int64_t i = 0; i < r; ++i) {
      a.dcos[pos * g.cos.seq + i] = FromFloat<T>(dcos[i]);
      a.dsin[pos * g.cos.seq + i] = FromFloat<T>(dsin[i]);
    }
  }
}

// Each entry point is compiled for AVX-512 (x86-64-v4), AVX2 and baseline
// x86-64 and picked at load time (GCC function multi-versioning): the 16-bit
// conversions vectorise two and four times as wide, and wheels cannot assume
// either. Results must be the spec's golden bit for bit on every clone, so no
// product may be fused into an add: -ffp-contract=off for this file, and the
// interleave rotation is written as a sum of products, since GCC's vectoriser
// turns the product difference/sum pairs into vfmaddsub whatever the flag.
#define JAX_ROPE_CLONED __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#define JAX_ROPE_DEFINE(T, NAME)                                                         \
  JAX_ROPE_CLONED void RopeForward##NAME(const RopeGeometry& g, const RopeForwardArgs<T>& a, \
                                         int64_t begin, int64_t end) {                   \
    RopeForwardImpl(g, a, begin, end);                                                   \
  }                                                                                      \
  JAX_ROPE_CLONED void RopeBackward##NAME(const RopeGeometry& g,                         \
                                          const RopeBackwardArgs<T>& a, int64_t begin,   \
                                          int64_t end) {                                 \
    RopeBackwardImpl(g, a, begin, end);                                                  \
  }                                                                                      \
  void RopeReduceTables##NAME(const RopeGeometry& g, const RopeBackwardArgs<T>& a,        \
                              int64_t begin, int64_t end) {                              \
    RopeReduceTablesImpl(g, a, begin, end);                                              \
  }
JAX_ROPE_DEFINE(float, F32)
JAX_ROPE_DEFINE(BFloat16, BF16)
JAX_ROPE_DEFINE(Float16, F16)
#undef JAX_ROPE_DEFINE
#undef JAX_ROPE_CLONED
#undef JAX_ROPE_INLINE

}  // namespace

#define JAX_ROPE_SPECIALIZE(T, NAME)                                                       \
  template <>                                                                              \
  void RopeForward<T>(const RopeGeometry& g, const RopeForwardArgs<T>& a, int64_t begin,   \
                      int64_t end) {                                                       \
    RopeForward##NAME(g, a, begin, end);                                                   \
  }                                                                                        \
  template <>                                                                              \
  void RopeBackward<T>(const RopeGeometry& g, const RopeBackwardArgs<T>& a, int64_t begin, \
                       int64_t end) {                                                      \
    RopeBackward##NAME(g, a, begin, end);                                                  \
  }                                                                                        \
  template <>                                                                              \
  void RopeReduceTables<T>(const RopeGeometry& g, const RopeBackwardArgs<T>& a,            \
                           int64_t begin, int64_t end) {                                   \
    RopeReduceTables##NAME(g, a, begin, end);                                              \
  }
void UseF16cForTesting(bool use) { g_use_f16c.store(use, std::memory_order_relaxed); }

JAX_ROPE_SPECIALIZE(float, F32)
JAX_ROPE_SPECIALIZE(BFloat16, BF16)
JAX_ROPE_SPECIALIZE(Float16, F16)
#undef JAX_ROPE_SPECIALIZE

}  // namespace jax_rope::cpu
