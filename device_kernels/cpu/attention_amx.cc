// TileOps::bf16_gemm and bf16_pairs_gemm on Intel AMX (AMX-BF16): tdpbf16ps
// multiplies a 16 x 16-pair tile of A by a 16-pair x 16 tile of B, exact
// products of bfloat16 added in float32, into a 16 x 16 float32 tile; on a core
// that has it, about ten times the products per cycle of vdpbf16ps. B's pairs
// (attention_tiles.h) are the tile layout of AMX's B operand, read in place; A
// is read in place where it is stored as rows of pairs, and otherwise packed a
// tile at a time (the transposed probability tiles of P V, 16 x 16 transposes).
// Compiled for AMX only inside this file's functions; attention_tiles.cc hands
// them out only where the CPU has AMX-BF16 and the OS lets the process use it
// (AmxBf16Usable).
#include <immintrin.h>

#include <cpuid.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define JAX_ROPE_AMX __attribute__((target("amx-tile,amx-bf16,avx512f")))
#define JAX_ROPE_AMX_INLINE JAX_ROPE_AMX inline __attribute__((always_inline))

namespace jax_rope::cpu {
namespace {

constexpr int kTile = 16;          // rows of a tile, and its 64-byte rows' float32 or pairs
constexpr int64_t kGroup = 4;      // chunks of 16 pairs of A packed at once (8 KiB for two tiles)
constexpr int64_t kRowBytes = 64;  // a tile row

// The tile configuration (palette 1): tiles 0-3 are C (2 x 2 blocks of 16 x 16
// float32), 4-5 A (16 rows x 16 pairs), 6-7 B (16 pairs x 16 columns).
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

constexpr TileConfig MakeConfig() {
  TileConfig t{};
  t.palette = 1;
  for (int i = 0; i < 8; ++i) {
    t.colsb[i] = kRowBytes;
    t.rows[i] = kTile;
  }
  return t;
}
alignas(64) constexpr TileConfig kConfig = MakeConfig();

// Lane o of the two-source permutes that transpose 16 x 16 words in four
// steps: step h pairs rows i and i + h (i & h == 0), and within each group of 2h
// lanes, row i takes the first h lanes of both and row i + h the last h.
constexpr int TransposeLane(int h, int o, bool high) {
  const int group = o / (2 * h) * (2 * h), w = o % (2 * h);
  const int lane = group + (high ? h : 0) + (w < h ? w : w - h);
  return w < h ? lane : 16 + lane;  // (16 + : the second row's lanes)
}

template <int H, bool High, size_t... I>
constexpr std::array<int32_t, 16> TransposeLanes(std::index_sequence<I...>) {
  return {TransposeLane(H, static_cast<int>(I), High)...};
}

template <int H>
JAX_ROPE_AMX_INLINE void TransposeStep(__m512i r[16]) {
  alignas(64) static constexpr std::array<int32_t, 16> kLow =
      TransposeLanes<H, false>(std::make_index_sequence<16>());
  alignas(64) static constexpr std::array<int32_t, 16> kHigh =
      TransposeLanes<H, true>(std::make_index_sequence<16>());
  const __m512i low = _mm512_load_si512(kLow.data()), high = _mm512_load_si512(kHigh.data());
  for (int i = 0; i < 16; ++i) {
    if (i & H) continue;
    const __m512i a = r[i], b = r[i + H];
    r[i] = _mm512_permutex2var_epi32(a, low, b);
    r[i + H] = _mm512_permutex2var_epi32(a, high, b);
  }
}

// Rows r[0..16) of 16 words each, transposed in place.
JAX_ROPE_AMX_INLINE void Transpose16(__m512i r[16]) {
  TransposeStep<8>(r);
  TransposeStep<4>(r);
  TransposeStep<2>(r);
  TransposeStep<1>(r);
}

// The 16 x 16 A tile of rows i < rows, pairs p < pairs (zero past them), A(i, p)
// at a[i * a_row + p * a_col], into dst (row stride 16).
JAX_ROPE_AMX_INLINE void PackA(const uint32_t* a, int64_t a_row, int64_t a_col, int64_t rows,
                               int64_t pairs, uint32_t* dst) {
  if (a_row == 1) {  // pairs along a_col: 16 x 16 transposes
    const __mmask16 lanes = static_cast<__mmask16>((1u << rows) - 1);
    __m512i r[16];
    for (int p = 0; p < kTile; ++p) {
      r[p] = p < pairs ? _mm512_maskz_loadu_epi32(lanes, a + p * a_col) : _mm512_setzero_si512();
    }
    Transpose16(r);
    for (int i = 0; i < kTile; ++i) _mm512_store_si512(dst + i * kTile, r[i]);
    return;
  }
  const __mmask16 cols = static_cast<__mmask16>((1u << pairs) - 1);
  for (int i = 0; i < kTile; ++i) {
    __m512i row = _mm512_setzero_si512();
    if (i < rows) {
      if (a_col == 1) {
        row = _mm512_maskz_loadu_epi32(cols, a + i * a_row);
      } else {
        alignas(64) uint32_t words[kTile] = {};
        for (int64_t p = 0; p < pairs; ++p) words[p] = a[i * a_row + p * a_col];
        row = _mm512_load_si512(words);
      }
    }
    _mm512_store_si512(dst + i * kTile, row);
  }
}

struct TilePtr {
  const void* data;
  int64_t stride;  // bytes
};

// C[RT x CT tiles] (+)= sum over chunks of A[r][ch] * B[c][ch]: tile 2r + c holds
// C's tile at c[2r + c], loaded from there (load_c) or zeroed, and stored back.
template <int RT, int CT>
JAX_ROPE_AMX_INLINE void Block(int64_t chunks, const TilePtr (*a)[kGroup], const TilePtr* b,
                               int64_t b_chunk_step, const TilePtr* b_last, bool load_c,
                               const TilePtr* c) {
#define JAX_ROPE_C(t, i)                                                \
  if (load_c) {                                                         \
    _tile_loadd(t, c[i].data, c[i].stride);                             \
  } else {                                                              \
    _tile_zero(t);                                                      \
  }
  JAX_ROPE_C(0, 0);
  if constexpr (CT > 1) {
    JAX_ROPE_C(1, 1);
  }
  if constexpr (RT > 1) {
    JAX_ROPE_C(2, 2);
  }
  if constexpr (RT > 1 && CT > 1) {
    JAX_ROPE_C(3, 3);
  }
#undef JAX_ROPE_C
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const bool last = b_last != nullptr && ch == chunks - 1;
    const TilePtr b0 = last ? b_last[0] : TilePtr{static_cast<const char*>(b[0].data) +
                                                      ch * b_chunk_step, b[0].stride};
    _tile_loadd(6, b0.data, b0.stride);
    if constexpr (CT > 1) {
      const TilePtr b1 = last ? b_last[1] : TilePtr{static_cast<const char*>(b[1].data) +
                                                        ch * b_chunk_step, b[1].stride};
      _tile_loadd(7, b1.data, b1.stride);
    }
    _tile_loadd(4, a[0][ch].data, a[0][ch].stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CT > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT > 1) {
      _tile_loadd(5, a[1][ch].data, a[1][ch].stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (CT > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, const_cast<void*>(c[0].data), c[0].stride);
  if constexpr (CT > 1) _tile_stored(1, const_cast<void*>(c[1].data), c[1].stride);
  if constexpr (RT > 1) _tile_stored(2, const_cast<void*>(c[2].data), c[2].stride);
  if constexpr (RT > 1 && CT > 1) _tile_stored(3, const_cast<void*>(c[3].data), c[3].stride);
}

}  // namespace

bool AmxBf16Usable() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
  if (!amx_bf16 || !amx_tile) return false;
#if defined(__linux__)
  // Linux hands the tile data state to a process that asks for it
  // (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); without it the first tile
  // instruction faults.
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

JAX_ROPE_AMX void Bf16PairsGemmAmx(int64_t m, int64_t n, int64_t kp, const uint32_t* a,
                                   int64_t a_row, int64_t a_col, const uint32_t* b, int64_t ldb,
                                   float* c, int64_t ldc, bool accumulate) {
  const int64_t col_tiles = (n + kTile - 1) / kTile;  // C is written up to RoundUpToTile(n)
  if (kp == 0) {
    if (!accumulate) {
      for (int64_t i = 0; i < m; ++i) std::memset(c + i * ldc, 0, col_tiles * kRowBytes);
    }
    return;
  }
  // The thread keeps the tile state between calls (no tilerelease): loading
  // the configuration costs about ten times reading it back, and other code on
  // this thread may have loaded its own.
  alignas(64) TileConfig current;
  _tile_storeconfig(&current);
  if (std::memcmp(&current, &kConfig, sizeof(TileConfig)) != 0) _tile_loadconfig(&kConfig);
  const int64_t chunks = (kp + kTile - 1) / kTile, tail = kp % kTile;
  // A's tiles packed where they are not rows of 16 whole pairs in place.
  alignas(64) uint32_t a_packed[2][kGroup][kTile * kTile];
  alignas(64) uint32_t b_tail[2][kTile * kTile];  // B's last chunk, short of 16 pairs
  alignas(64) float c_edge[4][kTile * kTile];     // C's tiles short of 16 rows
  const int64_t b_chunk_step = kTile * ldb * 4;
  for (int64_t i0 = 0; i0 < m; i0 += 2 * kTile) {
    const int rt = m - i0 > kTile ? 2 : 1;
    const int64_t rows[2] = {std::min<int64_t>(kTile, m - i0),
                             std::max<int64_t>(0, std::min<int64_t>(kTile, m - i0 - kTile))};
    for (int64_t g0 = 0; g0 < chunks; g0 += kGroup) {
      const int64_t group = std::min(kGroup, chunks - g0);
      TilePtr at[2][kGroup];
      for (int r = 0; r < rt; ++r) {
        const uint32_t* ar = a + (i0 + r * kTile) * a_row;
        for (int64_t ch = 0; ch < group; ++ch) {
          const int64_t p0 = (g0 + ch) * kTile, pairs = std::min<int64_t>(kTile, kp - p0);
          if (a_col == 1 && rows[r] == kTile && pairs == kTile) {
            at[r][ch] = {ar + p0, a_row * 4};
          } else {
            PackA(ar + p0 * a_col, a_row, a_col, rows[r], pairs, a_packed[r][ch]);
            at[r][ch] = {a_packed[r][ch], kRowBytes};
          }
        }
      }
      const bool ends = g0 + group == chunks && tail != 0;
      const bool load_c = accumulate || g0 > 0;
      for (int64_t j0 = 0; j0 < col_tiles; j0 += 2) {
        const int ct = col_tiles - j0 > 1 ? 2 : 1;
        TilePtr bt[2], b_last[2];
        for (int cc = 0; cc < ct; ++cc) {
          const uint32_t* bc = b + g0 * kTile * ldb + (j0 + cc) * kTile;
          bt[cc] = {bc, ldb * 4};
          if (ends) {
            const uint32_t* src = bc + (group - 1) * kTile * ldb;
            for (int p = 0; p < kTile; ++p) {
              if (p < tail) {
                std::memcpy(b_tail[cc] + p * kTile, src + p * ldb, kRowBytes);
              } else {
                std::memset(b_tail[cc] + p * kTile, 0, kRowBytes);
              }
            }
            b_last[cc] = {b_tail[cc], kRowBytes};
          }
        }
        TilePtr ct_ptr[4];  // tile 2r + c: C's rows r, columns c of this block
        for (int r = 0; r < rt; ++r) {
          for (int cc = 0; cc < ct; ++cc) {
            float* dst = c + (i0 + r * kTile) * ldc + (j0 + cc) * kTile;
            if (rows[r] == kTile) {
              ct_ptr[2 * r + cc] = {dst, ldc * 4};
              continue;
            }
            float* e = c_edge[2 * r + cc];
            if (load_c) {
              for (int64_t i = 0; i < kTile; ++i) {
                if (i < rows[r]) {
                  std::memcpy(e + i * kTile, dst + i * ldc, kRowBytes);
                } else {
                  std::memset(e + i * kTile, 0, kRowBytes);
                }
              }
            }
            ct_ptr[2 * r + cc] = {e, kRowBytes};
          }
        }
        const TilePtr* blast = ends ? b_last : nullptr;
        if (rt == 2 && ct == 2) {
          Block<2, 2>(group, at, bt, b_chunk_step, blast, load_c, ct_ptr);
        } else if (rt == 2) {
          Block<2, 1>(group, at, bt, b_chunk_step, blast, load_c, ct_ptr);
        } else if (ct == 2) {
          Block<1, 2>(group, at, bt, b_chunk_step, blast, load_c, ct_ptr);
        } else {
          Block<1, 1>(group, at, bt, b_chunk_step, blast, load_c, ct_ptr);
        }
        for (int r = 0; r < rt; ++r) {
          if (rows[r] == kTile) continue;
          for (int cc = 0; cc < ct; ++cc) {
            float* dst = c + (i0 + r * kTile) * ldc + (j0 + cc) * kTile;
            for (int64_t i = 0; i < rows[r]; ++i) {
              std::memcpy(dst + i * ldc, c_edge[2 * r + cc] + i * kTile, kRowBytes);
            }
          }
        }
      }
    }
  }
}

// bf16_gemm: the pairs GEMM with A's rows read in place as pairs (lda even).
JAX_ROPE_AMX void Bf16GemmAmx(int64_t m, int64_t n, int64_t kp, const uint16_t* a, int64_t lda,
                              const uint32_t* b, int64_t ldb, float* c, int64_t ldc) {
  Bf16PairsGemmAmx(m, n, kp, reinterpret_cast<const uint32_t*>(a), lda / 2, 1, b, ldb, c, ldc,
                   false);
}

}  // namespace jax_rope::cpu
