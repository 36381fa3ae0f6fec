// The float16 rows of the RoPE kernels with F16C's conversions (8 values per
// instruction; the same values as float_convert.h's selects, which cost 30
// vector instructions a vector on AVX2). They are functions of their own,
// compiled for F16C and called from every instruction-set clone of
// rope_kernels.cc when UseF16c() says so. Internal to the RoPE kernels.
//
// The rotations work in one pass, 8 values a step (staged through float32
// scratch they took three passes: widen, rotate, narrow), the rest pair by
// pair with the portable conversions, which give the same values. Their
// arithmetic is that of rope_kernels.cc's RotateHalf,
// RotateHalfAdjointWithTables and RotateInterleave, operation for operation (no
// fused products), so the bits are too; like them, each step reads only the
// elements it writes (alias-safe): [i, i + 8) and [i + h, i + h + 8) of the
// half rotations' rows, [i, i + 8) of the interleaved one's.
#pragma once

#include <atomic>
#include <cstdint>

#include "device_kernels/cpu/float_convert.h"

namespace jax_rope::cpu::rope_f16c {

extern std::atomic<bool> g_use_f16c;  // UseF16cForTesting (rope_kernels.h)
bool CpuHasF16c();

// Whether float16 rows take these routines: the CPU has F16C and no test said otherwise.
inline bool UseF16c() {
  static const bool has = CpuHasF16c();
  return has && g_use_f16c.load(std::memory_order_relaxed);
}

// n float16 values to float32.
void WidenF16c(const Float16* src, int64_t n, float* dst);

// out = x * c + rot(x) * s over one rotary block of width 2h.
void RotateHalfF16c(const Float16* x, Float16* out, const float* c, const float* s, int64_t h);

// The interleaved rotation of r elements, pairs (2i, 2i + 1): even * c + (-odd)
// * s and odd * c + even * s.
void RotateInterleaveF16c(const Float16* x, Float16* out, const float* c, const float* s,
                          int64_t r);

// RotateHalfF16c's adjoint, dx = c * g + rot^T(s * g), and when x (the
// forward's input row) is given this row's dcos/dsin terms added to float32 sums.
void RotateHalfAdjointF16c(const Float16* g, const Float16* x, Float16* dx, const float* c,
                           const float* s, float* dcos, float* dsin, int64_t h);

}  // namespace jax_rope::cpu::rope_f16c
