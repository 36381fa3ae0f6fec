// Axis roles of the layouts (codes in codes.h): which axis is batch, sequence
// and head, so that the CPU kernels and the NPU glue read every layout as one
// canonical (batch, seq, head, dim) view plus strides, never as a chain of
// layout comparisons.
#pragma once

#include <cstdint>
#include <vector>

#include "device_kernels/common/codes.h"

namespace jax_rope {

struct AxisRoles {
  int rank;
  int batch;  // -1: no batch axis (packed TND)
  int seq;
  int head;
};

constexpr AxisRoles LayoutRoles(Layout layout) {
  switch (layout) {
    case Layout::kBSND: return {4, 0, 1, 2};
    case Layout::kSBND: return {4, 1, 0, 2};
    case Layout::kBNSD: return {4, 0, 2, 1};
    case Layout::kTND: return {3, -1, 0, 1};
  }
  return {0, -1, 0, 0};
}

// Decodes a raw layout attribute: false for an unknown code.
inline bool LayoutRoles(int32_t code, AxisRoles* roles) {
  Layout layout;
  if (!ToLayout(code, &layout)) return false;
  *roles = LayoutRoles(layout);
  return true;
}

inline std::vector<int64_t> RowMajorStrides(const std::vector<int64_t>& dims) {
  std::vector<int64_t> strides(dims.size(), 1);
  for (int i = static_cast<int>(dims.size()) - 2; i >= 0; --i) {
    strides[i] = strides[i + 1] * dims[i + 1];
  }
  return strides;
}

// Size of a role's axis (1 for the absent batch axis of TND).
inline int64_t RoleSize(const std::vector<int64_t>& dims, int axis) {
  return axis < 0 ? 1 : dims[axis];
}

// Element strides of a tensor seen as (batch, seq, head, dim); the dim stride is 1.
struct Strides {
  int64_t batch = 0;  // 0 without a batch axis, or when it has size 1 (broadcast)
  int64_t seq = 0;
  int64_t head = 0;
};

// A dense row-major tensor of `dims` in the canonical view.
inline Strides StridesOf(const std::vector<int64_t>& dims, const AxisRoles& roles) {
  const std::vector<int64_t> strides = RowMajorStrides(dims);
  const bool broadcast = roles.batch < 0 || dims[roles.batch] == 1;
  return {broadcast ? 0 : strides[roles.batch], strides[roles.seq], strides[roles.head]};
}

}  // namespace jax_rope
