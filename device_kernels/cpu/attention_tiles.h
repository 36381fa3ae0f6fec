// Float32 tile routines behind the attention kernels: a register-blocked GEMM,
// the softmax steps over score tiles and the widening of 16-bit blocks. They
// are compiled for AVX-512, AVX2 and baseline x86-64 and picked once at run
// time, so one binary runs everywhere and uses the widest vectors the CPU has.
//
// Buffer convention: row-major, leading dimensions in floats. Column counts
// are rounded up to kTileAlign inside the routines, so every operand row must
// be readable (and every output row writable) up to RoundUpToTile(cols).
#pragma once

#include <cstdint>

namespace jax_rope::cpu {

constexpr int64_t kTileAlign = 16;

constexpr int64_t RoundUpToTile(int64_t n) {
  return (n + kTileAlign - 1) / kTileAlign * kTileAlign;
}

// Rows of blocks to be read next, which a routine reading its own block row by
// row asks for as it goes (row r of each stream with its row r, into L2, not
// the L1 that holds the block at hand). The rows of one head lie a page or
// more apart, where hardware prefetchers stop; asked for along the way, the
// requests overlap the computation on this block, where a burst ahead of it
// stalls the core until memory has answered most of it. A stream without data
// asks for nothing.
struct RowsAhead {
  struct Stream {
    const char* data = nullptr;
    int64_t stride = 0, bytes = 0;  // in bytes: row step and bytes per row
  };
  Stream streams[2];
  int64_t rows = 0;

  template <typename T>
  static Stream Of(const T* src, int64_t stride, int64_t cols) {
    return {reinterpret_cast<const char*>(src), stride * static_cast<int64_t>(sizeof(T)),
            cols * static_cast<int64_t>(sizeof(T))};
  }
  // Always inlined: GCC's pure-const analysis finds a function that only
  // prefetches free of effects and drops the calls to it that it does not
  // inline (the key-block prefetches of the forward's in-place path and of the
  // two-pass backward had been compiled away so).
  __attribute__((always_inline)) void Fetch(int64_t r) const {
    if (r >= rows) return;
    for (const Stream& s : streams) {
      const char* row = s.data + r * s.stride;
      for (int64_t off = 0; off < s.bytes; off += 64) __builtin_prefetch(row + off, 0, 2);
    }
  }
  __attribute__((always_inline)) void FetchAll() const {
    for (int64_t r = 0; r < rows; ++r) Fetch(r);
  }
};

// What the forward's score product can leave in place of its products (see
// TileOps::gemm_col_max): exp(scale * s - shift[j]), the product rounded to
// float32 before the subtraction, with each column's terms added to sum[j].
struct ExpTerms {
  float scale;
  const float* shift;
  float* sum;
};

struct TileOps {
  // C[m x n] = (accumulate ? C : 0) + A[m x k] * B[k x n], where A(i, p) is
  // a[i * a_row + p * a_col] (a_row = 1, a_col = ld reads a stored transpose).
  // B's columns from n up to RoundUpToTile(n) are read (keep them finite) and
  // C's are written.
  void (*gemm)(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_row, int64_t a_col,
               const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate);
  // gemm with B as bfloat16 bits (b[p * ldb + j], widened exactly as they are
  // loaded; the same read bounds): P V over bfloat16 values in place.
  void (*gemm_bf16_b)(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_row,
                      int64_t a_col, const uint16_t* b, int64_t ldb, float* c, int64_t ldc,
                      bool accumulate);
  // gemm (not accumulating) that also folds each column's largest product
  // into col_max[j], j < RoundUpToTile(n) (NaN skipped, as the softmax steps
  // skip it): the forward's score tiles without masked positions, whose
  // softmax_step then needs no pass of its own for the maximum. With terms,
  // C gets the softmax terms of the products (ExpTerms; shift and sum read
  // up to RoundUpToTile(n)), the sums added in row order as softmax_step adds
  // them: a step that keeps each query's shift, without a pass over C.
  void (*gemm_col_max)(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_row,
                       int64_t a_col, const float* b, int64_t ldb, float* c, int64_t ldc,
                       float* col_max, const ExpTerms* terms);

