// Run-time binding to CANN: dlopen libascendcl, libnnopbase and libopapi from
// the standard CANN locations and resolve every entry point jax_rope calls by
// name. Nothing links against CANN, so the extension builds and imports
// everywhere; without CANN, Runtime().available is false and `detail` says why.
#pragma once

#include <string>

#include "device_kernels/npu/acl_api.h"

namespace jax_rope::npu {

struct AclApi {
  // libascendcl
  AclrtGetSocNameFn aclrtGetSocName = nullptr;
  AclGetRecentErrMsgFn aclGetRecentErrMsg = nullptr;
  AclrtMemcpyAsyncFn aclrtMemcpyAsync = nullptr;
  AclrtMemcpyFn aclrtMemcpy = nullptr;
  AclrtSynchronizeStreamFn aclrtSynchronizeStream = nullptr;
  AclrtMallocFn aclrtMalloc = nullptr;
  AclrtGetDeviceFn aclrtGetDevice = nullptr;
  // libnnopbase
  AclCreateTensorFn aclCreateTensor = nullptr;
  AclDestroyTensorFn aclDestroyTensor = nullptr;
  AclCreateIntArrayFn aclCreateIntArray = nullptr;
  AclDestroyIntArrayFn aclDestroyIntArray = nullptr;
  // libopapi
  AclnnRopeV2WorkspaceFn aclnnApplyRotaryPosEmbV2GetWorkspaceSize = nullptr;
  AclnnLaunchFn aclnnApplyRotaryPosEmbV2 = nullptr;
  AclnnRopeGradWorkspaceFn aclnnApplyRotaryPosEmbGradGetWorkspaceSize = nullptr;
  AclnnLaunchFn aclnnApplyRotaryPosEmbGrad = nullptr;
  AclnnFlashAttentionWorkspaceFn aclnnFlashAttentionScoreGetWorkspaceSize = nullptr;
  AclnnLaunchFn aclnnFlashAttentionScore = nullptr;
  AclnnFlashAttentionVarLenWorkspaceFn aclnnFlashAttentionVarLenScoreGetWorkspaceSize = nullptr;
  AclnnLaunchFn aclnnFlashAttentionVarLenScore = nullptr;
  AclnnFlashAttentionGradWorkspaceFn aclnnFlashAttentionScoreGradGetWorkspaceSize = nullptr;
  AclnnLaunchFn aclnnFlashAttentionScoreGrad = nullptr;
  AclnnFlashAttentionVarLenGradWorkspaceFn
      aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize = nullptr;
  AclnnLaunchFn aclnnFlashAttentionUnpaddingScoreGrad = nullptr;
};

struct RuntimeState {
  bool available = false;
  std::string detail;    // where the libraries came from, or why they did not load
  std::string soc_name;  // from aclrtGetSocName, empty when unknown
  AclApi api;
};

// Loaded once, on first use (thread-safe); never unloaded.
const RuntimeState& Runtime();

// The most recent ACL error text (aclGetRecentErrMsg), or "" when none.
std::string RecentErrorMessage();

}  // namespace jax_rope::npu
