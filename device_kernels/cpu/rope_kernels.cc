#include "device_kernels/cpu/rope_kernels.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace jax_rope::cpu {
namespace {

// Rows of 16-bit types are widened into this scratch once; float rows are
// used in place, so the float32 path never copies.
template <typename T>
const float* LoadRow(const T* src, int64_t n, float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i) scratch[i] = ToFloat(src[i]);
    return scratch;
  }
}

template <typename T>
float* OutRow(T* dst, float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return dst;
  } else {
    return scratch;
  }
}

template <typename T>
void StoreRow(const float* src, int64_t n, T* dst) {
  if constexpr (!std::is_same_v<T, float>) {
    for (int64_t i = 0; i < n; ++i) dst[i] = FromFloat<T>(src[i]);
  }
}

// out = x * c + rot(x) * s over one rotary block of width 2h, half pairing.
inline void RotateHalf(const float* __restrict__ x, const float* __restrict__ c,
                       const float* __restrict__ s, float* __restrict__ out, int64_t h) {
  for (int64_t i = 0; i < h; ++i) out[i] = x[i] * c[i] - x[i + h] * s[i];
  for (int64_t i = h; i < 2 * h; ++i) out[i] = x[i] * c[i] + x[i - h] * s[i];
}

inline void RotateInterleave(const float* __restrict__ x, const float* __restrict__ c,
                             const float* __restrict__ s, float* __restrict__ out,
                             int64_t r) {
  for (int64_t i = 0; i < r; i += 2) {
    const float even = x[i];
    const float odd = x[i + 1];
    out[i] = even * c[i] - odd * s[i];
    out[i + 1] = odd * c[i + 1] + even * s[i + 1];
  }
}

inline void Rotate(RotaryMode mode, const float* x, const float* c, const float* s,
                   float* out, int64_t r) {
  switch (mode) {
    case RotaryMode::kHalf:
      RotateHalf(x, c, s, out, r / 2);
      break;
    case RotaryMode::kQuarter:  // two independent half rotations
      RotateHalf(x, c, s, out, r / 4);
      RotateHalf(x + r / 2, c + r / 2, s + r / 2, out + r / 2, r / 4);
      break;
    case RotaryMode::kInterleave:
      RotateInterleave(x, c, s, out, r);
      break;
  }
}

// Adjoint of the half rotation, plus this row's dcos/dsin contributions.
inline void RotateHalfAdjoint(const float* __restrict__ g, const float* __restrict__ c,
                              const float* __restrict__ s, float* __restrict__ dx,
                              int64_t h) {
  for (int64_t i = 0; i < h; ++i) dx[i] = c[i] * g[i] + s[i + h] * g[i + h];
  for (int64_t i = h; i < 2 * h; ++i) dx[i] = c[i] * g[i] - s[i - h] * g[i - h];
}

inline void AccumulateCosSin(const float* __restrict__ g, const float* __restrict__ x,
                             float* __restrict__ dcos, float* __restrict__ dsin, int64_t h) {
  for (int64_t i = 0; i < 2 * h; ++i) dcos[i] += g[i] * x[i];
  for (int64_t i = 0; i < h; ++i) dsin[i] -= g[i] * x[i + h];
  for (int64_t i = h; i < 2 * h; ++i) dsin[i] += g[i] * x[i - h];
}

struct Scratch {
  explicit Scratch(int64_t head_dim, int64_t rotary_dim)
      : x(head_dim), out(head_dim), c(rotary_dim), s(rotary_dim), x2(head_dim),
        dcos(rotary_dim), dsin(rotary_dim) {}
  std::vector<float> x, out, c, s, x2, dcos, dsin;
};

template <typename T>
void ForwardHeads(const RopeGeometry& g, const T* in, T* out, int64_t heads,
                  int64_t head_stride, const float* c, const float* s, Scratch& scratch) {
  const int64_t d = g.head_dim;
  const int64_t r = g.rotary_dim;
  for (int64_t n = 0; n < heads; ++n) {
    const T* x_row = in + n * head_stride;
    T* out_row = out + n * head_stride;
    const float* x = LoadRow(x_row, r, scratch.x.data());
    float* o = OutRow(out_row, scratch.out.data());
    Rotate(g.mode, x, c, s, o, r);
    StoreRow(o, r, out_row);
    if (r < d) std::memcpy(out_row + r, x_row + r, (d - r) * sizeof(T));
  }
}

