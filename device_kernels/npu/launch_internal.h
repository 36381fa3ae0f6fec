// Internal to the launch glue (launch.cc: RoPE, attention_launch.cc:
// attention): the pieces every operator call shares. Not for other code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "device_kernels/npu/acl_runtime.h"
#include "device_kernels/npu/launch.h"

namespace jax_rope::npu::internal {


inline int64_t ElementSize(int32_t dtype) {
  switch (dtype) {
    case kAclFloat: case kAclInt32: return 4;
    case kAclFloat16: case kAclBFloat16: return 2;
    case kAclInt64: return 8;
    default: return 1;  // uint8, bool
  }
}

inline std::string Failure(const std::string& what, int64_t status) {
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

// "" when the runtime is loaded and has operator `op`, else why not (the
// lowering asks the same question first, so this is a guard).
inline std::string Missing(const char* op) {
  if (!Runtime().available) {
    return std::string("the Ascend NPU runtime is not available: ") + Runtime().detail;
  }
  if (OperatorLibrary(op).empty()) return std::string(op) + " is not in this CANN's operator libraries";
  return "";
}

// Phase two of every operator: workspace from the caller, then the launch.
inline std::string Launch(const Device& device, const char* name, aclnnStatus prepared,
                   uint64_t workspace_size, aclOpExecutor* executor, AclnnLaunchFn launch) {
  if (prepared != 0) return Failure(std::string(name) + "GetWorkspaceSize", prepared);
  void* workspace = nullptr;
  if (workspace_size > 0) {
    workspace = device.workspace(workspace_size);
    if (workspace == nullptr) {
      // An executor that is never launched is only freed by destroying it.
      if (Runtime().api.aclDestroyAclOpExecutor != nullptr) {
        Runtime().api.aclDestroyAclOpExecutor(executor);
      }
      return std::string(name) + ": could not allocate " + std::to_string(workspace_size) +
             " bytes of workspace";
    }
  }
  if (aclnnStatus status = launch(workspace, workspace_size, executor, device.stream); status != 0) {
    return Failure(name, status);
  }
  return "";
}

}  // namespace jax_rope::npu::internal
