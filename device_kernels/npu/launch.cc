// See launch.h. The operators' parameter rules are checked by jax_rope's NPU
// lowering before a call reaches here; CANN checks them again and its
// messages come back through aclGetRecentErrMsg. Layouts are read through
// their axis roles (layout_roles.h); jax_rope's layout codes are the
// operators' inputLayout codes, so they pass through as they are.
#include "device_kernels/npu/launch.h"

#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "device_kernels/common/layout_roles.h"
#include "device_kernels/npu/acl_runtime.h"

namespace jax_rope::npu {
namespace {

int64_t ElementSize(int32_t dtype) {
  switch (dtype) {
    case kAclFloat: case kAclInt32: return 4;
    case kAclFloat16: case kAclBFloat16: return 2;
    case kAclInt64: return 8;
    default: return 1;  // uint8, bool
  }
}

std::string Failure(const std::string& what, int64_t status) {
  std::string message = what + " failed with status " + std::to_string(status);
  const std::string recent = RecentErrorMessage();
  return recent.empty() ? message : message + ": " + recent;
}

// Owns the descriptors of one call and destroys them on every path.
class Descriptors {
 public:
  explicit Descriptors(const AclApi& api) : api_(api) {}
  ~Descriptors() {
    for (const aclTensor* t : tensors_) api_.aclDestroyTensor(t);
    for (const aclIntArray* a : arrays_) api_.aclDestroyIntArray(a);
  }
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;

  // A contiguous ND descriptor over `data` viewed with `dims` (a reshape of
  // the buffer's own dims); null when `tensor` is null.
  aclTensor* Tensor(const DeviceTensor* tensor, std::vector<int64_t> dims = {}) {
    if (tensor == nullptr) return nullptr;
    if (dims.empty()) dims = tensor->dims;
    std::vector<int64_t> strides(dims.size(), 1);
    for (int i = static_cast<int>(dims.size()) - 2; i >= 0; --i) strides[i] = strides[i + 1] * dims[i + 1];
    aclTensor* t = api_.aclCreateTensor(dims.data(), dims.size(), tensor->dtype, strides.data(), 0,
                                        kAclFormatND, dims.data(), dims.size(), tensor->data);
    if (t == nullptr) ok_ = false; else tensors_.push_back(t);
    return t;
  }
  aclIntArray* IntArray(const std::vector<int64_t>& values) {
    aclIntArray* a = api_.aclCreateIntArray(values.data(), values.size());
    if (a == nullptr) ok_ = false; else arrays_.push_back(a);
    return a;
  }
  bool ok() const { return ok_; }