  // One online-softmax step of the forward over a transposed tile s of raw
  // dot products (keys x queries, queries a multiple of kTileAlign, -inf where
  // masked). Per query column: folds max(scale * s) into q_max (-inf: nothing
  // seen yet), rescales q_sum and row q of `out` (the first out_rows rows,
  // out_cols columns, a multiple of kTileAlign) by exp(old max - new max), adds
  // sum exp(scale * s - new max) to q_sum and leaves those terms in s. With
  // raw_max (scale > 0, nothing masked), the column maxima of s from
  // gemm_col_max: the same results, without a pass over s for them.
  void (*softmax_step)(float* s, int64_t lds, int64_t keys, int64_t queries, float scale,
                       const float* raw_max, float* q_max, float* q_sum, float* out,
                       int64_t ldo, int64_t out_rows, int64_t out_cols);

  // Backward on a tile (rows x cols, cols a multiple of kTileAlign) of raw dot
  // products s (-inf where masked) and dp = dO . v: p = exp(scale * s - max) *
  // inv_sum goes to s and p * (dp - delta) to dp (exactly 0 where masked, even
  // when dp is not finite there). The statistics are indexed
  // by row, or by column when the tile is transposed (keys along rows).
  void (*softmax_grad)(float* s, float* dp, int64_t ld, int64_t rows, int64_t cols, float scale,
                       const float* max, const float* inv_sum, const float* delta,
                       bool stats_by_column);

  // Scores of a short block of query rows: s[j * key_step + i * row_step] =
  // sum_p k[j * ldk + p] * q[i * ldq + p] for keys j < keys and rows i < rows
  // <= kTileAlign, as dot products with a tree reduction across lanes (the
  // GEMM would spend a whole vector on each handful of rows). k and q rows are
  // read up to RoundUpToTile(d) (k's padding finite, q's zero) and q has
  // RoundUpToTile(rows) readable rows (zeros past `rows`); nothing else of s
  // is written. Row j of `ahead` is asked for when key j is read.
  void (*dot_scores)(int64_t keys, int64_t rows, int64_t d, const float* k, int64_t ldk,
                     const float* q, int64_t ldq, float* s, int64_t key_step, int64_t row_step,
                     const RowsAhead& ahead);

  // softmax_step on a tile stored by query rows (rows x keys, keys padded
  // with -inf to a multiple of kTileAlign): per row, the same folding into
  // q_max / q_sum and rescaling of the row's first out_cols of `out`.
  void (*softmax_rows)(float* s, int64_t lds, int64_t rows, int64_t keys, float scale,
                       float* q_max, float* q_sum, float* out, int64_t ldo, int64_t out_cols);

  // bfloat16 products with the CPU's bf16 dot instructions (AVX512_BF16
  // vdpbf16ps, or AMX-BF16 tdpbf16ps where the CPU has it: exact products,
  // float32 sums, in each instruction's order); nullptr where they are missing.
  // C[m x n] = A[m x 2 kp] * B[2 kp x n]: A is bfloat16 bits, row stride lda
  // (even: bf16_pairs_gemm reads A's rows as pairs);
  // B comes as column pairs, b[p * ldb + j] = B[2p][j] | B[2p + 1][j] << 16,
  // readable up to column RoundUpToTile(n), which C is written to.
  void (*bf16_gemm)(int64_t m, int64_t n, int64_t kp, const uint16_t* a, int64_t lda,
                    const uint32_t* b, int64_t ldb, float* c, int64_t ldc);
  // C[m x n] (accumulate: C +) = A[m x 2 kp] * B on the same instruction, A
  // given as pairs: A[i][2p] | A[i][2p + 1] << 16 is a[i * a_row + p * a_col]
  // (a_row = 1, a_col = ld: pack_bf16_pairs of a transposed tile). B as in
  // bf16_gemm; C written up to column RoundUpToTile(n). nullptr where missing.
  void (*bf16_pairs_gemm)(int64_t m, int64_t n, int64_t kp, const uint32_t* a, int64_t a_row,
                          int64_t a_col, const uint32_t* b, int64_t ldb, float* c, int64_t ldc,
                          bool accumulate);
  // dot_scores of bfloat16 rows on the same instruction (nullptr where it is
  // missing): key row j is 2 kp bfloat16 (bits, k + j * ldk, read in place and
  // nothing past them), query row r kp pairs as in bf16_gemm's B (q + r * ldq,
  // readable and zero up to RoundUpToTile(kp) pairs, RoundUpToTile(rows) rows).
  void (*bf16_dot_scores)(int64_t keys, int64_t rows, int64_t kp, const uint16_t* k,
                          int64_t ldk, const uint32_t* q, int64_t ldq, float* s,
                          int64_t key_step, int64_t row_step, const RowsAhead& ahead);

