// Run-time binding to CANN: dlopen libascendcl and libnnopbase from the
// standard CANN locations, then resolve each aclnn operator on its own from
// the operator libraries, in torch_npu's (op-plugin's) order: custom builds
// (libcust_opapi.so), every lib64/libopapi_*.so of the split operator
// repositories (libopapi_transformer.so, ...), then the monolithic
// libopapi.so. Nothing links against CANN, so the extension builds and
// imports everywhere; without CANN, Runtime().available is false and `detail`
// says why; an operator a CANN lacks is null and listed as missing.
#pragma once

#include <string>
#include <utility>
#include <vector>

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
  AclrtFreeFn aclrtFree = nullptr;
  AclrtGetDeviceFn aclrtGetDevice = nullptr;
  AclrtMallocHostFn aclrtMallocHost = nullptr;
  AclrtFreeHostFn aclrtFreeHost = nullptr;
  // libnnopbase
  AclCreateTensorFn aclCreateTensor = nullptr;
  AclDestroyTensorFn aclDestroyTensor = nullptr;
  AclCreateIntArrayFn aclCreateIntArray = nullptr;
  AclDestroyIntArrayFn aclDestroyIntArray = nullptr;
  AclDestroyAclOpExecutorFn aclDestroyAclOpExecutor = nullptr;  // optional
  // operators: each pair is present or null independently
  AclnnRopeV2WorkspaceFn aclnnApplyRotaryPosEmbV2GetWorkspaceSize = nullptr;
  AclnnLaunchFn aclnnApplyRotaryPosEmbV2 = nullptr;
  AclnnRopeGradWorkspaceFn aclnnApplyRotaryPosEmbGradGetWorkspaceSize = nullptr;
  AclnnLaunchFn aclnnApplyRotaryPosEmbGrad = nullptr;
  AclnnRopeSingleGradWorkspaceFn aclnnRotaryPositionEmbeddingGradGetWorkspaceSize = nullptr;
  AclnnLaunchFn aclnnRotaryPositionEmbeddingGrad = nullptr;
  AclnnFlashAttentionWorkspaceFn aclnnFlashAttentionScoreGetWorkspaceSize = nullptr;
  AclnnLaunchFn aclnnFlashAttentionScore = nullptr;
  AclnnFlashAttentionVarLenWorkspaceFn aclnnFlashAttentionVarLenScoreGetWorkspaceSize = nullptr;
  AclnnLaunchFn aclnnFlashAttentionVarLenScore = nullptr;
  AclnnFlashAttentionGradWorkspaceFn aclnnFlashAttentionScoreGradGetWorkspaceSize = nullptr;
  AclnnLaunchFn aclnnFlashAttentionScoreGrad = nullptr;
  AclnnFlashAttentionVarLenGradWorkspaceFn
      aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize = nullptr;
  AclnnLaunchFn aclnnFlashAttentionUnpaddingScoreGrad = nullptr;
  // the V2 forms (pseType, qStartIdx/kvStartIdx)
  AclnnFlashAttentionV2WorkspaceFn aclnnFlashAttentionScoreV2GetWorkspaceSize = nullptr;
  AclnnLaunchFn aclnnFlashAttentionScoreV2 = nullptr;
  AclnnFlashAttentionVarLenV2WorkspaceFn aclnnFlashAttentionVarLenScoreV2GetWorkspaceSize = nullptr;
  AclnnLaunchFn aclnnFlashAttentionVarLenScoreV2 = nullptr;
  AclnnFlashAttentionGradV2WorkspaceFn aclnnFlashAttentionScoreGradV2GetWorkspaceSize = nullptr;
  AclnnLaunchFn aclnnFlashAttentionScoreGradV2 = nullptr;
  AclnnFlashAttentionVarLenGradV2WorkspaceFn
      aclnnFlashAttentionUnpaddingScoreGradV2GetWorkspaceSize = nullptr;
  AclnnLaunchFn aclnnFlashAttentionUnpaddingScoreGradV2 = nullptr;
};

// The operators jax_rope calls, by their aclnn name.
inline constexpr const char* kOperators[] = {
    "aclnnApplyRotaryPosEmbV2",       "aclnnApplyRotaryPosEmbGrad",
    "aclnnRotaryPositionEmbeddingGrad",
    "aclnnFlashAttentionScore",       "aclnnFlashAttentionVarLenScore",
    "aclnnFlashAttentionScoreGrad",   "aclnnFlashAttentionUnpaddingScoreGrad",
    "aclnnFlashAttentionScoreV2",     "aclnnFlashAttentionVarLenScoreV2",
    "aclnnFlashAttentionScoreGradV2", "aclnnFlashAttentionUnpaddingScoreGradV2"};

struct RuntimeState {
  bool available = false;  // libascendcl and libnnopbase loaded with every entry point
  std::string detail;      // where the libraries came from, or why they did not load
  std::string soc_name;    // from aclrtGetSocName, empty when unknown
  std::string acl_library; // the path libascendcl was loaded from
  // (operator, library that defines it, "" when no library has it)
  std::vector<std::pair<std::string, std::string>> operators;
  AclApi api;
};

// Loaded once, on first use (thread-safe); never unloaded.
const RuntimeState& Runtime();

// The library `op` (an aclnn name) was resolved from, or "" when it is missing.
std::string OperatorLibrary(const std::string& op);

// The most recent ACL error text (aclGetRecentErrMsg), or "" when none.
std::string RecentErrorMessage();

}  // namespace jax_rope::npu