template <typename T>
void BackwardHeads(const RopeGeometry& g, const T* grad, const T* input, T* dinput,
                   int64_t heads, int64_t head_stride, const float* c, const float* s,
                   Scratch& scratch) {
  const int64_t d = g.head_dim;
  const int64_t r = g.rotary_dim;
  for (int64_t n = 0; n < heads; ++n) {
    const T* g_row = grad + n * head_stride;
    T* dx_row = dinput + n * head_stride;
    const float* gr = LoadRow(g_row, r, scratch.x.data());
    float* dx = OutRow(dx_row, scratch.out.data());
    RotateHalfAdjoint(gr, c, s, dx, r / 2);
    StoreRow(dx, r, dx_row);
    if (r < d) std::memcpy(dx_row + r, g_row + r, (d - r) * sizeof(T));
    if (input != nullptr) {
      const float* x = LoadRow(input + n * head_stride, r, scratch.x2.data());
      AccumulateCosSin(gr, x, scratch.dcos.data(), scratch.dsin.data(), r / 2);
    }
  }
}

}  // namespace

template <typename T>
void RopeForward(const RopeGeometry& g, const RopeForwardArgs<T>& a, int64_t begin,
                 int64_t end) {
  Scratch scratch(g.head_dim, g.rotary_dim);
  const int64_t r = g.rotary_dim;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t b = t / g.seq;
    const int64_t pos = t % g.seq;
    const int64_t cos_offset = (g.cos_batch == 1 ? 0 : b) * g.cos.batch + pos * g.cos.seq;
    const float* c = LoadRow(a.cos + cos_offset, r, scratch.c.data());
    const float* s = LoadRow(a.sin + cos_offset, r, scratch.s.data());
    const int64_t q_offset = b * g.q.batch + pos * g.q.seq;
    const int64_t k_offset = b * g.k.batch + pos * g.k.seq;
    ForwardHeads(g, a.query + q_offset, a.query_out + q_offset, g.q_heads, g.q.head, c, s,
                 scratch);
    ForwardHeads(g, a.key + k_offset, a.key_out + k_offset, g.k_heads, g.k.head, c, s,
                 scratch);
  }
}

template <typename T>
void RopeBackward(const RopeGeometry& g, const RopeBackwardArgs<T>& a, int64_t begin,
                  int64_t end) {
  Scratch scratch(g.head_dim, g.rotary_dim);
  const int64_t r = g.rotary_dim;
  const bool with_inputs = a.query != nullptr;
  // With cos batch 1, one cos row serves every batch entry at that position.
  const int64_t batches_per_row = g.cos_batch == 1 ? g.batch : 1;
  for (int64_t row = begin; row < end; ++row) {
    const int64_t cb = row / g.seq;
    const int64_t pos = row % g.seq;
    const int64_t cos_offset = cb * g.cos.batch + pos * g.cos.seq;
    const float* c = LoadRow(a.cos + cos_offset, r, scratch.c.data());
    const float* s = LoadRow(a.sin + cos_offset, r, scratch.s.data());
    std::fill(scratch.dcos.begin(), scratch.dcos.end(), 0.0f);
    std::fill(scratch.dsin.begin(), scratch.dsin.end(), 0.0f);
    for (int64_t i = 0; i < batches_per_row; ++i) {
      const int64_t b = g.cos_batch == 1 ? i : cb;
      const int64_t q_offset = b * g.q.batch + pos * g.q.seq;
      const int64_t k_offset = b * g.k.batch + pos * g.k.seq;
      BackwardHeads(g, a.grad_query + q_offset, with_inputs ? a.query + q_offset : nullptr,
                    a.dquery + q_offset, g.q_heads, g.q.head, c, s, scratch);
      BackwardHeads(g, a.grad_key + k_offset, with_inputs ? a.key + k_offset : nullptr,
                    a.dkey + k_offset, g.k_heads, g.k.head, c, s, scratch);
    }
    if (with_inputs) {
      T* dcos_row = a.dcos + cos_offset;
      T* dsin_row = a.dsin + cos_offset;
      for (int64_t i = 0; i < r; ++i) {
        dcos_row[i] = FromFloat<T>(scratch.dcos[i]);
        dsin_row[i] = FromFloat<T>(scratch.dsin[i]);
      }
    }
  }
}

#define JAX_ROPE_INSTANTIATE(T)                                                         \
  template void RopeForward<T>(const RopeGeometry&, const RopeForwardArgs<T>&, int64_t, \
                               int64_t);                                                \
  template void RopeBackward<T>(const RopeGeometry&, const RopeBackwardArgs<T>&, int64_t, \
                                int64_t);
JAX_ROPE_INSTANTIATE(float)
JAX_ROPE_INSTANTIATE(BFloat16)
JAX_ROPE_INSTANTIATE(Float16)
#undef JAX_ROPE_INSTANTIATE

}  // namespace jax_rope::cpu
