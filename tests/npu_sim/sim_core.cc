// The simulated CANN runtime's core (tests only): libascendcl and libnnopbase
// over host memory (device memory = host memory, streams run nothing: every
// call completes at once), and the bookkeeping the operator libraries share
// (live descriptors, executors, the recent error). The contract tests install
// it as lib64/libascendcl.so and lib64/libnnopbase.so of a simulated CANN
// tree; the operators are in sim_ops.cc, one library per CANN generation.
// The checks can make a runtime call fail once (jax_rope_sim_fail_next) to
// see the glue report it and leave nothing allocated.
//
// What the generation changes here: asynchronous device-to-host copies. CANN
// 8.0/8.1 document them as undefined unless the host memory comes from
// aclrtMallocHost and both addresses are 64-byte aligned ("does not report an
// error, but an unpredictable error may occur"); the simulator of those
// generations corrupts the destination. From 8.5 a pageable destination makes
// the copy synchronous, which the simulator models as a correct copy.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>

#include "device_kernels/npu/acl_api.h"
#include "tests/npu_sim/sim.h"

namespace jax_rope_sim {

State& Shared() {
  static State state;
  return state;
}

std::string Soc() {
  const char* soc = std::getenv("JAX_ROPE_SIM_SOC");
  return soc ? soc : "Ascend910B2";
}

Chip ChipOf(const std::string& soc) {
  auto starts = [&](const char* prefix) { return soc.rfind(prefix, 0) == 0; };
  if (starts("Ascend910_95") || starts("Ascend950")) return Chip::k950;
  if (starts("Ascend910_93")) return Chip::kA2A3;
  if (starts("Ascend910B") && soc.size() >= 11 && soc[10] >= '1' && soc[10] <= '4') return Chip::kA2A3;
  if (starts("Ascend310P")) return Chip::k310P;
  return Chip::kUnsupported;  // e.g. Ascend910A/ProB (Atlas training), Ascend310B (200I/500 A2)
}

}  // namespace jax_rope_sim

namespace {

using jax_rope_sim::Shared;
using jax_rope_sim::Tensor;

constexpr aclnnStatus kInvalid = 161002;
std::map<const void*, size_t> g_pinned;  // aclrtMallocHost blocks (under Shared().mutex)

bool Pinned(const void* p, size_t count) {
  for (const auto& [start, size] : g_pinned) {
    const char* s = static_cast<const char*>(start);
    if (p >= start && static_cast<const char*>(p) + count <= s + size) return true;
  }
  return false;
}

bool Aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 64 == 0; }

// True (and the status to return) when a check injected a failure of
// `function`'s next call; consumes it. Called under Shared().mutex.
bool Injected(const char* function, aclError* status) {
  auto it = Shared().failures.find(function);
  if (it == Shared().failures.end()) return false;
  *status = it->second;
  Shared().failures.erase(it);
  Shared().error = std::string("EE9999 simulated CANN: injected failure of ") + function;
  return true;
}

}  // namespace

extern "C" {

// --- libascendcl -------------------------------------------------------------
JAX_ROPE_SIM_EXPORT const char* aclrtGetSocName() {
  static const std::string soc = jax_rope_sim::Soc();
  return soc.c_str();
}
JAX_ROPE_SIM_EXPORT const char* aclGetRecentErrMsg() {
  return Shared().error.empty() ? nullptr : Shared().error.c_str();
}
JAX_ROPE_SIM_EXPORT aclError aclrtMemcpyAsync(void* dst, size_t dest_max, const void* src,
                                              size_t count, int32_t kind, aclrtStream) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  if (aclError e; Injected("aclrtMemcpyAsync", &e)) return e;
  if (count > dest_max) { Shared().error = "memcpy count exceeds destination"; return 107000; }
  if (kind < 0 || kind > 3) { Shared().error = "bad memcpy kind"; return 107000; }
  if (kind == kAclMemcpyDeviceToDevice) ++Shared().device_copies;
  if (kind == kAclMemcpyDeviceToHost && Shared().generation < 85 &&
      (!Pinned(dst, count) || !Aligned(dst) || !Aligned(src))) {
    std::memset(dst, 0xFF, count);  // undefined behaviour, made visible
    return 0;
  }
  std::memcpy(dst, src, count);
  return 0;
}
JAX_ROPE_SIM_EXPORT aclError aclrtMemcpy(void* dst, size_t dest_max, const void* src, size_t count,
                                         int32_t kind) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  if (aclError e; Injected("aclrtMemcpy", &e)) return e;
  if (count > dest_max) { Shared().error = "memcpy count exceeds destination"; return 107000; }
  std::memcpy(dst, src, count);  // synchronous: any host memory
  return 0;
}
JAX_ROPE_SIM_EXPORT aclError aclrtSynchronizeStream(aclrtStream) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  if (aclError e; Injected("aclrtSynchronizeStream", &e)) return e;
  return 0;
}
JAX_ROPE_SIM_EXPORT aclError aclrtMalloc(void** ptr, size_t size, int32_t) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  *ptr = nullptr;
  if (aclError e; Injected("aclrtMalloc", &e)) return e;
  *ptr = std::aligned_alloc(64, (std::max<size_t>(size, 1) + 63) / 64 * 64);
  if (*ptr == nullptr) return 207001;
  Shared().device_blocks[*ptr] = Shared().device;
  return 0;
}
JAX_ROPE_SIM_EXPORT aclError aclrtFree(void* ptr) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  if (Shared().device_blocks.erase(ptr) == 0) {
    Shared().error = "aclrtFree of unknown device memory";
    return 107000;
  }
  std::free(ptr);
  return 0;
}
JAX_ROPE_SIM_EXPORT aclError aclrtMallocHost(void** ptr, size_t size) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  *ptr = nullptr;
  if (aclError e; Injected("aclrtMallocHost", &e)) return e;
  *ptr = std::aligned_alloc(64, (std::max<size_t>(size, 1) + 63) / 64 * 64);
  if (*ptr == nullptr) return 207001;
  g_pinned[*ptr] = size;
  return 0;
}
JAX_ROPE_SIM_EXPORT aclError aclrtFreeHost(void* ptr) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  if (g_pinned.erase(ptr) == 0) { Shared().error = "aclrtFreeHost of unknown memory"; return 107000; }
  std::free(ptr);
  return 0;
}
JAX_ROPE_SIM_EXPORT aclError aclrtGetDevice(int32_t* id) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  if (aclError e; Injected("aclrtGetDevice", &e)) return e;
  *id = Shared().device;
  return 0;
}

