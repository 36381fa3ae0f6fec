// The integer codes of jax_rope's operators, defined once: layouts, rotary
// modes and sparse modes, with their names. Used by the CPU kernels, the FFI
// handlers and the NPU glue; the extension exports the name tables
// (`_jax_rope_ffi.codes()`), jax_rope/core/codes.py mirrors them for a
// pure-Python install, and tests/test_codes.py checks the three agree.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace jax_rope {

// Tensor layouts (the NPU operators' inputLayout order); axis roles in layout_roles.h.
enum class Layout : int32_t { kBSND = 1, kSBND = 2, kBNSD = 3, kTND = 4 };

// RoPE rotary modes (spec/rope.md).
enum class RotaryMode : int32_t { kHalf = 0, kQuarter = 1, kInterleave = 2 };

// FlashAttentionScore sparse modes (spec/attention.md).
enum class SparseMode : int32_t {
  kDefaultMask = 0,
  kAllMask = 1,
  kLeftUpCausal = 2,
  kRightDownCausal = 3,
  kBand = 4,
  kPrefix = 5,
  kPrefixCompress = 6,
  kRightDownCausalBand = 7,
  kBandLeftUpCausal = 8,
};

template <typename Enum>
struct NamedCode {
  const char* name;
  Enum code;
};

inline constexpr NamedCode<Layout> kLayouts[] = {
    {"BSND", Layout::kBSND}, {"SBND", Layout::kSBND}, {"BNSD", Layout::kBNSD},
    {"TND", Layout::kTND}};

inline constexpr NamedCode<RotaryMode> kRotaryModes[] = {
    {"HALF", RotaryMode::kHalf}, {"QUARTER", RotaryMode::kQuarter},
    {"INTERLEAVE", RotaryMode::kInterleave}};

inline constexpr NamedCode<SparseMode> kSparseModes[] = {
    {"DEFAULT_MASK", SparseMode::kDefaultMask},
    {"ALL_MASK", SparseMode::kAllMask},
    {"LEFT_UP_CAUSAL", SparseMode::kLeftUpCausal},
    {"RIGHT_DOWN_CAUSAL", SparseMode::kRightDownCausal},
    {"BAND", SparseMode::kBand},
    {"PREFIX", SparseMode::kPrefix},
    {"PREFIX_COMPRESS", SparseMode::kPrefixCompress},
    {"RIGHT_DOWN_CAUSAL_BAND", SparseMode::kRightDownCausalBand},
    {"BAND_LEFT_UP_CAUSAL", SparseMode::kBandLeftUpCausal}};

// Decodes a raw attribute: false when `code` is not one of the table's codes.
template <typename Enum, size_t N>
constexpr bool FromCode(int32_t code, const NamedCode<Enum> (&table)[N], Enum* out) {
  for (const NamedCode<Enum>& entry : table) {
    if (static_cast<int32_t>(entry.code) == code) {
      *out = entry.code;
      return true;
    }
  }
  return false;
}

// The table's name of `code` ("" for a value outside the table).
template <typename Enum, size_t N>
constexpr const char* NameOf(Enum code, const NamedCode<Enum> (&table)[N]) {
  for (const NamedCode<Enum>& entry : table) {
    if (entry.code == code) return entry.name;
  }
  return "";
}

// "1 (BSND), 2 (SBND), 3 (BNSD) or 4 (TND)": the valid codes, for messages.
template <typename Enum, size_t N>
std::string Choices(const NamedCode<Enum> (&table)[N]) {
  std::string out;
  for (size_t i = 0; i < N; ++i) {
    if (i > 0) out += i + 1 == N ? " or " : ", ";
    out += std::to_string(static_cast<int32_t>(table[i].code)) + " (" + table[i].name + ")";
  }
  return out;
}

inline constexpr bool ToLayout(int32_t code, Layout* out) { return FromCode(code, kLayouts, out); }
inline constexpr bool ToRotaryMode(int32_t code, RotaryMode* out) {
  return FromCode(code, kRotaryModes, out);
}
inline constexpr bool ToSparseMode(int32_t code, SparseMode* out) {
  return FromCode(code, kSparseModes, out);
}

// The rotaryMode strings of the Ascend RoPE operators.
inline constexpr NamedCode<RotaryMode> kNpuRotaryModes[] = {
    {"half", RotaryMode::kHalf}, {"quarter", RotaryMode::kQuarter},
    {"interleave", RotaryMode::kInterleave}};

inline constexpr const char* NpuRotaryModeName(RotaryMode mode) {
  return NameOf(mode, kNpuRotaryModes);
}

// What the FlashAttentionScore operators expect per sparse mode (attention.md):
// the compressed attenMask instead of the caller's (2048x2048 lower
// triangle, or the 3072x2048 prefix mask for kPrefixCompress) ...
inline constexpr bool NeedsCompressedMask(SparseMode mode) {
  switch (mode) {
    case SparseMode::kLeftUpCausal:
    case SparseMode::kRightDownCausal:
    case SparseMode::kBand:
    case SparseMode::kPrefixCompress:
    case SparseMode::kRightDownCausalBand:
    case SparseMode::kBandLeftUpCausal:
      return true;
    default:
      return false;
  }
}

// ... and the per-sequence prefix list.
inline constexpr bool TakesPrefix(SparseMode mode) {
  return mode == SparseMode::kPrefix || mode == SparseMode::kPrefixCompress;
}

}  // namespace jax_rope
