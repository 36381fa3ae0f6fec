// Staging of tensor blocks for the attention tile routines (attention_tiles.h):
// float32 rows or transposes of a block of any element type, blocks as GEMM
// operands (in place, or copied where the instruction set wants B blocks
// contiguous), and the scaled stores of float32 accumulators. Internal to the
// kernels; the transposes are tested in tests/attention_blocks_test.cc.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "device_kernels/cpu/attention_tiles.h"
#include "device_kernels/cpu/float_convert.h"

namespace jax_rope::cpu::attention {

// rows x cols of `src` (row stride `stride`) to float32 rows of `ld`, zero
// columns up to RoundUpToTile(cols).
template <typename T>
void LoadBlock(const T* src, int64_t stride, int64_t rows, int64_t cols, float* dst, int64_t ld) {
  const int64_t padded = RoundUpToTile(cols);
  for (int64_t r = 0; r < rows; ++r) {
    const T* in = src + r * stride;
    float* out = dst + r * ld;
    for (int64_t c = 0; c < cols; ++c) out[c] = ToFloat(in[c]);
    for (int64_t c = cols; c < padded; ++c) out[c] = 0.0f;
  }
}

// 16-bit rows widen at the CPU's widest vectors (TileOps::widen_bf16 and
// widen_f16): the kernels convert each key/value block for every query block
// that reads it.
inline void LoadBlock(const BFloat16* src, int64_t stride, int64_t rows, int64_t cols, float* dst,
                      int64_t ld) {
  GetTileOps().widen_bf16(reinterpret_cast<const uint16_t*>(src), stride, rows, cols, dst, ld);
}
inline void LoadBlock(const Float16* src, int64_t stride, int64_t rows, int64_t cols, float* dst,
                      int64_t ld) {
  GetTileOps().widen_f16(reinterpret_cast<const uint16_t*>(src), stride, rows, cols, dst, ld);
}

// dst[l * ld + r] = element(r, l) for source rows r < rows and lines l <
// lines, zero for r from rows up to RoundUpToTile(rows) when `pad`.
template <typename Out, typename Element>
void TransposeBlock(int64_t rows, int64_t lines, Out* dst, int64_t ld, bool pad,
                    const Element& element) {
  // Eight source rows at a time: rows a page apart share L1 sets, and a
  // line-by-line walk down all of them would miss on every element (as would
  // a row-by-row walk writing one element to each of `lines` cache lines).
  constexpr int64_t kRows = 8;
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t nr = std::min(kRows, rows - r0);
    for (int64_t l = 0; l < lines; ++l) {
      Out* out = dst + l * ld + r0;
      for (int64_t r = 0; r < nr; ++r) out[r] = element(r0 + r, l);
    }
  }
  const int64_t padded = pad ? RoundUpToTile(rows) : rows;
  for (int64_t l = 0; l < lines; ++l) {
    for (int64_t r = rows; r < padded; ++r) dst[l * ld + r] = Out{0};
  }
}

