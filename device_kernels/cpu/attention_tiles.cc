// TileOps per instruction set: the tile routines of attention_tile_products.h
// and attention_tile_softmax.h instantiated for AVX-512, AVX2 and baseline
// x86-64, and the run-time choice among them.
#include "device_kernels/cpu/attention_tiles.h"

// (The standard headers come in before the pragma below.)
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

// The GEMM is built on fused multiply-adds whatever -ffp-contract the rest of
// the library uses (contraction only ever removes a rounding step).
#pragma GCC optimize("fp-contract=fast")

#include "device_kernels/cpu/attention_tile_products.h"
#include "device_kernels/cpu/attention_tile_rows.h"
#include "device_kernels/cpu/attention_tile_softmax.h"
#include "device_kernels/cpu/attention_tile_vectors.h"

namespace jax_rope::cpu {

// attention_bf16.cc, compiled for AVX-512 with AVX512_BF16.
void Bf16GemmAvx512(int64_t m, int64_t n, int64_t kp, const uint16_t* a, int64_t lda,
                    const uint32_t* b, int64_t ldb, float* c, int64_t ldc);
void Bf16PairsGemmAvx512(int64_t m, int64_t n, int64_t kp, const uint32_t* a, int64_t a_row,
                         int64_t a_col, const uint32_t* b, int64_t ldb, float* c, int64_t ldc,
                         bool accumulate);
void Bf16DotScoresAvx512(int64_t keys, int64_t rows, int64_t kp, const uint16_t* k, int64_t ldk,
                         const uint32_t* q, int64_t ldq, float* s, int64_t key_step,
                         int64_t row_step, const RowsAhead& ahead);
// attention_amx.cc, compiled for AMX-BF16.
bool AmxBf16Usable();
void Bf16GemmAmx(int64_t m, int64_t n, int64_t kp, const uint16_t* a, int64_t lda,
                 const uint32_t* b, int64_t ldb, float* c, int64_t ldc);
void Bf16PairsGemmAmx(int64_t m, int64_t n, int64_t kp, const uint32_t* a, int64_t a_row,
                      int64_t a_col, const uint32_t* b, int64_t ldb, float* c, int64_t ldc,
                      bool accumulate);

namespace {

using namespace tile_simd;

#define JAX_ROPE_TILE_OPS(Isa, attr, copy_b)                                             \
  attr void Gemm##Isa(                                          \
      int64_t m, int64_t n, int64_t k, const float* a, int64_t a_row, int64_t a_col,           \
      const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {                   \
    Gemm<Isa>(m, n, k, a, a_row, a_col, b, ldb, c, ldc, accumulate);                           \
  }                                                                                            \
  attr void GemmBf16B##Isa(                                                                    \
      int64_t m, int64_t n, int64_t k, const float* a, int64_t a_row, int64_t a_col,           \
      const uint16_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {                \
    Gemm<Isa>(m, n, k, a, a_row, a_col, b, ldb, c, ldc, accumulate);                           \
  }                                                                                            \
  attr void GemmColMax##Isa(                                                                   \
      int64_t m, int64_t n, int64_t k, const float* a, int64_t a_row, int64_t a_col,           \
      const float* b, int64_t ldb, float* c, int64_t ldc, float* col_max,                      \
      const ExpTerms* terms) {                                                                 \
    Gemm<Isa>(m, n, k, a, a_row, a_col, b, ldb, c, ldc, false, col_max, terms);                \
  }                                                                                            \
  attr void SoftmaxStep##Isa(                                                                  \
      float* s, int64_t lds, int64_t keys, int64_t queries, float scale, const float* raw_max, \
      float* q_max, float* q_sum, float* out, int64_t ldo, int64_t out_rows,                   \
      int64_t out_cols) {                                                                      \
    SoftmaxStep<Isa>(s, lds, keys, queries, scale, raw_max, q_max, q_sum, out, ldo, out_rows,  \
                     out_cols);                                                                \
  }                                                                                            \
  attr void SoftmaxGrad##Isa(                                   \
      float* s, float* dp, int64_t ld, int64_t rows, int64_t cols, float scale,                \
      const float* max, const float* inv_sum, const float* delta, bool stats_by_column) {      \
    SoftmaxGrad<Isa>(s, dp, ld, rows, cols, scale, max, inv_sum, delta, stats_by_column);      \
  }                                                                                            \
  attr void DotScores##Isa(int64_t keys, int64_t rows, int64_t d, const float* k, int64_t ldk, \
                           const float* q, int64_t ldq, float* s, int64_t key_step,            \
                           int64_t row_step, const RowsAhead& ahead) {                         \
    DotScores<Isa>(keys, rows, d, k, ldk, q, ldq, s, key_step, row_step, ahead);               \
  }                                                                                            \
  attr void SoftmaxRows##Isa(float* s, int64_t lds, int64_t rows, int64_t keys, float scale,   \
                             float* q_max, float* q_sum, float* out, int64_t ldo,              \
                             int64_t out_cols) {                                               \
    SoftmaxRows<Isa>(s, lds, rows, keys, scale, q_max, q_sum, out, ldo, out_cols);             \
  }                                                                                            \
  attr void WidenBf16##Isa(const uint16_t* src, int64_t stride, int64_t rows, int64_t cols,    \
                           float* dst, int64_t ld) {                                           \
    WidenRows<BFloat16>(src, stride, rows, cols, dst, ld);                                     \
  }                                                                                            \
  attr void WidenF16##Isa(const uint16_t* src, int64_t stride, int64_t rows, int64_t cols,     \
                          float* dst, int64_t ld) {                                            \
    WidenRows<Float16>(src, stride, rows, cols, dst, ld);                                      \
  }                                                                                            \
  attr bool CopyRow##Isa(const float* src, int64_t cols, float* dst) {                         \
    return CopyRowFinite(src, cols, dst);                                                      \
  }                                                                                            \
  attr void ScaleRows##Isa(const float* src, int64_t ld, int64_t rows, int64_t cols,           \
                           float factor, float* dst, int64_t stride) {                         \
    ScaleRows(src, ld, rows, cols, factor, dst, stride);                                       \
  }                                                                                            \
  attr void MaskRow##Isa(float* x, const uint8_t* masked, int64_t n) {                         \
    MaskRow(x, masked, n);                                                                     \
  }                                                                                            \
  attr float RowDot##Isa(const float* a, const float* b, int64_t n) {                          \
    return RowDot8(a, b, n);                                                                   \
  }                                                                                            \
  attr void RoundBf16##Isa(float* s, int64_t ld, int64_t rows, int64_t cols) {                 \
    RoundRowsToBf16(s, ld, rows, cols);                                                        \
  }                                                                                            \
  attr void PackBf16Pairs##Isa(const float* s, int64_t ld, int64_t rows, int64_t cols,         \
                               uint32_t* dst, int64_t ldd) {                                   \
    PackRowPairsBf16(s, ld, rows, cols, dst, ldd);                                             \
  }                                                                                            \
  attr bool PairRowsBf16##Isa(const uint16_t* src, int64_t stride, int64_t rows, int64_t cols, \
                              uint32_t* dst, int64_t ld) {                                     \
    return PairRowsBf16(src, stride, rows, cols, dst, ld);                                     \
  }                                                                                            \
  attr void NarrowBf16##Isa(const float* s, int64_t ld, int64_t rows, int64_t cols,            \
                            uint16_t* dst, int64_t ldd) {                                      \
    NarrowRowsToBf16(s, ld, rows, cols, dst, ldd);                                             \
  }                                                                                            \
  constexpr TileOps k##Isa##Ops = {Gemm##Isa,      GemmBf16B##Isa,   GemmColMax##Isa,          \
                                   SoftmaxStep##Isa,                                           \
                                   SoftmaxGrad##Isa, DotScores##Isa, SoftmaxRows##Isa,         \
                                   nullptr,        nullptr,          nullptr,                  \
                                   WidenBf16##Isa, WidenF16##Isa,    CopyRow##Isa,             \
                                   RoundBf16##Isa, PackBf16Pairs##Isa, PairRowsBf16##Isa,      \
                                   NarrowBf16##Isa,                                            \
                                   ScaleRows##Isa, MaskRow##Isa,                               \
                                   RowDot##Isa,    copy_b};

