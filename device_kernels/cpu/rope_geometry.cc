#include "device_kernels/cpu/rope_geometry.h"

#include <sstream>

namespace jax_rope::cpu {
namespace {

std::string Dims(const std::vector<int64_t>& dims) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? ", " : "") << dims[i];
  out << (dims.size() == 1 ? ",)" : ")");
  return out.str();
}

}  // namespace

std::string MakeRopeGeometry(int32_t layout, int32_t mode,
                             const std::vector<int64_t>& query_dims,
                             const std::vector<int64_t>& key_dims,
                             const std::vector<int64_t>& cos_dims,
                             const std::vector<int64_t>& sin_dims,
                             RopeGeometry* geometry) {
  std::ostringstream err;
  AxisRoles roles;
  if (!LayoutRoles(layout, &roles)) {
    err << "layout code must be " << Choices(kLayouts) << ", got " << layout;
    return err.str();
  }
  RotaryMode rotary_mode;
  if (!ToRotaryMode(mode, &rotary_mode)) {
    err << "rotary_mode code must be " << Choices(kRotaryModes) << ", got " << mode;
    return err.str();
  }
  const std::pair<const char*, const std::vector<int64_t>*> named[] = {
      {"query", &query_dims}, {"key", &key_dims}, {"cos", &cos_dims}, {"sin", &sin_dims}};
  for (const auto& [name, dims] : named) {
    if (static_cast<int>(dims->size()) != roles.rank) {
      err << name << " must have rank " << roles.rank << " for this layout, got shape "
          << Dims(*dims);
      return err.str();
    }
    for (int64_t d : *dims) {
      if (d <= 0) {
        err << name << " must not have an empty axis, got shape " << Dims(*dims);
        return err.str();
      }
    }
  }
  if (cos_dims != sin_dims) {
    err << "sin must have the shape of cos " << Dims(cos_dims) << ", got " << Dims(sin_dims);
    return err.str();
  }
  for (int axis = 0; axis < roles.rank; ++axis) {
    if (axis != roles.head && key_dims[axis] != query_dims[axis]) {
      err << "key must match query on every axis but the head axis: query "
          << Dims(query_dims) << ", key " << Dims(key_dims);
      return err.str();
    }
  }
  RopeGeometry g;
  g.batch = RoleSize(query_dims, roles.batch);
  g.seq = query_dims[roles.seq];
  g.q_heads = query_dims[roles.head];
  g.k_heads = key_dims[roles.head];
  g.head_dim = query_dims[roles.rank - 1];
  g.rotary_dim = cos_dims[roles.rank - 1];
  g.cos_batch = RoleSize(cos_dims, roles.batch);
  g.mode = rotary_mode;
  if (cos_dims[roles.head] != 1) {
    err << "cos must have head axis 1, got shape " << Dims(cos_dims);
    return err.str();
  }
  if (cos_dims[roles.seq] != g.seq) {
    err << "cos must have sequence length " << g.seq << ", got shape " << Dims(cos_dims);
    return err.str();
  }
  if (g.cos_batch != 1 && g.cos_batch != g.batch) {
    err << "cos batch must be 1 or " << g.batch << ", got shape " << Dims(cos_dims);
    return err.str();
  }
  const int64_t multiple = g.mode == RotaryMode::kQuarter ? 4 : 2;
  if (g.head_dim % multiple != 0 || g.rotary_dim % multiple != 0) {
    err << "head dim " << g.head_dim << " and rotary dim " << g.rotary_dim
        << " must be divisible by " << multiple << " in this rotary mode";
    return err.str();
  }
  if (g.rotary_dim > g.head_dim) {
    err << "cos last axis " << g.rotary_dim << " must be <= head dim " << g.head_dim;
    return err.str();
  }
  g.q = StridesOf(query_dims, roles);
  g.k = StridesOf(key_dims, roles);
  g.cos = StridesOf(cos_dims, roles);
  *geometry = g;
  return "";
}

}  // namespace jax_rope::cpu