 private:
  const AclApi& api_;
  std::vector<const aclTensor*> tensors_;
  std::vector<const aclIntArray*> arrays_;
  bool ok_ = true;
};

std::string Unavailable() { return "the Ascend NPU runtime is not available: " + Runtime().detail; }

// Phase two of every operator: workspace from the caller, then the launch.
std::string Launch(const Device& device, const char* name, aclnnStatus prepared,
                   uint64_t workspace_size, aclOpExecutor* executor, AclnnLaunchFn launch) {
  if (prepared != 0) return Failure(std::string(name) + "GetWorkspaceSize", prepared);
  void* workspace = nullptr;
  if (workspace_size > 0) {
    workspace = device.workspace(workspace_size);
    if (workspace == nullptr) {
      return std::string(name) + ": could not allocate " + std::to_string(workspace_size) +
             " bytes of workspace";
    }
  }
  if (aclnnStatus status = launch(workspace, workspace_size, executor, device.stream); status != 0) {
    return Failure(name, status);
  }
  return "";
}

std::string CopyOnDevice(const Device& device, const DeviceTensor& from, const DeviceTensor& to) {
  const AclApi& api = Runtime().api;
  aclError status = api.aclrtMemcpyAsync(to.data, to.bytes(), from.data, from.bytes(),
                                         kAclMemcpyDeviceToDevice, device.stream);
  return status == 0 ? "" : Failure("aclrtMemcpyAsync (device to device)", status);
}

// RoPE V2 has no code for a layout without a batch axis (TND): (T, N, D)
// goes as the BSND tensor (T, 1, N, D).
bool RopeAsBsnd(Layout layout) { return LayoutRoles(layout).batch < 0; }

std::vector<int64_t> RopeView(const DeviceTensor& t, Layout layout) {
  if (!RopeAsBsnd(layout)) return t.dims;
  const AxisRoles roles = LayoutRoles(layout);
  return {t.dims[roles.seq], 1, t.dims[roles.head], t.dims.back()};
}

}  // namespace

int64_t DeviceTensor::bytes() const {
  int64_t n = ElementSize(dtype);
  for (int64_t d : dims) n *= d;
  return n;
}

std::string RopeForward(const Device& device, const DeviceTensor& query, const DeviceTensor& key,
                        const DeviceTensor& cos, const DeviceTensor& sin,
                        const DeviceTensor& query_out, const DeviceTensor& key_out,
                        Layout layout, RotaryMode rotary_mode) {
  if (!Runtime().available) return Unavailable();
  const AclApi& api = Runtime().api;
  if (auto e = CopyOnDevice(device, query, query_out); !e.empty()) return e;
  if (auto e = CopyOnDevice(device, key, key_out); !e.empty()) return e;
  Descriptors d(api);
  aclTensor* q = d.Tensor(&query_out, RopeView(query_out, layout));
  aclTensor* k = d.Tensor(&key_out, RopeView(key_out, layout));
  aclTensor* c = d.Tensor(&cos, RopeView(cos, layout));
  aclTensor* s = d.Tensor(&sin, RopeView(sin, layout));
  if (!d.ok()) return Failure("aclCreateTensor", -1);
  std::string mode(NpuRotaryModeName(rotary_mode));
  const Layout op_layout = RopeAsBsnd(layout) ? Layout::kBSND : layout;
  uint64_t workspace_size = 0;
  aclOpExecutor* executor = nullptr;
  aclnnStatus status = api.aclnnApplyRotaryPosEmbV2GetWorkspaceSize(
      q, k, c, s, static_cast<int64_t>(op_layout), mode.data(), &workspace_size, &executor);
  return Launch(device, "aclnnApplyRotaryPosEmbV2", status, workspace_size, executor,
                api.aclnnApplyRotaryPosEmbV2);
}

std::string RopeBackward(const Device& device, const DeviceTensor& grad_query,
                         const DeviceTensor& grad_key, const DeviceTensor& cos,
                         const DeviceTensor& sin, const DeviceTensor* query,
                         const DeviceTensor* key, const DeviceTensor& dquery,
                         const DeviceTensor& dkey, const DeviceTensor* dcos,
                         const DeviceTensor* dsin, Layout layout) {
  if (!Runtime().available) return Unavailable();
  const AclApi& api = Runtime().api;
  Descriptors d(api);
  aclTensor* gq = d.Tensor(&grad_query);
  aclTensor* gk = d.Tensor(&grad_key);
  aclTensor* c = d.Tensor(&cos);
  aclTensor* s = d.Tensor(&sin);
  aclTensor* q = d.Tensor(query);
  aclTensor* k = d.Tensor(key);
  aclTensor* dq = d.Tensor(&dquery);
  aclTensor* dk = d.Tensor(&dkey);
  aclTensor* dc = d.Tensor(dcos);
  aclTensor* ds = d.Tensor(dsin);
  if (!d.ok()) return Failure("aclCreateTensor", -1);
  std::string mode(NpuRotaryModeName(RotaryMode::kHalf));
  uint64_t workspace_size = 0;
  aclOpExecutor* executor = nullptr;
  aclnnStatus status = api.aclnnApplyRotaryPosEmbGradGetWorkspaceSize(
      gq, gk, c, s, q, k, mode.data(), static_cast<int64_t>(layout), dq, dk, dc, ds,
      &workspace_size, &executor);
  return Launch(device, "aclnnApplyRotaryPosEmbGrad", status, workspace_size, executor,
                api.aclnnApplyRotaryPosEmbGrad);
}

// --- attention ---------------------------------------------------------------

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
  api.aclrtGetDevice(&device_id);
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
      return Failure("aclrtMemcpy (compressed mask)", e);
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

std::string ReadTable(const Device& device, const DeviceTensor& table, HostTable* host) {
  const AclApi& api = Runtime().api;
  host->batch = table.dims[0];
  host->rows.resize(host->batch * kTableColumns);
  const size_t bytes = host->rows.size() * sizeof(int32_t);
  if (aclError e = api.aclrtMemcpyAsync(host->rows.data(), bytes, table.data, bytes,
                                        kAclMemcpyDeviceToHost, device.stream); e != 0) {
    return Failure("aclrtMemcpyAsync (sequence table)", e);
  }
  aclError e = api.aclrtSynchronizeStream(device.stream);
  return e == 0 ? "" : Failure("aclrtSynchronizeStream", e);
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
  // The reserved outputs softmaxOutOut and dpseOut are required (not
  // "Optional"): like torch_npu, pass an empty tensor of query's dtype.
  DeviceTensor empty;
};

std::string Prepare(const Device& device, const AttentionConfig& config, const DeviceTensor& query,
                    const DeviceTensor& table, const DeviceTensor* mask, AttentionCall* call) {
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
  }
  if (TakesPrefix(mode) || call->varlen) {
    HostTable host;
    if (auto e = ReadTable(device, table, &host); !e.empty()) return e;
    if (TakesPrefix(mode)) {
      call->prefix = host.column(6);
      for (int64_t& p : call->prefix) p += 1;  // hi_floor = prefix - 1
    }
    if (call->varlen) {
      call->q_ends = host.column(0, 1);
      call->kv_ends = host.column(2, 3);
    }
  }
  return "";
}

