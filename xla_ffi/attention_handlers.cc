// XLA FFI handlers for masked attention: decode buffers and attributes into an
// AttentionGeometry, re-check every shape and the run-time sequence table
// (varlen lengths may be traced, so only here are their values known), and run
// the tiled kernels of device_kernels/cpu on XLA's thread pool. Every handler
// takes every optional operand (mask, positional bias, ALiBi offsets, dropout
// keys/rows/mask; the lowering passes small placeholders for absent ones) and
// re-checks the ones its attributes select against their kind.
#include "xla_ffi/attention_handlers.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <new>
#include <string>
#include <vector>

#include "device_kernels/common/layout_roles.h"
#include "device_kernels/cpu/attention_kernels.h"
#include "xla_ffi/dtype_dispatch.h"
#include "xla_ffi/parallel.h"

namespace ffi = xla::ffi;

namespace jax_rope::ffi_support {
namespace {

using cpu::AttentionGeometry;
using cpu::SequenceBand;

ffi::Error Fail(const std::string& message) {
  return ffi::Error::InvalidArgument("jax_rope attention: " + message);
}

// Everything a handler needs, checked once.
struct Decoded {
  AttentionGeometry geometry;
  const SequenceBand* seqs = nullptr;
  int64_t q_rows = 0;   // Sq or Tq
  int64_t kv_rows = 0;  // Skv or Tkv
  bool packed = false;
  std::vector<int64_t> bias_base;  // geometry.bias.seq_base points here
};

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
  if (k.back() != g.head_dim || g.value_dim > g.head_dim) return Fail("need D(key) == D(query) and Dv <= D");
  if (g.head_dim <= 0 || g.value_dim <= 0) return Fail("query/key/value must have D > 0 and Dv > 0");
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

bool BiasBatchOk(int64_t dim, const AttentionGeometry& g) { return dim == 1 || dim == g.batch; }

// The positional bias operand for bias_kind (attention_kernels.h: PositionBias).
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

// The dropout operands for mode `dropout` (attention_kernels.h: Dropout).
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

template <typename T>
void Fill(T* data, size_t count, T value) {
  std::fill(data, data + count, value);
}

// ParallelFor for kernels that allocate their scratch: an allocation failure in
// any chunk becomes an FFI error instead of terminating the process.
template <typename Fn>
ffi::Error GuardedParallelFor(ffi::ThreadPool& pool, int64_t n, const Fn& fn) {
  std::atomic<bool> failed{false};
  ParallelFor(pool, n, 1, [&](int64_t begin, int64_t end) {
    try {
      fn(begin, end);
    } catch (const std::bad_alloc&) {
      failed = true;
    }
  });
  return failed ? ffi::Error(ffi::ErrorCode::kResourceExhausted,
                             "jax_rope attention: out of memory for kernel scratch")
                : ffi::Error::Success();
}

// Whether the backward runs as one pass over (sequence, kv head) items
// (cpu::AttentionBackwardFused: five tile products instead of seven, the same
// bits as the two passes, so the choice may follow the thread count): when
// those items keep every thread busy and the per-thread dquery accumulator
// (group x q_len x head_dim floats) stays small.
bool UseFusedBackward(const cpu::AttentionGeometry& g, const cpu::SequenceBand* seqs,
                      int64_t threads) {
  const int64_t items = cpu::FusedBackwardWorkItems(g);
  threads = std::max<int64_t>(threads, 1);
  if (items < 2 * threads && items % threads != 0) return false;
  if (items == 0) return false;
  int64_t longest = 0;
  for (int64_t b = 0; b < g.batch; ++b) longest = std::max<int64_t>(longest, seqs[b].q_len);
  const int64_t dp = (g.head_dim + 15) / 16 * 16;
  constexpr int64_t kMaxAccumulatorFloats = int64_t{1} << 25;  // 128 MiB
  return (g.q_heads / g.kv_heads) * longest * dp <= kMaxAccumulatorFloats;
}

}  // namespace

ffi::Error AttentionForwardImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer query, ffi::AnyBuffer key, ffi::AnyBuffer value,
    ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::U8> mask, ffi::AnyBuffer bias,
    ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::U32> drop_keys,
    ffi::Buffer<ffi::U32> drop_rows, ffi::Buffer<ffi::U8> drop_mask,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> softmax_max,
    ffi::Result<ffi::AnyBuffer> softmax_sum, int32_t layout, float scale, int32_t has_mask,
    int32_t bias_kind, int32_t bias_after_scale, int32_t dropout, int64_t keep_threshold,
    float keep_scale) {
  Decoded d;
  if (auto e = Decode(layout, scale, has_mask, query, key, DimsOf(value), table, mask, &d);
      e.failure()) {
    return e;
  }
  if (auto e = DecodeBias(bias_kind, bias_after_scale, query, bias, offsets, &d); e.failure()) {
    return e;
  }
  if (auto e = DecodeDropout(dropout, keep_threshold, keep_scale, drop_keys, drop_rows, drop_mask,
                             &d);
      e.failure()) {
    return e;
  }
  if (value.element_type() != query.element_type()) return Fail("value must have query's dtype");
  std::vector<int64_t> out_dims = DimsOf(query);
  out_dims.back() = d.geometry.value_dim;
  for (auto [buffer, dims, dtype, name] :
       {std::tuple{&*out, out_dims, query.element_type(), "attention_out"},
        std::tuple{&*softmax_max, StatsDims(d), ffi::DataType::F32, "softmax_max"},
        std::tuple{&*softmax_sum, StatsDims(d), ffi::DataType::F32, "softmax_sum"}}) {
    if (auto e = CheckResult(*buffer, dims, dtype, name); e.failure()) return e;
  }
  const AttentionGeometry& g = d.geometry;
  ffi::Error status = ffi::Error::Success();
  ffi::Error dispatched = DispatchFloat("attention forward", query.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const cpu::AttentionForwardArgs<T> args{Data<T>(query), Data<T>(key), Data<T>(value),
                                            Data<T>(*out), Data<float>(*softmax_max),
                                            Data<float>(*softmax_sum)};
    if (d.packed) {  // rows outside every sequence keep these values
      Fill(args.out, out->element_count(), cpu::FromFloat<T>(0.0f));
      Fill(args.softmax_max, softmax_max->element_count(), cpu::kMaskValue);
      Fill(args.softmax_sum, softmax_sum->element_count(), cpu::kDeadRowSum);
    }
    const cpu::SplitForwardPlan split = cpu::PlanSplitForward(g, d.seqs);
    if (split.groups == 0) {
      status = GuardedParallelFor(pool, cpu::AttentionForwardWorkItems(g, d.seqs), [&](int64_t b, int64_t e) {
        cpu::AttentionForward(g, d.seqs, args, b, e);
      });
      return;
    }
    // Short query blocks: key chunks in parallel, then an in-order merge per group.
    std::vector<float> scratch;
    try {
      scratch.resize(split.scratch);
    } catch (const std::bad_alloc&) {
      status = ffi::Error(ffi::ErrorCode::kResourceExhausted,
                          "jax_rope attention: out of memory for kernel scratch");
      return;
    }
    status = GuardedParallelFor(pool, split.items, [&](int64_t b, int64_t e) {
      cpu::AttentionForwardSplit(g, d.seqs, args, scratch.data(), b, e);
    });
    if (status.success()) {
      status = GuardedParallelFor(pool, split.groups, [&](int64_t b, int64_t e) {
        cpu::AttentionForwardMerge(g, d.seqs, args, scratch.data(), b, e);
      });
    }
  });
  return dispatched.failure() ? std::move(dispatched) : std::move(status);
}

