// Axis roles of the kernels' layouts (codes shared with jax_rope/layouts.py
// and the NPU operators): which axis is batch, sequence and head.
#pragma once

#include <cstdint>
#include <vector>

namespace jax_rope::cpu {

enum class Layout : int32_t { kBSND = 1, kSBND = 2, kBNSD = 3, kTND = 4 };

struct AxisRoles {
  int rank;
  int batch;  // -1: no batch axis (packed TND)
  int seq;
  int head;
};

inline bool LayoutRoles(int32_t layout, AxisRoles* roles) {
  switch (static_cast<Layout>(layout)) {
    case Layout::kBSND: *roles = {4, 0, 1, 2}; return true;
    case Layout::kSBND: *roles = {4, 1, 0, 2}; return true;
    case Layout::kBNSD: *roles = {4, 0, 2, 1}; return true;
    case Layout::kTND: *roles = {3, -1, 0, 1}; return true;
  }
  return false;
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

}  // namespace jax_rope::cpu