JAX_ROPE_TILE_OPS(Avx512, __attribute__((target("avx512f,avx2,fma"))), false)
JAX_ROPE_TILE_OPS(Avx2, __attribute__((target("avx2,fma"))), true)
JAX_ROPE_TILE_OPS(Sse2, , true)
#undef JAX_ROPE_TILE_OPS

// AVX-512 routines plus the bf16 GEMMs and dot scores (attention_bf16.cc).
constexpr TileOps kAvx512Bf16Ops = {GemmAvx512,        GemmBf16BAvx512,     GemmColMaxAvx512,
                                    SoftmaxStepAvx512,
                                    SoftmaxGradAvx512, DotScoresAvx512,     SoftmaxRowsAvx512,
                                    Bf16GemmAvx512,    Bf16PairsGemmAvx512, Bf16DotScoresAvx512,
                                    WidenBf16Avx512,   WidenF16Avx512,      CopyRowAvx512,
                                    RoundBf16Avx512,   PackBf16PairsAvx512, PairRowsBf16Avx512,
                                    NarrowBf16Avx512,  ScaleRowsAvx512,     MaskRowAvx512,
                                    RowDotAvx512,      false};

// The same with the bf16 GEMMs on AMX tiles (attention_amx.cc).
constexpr TileOps kAvx512AmxOps = {GemmAvx512,        GemmBf16BAvx512,     GemmColMaxAvx512,
                                   SoftmaxStepAvx512,
                                   SoftmaxGradAvx512, DotScoresAvx512,     SoftmaxRowsAvx512,
                                   Bf16GemmAmx,       Bf16PairsGemmAmx,    Bf16DotScoresAvx512,
                                   WidenBf16Avx512,   WidenF16Avx512,      CopyRowAvx512,
                                   RoundBf16Avx512,   PackBf16PairsAvx512, PairRowsBf16Avx512,
                                   NarrowBf16Avx512,  ScaleRowsAvx512,     MaskRowAvx512,
                                   RowDotAvx512,      false};

}  // namespace

