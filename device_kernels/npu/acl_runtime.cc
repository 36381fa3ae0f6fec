// See acl_runtime.h. Search order for libascendcl and libnnopbase:
// $ASCEND_HOME_PATH/lib64, $ASCEND_TOOLKIT_HOME/lib64 (each only when the
// value is an absolute path: a relative one would load libraries from the
// working directory), the usual install prefixes, then the plain name (the
// dynamic loader's LD_LIBRARY_PATH search). The operator libraries are looked
// for next to the libascendcl that loaded, as op-plugin's GetOpApiFuncAddr does.
#include "device_kernels/npu/acl_runtime.h"

#include <dlfcn.h>
#include <glob.h>

#include <algorithm>
#include <cstdlib>

namespace jax_rope::npu {
namespace {

// An environment variable naming a directory, or "" unless it is absolute.
std::string AbsoluteDir(const char* var) {
  const char* value = std::getenv(var);
  return value != nullptr && value[0] == '/' ? std::string(value) : std::string();
}

std::vector<std::string> Candidates(const std::string& file) {
  std::vector<std::string> paths;
  for (const char* var : {"ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"}) {
    if (std::string root = AbsoluteDir(var); !root.empty()) paths.push_back(root + "/lib64/" + file);
  }
  paths.push_back("/usr/local/Ascend/ascend-toolkit/latest/lib64/" + file);
  paths.push_back("/usr/local/Ascend/cann/lib64/" + file);
  paths.push_back(file);  // LD_LIBRARY_PATH and the system paths
  return paths;
}

void* Open(const std::string& file, std::string* why) {
  std::string errors;
  for (const std::string& path : Candidates(file)) {
    // RTLD_GLOBAL: the operator libraries resolve their own dependencies on these.
    if (void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL)) return handle;
    const char* error = dlerror();
    if (path == file) errors = error != nullptr ? error : "not found";
  }
  *why = file + " not found (set ASCEND_HOME_PATH or source CANN's set_env.sh): " + errors;
  return nullptr;
}

std::vector<std::string> Glob(const std::string& pattern) {
  std::vector<std::string> out;
  glob_t g;
  if (glob(pattern.c_str(), 0, nullptr, &g) == 0) {
    for (size_t i = 0; i < g.gl_pathc; ++i) out.push_back(g.gl_pathv[i]);  // sorted by glob
  }
  globfree(&g);
  return out;
}

std::string Directory(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash);
}

// The operator libraries in op-plugin's order: custom builds first, then the
// split repositories' libopapi_*.so, then the monolithic libopapi.so.
std::vector<void*> OperatorLibraries(const std::string& lib64) {
  std::vector<std::string> paths;
  if (const char* custom = std::getenv("ASCEND_CUSTOM_OPP_PATH"); custom != nullptr) {
    std::string all = custom;
    for (size_t start = 0; start <= all.size();) {
      const size_t end = std::min(all.find(':', start), all.size());
      const std::string dir = all.substr(start, end - start);
      if (!dir.empty() && dir[0] == '/') paths.push_back(dir + "/op_api/lib/libcust_opapi.so");
      start = end + 1;
    }
  }
  if (std::string opp = AbsoluteDir("ASCEND_OPP_PATH"); !opp.empty()) {
    for (const std::string& p : Glob(opp + "/vendors/*/op_api/lib/libcust_opapi.so")) paths.push_back(p);
  }
  if (!lib64.empty()) {
    for (const std::string& p : Glob(lib64 + "/libopapi_*.so")) paths.push_back(p);
    paths.push_back(lib64 + "/libopapi.so");
  }
  paths.push_back("libopapi.so");
  std::vector<void*> handles;
  for (const std::string& path : paths) {
    if (void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL)) handles.push_back(h);
    else dlerror();
  }
  return handles;
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

std::string LibraryOf(void* symbol) {
  Dl_info info;
  return symbol != nullptr && dladdr(symbol, &info) && info.dli_fname ? info.dli_fname : "";
}

