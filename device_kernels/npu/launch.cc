// See launch.h: the RoPE operators (attention: attention_launch.cc). The
// operators' parameter rules are checked by jax_rope's NPU lowering before a
// call reaches here; CANN checks them again and its messages come back
// through aclGetRecentErrMsg.
#include "device_kernels/npu/launch.h"

#include "device_kernels/common/layout_roles.h"
#include "device_kernels/npu/acl_runtime.h"
#include "device_kernels/npu/launch_internal.h"

namespace jax_rope::npu {
namespace {

using internal::Descriptors;
using internal::ElementSize;
using internal::Failure;
using internal::Launch;
using internal::Missing;

// The operator rotates in place: its outputs start as copies of query/key,
// unless XLA aliased them (in_place), and then they are query/key already.
std::string CopyOnDevice(const Device& device, const DeviceTensor& from, const DeviceTensor& to) {
  if (from.data == to.data) return "";
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

// The 4-D view RotaryPositionEmbeddingGrad gets: TND as (1, T, N, D).
std::vector<int64_t> SingleGradView(const DeviceTensor& t, Layout layout) {
  if (layout != Layout::kTND) return t.dims;
  return {1, t.dims[0], t.dims[1], t.dims[2]};
}

// One RotaryPositionEmbeddingGrad call: dx for dy, and with x, dcos/dsin.
std::string RopeGradOne(const Device& device, const DeviceTensor& dy, const DeviceTensor& cos,
                        const DeviceTensor& sin, const DeviceTensor* x, const DeviceTensor& dx,
                        const DeviceTensor& dcos, const DeviceTensor& dsin, Layout layout) {
  const AclApi& api = Runtime().api;
  Descriptors d(api);
  aclTensor* g = d.Tensor(&dy, SingleGradView(dy, layout));
  aclTensor* c = d.Tensor(&cos, SingleGradView(cos, layout));
  aclTensor* s = d.Tensor(&sin, SingleGradView(sin, layout));
  aclTensor* in = x != nullptr ? d.Tensor(x, SingleGradView(*x, layout)) : nullptr;
  aclTensor* out = d.Tensor(&dx, SingleGradView(dx, layout));
  aclTensor* dc = d.Tensor(&dcos, SingleGradView(dcos, layout));
  aclTensor* ds = d.Tensor(&dsin, SingleGradView(dsin, layout));
  if (!d.ok()) return Failure("aclCreateTensor", -1);
  constexpr int64_t kHalfMode = 0;  // the operator's mode code for half
  uint64_t workspace_size = 0;
  aclOpExecutor* executor = nullptr;
  aclnnStatus status = api.aclnnRotaryPositionEmbeddingGradGetWorkspaceSize(
      g, c, s, in, kHalfMode, out, dc, ds, &workspace_size, &executor);
  return Launch(device, "aclnnRotaryPositionEmbeddingGrad", status, workspace_size, executor,
                api.aclnnRotaryPositionEmbeddingGrad);
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
  if (auto e = Missing("aclnnApplyRotaryPosEmbV2"); !e.empty()) return e;
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
  if (auto e = Missing("aclnnApplyRotaryPosEmbGrad"); !e.empty()) return e;
  const AclApi& api = Runtime().api;
  // gradCosOut/gradSinOut are REQUIRED outputs of the operator (its op
  // definition; torch's wrapper always allocates them): scratch when unwanted.
  DeviceTensor scratch_cos{nullptr, cos.dims, cos.dtype}, scratch_sin{nullptr, sin.dims, sin.dtype};
  if (dcos == nullptr) {
    scratch_cos.data = device.workspace(cos.bytes());
    scratch_sin.data = device.workspace(sin.bytes());
    if (scratch_cos.data == nullptr || scratch_sin.data == nullptr) {
      return "aclnnApplyRotaryPosEmbGrad: could not allocate the gradCos/gradSin scratch";
    }
    dcos = &scratch_cos;
    dsin = &scratch_sin;
  }
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

std::string RopeBackwardSingle(const Device& device, const DeviceTensor& grad_query,
                               const DeviceTensor& grad_key, const DeviceTensor& cos,
                               const DeviceTensor& sin, const DeviceTensor* query,
                               const DeviceTensor* key, const DeviceTensor& dquery,
                               const DeviceTensor& dkey, const RopeSingleGrads& tables,
                               Layout layout) {
  if (auto e = Missing("aclnnRotaryPositionEmbeddingGrad"); !e.empty()) return e;
  if (layout != Layout::kBSND && layout != Layout::kTND) {
    return "aclnnRotaryPositionEmbeddingGrad: jax_rope sends BSND or TND only";
  }
  if ((query == nullptr) != (key == nullptr) ||
      (query != nullptr && (tables.dcos_q == nullptr || tables.dsin_q == nullptr ||
                            tables.dcos_k == nullptr || tables.dsin_k == nullptr))) {
    return "aclnnRotaryPositionEmbeddingGrad: query and key (and their dcos/dsin) go together";
  }
  // Without x the operator computes no dcos/dsin but still needs the outputs.
  DeviceTensor scratch_cos{nullptr, cos.dims, cos.dtype}, scratch_sin{nullptr, sin.dims, sin.dtype};
  if (query == nullptr) {
    scratch_cos.data = device.workspace(cos.bytes());
    scratch_sin.data = device.workspace(sin.bytes());
    if (scratch_cos.data == nullptr || scratch_sin.data == nullptr) {
      return "aclnnRotaryPositionEmbeddingGrad: could not allocate the dcosOut/dsinOut scratch";
    }
  }
  const DeviceTensor& dcos_q = query ? *tables.dcos_q : scratch_cos;
  const DeviceTensor& dsin_q = query ? *tables.dsin_q : scratch_sin;
  const DeviceTensor& dcos_k = query ? *tables.dcos_k : scratch_cos;
  const DeviceTensor& dsin_k = query ? *tables.dsin_k : scratch_sin;
  if (auto e = RopeGradOne(device, grad_query, cos, sin, query, dquery, dcos_q, dsin_q, layout);
      !e.empty()) {
    return e;
  }
  return RopeGradOne(device, grad_key, cos, sin, key, dkey, dcos_k, dsin_k, layout);
}

}  // namespace jax_rope::npu
