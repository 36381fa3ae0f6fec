// See launch.h: the FlashAttentionScore family. Layouts are read through
// their axis roles (layout_roles.h); jax_rope's layout codes are the
// operators' inputLayout codes, so they pass through as they are.
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "device_kernels/common/layout_roles.h"
#include "device_kernels/npu/acl_runtime.h"
#include "device_kernels/npu/launch.h"
#include "device_kernels/npu/launch_internal.h"

namespace jax_rope::npu {

using internal::Descriptors;
using internal::Failure;
using internal::Launch;
using internal::Missing;

namespace {

constexpr int kTableColumns = 7;  // q_start, q_len, kv_start, kv_len, lo, hi, floor

// The compressed masks, built once per device and mode family and kept for the
// life of the process: 2048x2048 M0[r][c] = c > r, and the 3072x2048 prefix mask.
std::string CompressedMask(const Device& device, SparseMode sparse_mode, DeviceTensor* mask) {
  static std::mutex mutex;
  static std::map<std::pair<int32_t, bool>, void*> cache;
  const AclApi& api = Runtime().api;
  const bool prefix = sparse_mode == SparseMode::kPrefixCompress;
  const int64_t rows = prefix ? 3072 : 2048, cols = 2048;
  int32_t device_id = 0;
  if (aclError e = api.aclrtGetDevice(&device_id); e != 0) return Failure("aclrtGetDevice", e);
  std::lock_guard<std::mutex> lock(mutex);
  void*& data = cache[{device_id, prefix}];
  if (data == nullptr) {
    std::vector<uint8_t> host(rows * cols, 0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        host[r * cols + c] = r < 2048 ? (c > r) : (c >= 1024);
      }
    }
    void* buffer = nullptr;
    if (aclError e = api.aclrtMalloc(&buffer, host.size(), kAclMemMallocHugeFirst); e != 0) {
      return Failure("aclrtMalloc (compressed mask)", e);
    }
    if (aclError e = api.aclrtMemcpy(buffer, host.size(), host.data(), host.size(),
                                     kAclMemcpyHostToDevice); e != 0) {
      const std::string failure = Failure("aclrtMemcpy (compressed mask)", e);
      api.aclrtFree(buffer);  // the next call builds it again
      return failure;
    }
    data = buffer;
  }
  *mask = DeviceTensor{data, {rows, cols}, kAclUint8};
  return "";
}

struct HostTable {
  std::vector<int32_t> rows;
  int64_t batch = 0;
  std::vector<int64_t> column(int c, int add = -1) const {
    std::vector<int64_t> out;
    for (int64_t b = 0; b < batch; ++b) {
      const int32_t* row = &rows[b * kTableColumns];
      out.push_back(add < 0 ? row[c] : int64_t{row[c]} + row[add]);
    }
    return out;
  }
};

// The table to the host: CANN 8.0/8.1 document an asynchronous device-to-host
// copy as undefined unless the destination comes from aclrtMallocHost (page
// locked, 64-byte aligned), so the copy lands there first.
std::string ReadTable(const Device& device, const DeviceTensor& table, HostTable* host) {
  const AclApi& api = Runtime().api;
  host->batch = table.dims[0];
  host->rows.resize(host->batch * kTableColumns);
  const size_t bytes = host->rows.size() * sizeof(int32_t);
  void* pinned = nullptr;
  if (aclError e = api.aclrtMallocHost(&pinned, bytes); e != 0 || pinned == nullptr) {
    return Failure("aclrtMallocHost (sequence table)", e);
  }
  std::unique_ptr<void, AclrtFreeHostFn> owner(pinned, api.aclrtFreeHost);
  if (aclError e = api.aclrtMemcpyAsync(pinned, bytes, table.data, bytes, kAclMemcpyDeviceToHost,
                                        device.stream); e != 0) {
    return Failure("aclrtMemcpyAsync (sequence table)", e);
  }
  if (aclError e = api.aclrtSynchronizeStream(device.stream); e != 0) {
    return Failure("aclrtSynchronizeStream", e);
  }
  std::memcpy(host->rows.data(), pinned, bytes);
  return "";
}

// Everything both directions share: how the tensors go, the mask, host lists.
struct AttentionCall {
  std::string layout;        // the operators' inputLayout
  bool as_sbh = false;       // the operators have no SBND: (S, B, N * D) as SBH
  bool varlen = false;       // no batch axis (TND): the VarLen operators
  int64_t head_num = 0;
  DeviceTensor mask;
  bool use_mask = false;
  std::vector<int64_t> prefix, q_ends, kv_ends;
  // TND: the tokens the sequences hold (the last cumulative ends). The
  // operators get exactly those rows: CANN 8.0's tiling wants T == the last end,
  // later ones accept more rows but never write them (the lowering gives them
  // the dead-row values). T must be at least 1: with no query or no key token
  // every row sees nothing, and the lowering gives all of them those values.
  int64_t q_tokens = 0, kv_tokens = 0;
  bool Empty() const { return varlen && (q_tokens == 0 || kv_tokens == 0); }
  // 2 turns on the operator's "invalid line" handling, which gives fully
  // masked rows the spec's 0 / -FLT_MAX / FLT_MAX; the tiling turns it on by
  // itself only for band, rightDown and prefix geometries, not for rows a
  // user mask kills (modes 0, 1, 5). TND takes no element mask here.
  int64_t inner_precise = 0;
  // The reserved outputs softmaxOutOut and dpseOut are required (not
  // "Optional"): like torch_npu, pass an empty tensor of query's dtype.
  DeviceTensor empty;
};

// The host copy of the table holds what traced lengths and prefixes became:
// refuse what the Python side would refuse at trace time (the values were not
// known then, and the jnp fallback's host check does not exist on the NPU).
// The VarLen operators also have no fully masked rows in sparse_mode 3 ("needs
// Sq <= Skv in every batch"); concrete lengths that break it take the fallback
// (npu/coverage.py), traced ones are refused here before the operator runs.
std::string CheckTable(const HostTable& host, bool varlen, SparseMode mode, int64_t q_rows,
                       int64_t kv_rows) {
  const bool prefix = TakesPrefix(mode);
  int64_t q_end = 0, kv_end = 0;
  for (int64_t b = 0; b < host.batch; ++b) {
    const int32_t* r = &host.rows[b * kTableColumns];
    const int64_t q0 = r[0], q_len = r[1], kv0 = r[2], kv_len = r[3];
    if (varlen && (q0 != q_end || q_len < 0 || q0 + q_len > q_rows || kv0 != kv_end ||
                   kv_len < 0 || kv0 + kv_len > kv_rows)) {
      return "actual_seq_qlen/actual_seq_kvlen must be non-decreasing cumulative ends within "
             "Tq/Tkv (sequence " + std::to_string(b) + ")";
    }
    if (varlen && mode == SparseMode::kRightDownCausal && q_len > kv_len) {
      return "sparse_mode 3 with TND needs Sq <= Skv in every sequence on the NPU (sequence " +
             std::to_string(b) + ": Sq " + std::to_string(q_len) + ", Skv " +
             std::to_string(kv_len) + "); backend \"auto\" takes the fallback for such "
             "lengths";
    }
    q_end = q0 + q_len;
    kv_end = kv0 + kv_len;
    const int64_t p = int64_t{r[6]} + 1;  // hi_floor = prefix - 1
    if (prefix && (p < std::max<int64_t>(kv_len - q_len, 0) || p > kv_len)) {
      return "prefix[" + std::to_string(b) + "] must be in [max(Skv - Sq, 0), Skv], got " +
             std::to_string(p);
    }
  }
  return "";
}

std::string Prepare(const Device& device, const AttentionConfig& config, const DeviceTensor& query,
                    const DeviceTensor& key, const DeviceTensor& table, const DeviceTensor* mask,
                    AttentionCall* call) {
  const AxisRoles roles = LayoutRoles(config.layout);
  call->as_sbh = config.layout == Layout::kSBND;
  call->layout = call->as_sbh ? "SBH" : NameOf(config.layout, kLayouts);
  call->varlen = roles.batch < 0;
  call->head_num = query.dims[roles.head];
  call->empty = DeviceTensor{nullptr, {0}, query.dtype};
  const SparseMode mode = config.sparse_mode;
  if (NeedsCompressedMask(mode)) {
    if (auto e = CompressedMask(device, mode, &call->mask); !e.empty()) return e;
    call->use_mask = true;
  } else if (config.has_mask && mask != nullptr) {
    call->mask = *mask;
    call->use_mask = true;
    if (!call->varlen) call->inner_precise = 2;
  }
  if (TakesPrefix(mode) || call->varlen) {
    HostTable host;
    if (auto e = ReadTable(device, table, &host); !e.empty()) return e;
    if (auto e = CheckTable(host, call->varlen, mode, query.dims[roles.seq],
                            key.dims[roles.seq]);
        !e.empty()) {
      return e;
    }
    if (TakesPrefix(mode)) {
      call->prefix = host.column(6);
      for (int64_t& p : call->prefix) p += 1;  // hi_floor = prefix - 1
    }
    if (call->varlen) {
      call->q_ends = host.column(0, 1);
      call->kv_ends = host.column(2, 3);
      call->q_tokens = call->q_ends.back();
      call->kv_tokens = call->kv_ends.back();
    }
  }
  return "";
}

// Which rows a TND operand holds: query's (query, out and their gradients) or
// key's (key, value and theirs).
enum class Rows { kQuery, kKey };

// A descriptor of query, key, value, out or one of their gradients.
aclTensor* Operand(Descriptors& d, const AttentionCall& call, const DeviceTensor& t, Rows rows) {
  if (call.varlen) {
    std::vector<int64_t> dims = t.dims;
    dims[0] = rows == Rows::kQuery ? call.q_tokens : call.kv_tokens;
    return d.Tensor(&t, dims);
  }
  if (!call.as_sbh) return d.Tensor(&t);
  return d.Tensor(&t, {t.dims[0], t.dims[1], t.dims[2] * t.dims[3]});
}

// softmax_max or softmax_sum. TND's are [N1, T, 8] in the operators' NTD
// order, one [N1, S_b, 8] block per sequence after the other: the sequences'
// blocks fill the first N1 x q_tokens x 8 floats, a [N1, q_tokens, 8] view.
aclTensor* Statistic(Descriptors& d, const AttentionCall& call, const DeviceTensor& t) {
  if (!call.varlen) return d.Tensor(&t);
  return d.Tensor(&t, {t.dims[0], call.q_tokens, t.dims[2]});
}

// The descriptors both directions pass (q_ends/kv_ends: varlen only).
struct AttentionDescriptors {
  aclTensor *query, *key, *value, *out, *mask, *softmax_max, *softmax_sum, *empty;
  aclIntArray *prefix, *q_ends = nullptr, *kv_ends = nullptr;
  aclTensor *pse = nullptr, *drop_mask = nullptr;
  // V2 only: {qStartIdx}, {kvStartIdx}; both always passed (the tiling reads
  // kvStartIdx only after a present qStartIdx).
  aclIntArray *q_start_idx = nullptr, *kv_start_idx = nullptr;
};

std::string Describe(Descriptors& d, const AttentionConfig& config, const AttentionCall& call,
                     const DeviceTensor& query, const DeviceTensor& key, const DeviceTensor& value,
                     const DeviceTensor& out, const DeviceTensor& softmax_max,
                     const DeviceTensor& softmax_sum, const AttentionExtras& extras,
                     AttentionDescriptors* t) {
  t->query = Operand(d, call, query, Rows::kQuery);
  t->key = Operand(d, call, key, Rows::kKey);
  t->value = Operand(d, call, value, Rows::kKey);
  t->out = Operand(d, call, out, Rows::kQuery);
  t->mask = call.use_mask ? d.Tensor(&call.mask) : nullptr;
  t->softmax_max = Statistic(d, call, softmax_max);
  t->softmax_sum = Statistic(d, call, softmax_sum);
  t->empty = d.Tensor(&call.empty);
  t->prefix = call.prefix.empty() ? nullptr : d.IntArray(call.prefix);
  t->pse = d.Tensor(extras.pse);
  t->drop_mask = config.keep_prob < 1.0 ? d.Tensor(extras.drop_mask) : nullptr;
  if (config.NeedsV2()) {
    t->q_start_idx = d.IntArray({config.q_start_idx});
    t->kv_start_idx = d.IntArray({config.kv_start_idx});
  }
  if (!d.ok()) return Failure("aclCreateTensor", -1);
  if (call.varlen) {
    t->q_ends = d.IntArray(call.q_ends);
    t->kv_ends = d.IntArray(call.kv_ends);
    if (!d.ok()) return Failure("aclCreateIntArray", -1);
  }
  return "";
}

}  // namespace

