#include "xla_ffi/attention_decode.h"

#include <algorithm>
#include <cmath>

#include "device_kernels/common/layout_roles.h"
#include "xla_ffi/dtype_dispatch.h"

namespace jax_rope::ffi_support::attention_decode {
namespace {

using cpu::AttentionGeometry;
using cpu::SequenceBand;

bool BiasBatchOk(int64_t dim, const AttentionGeometry& g) { return dim == 1 || dim == g.batch; }

}  // namespace

ffi::Error Fail(const std::string& message) {
  return ffi::Error::InvalidArgument("jax_rope attention: " + message);
}


ffi::Error Decode(int32_t layout, float scale, int32_t has_mask, const ffi::AnyBuffer& query,
                  const ffi::AnyBuffer& key, const std::vector<int64_t>& value_dims,
                  const ffi::Buffer<ffi::S32>& table, const ffi::Buffer<ffi::U8>& mask,
                  Decoded* out) {
  AxisRoles roles;
  if (!LayoutRoles(layout, &roles)) return Fail("unknown layout code " + std::to_string(layout));
  const std::vector<int64_t> q = DimsOf(query), k = DimsOf(key);
  if (static_cast<int>(q.size()) != roles.rank || static_cast<int>(k.size()) != roles.rank ||
      static_cast<int>(value_dims.size()) != roles.rank) {
    return Fail("query, key and value must have rank " + std::to_string(roles.rank));
  }
  if (query.element_type() != key.element_type()) return Fail("key must have query's dtype");
  AttentionGeometry& g = out->geometry;
  out->packed = roles.batch < 0;
  g.batch = RoleSize(q, roles.batch);
  g.q_heads = q[roles.head];
  g.kv_heads = k[roles.head];
  g.head_dim = q.back();
  g.value_dim = value_dims.back();
  g.scale = scale;
  out->q_rows = q[roles.seq];
  out->kv_rows = k[roles.seq];
  if (RoleSize(k, roles.batch) != g.batch || RoleSize(value_dims, roles.batch) != g.batch ||
      value_dims[roles.seq] != out->kv_rows || value_dims[roles.head] != g.kv_heads) {
    return Fail("key and value must agree with query on batch and with each other on rows/heads");
  }
  if (g.kv_heads <= 0 || g.q_heads % g.kv_heads != 0) return Fail("N1 must be a multiple of N2");
  if (k.back() != g.head_dim || g.value_dim > g.head_dim) {
    return Fail("need D(key) == D(query) and Dv <= D");
  }
  if (g.head_dim <= 0 || g.value_dim <= 0) {
    return Fail("query/key/value must have D > 0 and Dv > 0");
  }
  g.q = StridesOf(q, roles);
  g.k = StridesOf(k, roles);
  g.v = StridesOf(value_dims, roles);
  std::vector<int64_t> out_dims = q;
  out_dims.back() = g.value_dim;
  g.out = StridesOf(out_dims, roles);
  g.stats = out->packed ? Strides{0, g.q_heads, 1}
                        : Strides{g.q_heads * out->q_rows, 1, out->q_rows};
  // The sequence table: one row per sequence, ranges inside the tensors.
  auto table_dims = table.dimensions();
  if (table_dims.size() != 2 || table_dims[1] != 7 ||
      (!out->packed && table_dims[0] != g.batch)) {
    return Fail("sequence table must be int32 (B, 7) with a row per batch entry");
  }
  g.batch = table_dims[0];
  out->seqs = reinterpret_cast<const SequenceBand*>(table.typed_data());
  int64_t max_q = 0, max_kv = 0;
  for (int64_t b = 0; b < g.batch; ++b) {
    const SequenceBand& s = out->seqs[b];
    if (s.q_start < 0 || s.q_len < 0 || s.q_start + int64_t{s.q_len} > out->q_rows ||
        s.kv_start < 0 || s.kv_len < 0 || s.kv_start + int64_t{s.kv_len} > out->kv_rows ||
        (!out->packed && (s.q_start != 0 || s.kv_start != 0))) {
      return Fail("sequence " + std::to_string(b) + " lies outside the tensors (actual_seq_qlen/"
                  "actual_seq_kvlen must be non-decreasing and end within Tq/Tkv)");
    }
    // A padded layout's row covers the whole sequence: the kernels write only
    // the rows a table row covers.
    if (!out->packed && (s.q_len != out->q_rows || s.kv_len != out->kv_rows)) {
      return Fail("sequence table row " + std::to_string(b) + " must cover the padded sequence "
                  "(q_len == Sq, kv_len == Skv)");
    }
    max_q = std::max<int64_t>(max_q, s.q_len);
    max_kv = std::max<int64_t>(max_kv, s.kv_len);
  }
  if (has_mask) {
    auto m = mask.dimensions();
    if (m.size() != 4 || (m[0] != 1 && m[0] != g.batch) || (m[1] != 1 && m[1] != g.q_heads) ||
        m[2] < max_q || m[3] < max_kv) {
      return Fail("atten_mask must be (1 or B, 1 or N1, rows, cols) covering every sequence");
    }
    g.mask.data = mask.typed_data();
    g.mask.batch = m[0] == 1 ? 0 : m[1] * m[2] * m[3];
    g.mask.head = m[1] == 1 ? 0 : m[2] * m[3];
    g.mask.row = m[3];
    g.mask.col = 1;
  }
  return ffi::Error::Success();
}


ffi::Error DecodeBias(int32_t kind, int32_t after_scale, const ffi::AnyBuffer& query,
                      const ffi::AnyBuffer& bias, const ffi::Buffer<ffi::S32>& offsets,
                      Decoded* d) {
  using cpu::BiasKind;
  if (kind < 0 || kind > 5) return Fail("unknown bias_kind " + std::to_string(kind));
  if (after_scale != 0 && after_scale != 1) return Fail("bias_after_scale must be 0 or 1");
  AttentionGeometry& g = d->geometry;
  cpu::PositionBias& pb = g.bias;
  pb.kind = static_cast<BiasKind>(kind);
  pb.after_scale = after_scale == 1;
  if (pb.kind == BiasKind::kNone) return ffi::Error::Success();
  const std::vector<int64_t> dims = DimsOf(bias);
  const int64_t n1 = g.q_heads, nb = g.batch;
  int64_t max_q = 0, cells = 0;
  for (int64_t b = 0; b < nb; ++b) {
    max_q = std::max<int64_t>(max_q, d->seqs[b].q_len);
    cells += int64_t{d->seqs[b].q_len} * d->seqs[b].kv_len;
  }
  pb.data = bias.untyped_data();
  d->bias_base.assign(nb, 0);
  if (pb.kind == BiasKind::kAlibi || pb.kind == BiasKind::kAlibiSqrt) {
    if (bias.element_type() != ffi::DataType::F32 || dims.size() != 2 ||
        !BiasBatchOk(dims[0], g) || dims[1] != n1) {
      return Fail("ALiBi slopes must be float32 (1 or B, N1)");
    }
    auto off = offsets.dimensions();
    if (off.size() != 2 || off[0] != nb || off[1] != 2) {
      return Fail("ALiBi offsets must be int32 (B, 2), one row per sequence");
    }
    if (!pb.after_scale) return Fail("ALiBi biases are added after scaling (bias_after_scale 1)");
    pb.slope_batch = dims[0] == 1 ? 0 : n1;
    pb.offsets = offsets.typed_data();
    return ffi::Error::Success();
  }
  if (bias.element_type() != query.element_type()) return Fail("pse must have query's dtype");
  switch (pb.kind) {
    case BiasKind::kTensor:
      if (d->packed) {  // (N1, Tkv): row-broadcast, read at the sequence's key rows
        if (dims != std::vector<int64_t>{n1, d->kv_rows}) return Fail("pse must be (N1, Tkv)");
        for (int64_t b = 0; b < nb; ++b) d->bias_base[b] = d->seqs[b].kv_start;
        pb.head = d->kv_rows;
      } else {
        if (dims.size() != 4 || !BiasBatchOk(dims[0], g) || dims[1] != n1 ||
            (dims[2] != 1 && dims[2] != d->q_rows) || dims[3] != d->kv_rows) {
          return Fail("pse must be (1 or B, N1, 1 or Sq, Skv)");
        }
        for (int64_t b = 0; b < nb; ++b) {
          d->bias_base[b] = (dims[0] == 1 ? 0 : b) * n1 * dims[2] * dims[3];
        }
        pb.head = dims[2] * dims[3];
        pb.row = dims[2] == 1 ? 0 : dims[3];
      }
      break;
    case BiasKind::kCompressed:
      // Row 1023, column W - 1 - (i - j) is read for i >= j: W must cover every query row.
      if (dims.size() != 4 || !BiasBatchOk(dims[0], g) || dims[1] != n1 || dims[2] != 1024 ||
          dims[3] < std::max<int64_t>(max_q, 1) || (!d->packed && dims[3] != d->kv_rows)) {
        return Fail("compressed pse must be (1 or B, N1, 1024, Skv) (TND: W >= every q_len)");
      }
      for (int64_t b = 0; b < nb; ++b) {
        d->bias_base[b] = (dims[0] == 1 ? 0 : b) * n1 * 1024 * dims[3];
      }
      pb.head = 1024 * dims[3];
      pb.width = dims[3];
      break;
    case BiasKind::kPacked: {
      if (!d->packed) return Fail("the packed pse form needs the TND layout");
      if (dims != std::vector<int64_t>{n1, cells}) {
        return Fail("packed pse must be (N1, sum of q_len * kv_len) = (" + std::to_string(n1) +
                    ", " + std::to_string(cells) + ")");
      }
      int64_t base = 0;
      for (int64_t b = 0; b < nb; ++b) {
        d->bias_base[b] = base;
        base += int64_t{d->seqs[b].q_len} * d->seqs[b].kv_len;
      }
      pb.head = cells;
      pb.row_is_kv_len = true;
      break;
    }
    default:
      break;
  }
  pb.seq_base = d->bias_base.data();
  return ffi::Error::Success();
}

ffi::Error DecodeDropout(int32_t dropout, int64_t keep_threshold, float keep_scale,
                         const ffi::Buffer<ffi::U32>& drop_keys,
                         const ffi::Buffer<ffi::U32>& drop_rows,
                         const ffi::Buffer<ffi::U8>& drop_mask, Decoded* d) {
  using cpu::DropoutMode;
  if (dropout < 0 || dropout > 2) return Fail("unknown dropout mode " + std::to_string(dropout));
  AttentionGeometry& g = d->geometry;
  cpu::Dropout& dr = g.dropout;
  dr.mode = static_cast<DropoutMode>(dropout);
  if (dr.mode == DropoutMode::kNone) return ffi::Error::Success();
  if (keep_threshold < 0 || keep_threshold >= (int64_t{1} << 32)) {
    return Fail("keep_threshold must be in [0, 2^32)");
  }
  if (!std::isfinite(keep_scale) || keep_scale < 1.0f) return Fail("keep_scale must be >= 1");
  auto keys = drop_keys.dimensions();
  auto rows = drop_rows.dimensions();
  if (keys.size() != 2 || keys[0] != g.batch || keys[1] != 2) {
    return Fail("drop_keys must be uint32 (B, 2), one key per sequence");
  }
  if (rows.size() != 2 || rows[0] != g.batch || rows[1] != g.q_heads) {
    return Fail("drop_rows must be uint32 (B, N1)");
  }
  dr.threshold = static_cast<uint32_t>(keep_threshold);
  dr.keep_scale = keep_scale;
  dr.keys = drop_keys.typed_data();
  dr.rows = drop_rows.typed_data();
  if (dr.mode == DropoutMode::kMask) {
    auto bytes = drop_mask.dimensions();
    if (bytes.size() != 1) return Fail("dropout_mask must be 1-D uint8");
    // Bits rows[b, n] + i * kv_len + j for every (i, j) of a sequence are read.
    uint64_t needed = 0;
    for (int64_t b = 0; b < g.batch; ++b) {
      const uint64_t cells = uint64_t(d->seqs[b].q_len) * uint64_t(d->seqs[b].kv_len);
      if (cells == 0) continue;
      for (int64_t n = 0; n < g.q_heads; ++n) {
        needed = std::max<uint64_t>(needed, dr.rows[b * g.q_heads + n] + cells);
      }
    }
    if ((needed + 7) / 8 > static_cast<uint64_t>(bytes[0])) {
      return Fail("dropout_mask has " + std::to_string(bytes[0]) + " bytes, the sequences read " +
                  std::to_string((needed + 7) / 8));
    }
    dr.mask = drop_mask.typed_data();
  }
  return ffi::Error::Success();
}

ffi::Error CheckResult(const ffi::AnyBuffer& result, const std::vector<int64_t>& dims,
                       ffi::DataType dtype, const char* name) {
  if (DimsOf(result) != dims || result.element_type() != dtype) {
    return Fail(std::string(name) + " has an unexpected shape or dtype");
  }
  return ffi::Error::Success();
}

std::vector<int64_t> StatsDims(const Decoded& d) {
  const AttentionGeometry& g = d.geometry;
  if (d.packed) return {d.q_rows, g.q_heads};
  return {g.batch, g.q_heads, d.q_rows};
}

}  // namespace jax_rope::ffi_support::attention_decode