ffi::Error AttentionScoresImpl(ffi::ThreadPool pool, ffi::AnyBuffer query, ffi::AnyBuffer key,
                               ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::U8> mask,
                               ffi::AnyBuffer bias, ffi::Buffer<ffi::S32> offsets,
                               ffi::Result<ffi::AnyBuffer> scores, int32_t layout, float scale,
                               int32_t has_mask, int32_t bias_kind, int32_t bias_after_scale) {
  Decoded d;
  if (auto e = Decode(layout, scale, has_mask, query, key, DimsOf(key), table, mask, &d);
      e.failure()) {
    return e;
  }
  if (auto e = DecodeBias(bias_kind, bias_after_scale, query, bias, offsets, &d); e.failure()) {
    return e;
  }
  const AttentionGeometry& g = d.geometry;
  const std::vector<int64_t> dims =
      d.packed ? std::vector<int64_t>{g.q_heads, d.q_rows, d.kv_rows}
               : std::vector<int64_t>{g.batch, g.q_heads, d.q_rows, d.kv_rows};
  if (auto e = CheckResult(*scores, dims, ffi::DataType::F32, "scores"); e.failure()) return e;
  const int64_t strides[3] = {d.packed ? 0 : g.q_heads * d.q_rows * d.kv_rows,
                              d.q_rows * d.kv_rows, d.kv_rows};
  float* data = Data<float>(*scores);
  Fill(data, scores->element_count(), cpu::kMaskValue);
  ffi::Error status = ffi::Error::Success();
  ffi::Error dispatched = DispatchFloat("attention scores", query.element_type(), [&](auto tag) {
    using T = decltype(tag);
    status = GuardedParallelFor(pool, cpu::ForwardWorkItems(g, d.seqs), [&](int64_t b, int64_t e) {
      cpu::AttentionScores(g, d.seqs, Data<T>(query), Data<T>(key), data, strides, b, e);
    });
  });
  return dispatched.failure() ? std::move(dispatched) : std::move(status);
}