// TransposeBlock of float32 rows, 4 x 4 blocks at a time in 16-byte vectors
// (GCC vector extensions: SSE2 on x86-64) where element by element took an
// eighth of a small step's kernel time (B2 S32 N16 D256: the backward
// transposes each head's keys and values, the forward its queries). Eight
// source rows at a time, as TransposeBlock.
inline void TransposeFloats(const float* src, int64_t stride, int64_t rows, int64_t cols,
                            float* dst, int64_t ld, bool pad) {
  typedef float V4 __attribute__((vector_size(16)));
  typedef float U4 __attribute__((vector_size(16), aligned(alignof(float)), may_alias));
  typedef int32_t I4 __attribute__((vector_size(16)));
  constexpr int64_t kRows = 8;
  const int64_t cols4 = cols / 4 * 4;
  int64_t r0 = 0;
  for (; r0 + kRows <= rows; r0 += kRows) {
    const float* in = src + r0 * stride;
    for (int64_t l = 0; l < cols4; l += 4) {
      for (int64_t h = 0; h < kRows; h += 4) {
        const V4 a = *reinterpret_cast<const U4*>(in + h * stride + l);
        const V4 b = *reinterpret_cast<const U4*>(in + (h + 1) * stride + l);
        const V4 c = *reinterpret_cast<const U4*>(in + (h + 2) * stride + l);
        const V4 d = *reinterpret_cast<const U4*>(in + (h + 3) * stride + l);
        const V4 ab_lo = __builtin_shuffle(a, b, I4{0, 4, 1, 5});
        const V4 ab_hi = __builtin_shuffle(a, b, I4{2, 6, 3, 7});
        const V4 cd_lo = __builtin_shuffle(c, d, I4{0, 4, 1, 5});
        const V4 cd_hi = __builtin_shuffle(c, d, I4{2, 6, 3, 7});
        float* out = dst + l * ld + r0 + h;
        *reinterpret_cast<U4*>(out) = __builtin_shuffle(ab_lo, cd_lo, I4{0, 1, 4, 5});
        *reinterpret_cast<U4*>(out + ld) = __builtin_shuffle(ab_lo, cd_lo, I4{2, 3, 6, 7});
        *reinterpret_cast<U4*>(out + 2 * ld) = __builtin_shuffle(ab_hi, cd_hi, I4{0, 1, 4, 5});
        *reinterpret_cast<U4*>(out + 3 * ld) = __builtin_shuffle(ab_hi, cd_hi, I4{2, 3, 6, 7});
      }
    }
    for (int64_t l = cols4; l < cols; ++l) {
      for (int64_t r = 0; r < kRows; ++r) dst[l * ld + r0 + r] = in[r * stride + l];
    }
  }
  // The last rows, and the padding, as TransposeBlock does them.
  TransposeBlock(rows - r0, cols, dst + r0, ld, false,
                 [&](int64_t r, int64_t c) { return src[(r0 + r) * stride + c]; });
  const int64_t padded = pad ? RoundUpToTile(rows) : rows;
  for (int64_t l = 0; l < cols; ++l) {
    for (int64_t r = rows; r < padded; ++r) dst[l * ld + r] = 0.0f;
  }
}

// The transpose of rows x cols of `src` into dst as float32 (cols x rows, row
// stride ld), zero columns up to RoundUpToTile(rows) when `pad`.
template <typename T>
void TransposeToFloat(const T* src, int64_t stride, int64_t rows, int64_t cols, float* dst,
                      int64_t ld, bool pad) {
  if constexpr (std::is_same_v<T, float>) {
    TransposeFloats(src, stride, rows, cols, dst, ld, pad);
  } else {
    TransposeBlock(rows, cols, dst, ld, pad,
                   [&](int64_t r, int64_t c) { return ToFloat(src[r * stride + c]); });
  }
}

// The transpose (cols x rows, row stride ld); nothing past `rows` in dst's rows
// is written.
template <typename T>
void TransposeRows(const T* src, int64_t stride, int64_t rows, int64_t cols, float* dst,
                   int64_t ld) {
  TransposeToFloat(src, stride, rows, cols, dst, ld, false);
}

// The transpose (cols x rows, row stride ld), zero columns up to RoundUpToTile(rows).
template <typename T>
void LoadTransposed(const T* src, int64_t stride, int64_t rows, int64_t cols, float* dst,
                    int64_t ld) {
  TransposeToFloat(src, stride, rows, cols, dst, ld, true);
}

// Two neighbouring bfloat16 values as one pair of the bf16 dot products:
// bits(x[0]) | bits(x[1]) << 16.
inline uint32_t Bf16Pair(const BFloat16* x) {
  return uint32_t{x[0].bits} | uint32_t{x[1].bits} << 16;
}

// The transpose of a block of rows x cols (cols even) as column pairs for
// TileOps::bf16_gemm: dst[p * ld + r] = Bf16Pair(src[r] + 2p), zero columns up
// to RoundUpToTile(rows) when `pad`. Only for bfloat16 blocks.
template <typename T>
void LoadPairsTransposed(const T* src, int64_t stride, int64_t rows, int64_t cols, uint32_t* dst,
                         int64_t ld, bool pad = true) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    TransposeBlock(rows, cols / 2, dst, ld, pad, [&](int64_t r, int64_t p) {
      return Bf16Pair(src + r * stride + 2 * p);
    });
  }
}