// --- libnnopbase ---------------------------------------------------------------
JAX_ROPE_SIM_EXPORT aclTensor* aclCreateTensor(const int64_t* view_dims, uint64_t n, int32_t dtype,
                                               const int64_t* stride, int64_t offset, int32_t format,
                                               const int64_t* storage_dims, uint64_t storage_n,
                                               void* data) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  // Our glue always passes dense row-major ND views of the whole buffer (an
  // empty tensor, for reserved outputs, may have no data).
  if (format != kAclFormatND || offset != 0 || storage_n != n) { Shared().error = "bad tensor"; return nullptr; }
  int64_t expect = 1;
  for (int i = static_cast<int>(n) - 1; i >= 0; --i) {
    if (view_dims[i] < 0 || stride[i] != expect || storage_dims[i] != view_dims[i]) {
      Shared().error = "non-contiguous tensor";
      return nullptr;
    }
    expect *= view_dims[i];
  }
  if (data == nullptr && expect != 0) { Shared().error = "tensor without data"; return nullptr; }
  auto* t = new Tensor{std::vector<int64_t>(view_dims, view_dims + n), dtype, data};
  Shared().tensors.insert(t);
  ++Shared().live_tensors;
  return reinterpret_cast<aclTensor*>(t);
}
JAX_ROPE_SIM_EXPORT aclnnStatus aclDestroyTensor(const aclTensor* t) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  if (Shared().tensors.erase(t) == 0) {
    Shared().error = "EZ9999 simulated CANN: aclDestroyTensor of an unknown or destroyed tensor";
    return kInvalid;
  }
  --Shared().live_tensors;
  delete reinterpret_cast<const Tensor*>(t);
  return 0;
}
JAX_ROPE_SIM_EXPORT aclIntArray* aclCreateIntArray(const int64_t* v, uint64_t n) {
  auto* a = new std::vector<int64_t>(v, v + n);
  std::lock_guard<std::mutex> lock(Shared().mutex);
  Shared().arrays.insert(a);
  return reinterpret_cast<aclIntArray*>(a);
}
JAX_ROPE_SIM_EXPORT aclnnStatus aclDestroyIntArray(const aclIntArray* a) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  if (Shared().arrays.erase(a) == 0) {
    Shared().error = "EZ9999 simulated CANN: aclDestroyIntArray of an unknown array";
    return kInvalid;
  }
  delete reinterpret_cast<const std::vector<int64_t>*>(a);
  return 0;
}
JAX_ROPE_SIM_EXPORT aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor* e) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  if (Shared().executors.erase(e) == 0) {
    Shared().error = "EZ9999 simulated CANN: aclDestroyAclOpExecutor of an unknown executor";
    return kInvalid;
  }
  delete reinterpret_cast<jax_rope_sim::ExecutorBase*>(e);
  return 0;
}

// Test hooks: descriptors and executors alive now (every call must leave none
// behind), and the generation the operator libraries registered.
JAX_ROPE_SIM_EXPORT int jax_rope_sim_live_tensors() { return Shared().live_tensors; }
// Copies up to `capacity` bytes of the last dropMask into `out`; returns its size.
JAX_ROPE_SIM_EXPORT int64_t jax_rope_sim_last_drop_mask(uint8_t* out, int64_t capacity) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  const auto& m = Shared().last_drop_mask;
  const int64_t bytes = std::min<int64_t>(capacity, m.size());
  if (bytes > 0) std::memcpy(out, m.data(), bytes);  // (null out: a size query)
  return static_cast<int64_t>(m.size());
}
JAX_ROPE_SIM_EXPORT int jax_rope_sim_live_executors() {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  return static_cast<int>(Shared().executors.size());
}
JAX_ROPE_SIM_EXPORT int jax_rope_sim_generation() { return Shared().generation; }
// The next call of runtime function `function` fails with `status` (null:
// forget every pending failure); which device the process is on; device and
// pinned host blocks alive now; device-to-device copies made so far.
JAX_ROPE_SIM_EXPORT void jax_rope_sim_fail_next(const char* function, int32_t status) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  if (function == nullptr) Shared().failures.clear(); else Shared().failures[function] = status;
}
JAX_ROPE_SIM_EXPORT void jax_rope_sim_set_device(int32_t device) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  Shared().device = device;
}
JAX_ROPE_SIM_EXPORT int jax_rope_sim_device_blocks() {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  return static_cast<int>(Shared().device_blocks.size());
}
JAX_ROPE_SIM_EXPORT int jax_rope_sim_pinned_blocks() {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  return static_cast<int>(g_pinned.size());
}
JAX_ROPE_SIM_EXPORT int jax_rope_sim_device_copies() {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  return Shared().device_copies;
}

}  // extern "C"
