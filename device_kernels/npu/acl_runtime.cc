// See acl_runtime.h. Search order for each library: $ASCEND_HOME_PATH/lib64,
// $ASCEND_TOOLKIT_HOME/lib64, the usual install prefix, then the plain name
// (the dynamic loader's own LD_LIBRARY_PATH search).
#include "device_kernels/npu/acl_runtime.h"

#include <dlfcn.h>

#include <cstdlib>
#include <vector>

namespace jax_rope::npu {
namespace {

std::vector<std::string> Candidates(const std::string& file) {
  std::vector<std::string> paths;
  for (const char* var : {"ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"}) {
    const char* root = std::getenv(var);
    if (root != nullptr && *root != '\0') paths.push_back(std::string(root) + "/lib64/" + file);
  }
  paths.push_back("/usr/local/Ascend/ascend-toolkit/latest/lib64/" + file);
  paths.push_back(file);  // LD_LIBRARY_PATH and the system paths
  return paths;
}

void* Open(const std::string& file, std::string* why) {
  std::string errors;
  for (const std::string& path : Candidates(file)) {
    // RTLD_GLOBAL: libopapi resolves its own dependencies on the other two.
    if (void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL)) return handle;
    const char* error = dlerror();
    if (path == file) errors = error != nullptr ? error : "not found";
  }
  *why = file + " not found (set ASCEND_HOME_PATH or source CANN's set_env.sh): " + errors;
  return nullptr;
}

template <typename Fn>
bool Resolve(void* handle, const char* name, Fn* slot, std::string* missing) {
  *slot = reinterpret_cast<Fn>(dlsym(handle, name));
  if (*slot == nullptr) {
    if (!missing->empty()) *missing += ", ";
    *missing += name;
  }
  return *slot != nullptr;
}

RuntimeState Load() {
  RuntimeState state;
  if (const char* off = std::getenv("JAX_ROPE_DISABLE_NPU"); off && *off && std::string(off) != "0") {
    state.detail = "disabled by JAX_ROPE_DISABLE_NPU";
    return state;
  }
  std::string why;
  void* acl = Open("libascendcl.so", &why);
  void* nnop = acl ? Open("libnnopbase.so", &why) : nullptr;
  void* opapi = nnop ? Open("libopapi.so", &why) : nullptr;
  if (opapi == nullptr) {
    state.detail = "CANN not found: " + why;
    return state;
  }
  AclApi& a = state.api;
  std::string missing;
#define JAX_ROPE_RESOLVE(handle, name) Resolve(handle, #name, &a.name, &missing)
  JAX_ROPE_RESOLVE(acl, aclrtGetSocName);
  JAX_ROPE_RESOLVE(acl, aclGetRecentErrMsg);
  JAX_ROPE_RESOLVE(acl, aclrtMemcpyAsync);
  JAX_ROPE_RESOLVE(acl, aclrtMemcpy);
  JAX_ROPE_RESOLVE(acl, aclrtSynchronizeStream);
  JAX_ROPE_RESOLVE(acl, aclrtMalloc);
  JAX_ROPE_RESOLVE(acl, aclrtGetDevice);
  JAX_ROPE_RESOLVE(nnop, aclCreateTensor);
  JAX_ROPE_RESOLVE(nnop, aclDestroyTensor);
  JAX_ROPE_RESOLVE(nnop, aclCreateIntArray);
  JAX_ROPE_RESOLVE(nnop, aclDestroyIntArray);
  JAX_ROPE_RESOLVE(opapi, aclnnApplyRotaryPosEmbV2GetWorkspaceSize);
  JAX_ROPE_RESOLVE(opapi, aclnnApplyRotaryPosEmbV2);
  JAX_ROPE_RESOLVE(opapi, aclnnApplyRotaryPosEmbGradGetWorkspaceSize);
  JAX_ROPE_RESOLVE(opapi, aclnnApplyRotaryPosEmbGrad);
  JAX_ROPE_RESOLVE(opapi, aclnnFlashAttentionScoreGetWorkspaceSize);
  JAX_ROPE_RESOLVE(opapi, aclnnFlashAttentionScore);
  JAX_ROPE_RESOLVE(opapi, aclnnFlashAttentionVarLenScoreGetWorkspaceSize);
  JAX_ROPE_RESOLVE(opapi, aclnnFlashAttentionVarLenScore);
  JAX_ROPE_RESOLVE(opapi, aclnnFlashAttentionScoreGradGetWorkspaceSize);
  JAX_ROPE_RESOLVE(opapi, aclnnFlashAttentionScoreGrad);
  JAX_ROPE_RESOLVE(opapi, aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize);
  JAX_ROPE_RESOLVE(opapi, aclnnFlashAttentionUnpaddingScoreGrad);
#undef JAX_ROPE_RESOLVE
  if (!missing.empty()) {
    state.detail = "CANN found but too old or incomplete, missing: " + missing;
    return state;
  }
  const char* soc = a.aclrtGetSocName();
  state.soc_name = soc != nullptr ? soc : "";
  Dl_info info;
  state.detail = dladdr(reinterpret_cast<void*>(a.aclnnApplyRotaryPosEmbV2), &info) && info.dli_fname
                     ? std::string("libopapi from ") + info.dli_fname
                     : std::string("loaded");
  state.available = true;
  return state;
}

}  // namespace

const RuntimeState& Runtime() {
  static const RuntimeState state = Load();
  return state;
}

std::string RecentErrorMessage() {
  const RuntimeState& state = Runtime();
  if (state.api.aclGetRecentErrMsg == nullptr) return "";
  const char* message = state.api.aclGetRecentErrMsg();
  return message != nullptr ? message : "";
}

}  // namespace jax_rope::npu