// One operator: the first library that has both of its entry points.
template <typename WorkspaceFn>
void ResolveOperator(const std::vector<void*>& libraries, const char* name, WorkspaceFn* workspace,
                     AclnnLaunchFn* launch, RuntimeState* state) {
  const std::string prepare = std::string(name) + "GetWorkspaceSize";
  for (void* h : libraries) {
    auto* w = reinterpret_cast<WorkspaceFn>(dlsym(h, prepare.c_str()));
    auto* l = reinterpret_cast<AclnnLaunchFn>(dlsym(h, name));
    if (w != nullptr && l != nullptr) {
      *workspace = w;
      *launch = l;
      state->operators.emplace_back(name, LibraryOf(reinterpret_cast<void*>(l)));
      return;
    }
  }
  state->operators.emplace_back(name, "");
}

RuntimeState Load() {
  RuntimeState state;
  for (const char* op : kOperators) state.operators.emplace_back(op, "");
  if (const char* off = std::getenv("JAX_ROPE_DISABLE_NPU"); off && *off && std::string(off) != "0") {
    state.detail = "disabled by JAX_ROPE_DISABLE_NPU";
    return state;
  }
  std::string why;
  void* acl = Open("libascendcl.so", &why);
  void* nnop = acl ? Open("libnnopbase.so", &why) : nullptr;
  if (nnop == nullptr) {
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
  JAX_ROPE_RESOLVE(acl, aclrtFree);
  JAX_ROPE_RESOLVE(acl, aclrtGetDevice);
  JAX_ROPE_RESOLVE(acl, aclrtMallocHost);
  JAX_ROPE_RESOLVE(acl, aclrtFreeHost);
  JAX_ROPE_RESOLVE(nnop, aclCreateTensor);
  JAX_ROPE_RESOLVE(nnop, aclDestroyTensor);
  JAX_ROPE_RESOLVE(nnop, aclCreateIntArray);
  JAX_ROPE_RESOLVE(nnop, aclDestroyIntArray);
#undef JAX_ROPE_RESOLVE
  state.operators.clear();
  if (!missing.empty()) {
    for (const char* op : kOperators) state.operators.emplace_back(op, "");
    state.detail = "CANN found but too old or incomplete, missing: " + missing;
    return state;
  }
  state.acl_library = LibraryOf(reinterpret_cast<void*>(a.aclrtGetSocName));
  const std::vector<void*> libraries = OperatorLibraries(Directory(state.acl_library));
  a.aclDestroyAclOpExecutor =
      reinterpret_cast<AclDestroyAclOpExecutorFn>(dlsym(nnop, "aclDestroyAclOpExecutor"));
#define JAX_ROPE_OPERATOR(name) \
  ResolveOperator(libraries, #name, &a.name##GetWorkspaceSize, &a.name, &state)
  JAX_ROPE_OPERATOR(aclnnApplyRotaryPosEmbV2);
  JAX_ROPE_OPERATOR(aclnnApplyRotaryPosEmbGrad);
  JAX_ROPE_OPERATOR(aclnnRotaryPositionEmbeddingGrad);
  JAX_ROPE_OPERATOR(aclnnFlashAttentionScore);
  JAX_ROPE_OPERATOR(aclnnFlashAttentionVarLenScore);
  JAX_ROPE_OPERATOR(aclnnFlashAttentionScoreGrad);
  JAX_ROPE_OPERATOR(aclnnFlashAttentionUnpaddingScoreGrad);
  JAX_ROPE_OPERATOR(aclnnFlashAttentionScoreV2);
  JAX_ROPE_OPERATOR(aclnnFlashAttentionVarLenScoreV2);
  JAX_ROPE_OPERATOR(aclnnFlashAttentionScoreGradV2);
  JAX_ROPE_OPERATOR(aclnnFlashAttentionUnpaddingScoreGradV2);
#undef JAX_ROPE_OPERATOR
  const char* soc = a.aclrtGetSocName();
  state.soc_name = soc != nullptr ? soc : "";
  state.detail = "libascendcl from " + state.acl_library;
  state.available = true;
  return state;
}

}  // namespace

const RuntimeState& Runtime() {
  static const RuntimeState state = Load();
  return state;
}

std::string OperatorLibrary(const std::string& op) {
  for (const auto& [name, library] : Runtime().operators) {
    if (name == op) return library;
  }
  return "";
}

std::string RecentErrorMessage() {
  const RuntimeState& state = Runtime();
  if (state.api.aclGetRecentErrMsg == nullptr) return "";
  const char* message = state.api.aclGetRecentErrMsg();
  return message != nullptr ? message : "";
}

}  // namespace jax_rope::npu