// A descriptor of query, key, value, out or one of their gradients.
aclTensor* Operand(Descriptors& d, const AttentionCall& call, const DeviceTensor& t) {
  if (!call.as_sbh) return d.Tensor(&t);
  return d.Tensor(&t, {t.dims[0], t.dims[1], t.dims[2] * t.dims[3]});
}

// The descriptors both directions pass (q_ends/kv_ends: varlen only).
struct AttentionDescriptors {
  aclTensor *query, *key, *value, *out, *mask, *softmax_max, *softmax_sum, *empty;
  aclIntArray *prefix, *q_ends = nullptr, *kv_ends = nullptr;
};

std::string Describe(Descriptors& d, const AttentionCall& call, const DeviceTensor& query,
                     const DeviceTensor& key, const DeviceTensor& value, const DeviceTensor& out,
                     const DeviceTensor& softmax_max, const DeviceTensor& softmax_sum,
                     AttentionDescriptors* t) {
  t->query = Operand(d, call, query);
  t->key = Operand(d, call, key);
  t->value = Operand(d, call, value);
  t->out = Operand(d, call, out);
  t->mask = call.use_mask ? d.Tensor(&call.mask) : nullptr;
  t->softmax_max = d.Tensor(&softmax_max);
  t->softmax_sum = d.Tensor(&softmax_sum);
  t->empty = d.Tensor(&call.empty);
  t->prefix = call.prefix.empty() ? nullptr : d.IntArray(call.prefix);
  if (!d.ok()) return Failure("aclCreateTensor", -1);
  if (call.varlen) {
    t->q_ends = d.IntArray(call.q_ends);
    t->kv_ends = d.IntArray(call.kv_ends);
    if (!d.ok()) return Failure("aclCreateIntArray", -1);
  }
  return "";
}

}  // namespace

