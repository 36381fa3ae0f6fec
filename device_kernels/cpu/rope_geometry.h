// Canonical geometry of a fused Q/K RoPE call: every layout becomes
// (batch, seq, heads, dim) plus element strides, so kernels never branch on
// the layout. Free of XLA: callers pass plain dimension lists.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "device_kernels/common/codes.h"
#include "device_kernels/common/layout_roles.h"

namespace jax_rope::cpu {

struct RopeGeometry {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t q_heads = 0;
  int64_t k_heads = 0;
  int64_t head_dim = 0;    // D
  int64_t rotary_dim = 0;  // r = cos.shape[-1]
  int64_t cos_batch = 0;   // 1 or batch
  Strides q, k, cos;       // cos: batch 0 when it broadcasts; head unused (axis of 1)
  RotaryMode mode = RotaryMode::kHalf;

  int64_t tokens() const { return batch * seq; }
  int64_t cos_rows() const { return cos_batch * seq; }
};

// Decodes the layout and rotary_mode codes, checks the shapes against rope.md
// and fills `geometry`. Returns an empty string on success, otherwise a
// message naming the argument at fault.
std::string MakeRopeGeometry(int32_t layout, int32_t mode,
                             const std::vector<int64_t>& query_dims,
                             const std::vector<int64_t>& key_dims,
                             const std::vector<int64_t>& cos_dims,
                             const std::vector<int64_t>& sin_dims,
                             RopeGeometry* geometry);

}  // namespace jax_rope::cpu