// What both directions do before their operator call: the operator must be
// there (VarLen or padded by the layout), the call prepared, the shared
// descriptors made.
std::string Begin(const Device& device, const AttentionConfig& config, const char* varlen_op,
                  const char* padded_op, const DeviceTensor& query, const DeviceTensor& key,
                  const DeviceTensor& value, const DeviceTensor& out,
                  const DeviceTensor& softmax_max, const DeviceTensor& softmax_sum,
                  const DeviceTensor& table, const DeviceTensor* mask,
                  const AttentionExtras& extras, Descriptors& d, AttentionCall* call,
                  AttentionDescriptors* t) {
  const bool varlen = LayoutRoles(config.layout).batch < 0;
  if (auto e = Missing(varlen ? varlen_op : padded_op); !e.empty()) return e;
  if (config.pse_type != 1 && extras.pse == nullptr) return "pseType != 1 needs pse";
  if (config.keep_prob < 1.0 && extras.drop_mask == nullptr) return "keepProb < 1 needs dropMask";
  if (auto e = Prepare(device, config, query, key, table, mask, call); !e.empty()) return e;
  return Describe(d, config, *call, query, key, value, out, softmax_max, softmax_sum, extras, t);
}

std::string AttentionForward(const Device& device, const AttentionConfig& config,
                             const DeviceTensor& query, const DeviceTensor& key,
                             const DeviceTensor& value, const DeviceTensor& table,
                             const DeviceTensor* mask, const AttentionExtras& extras,
                             const DeviceTensor& out, const DeviceTensor& softmax_max,
                             const DeviceTensor& softmax_sum) {
  const AclApi& api = Runtime().api;
  Descriptors d(api);
  AttentionCall call;
  AttentionDescriptors t;
  const bool v2 = config.NeedsV2();
  const char* varlen_op = v2 ? "aclnnFlashAttentionVarLenScoreV2" : "aclnnFlashAttentionVarLenScore";
  const char* padded_op = v2 ? "aclnnFlashAttentionScoreV2" : "aclnnFlashAttentionScore";
  if (auto e = Begin(device, config, varlen_op, padded_op, query, key, value, out, softmax_max,
                     softmax_sum, table, mask, extras, d, &call, &t);
      !e.empty()) {
    return e;
  }
  if (call.Empty()) return "";
  const int64_t sparse_mode = static_cast<int64_t>(config.sparse_mode);
  const double keep = config.keep_prob;
  uint64_t workspace_size = 0;
  aclOpExecutor* executor = nullptr;
  aclnnStatus status;
  if (call.varlen && v2) {
    status = api.aclnnFlashAttentionVarLenScoreV2GetWorkspaceSize(
        t.query, t.key, t.value, t.pse, t.drop_mask, nullptr, t.mask, t.prefix, t.q_ends,
        t.kv_ends, t.q_start_idx, t.kv_start_idx, config.scale, keep, config.pre_tokens,
        config.next_tokens, call.head_num, call.layout.data(), call.inner_precise, sparse_mode,
        config.pse_type, t.softmax_max, t.softmax_sum, t.empty, t.out, &workspace_size,
        &executor);
    return Launch(device, varlen_op, status, workspace_size, executor,
                  api.aclnnFlashAttentionVarLenScoreV2);
  }
  if (call.varlen) {
    status = api.aclnnFlashAttentionVarLenScoreGetWorkspaceSize(
        t.query, t.key, t.value, t.pse, t.drop_mask, nullptr, t.mask, t.prefix, t.q_ends,
        t.kv_ends, config.scale, keep, config.pre_tokens, config.next_tokens, call.head_num,
        call.layout.data(), call.inner_precise, sparse_mode, t.softmax_max, t.softmax_sum,
        t.empty, t.out, &workspace_size, &executor);
    return Launch(device, varlen_op, status, workspace_size, executor,
                  api.aclnnFlashAttentionVarLenScore);
  }
  if (v2) {
    status = api.aclnnFlashAttentionScoreV2GetWorkspaceSize(
        t.query, t.key, t.value, t.pse, t.drop_mask, nullptr, t.mask, t.prefix, t.q_start_idx,
        t.kv_start_idx, config.scale, keep, config.pre_tokens, config.next_tokens, call.head_num,
        call.layout.data(), call.inner_precise, sparse_mode, config.pse_type, t.softmax_max,
        t.softmax_sum, t.empty, t.out, &workspace_size, &executor);
    return Launch(device, padded_op, status, workspace_size, executor,
                  api.aclnnFlashAttentionScoreV2);
  }
  status = api.aclnnFlashAttentionScoreGetWorkspaceSize(
      t.query, t.key, t.value, t.pse, t.drop_mask, nullptr, t.mask, t.prefix, config.scale, keep,
      config.pre_tokens, config.next_tokens, call.head_num, call.layout.data(), call.inner_precise,
      sparse_mode, t.softmax_max, t.softmax_sum, t.empty, t.out, &workspace_size, &executor);
  return Launch(device, padded_op, status, workspace_size, executor, api.aclnnFlashAttentionScore);
}