std::string AttentionForward(const Device& device, const AttentionConfig& config,
                             const DeviceTensor& query, const DeviceTensor& key,
                             const DeviceTensor& value, const DeviceTensor& table,
                             const DeviceTensor* mask, const DeviceTensor& out,
                             const DeviceTensor& softmax_max, const DeviceTensor& softmax_sum) {
  if (!Runtime().available) return Unavailable();
  const AclApi& api = Runtime().api;
  AttentionCall call;
  if (auto e = Prepare(device, config, query, table, mask, &call); !e.empty()) return e;
  Descriptors d(api);
  AttentionDescriptors t;
  if (auto e = Describe(d, call, query, key, value, out, softmax_max, softmax_sum, &t);
      !e.empty()) {
    return e;
  }
  const int64_t sparse_mode = static_cast<int64_t>(config.sparse_mode);
  uint64_t workspace_size = 0;
  aclOpExecutor* executor = nullptr;
  if (call.varlen) {
    aclnnStatus status = api.aclnnFlashAttentionVarLenScoreGetWorkspaceSize(
        t.query, t.key, t.value, nullptr, nullptr, nullptr, t.mask, t.prefix, t.q_ends,
        t.kv_ends, config.scale, 1.0, config.pre_tokens, config.next_tokens, call.head_num,
        call.layout.data(), 0, sparse_mode, t.softmax_max, t.softmax_sum, t.empty, t.out,
        &workspace_size, &executor);
    return Launch(device, "aclnnFlashAttentionVarLenScore", status, workspace_size, executor,
                  api.aclnnFlashAttentionVarLenScore);
  }
  aclnnStatus status = api.aclnnFlashAttentionScoreGetWorkspaceSize(
      t.query, t.key, t.value, nullptr, nullptr, nullptr, t.mask, t.prefix, config.scale, 1.0,
      config.pre_tokens, config.next_tokens, call.head_num, call.layout.data(), 0, sparse_mode,
      t.softmax_max, t.softmax_sum, t.empty, t.out, &workspace_size, &executor);
  return Launch(device, "aclnnFlashAttentionScore", status, workspace_size, executor,
                api.aclnnFlashAttentionScore);
}

std::string AttentionBackward(const Device& device, const AttentionConfig& config,
                              const DeviceTensor& query, const DeviceTensor& key,
                              const DeviceTensor& value, const DeviceTensor& out,
                              const DeviceTensor& dout, const DeviceTensor& softmax_max,
                              const DeviceTensor& softmax_sum, const DeviceTensor& table,
                              const DeviceTensor* mask, const DeviceTensor& dquery,
                              const DeviceTensor& dkey, const DeviceTensor& dvalue) {
  if (!Runtime().available) return Unavailable();
  const AclApi& api = Runtime().api;
  AttentionCall call;
  if (auto e = Prepare(device, config, query, table, mask, &call); !e.empty()) return e;
  Descriptors d(api);
  aclTensor* dy = Operand(d, call, dout);
  aclTensor* dq = Operand(d, call, dquery);
  aclTensor* dk = Operand(d, call, dkey);
  aclTensor* dv = Operand(d, call, dvalue);
  AttentionDescriptors t;
  if (auto e = Describe(d, call, query, key, value, out, softmax_max, softmax_sum, &t);
      !e.empty()) {
    return e;
  }
  const int64_t sparse_mode = static_cast<int64_t>(config.sparse_mode);
  uint64_t workspace_size = 0;
  aclOpExecutor* executor = nullptr;
  if (call.varlen) {
    aclnnStatus status = api.aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize(
        t.query, t.key, t.value, dy, nullptr, nullptr, nullptr, t.mask, t.softmax_max,
        t.softmax_sum, nullptr, t.out, t.prefix, t.q_ends, t.kv_ends, config.scale, 1.0,
        config.pre_tokens, config.next_tokens, call.head_num, call.layout.data(), 0,
        sparse_mode, dq, dk, dv, t.empty, &workspace_size, &executor);
    return Launch(device, "aclnnFlashAttentionUnpaddingScoreGrad", status, workspace_size,
                  executor, api.aclnnFlashAttentionUnpaddingScoreGrad);
  }
  aclnnStatus status = api.aclnnFlashAttentionScoreGradGetWorkspaceSize(
      t.query, t.key, t.value, dy, nullptr, nullptr, nullptr, t.mask, t.softmax_max,
      t.softmax_sum, nullptr, t.out, t.prefix, config.scale, 1.0, config.pre_tokens,
      config.next_tokens, call.head_num, call.layout.data(), 0, sparse_mode, dq, dk, dv,
      t.empty, &workspace_size, &executor);
  return Launch(device, "aclnnFlashAttentionScoreGrad", status, workspace_size, executor,
                api.aclnnFlashAttentionScoreGrad);
}

}  // namespace jax_rope::npu