// A block of rows x cols (cols even) as rows of pairs for
// TileOps::bf16_dot_scores: dst[r * ld + p] = Bf16Pair(src[r] + 2p). Only for
// bfloat16 blocks.
template <typename T>
void LoadPairs(const T* src, int64_t stride, int64_t rows, int64_t cols, uint32_t* dst,
               int64_t ld) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t p = 0; p < cols / 2; ++p) dst[r * ld + p] = Bf16Pair(src + r * stride + 2 * p);
    }
  }
}

// A block of rows x cols as row pairs, TileOps::bf16_pairs_gemm's B
// (TileOps::pair_rows_bf16): dst[p * ld + c] = bits(src[2p][c]) |
// bits(src[2p + 1][c]) << 16, a row past `rows` and columns up to
// RoundUpToTile(cols) zero. Whether every element is finite. Only for bfloat16
// blocks.
template <typename T>
bool LoadRowPairs(const T* src, int64_t stride, int64_t rows, int64_t cols, uint32_t* dst,
                  int64_t ld) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    return GetTileOps().pair_rows_bf16(reinterpret_cast<const uint16_t*>(src), stride, rows,
                                       cols, dst, ld);
  }
  return false;
}

// A block as a GEMM operand: float32 rows are used in place unless a B operand
// would read past `cols`; other types are converted into `scratch`. finite:
// every element is known to be finite (BOperand's copy looked), which spares
// MaskedGemm its own look.
struct Operand {
  const float* data;
  int64_t ld;
  bool finite = false;
  // The block from row `first` on.
  Operand Rows(int64_t first) const { return {data + first * ld, ld, finite}; }
};

// Whether View uses a block of T in place.
template <typename T>
bool InPlace(int64_t cols, bool b_operand) {
  return std::is_same_v<T, float> && (!b_operand || cols % kTileAlign == 0);
}

template <typename T>
Operand View(const T* src, int64_t stride, int64_t rows, int64_t cols, bool b_operand,
             float* scratch, int64_t ld) {
  if constexpr (std::is_same_v<T, float>) {
    if (InPlace<T>(cols, b_operand)) return {src, stride};
  }
  LoadBlock(src, stride, rows, cols, scratch, ld);
  return {scratch, ld};
}

// A block a GEMM reads as its B operand, copied into `scratch` row by row
// (rows ld apart) whatever the instruction set, with row r of `ahead` (blocks
// read after it) asked for along with row r of the copy, whose own rows arrive
// from memory anyway. A float32 copy finds out whether the block is finite.
template <typename T>
Operand CopiedOperand(const TileOps& ops, const T* src, int64_t stride, int64_t rows,
                      int64_t cols, float* scratch, int64_t ld, const RowsAhead& ahead) {
  bool finite = std::is_same_v<T, float>;
  for (int64_t r = 0; r < rows; ++r) {
    ahead.Fetch(r);
    if constexpr (std::is_same_v<T, float>) {
      finite &= ops.copy_row(src + r * stride, cols, scratch + r * ld);
    } else {
      LoadBlock(src + r * stride, 0, 1, cols, scratch + r * ld, ld);
    }
  }
  return {scratch, ld, finite};
}

// A block a GEMM reads as its B operand, with the rows of `ahead` asked for:
// where the instruction set copies B blocks (TileOps::copy_b_blocks) a
// CopiedOperand (AVX2: the backward 3-8% faster than with a burst ahead);
// elsewhere `ahead` is asked for at once and the block is a View.
template <typename T>
Operand BOperand(const TileOps& ops, const T* src, int64_t stride, int64_t rows, int64_t cols,
                 float* scratch, int64_t ld, const RowsAhead& ahead) {
  if (!ops.copy_b_blocks) {
    ahead.FetchAll();
    return View(src, stride, rows, cols, true, scratch, ld);
  }
  return CopiedOperand(ops, src, stride, rows, cols, scratch, ld, ahead);
}

template <typename T>
void StoreRows(const float* src, int64_t ld, int64_t rows, int64_t cols, float factor, T* dst,
               int64_t stride) {
  if constexpr (std::is_same_v<T, float>) {
    GetTileOps().scale_rows(src, ld, rows, cols, factor, dst, stride);
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        dst[r * stride + c] = FromFloat<T>(src[r * ld + c] * factor);
      }
    }
  }
}

}  // namespace jax_rope::cpu::attention