const TileOps* TileOpsFor(TileIsa isa) {
  __builtin_cpu_init();
  const bool fma = __builtin_cpu_supports("fma");
  switch (isa) {
    case TileIsa::kAvx512:
      if (!fma || !__builtin_cpu_supports("avx512f")) return nullptr;
      return __builtin_cpu_supports("avx512bf16") ? &kAvx512Bf16Ops : &kAvx512Ops;
    case TileIsa::kAvx512Amx: {
      static const bool amx = AmxBf16Usable();  // (asks the OS for the tile state once)
      const TileOps* avx512 = TileOpsFor(TileIsa::kAvx512);
      return avx512 == &kAvx512Bf16Ops && amx ? &kAvx512AmxOps : nullptr;
    }
    case TileIsa::kAvx2:
      return fma && __builtin_cpu_supports("avx2") ? &kAvx2Ops : nullptr;
    case TileIsa::kBaseline:
      return &kSse2Ops;
  }
  return nullptr;
}

namespace {
std::atomic<const TileOps*> g_tile_ops_for_testing{nullptr};
}  // namespace

const TileOps& GetTileOps() {
  static const TileOps& best = [] {
    const TileOps* found = TileOpsFor(TileIsa::kAvx512Amx);
    if (found == nullptr) found = TileOpsFor(TileIsa::kAvx512);
    if (found == nullptr) found = TileOpsFor(TileIsa::kAvx2);
    return found != nullptr ? *found : *TileOpsFor(TileIsa::kBaseline);
  }();
  const TileOps* chosen = g_tile_ops_for_testing.load(std::memory_order_acquire);
  return chosen != nullptr ? *chosen : best;
}

void UseTileOpsForTesting(const TileOps* ops) {
  g_tile_ops_for_testing.store(ops, std::memory_order_release);
}

}  // namespace jax_rope::cpu