  // rows x cols of bfloat16 (widen_bf16) or IEEE float16 (widen_f16) bits,
  // row stride `stride`, to float32 rows of dst (row stride ld), exactly (as
  // float_convert.h's ToFloat), zero columns up to RoundUpToTile(cols).
  void (*widen_bf16)(const uint16_t* src, int64_t stride, int64_t rows, int64_t cols,
                     float* dst, int64_t ld);
  void (*widen_f16)(const uint16_t* src, int64_t stride, int64_t rows, int64_t cols,
                    float* dst, int64_t ld);

  // float32 rows for the staging code: copy_row copies cols floats of src to
  // dst, zeros up to RoundUpToTile(cols), and says whether all were finite;
  // scale_rows sets dst[r * stride + c] = src[r * ld + c] * factor for r < rows,
  // c < cols (one rounding, the same bits everywhere); row_dot sums a[c] * b[c]
  // for c < n in eight partial sums (c mod 8) added in a fixed order.
  bool (*copy_row)(const float* src, int64_t cols, float* dst);
  // bfloat16 rounding (ties to even, NaN kept) of float32 tiles: round_bf16
  // rounds rows x cols in place; pack_bf16_pairs writes rows 2p and 2p + 1 of
  // a rows x cols tile (read up to RoundUpToTile(cols); a row past `rows` is
  // zero) as bf16_gemm's B pairs, dst[p * ldd + c], c < RoundUpToTile(cols).
  void (*round_bf16)(float* s, int64_t ld, int64_t rows, int64_t cols);
  void (*pack_bf16_pairs)(const float* s, int64_t ld, int64_t rows, int64_t cols, uint32_t* dst,
                          int64_t ldd);
  // pair_rows_bf16: rows 2p and 2p + 1 of bfloat16 bits (row stride `stride`)
  // as bf16_gemm's B pairs, dst[p * ld + c] (a row past `rows` and columns up to
  // RoundUpToTile(cols) zero); whether every value is finite.
  bool (*pair_rows_bf16)(const uint16_t* src, int64_t stride, int64_t rows, int64_t cols,
                         uint32_t* dst, int64_t ld);
  // narrow_bf16 writes the rounded rows as bfloat16 bits, dst[r * ldd + c], a
  // zero after an odd cols (rows of pairs for bf16_pairs_gemm's A, a_col = 1).
  void (*narrow_bf16)(const float* s, int64_t ld, int64_t rows, int64_t cols, uint16_t* dst,
                      int64_t ldd);
  void (*scale_rows)(const float* src, int64_t ld, int64_t rows, int64_t cols, float factor,
                     float* dst, int64_t stride);
  // x[j] = -inf where masked[j] != 0, j < n (a score row under an element mask).
  void (*mask_row)(float* x, const uint8_t* masked, int64_t n);
  float (*row_dot)(const float* a, const float* b, int64_t n);

  // Whether the kernels copy a float32 block into contiguous rows before a GEMM
  // reads it as its B operand, rather than reading it in place. The GEMM walks
  // down a panel of kNv vectors per row, one cache line on AVX2 and SSE, and
  // the rows of one head lie a page or more apart, so a panel's rows evict
  // each other from L1. Measured per instruction set: on AVX2 the copies made
  // the forward 15% and the backward 10% faster; AVX-512 (four lines per panel
  // row) was faster in place. The decode path (attention_split.cc) reads its
  // blocks in place on every instruction set, kSubRows rows at a time; the
  // forward and the fused backward, which read each of their B blocks for
  // many tiles, copy them on every instruction set (attention_kernels.cc,
  // attention_backward_fused.cc).
  bool copy_b_blocks;
};

// The routines for the best instruction set of this CPU.
const TileOps& GetTileOps();

// Tests only: GetTileOps returns *ops from now on (nullptr: this CPU's best
// again), so that one machine runs the kernels' branches for another
// instruction set's routines (copy_b_blocks either way, with or without a
// bf16_gemm). Not to be called while kernels run.
void UseTileOpsForTesting(const TileOps* ops);

// One instruction set's routines, or nullptr when this CPU lacks it (tests).
// kAvx512Amx: AVX-512's, with the bf16 GEMMs on AMX tiles (AMX-BF16, where the
// OS grants the process the tile state).
enum class TileIsa { kAvx512Amx, kAvx512, kAvx2, kBaseline };
const TileOps* TileOpsFor(TileIsa isa);

}  // namespace jax_rope::cpu