std::string AttentionBackward(const Device& device, const AttentionConfig& config,
                              const DeviceTensor& query, const DeviceTensor& key,
                              const DeviceTensor& value, const DeviceTensor& out,
                              const DeviceTensor& dout, const DeviceTensor& softmax_max,
                              const DeviceTensor& softmax_sum, const DeviceTensor& table,
                              const DeviceTensor* mask, const AttentionExtras& extras,
                              const DeviceTensor& dquery, const DeviceTensor& dkey,
                              const DeviceTensor& dvalue) {
  const AclApi& api = Runtime().api;
  Descriptors d(api);
  AttentionCall call;
  AttentionDescriptors t;
  const bool v2 = config.NeedsV2();
  const char* varlen_op =
      v2 ? "aclnnFlashAttentionUnpaddingScoreGradV2" : "aclnnFlashAttentionUnpaddingScoreGrad";
  const char* padded_op = v2 ? "aclnnFlashAttentionScoreGradV2" : "aclnnFlashAttentionScoreGrad";
  if (auto e = Begin(device, config, varlen_op, padded_op, query, key, value, out, softmax_max,
                     softmax_sum, table, mask, extras, d, &call, &t);
      !e.empty()) {
    return e;
  }
  if (call.Empty()) return "";
  aclTensor* dy = Operand(d, call, dout, Rows::kQuery);
  aclTensor* dq = Operand(d, call, dquery, Rows::kQuery);
  aclTensor* dk = Operand(d, call, dkey, Rows::kKey);
  aclTensor* dv = Operand(d, call, dvalue, Rows::kKey);
  // dpseOut: with pse, torch_npu's buffer (pse's shape and dtype; never
  // written by the kernels), here scratch; without, the empty tensor.
  aclTensor* dpse = t.empty;
  DeviceTensor dpse_scratch;
  if (extras.pse != nullptr) {
    dpse_scratch = DeviceTensor{device.workspace(extras.pse->bytes()), extras.pse->dims,
                                extras.pse->dtype};
    if (dpse_scratch.data == nullptr) return std::string(padded_op) + ": could not allocate the dpseOut scratch";
    dpse = d.Tensor(&dpse_scratch);
  }
  if (!d.ok()) return Failure("aclCreateTensor", -1);
  const int64_t sparse_mode = static_cast<int64_t>(config.sparse_mode);
  const double keep = config.keep_prob;
  uint64_t workspace_size = 0;
  aclOpExecutor* executor = nullptr;
  aclnnStatus status;
  if (call.varlen && v2) {
    status = api.aclnnFlashAttentionUnpaddingScoreGradV2GetWorkspaceSize(
        t.query, t.key, t.value, dy, t.pse, t.drop_mask, nullptr, t.mask, t.softmax_max,
        t.softmax_sum, nullptr, t.out, t.prefix, t.q_ends, t.kv_ends, t.q_start_idx,
        t.kv_start_idx, config.scale, keep, config.pre_tokens, config.next_tokens, call.head_num,
        call.layout.data(), call.inner_precise, sparse_mode, config.pse_type, dq, dk, dv, dpse,
        &workspace_size, &executor);
    return Launch(device, varlen_op, status, workspace_size, executor,
                  api.aclnnFlashAttentionUnpaddingScoreGradV2);
  }
  if (call.varlen) {
    status = api.aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize(
        t.query, t.key, t.value, dy, t.pse, t.drop_mask, nullptr, t.mask, t.softmax_max,
        t.softmax_sum, nullptr, t.out, t.prefix, t.q_ends, t.kv_ends, config.scale, keep,
        config.pre_tokens, config.next_tokens, call.head_num, call.layout.data(),
        call.inner_precise, sparse_mode, dq, dk, dv, dpse, &workspace_size, &executor);
    return Launch(device, varlen_op, status, workspace_size, executor,
                  api.aclnnFlashAttentionUnpaddingScoreGrad);
  }
  if (v2) {
    status = api.aclnnFlashAttentionScoreGradV2GetWorkspaceSize(
        t.query, t.key, t.value, dy, t.pse, t.drop_mask, nullptr, t.mask, t.softmax_max,
        t.softmax_sum, nullptr, t.out, t.prefix, t.q_start_idx, t.kv_start_idx, config.scale,
        keep, config.pre_tokens, config.next_tokens, call.head_num, call.layout.data(),
        call.inner_precise, sparse_mode, config.pse_type, dq, dk, dv, dpse, &workspace_size,
        &executor);
    return Launch(device, padded_op, status, workspace_size, executor,
                  api.aclnnFlashAttentionScoreGradV2);
  }
  status = api.aclnnFlashAttentionScoreGradGetWorkspaceSize(
      t.query, t.key, t.value, dy, t.pse, t.drop_mask, nullptr, t.mask, t.softmax_max,
      t.softmax_sum, nullptr, t.out, t.prefix, config.scale, keep, config.pre_tokens,
      config.next_tokens, call.head_num, call.layout.data(), call.inner_precise, sparse_mode, dq,
      dk, dv, dpse, &workspace_size, &executor);
  return Launch(device, padded_op, status, workspace_size, executor,
                api.aclnnFlashAttentionScoreGrad);
}

}  // namespace jax_rope::npu