ffi::Error AttentionBackwardImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer query, ffi::AnyBuffer key, ffi::AnyBuffer value,
    ffi::AnyBuffer out, ffi::AnyBuffer dout, ffi::AnyBuffer softmax_max,
    ffi::AnyBuffer softmax_sum, ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::U8> mask,
    ffi::AnyBuffer bias, ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::U32> drop_keys,
    ffi::Buffer<ffi::U32> drop_rows, ffi::Buffer<ffi::U8> drop_mask,
    ffi::Result<ffi::AnyBuffer> dquery, ffi::Result<ffi::AnyBuffer> dkey,
    ffi::Result<ffi::AnyBuffer> dvalue, int32_t layout, float scale, int32_t has_mask,
    int32_t bias_kind, int32_t bias_after_scale, int32_t dropout, int64_t keep_threshold,
    float keep_scale) {
  Decoded d;
  if (auto e = Decode(layout, scale, has_mask, query, key, DimsOf(value), table, mask, &d);
      e.failure()) {
    return e;
  }
  if (auto e = DecodeBias(bias_kind, bias_after_scale, query, bias, offsets, &d); e.failure()) {
    return e;
  }
  if (auto e = DecodeDropout(dropout, keep_threshold, keep_scale, drop_keys, drop_rows, drop_mask,
                             &d);
      e.failure()) {
    return e;
  }
  const ffi::DataType dtype = query.element_type();
  std::vector<int64_t> out_dims = DimsOf(query);
  out_dims.back() = d.geometry.value_dim;
  for (auto [buffer, dims, type, name] :
       {std::tuple{&value, DimsOf(value), dtype, "value"},
        std::tuple{&out, out_dims, dtype, "attention_out"},
        std::tuple{&dout, out_dims, dtype, "grad of attention_out"},
        std::tuple{&softmax_max, StatsDims(d), ffi::DataType::F32, "softmax_max"},
        std::tuple{&softmax_sum, StatsDims(d), ffi::DataType::F32, "softmax_sum"},
        std::tuple{&*dquery, DimsOf(query), dtype, "dquery"},
        std::tuple{&*dkey, DimsOf(key), dtype, "dkey"},
        std::tuple{&*dvalue, DimsOf(value), dtype, "dvalue"}}) {
    if (auto e = CheckResult(*buffer, dims, type, name); e.failure()) return e;
  }
  const AttentionGeometry& g = d.geometry;
  ffi::Error status = ffi::Error::Success();
  ffi::Error dispatched = DispatchFloat("attention backward", dtype, [&](auto tag) {
    using T = decltype(tag);
    const cpu::AttentionBackwardArgs<T> args{
        Data<T>(query),          Data<T>(key),           Data<T>(value),  Data<T>(out),
        Data<T>(dout),           Data<float>(softmax_max), Data<float>(softmax_sum),
        Data<T>(*dquery),        Data<T>(*dkey),         Data<T>(*dvalue)};
    if (d.packed) {  // rows outside every sequence get zero gradient
      for (auto* buffer : {&*dquery, &*dkey, &*dvalue}) {
        Fill(Data<T>(*buffer), buffer->element_count(), cpu::FromFloat<T>(0.0f));
      }
    }
    std::vector<float> row_delta(softmax_max.element_count(), 0.0f);
    float* delta = row_delta.data();
    const int64_t query_items = cpu::ForwardWorkItems(g, d.seqs);
    status = GuardedParallelFor(pool, query_items, [&](int64_t b, int64_t e) {
      cpu::AttentionRowDelta(g, d.seqs, args, delta, b, e);
    });
    if (status.success() && UseFusedBackward(g, d.seqs, pool.num_threads())) {
      status = GuardedParallelFor(pool, cpu::FusedBackwardWorkItems(g), [&](int64_t b, int64_t e) {
        cpu::AttentionBackwardFused(g, d.seqs, args, delta, b, e);
      });
      return;
    }
    if (status.success()) {
      status = GuardedParallelFor(pool, cpu::KeyBlockWorkItems(g, d.seqs), [&](int64_t b, int64_t e) {
        cpu::AttentionBackwardKeyValue(g, d.seqs, args, delta, b, e);
      });
    }
    if (status.success()) {
      status = GuardedParallelFor(pool, query_items, [&](int64_t b, int64_t e) {
        cpu::AttentionBackwardQuery(g, d.seqs, args, delta, b, e);
      });
    }
  });
  return dispatched.failure() ? std::move(dispatched) : std::move(status);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeAttentionForward, AttentionForwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // query
                                  .Arg<ffi::AnyBuffer>()         // key
                                  .Arg<ffi::AnyBuffer>()         // value
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sequence table
                                  .Arg<ffi::Buffer<ffi::U8>>()   // element mask
                                  .Arg<ffi::AnyBuffer>()         // positional bias
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ALiBi offsets
                                  .Arg<ffi::Buffer<ffi::U32>>()  // dropout keys
                                  .Arg<ffi::Buffer<ffi::U32>>()  // dropout row words
                                  .Arg<ffi::Buffer<ffi::U8>>()   // dropout mask
                                  .Ret<ffi::AnyBuffer>()         // attention_out
                                  .Ret<ffi::AnyBuffer>()         // softmax_max
                                  .Ret<ffi::AnyBuffer>()         // softmax_sum
                                  .Attr<int32_t>("layout")
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("has_mask")
                                  .Attr<int32_t>("bias_kind")
                                  .Attr<int32_t>("bias_after_scale")
                                  .Attr<int32_t>("dropout")
                                  .Attr<int64_t>("keep_threshold")
                                  .Attr<float>("keep_scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeAttentionScores, AttentionScoresImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // query
                                  .Arg<ffi::AnyBuffer>()         // key
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sequence table
                                  .Arg<ffi::Buffer<ffi::U8>>()   // element mask
                                  .Arg<ffi::AnyBuffer>()         // positional bias
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ALiBi offsets
                                  .Ret<ffi::AnyBuffer>()         // scores
                                  .Attr<int32_t>("layout")
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("has_mask")
                                  .Attr<int32_t>("bias_kind")
                                  .Attr<int32_t>("bias_after_scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeAttentionBackward, AttentionBackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // query
                                  .Arg<ffi::AnyBuffer>()         // key
                                  .Arg<ffi::AnyBuffer>()         // value
                                  .Arg<ffi::AnyBuffer>()         // attention_out
                                  .Arg<ffi::AnyBuffer>()         // grad of attention_out
                                  .Arg<ffi::AnyBuffer>()         // softmax_max
                                  .Arg<ffi::AnyBuffer>()         // softmax_sum
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sequence table
                                  .Arg<ffi::Buffer<ffi::U8>>()   // element mask
                                  .Arg<ffi::AnyBuffer>()         // positional bias
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ALiBi offsets
                                  .Arg<ffi::Buffer<ffi::U32>>()  // dropout keys
                                  .Arg<ffi::Buffer<ffi::U32>>()  // dropout row words
                                  .Arg<ffi::Buffer<ffi::U8>>()   // dropout mask
                                  .Ret<ffi::AnyBuffer>()         // dquery
                                  .Ret<ffi::AnyBuffer>()         // dkey
                                  .Ret<ffi::AnyBuffer>()         // dvalue
                                  .Attr<int32_t>("layout")
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("has_mask")
                                  .Attr<int32_t>("bias_kind")
                                  .Attr<int32_t>("bias_after_scale")
                                  .Attr<int32_t>("dropout")
                                  .Attr<int64_t>("keep_threshold")
                                  .Attr<float>("keep_scale"));

}  // namespace jax_rope::ffi_support
