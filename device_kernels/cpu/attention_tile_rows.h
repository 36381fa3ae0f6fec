// Row routines of the staging code (attention_staging.h) at each instruction
// set's width: 16-bit rows widened (TileOps::widen_bf16, widen_f16), float32
// rows copied with a finiteness check (copy_row), scaled (scale_rows),
// multiplied and summed (row_dot), rounded to bfloat16 (round_bf16,
// pack_bf16_pairs, narrow_bf16), bfloat16 rows paired (pair_rows_bf16) and
// masked by a row of mask bytes (mask_row). Plain loops that the compiler vectorizes at
// the width of the wrapper they are inlined into. Compiled with the rest of
// the kernels for baseline x86-64 they ran in 16-byte vectors: on one AVX2
// core the B2 S32 N16 D256 causal backward took 1.37-1.47 ms with them there,
// 1.22-1.27 ms with them here (the forward 0.50 -> 0.46 ms).
// Private to attention_tiles.cc, which includes it after its fp-contract
// pragma and instantiates these templates once per instruction set.
#pragma once

#include <cstdint>
#include <cstring>

#include "device_kernels/cpu/attention_tile_vectors.h"
#include "device_kernels/cpu/attention_tiles.h"
#include "device_kernels/cpu/float_convert.h"

namespace jax_rope::cpu::tile_simd {

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

// TileOps::copy_row: integer tests on the bits, in the copy's own loop.
JAX_ROPE_INLINE bool CopyRowFinite(const float* src, int64_t cols, float* dst) {
  constexpr uint32_t kExponent = 0x7f800000u;
  uint32_t non_finite = 0;
  for (int64_t c = 0; c < cols; ++c) {
    uint32_t bits;
    std::memcpy(&bits, src + c, sizeof bits);
    non_finite |= (bits & kExponent) == kExponent;
    std::memcpy(dst + c, &bits, sizeof bits);
  }
  for (int64_t c = cols; c < RoundUpToTile(cols); ++c) dst[c] = 0.0f;
  return non_finite == 0;
}

JAX_ROPE_INLINE void ScaleRows(const float* src, int64_t ld, int64_t rows, int64_t cols,
                               float factor, float* dst, int64_t stride) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[r * stride + c] = src[r * ld + c] * factor;
  }
}

// TileOps::row_dot: eight partial sums (element c goes to sum c mod 8) in one
// 8-float vector at every width, added in a fixed order.
JAX_ROPE_INLINE float RowDot8(const float* a, const float* b, int64_t n) {
  typedef float V8 __attribute__((vector_size(32)));
  V8 part = {};
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    V8 x;
    V8 y;
    Load(x, a + c);
    Load(y, b + c);
    part += x * y;
  }
  for (; c < n; ++c) part[c % 8] += a[c] * b[c];
  return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
}

// TileOps::pair_rows_bf16: rows 2p and 2p + 1 of bfloat16 bits as pairs (the
// even row in the low half; a row past `rows` and the columns up to
// RoundUpToTile(cols) zero); whether every value is finite.
JAX_ROPE_INLINE bool PairRowsBf16(const uint16_t* src, int64_t stride, int64_t rows,
                                  int64_t cols, uint32_t* dst, int64_t ld) {
  constexpr uint32_t kExponent = 0x7f80u;
  const int64_t padded = RoundUpToTile(cols);
  uint32_t non_finite = 0;
  for (int64_t p = 0; 2 * p < rows; ++p) {
    const uint16_t* even = src + 2 * p * stride;
    uint32_t* out = dst + p * ld;
    if (2 * p + 1 < rows) {
      const uint16_t* odd = even + stride;
      for (int64_t c = 0; c < cols; ++c) {
        const uint32_t lo = even[c], hi = odd[c];
        out[c] = lo | hi << 16;
        non_finite |= ((lo & kExponent) == kExponent) | ((hi & kExponent) == kExponent);
      }
    } else {
      for (int64_t c = 0; c < cols; ++c) {
        out[c] = even[c];
        non_finite |= (even[c] & kExponent) == kExponent;
      }
    }
    for (int64_t c = cols; c < padded; ++c) out[c] = 0;
  }
  return non_finite == 0;
}

// TileOps::mask_row: x[j] = -inf where masked[j] != 0, by bit operations (no
// branch for an irregular mask to mispredict).
JAX_ROPE_INLINE void MaskRow(float* x, const uint8_t* masked, int64_t n) {
  constexpr uint32_t kNegInfBits = 0xff800000u;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t all = 0u - static_cast<uint32_t>(masked[j] != 0);
    uint32_t bits;
    std::memcpy(&bits, x + j, sizeof bits);
    bits = (bits & ~all) | (kNegInfBits & all);
    std::memcpy(x + j, &bits, sizeof bits);
  }
}

// TileOps::round_bf16: each value to the nearest bfloat16 (float_convert.h's
// FromFloat, ties to even, NaN kept), in place.
JAX_ROPE_INLINE void RoundRowsToBf16(float* s, int64_t ld, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * ld;
    for (int64_t c = 0; c < cols; ++c) row[c] = ToFloat(FromFloat<BFloat16>(row[c]));
  }
}

// TileOps::pack_bf16_pairs: rows 2p and 2p + 1 of s rounded to bfloat16 as
// FromFloat does, one pair per column (the even row in the low half), a row
// past `rows` read as zero: dst[p * ldd + c] for c < RoundUpToTile(cols).
JAX_ROPE_INLINE void PackRowPairsBf16(const float* s, int64_t ld, int64_t rows, int64_t cols,
                                      uint32_t* dst, int64_t ldd) {
  const int64_t padded = RoundUpToTile(cols);
  for (int64_t p = 0; 2 * p < rows; ++p) {
    const float* even = s + 2 * p * ld;
    const float* odd = 2 * p + 1 < rows ? even + ld : nullptr;
    uint32_t* out = dst + p * ldd;
    if (odd == nullptr) {
      for (int64_t c = 0; c < padded; ++c) out[c] = FromFloat<BFloat16>(even[c]).bits;
      continue;
    }
    for (int64_t c = 0; c < padded; ++c) {
      out[c] = uint32_t{FromFloat<BFloat16>(even[c]).bits} |
               uint32_t{FromFloat<BFloat16>(odd[c]).bits} << 16;
    }
  }
}

// TileOps::narrow_bf16: rows of s rounded to bfloat16 as FromFloat does, as
// bits, dst[r * ldd + c]; an odd cols gets a zero column after it.
JAX_ROPE_INLINE void NarrowRowsToBf16(const float* s, int64_t ld, int64_t rows, int64_t cols,
                                      uint16_t* dst, int64_t ldd) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = s + r * ld;
    uint16_t* out = dst + r * ldd;
    for (int64_t c = 0; c < cols; ++c) out[c] = FromFloat<BFloat16>(in[c]).bits;
    if (cols % 2 != 0) out[cols] = 0;
  }
}

}  // namespace jax_rope::cpu::tile_simd
