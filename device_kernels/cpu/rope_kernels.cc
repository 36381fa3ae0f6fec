#include "device_kernels/cpu/rope_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "device_kernels/cpu/rope_rows_f16c.h"
#include "device_kernels/cpu/thread_scratch.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace jax_rope::cpu {
namespace {

using namespace rope_f16c;

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
// dcos/dsin sums over heads. The thread's kept scratch (ThreadScratch: its
// contents undefined, each row written before it is read); throws
// std::bad_alloc where it cannot be had.
class Scratch {
 public:
  explicit Scratch(int64_t rotary_dim, int64_t head_dim = 0)
      : table_(RoundUp(rotary_dim)),
        buffer_(ScratchRole::kRopeRows, 4 * table_ + RoundUp(head_dim)),
        data_(buffer_.data()) {}

  float* c() { return data_; }
  float* s() { return data_ + table_; }
  float* dcos() { return data_ + 2 * table_; }
  float* dsin() { return data_ + 3 * table_; }
  // head_dim elements of any type up to float32's size.
  template <typename T>
  T* row() {
    return reinterpret_cast<T*>(data_ + 4 * table_);
  }

 private:
  static int64_t RoundUp(int64_t n) { return (n + 15) / 16 * 16; }
  int64_t table_;
  ThreadScratch buffer_;
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

// Copies `bytes` to dst with non-temporal stores where dst is 16-byte aligned,
// which write memory without first reading each line into the cache.
JAX_ROPE_INLINE void StreamBytes(const void* src, void* dst, int64_t bytes) {
#if defined(__SSE2__)
  const char* from = static_cast<const char*>(src);
  char* to = static_cast<char*>(dst);
  const int64_t head =
      std::min<int64_t>(bytes, (16 - (reinterpret_cast<uintptr_t>(to) & 15)) & 15);
  std::memcpy(to, from, head);
  int64_t i = head;
  for (; i + 16 <= bytes; i += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + i),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i)));
  }
  std::memcpy(to + i, from + i, bytes - i);
#else
  std::memcpy(dst, src, bytes);
#endif
}

// Orders the non-temporal stores before whatever follows (the caller's hand-off).
JAX_ROPE_INLINE void StreamFence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// staging (head_dim elements, or null): each output row is built there and
// streamed to `out`.
template <typename T>
JAX_ROPE_INLINE void ForwardHeads(const RopeGeometry& g, const T* in, T* out, int64_t heads,
                                  int64_t head_stride, const float* c, const float* s,
                                  T* staging) {
  const int64_t d = g.head_dim;
  const int64_t r = g.rotary_dim;
  for (int64_t n = 0; n < heads; ++n) {
    const T* x_row = in + n * head_stride;
    T* out_row = out + n * head_stride;
    T* row = staging != nullptr ? staging : out_row;
    RotateRow(g.mode, x_row, row, c, s, r);
    if (r < d && row != x_row) std::memcpy(row + r, x_row + r, (d - r) * sizeof(T));
    if (staging != nullptr) StreamBytes(staging, out_row, d * int64_t{sizeof(T)});
  }
}

// staging as in ForwardHeads.
template <typename T>
JAX_ROPE_INLINE void BackwardHeads(const RopeGeometry& g, const T* grad, const T* input,
                                   T* dinput, int64_t heads, int64_t head_stride, const float* c,
                                   const float* s, Scratch& scratch, T* staging) {
  const int64_t d = g.head_dim;
  const int64_t r = g.rotary_dim;
  for (int64_t n = 0; n < heads; ++n) {
    const T* g_row = grad + n * head_stride;
    T* dx_row = dinput + n * head_stride;
    T* row = staging != nullptr ? staging : dx_row;
    RotateHalfAdjointRow(g_row, input != nullptr ? input + n * head_stride : nullptr, row, c, s,
                         scratch.dcos(), scratch.dsin(), r / 2);
    if (r < d && row != g_row) std::memcpy(row + r, g_row + r, (d - r) * sizeof(T));
    if (staging != nullptr) StreamBytes(staging, dx_row, d * int64_t{sizeof(T)});
  }
}

template <typename T>
JAX_ROPE_INLINE void RopeForwardImpl(const RopeGeometry& g,
                                                   const RopeForwardArgs<T>& a, int64_t begin,
                                                   int64_t end) {
  Scratch scratch(g.rotary_dim, g.head_dim);
  const int64_t r = g.rotary_dim;
  // In place, each output line is in the cache from its read: stored as usual.
  const bool stream = a.stream_outputs && a.query_out != a.query && a.key_out != a.key;
  T* staging = stream ? scratch.row<T>() : nullptr;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t b = t / g.seq;
    const int64_t pos = t % g.seq;
    const int64_t cos_offset = (g.cos_batch == 1 ? 0 : b) * g.cos.batch + pos * g.cos.seq;
    const float* c = LoadRow(a.cos + cos_offset, r, scratch.c());
    const float* s = LoadRow(a.sin + cos_offset, r, scratch.s());
    const int64_t q_offset = b * g.q.batch + pos * g.q.seq;
    const int64_t k_offset = b * g.k.batch + pos * g.k.seq;
    ForwardHeads(g, a.query + q_offset, a.query_out + q_offset, g.q_heads, g.q.head, c, s,
                 staging);
    ForwardHeads(g, a.key + k_offset, a.key_out + k_offset, g.k_heads, g.k.head, c, s,
                 staging);
  }
  if (staging != nullptr) StreamFence();
}

template <typename T>
JAX_ROPE_INLINE void RopeBackwardImpl(const RopeGeometry& g, const RopeBackwardArgs<T>& a,
                                      int64_t begin, int64_t end) {
  Scratch scratch(g.rotary_dim, g.head_dim);
  const int64_t r = g.rotary_dim;
  const bool with_inputs = a.query != nullptr;
  const bool stream = a.stream_outputs && a.dquery != a.grad_query && a.dkey != a.grad_key;
  T* staging = stream ? scratch.row<T>() : nullptr;
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
                  a.dquery + q_offset, g.q_heads, g.q.head, c, s, scratch, staging);
    BackwardHeads(g, a.grad_key + k_offset, with_inputs ? a.key + k_offset : nullptr,
                  a.dkey + k_offset, g.k_heads, g.k.head, c, s, scratch, staging);
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
  if (staging != nullptr) StreamFence();
}

template <typename T>
JAX_ROPE_INLINE void RopeReduceTablesImpl(const RopeGeometry& g, const RopeBackwardArgs<T>& a,
                                          int64_t begin, int64_t end) {
  if (a.partial == nullptr || a.dcos == nullptr) return;
  const int64_t r = g.rotary_dim;
  Scratch scratch(r);
  float* dcos = scratch.dcos();
  float* dsin = scratch.dsin();
  for (int64_t pos = begin; pos < end; ++pos) {
    std::fill(dcos, dcos + r, 0.0f);
    std::fill(dsin, dsin + r, 0.0f);
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
JAX_ROPE_SPECIALIZE(float, F32)
JAX_ROPE_SPECIALIZE(BFloat16, BF16)
JAX_ROPE_SPECIALIZE(Float16, F16)
#undef JAX_ROPE_SPECIALIZE

}  // namespace jax_rope::cpu
