// The compiled extension `jax_rope._jax_rope_cpu`: hands Python the FFI
// handlers to register (one dict, registered in one loop) and build facts.
#include <pybind11/pybind11.h>

#include "device_kernels/npu/acl_runtime.h"
#include "xla_ffi/attention_handlers.h"
#include "xla_ffi/npu_handlers.h"
#include "xla_ffi/rope_handlers.h"

namespace py = pybind11;

namespace {

template <typename Fn>
py::capsule Capsule(Fn* fn) {
  return py::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

PYBIND11_MODULE(_jax_rope_cpu, m) {
  m.doc() = "jax_rope CPU kernels as XLA FFI handlers";
  m.def("registrations", []() {
    py::dict targets;
    targets["jax_rope_rope_fwd"] = Capsule(jax_rope::ffi_support::JaxRopeRopeForward);
    targets["jax_rope_rope_bwd"] = Capsule(jax_rope::ffi_support::JaxRopeRopeBackward);
    targets["jax_rope_rope_bwd_no_inputs"] =
        Capsule(jax_rope::ffi_support::JaxRopeRopeBackwardNoInputs);
    targets["jax_rope_attention_fwd"] = Capsule(jax_rope::ffi_support::JaxRopeAttentionForward);
    targets["jax_rope_attention_scores"] = Capsule(jax_rope::ffi_support::JaxRopeAttentionScores);
    targets["jax_rope_attention_bwd"] = Capsule(jax_rope::ffi_support::JaxRopeAttentionBackward);
    return targets;
  });
  // Ascend NPU handlers, registered by Python for the NPU platform name; the
  // host twins only by the tests (platform "cpu", simulated runtime).
  m.def("npu_registrations", []() {
    namespace fs = jax_rope::ffi_support;
    py::dict targets;
    targets["jax_rope_npu_rope_fwd"] = Capsule(fs::JaxRopeNpuRopeForward);
    targets["jax_rope_npu_rope_bwd"] = Capsule(fs::JaxRopeNpuRopeBackward);
    targets["jax_rope_npu_rope_bwd_no_inputs"] = Capsule(fs::JaxRopeNpuRopeBackwardNoInputs);
    targets["jax_rope_npu_attention_fwd"] = Capsule(fs::JaxRopeNpuAttentionForward);
    targets["jax_rope_npu_attention_bwd"] = Capsule(fs::JaxRopeNpuAttentionBackward);
    return targets;
  });
  m.def("npu_host_registrations", []() {
    namespace fs = jax_rope::ffi_support;
    py::dict targets;
    targets["jax_rope_npu_rope_fwd"] = Capsule(fs::JaxRopeNpuHostRopeForward);
    targets["jax_rope_npu_rope_bwd"] = Capsule(fs::JaxRopeNpuHostRopeBackward);
    targets["jax_rope_npu_rope_bwd_no_inputs"] = Capsule(fs::JaxRopeNpuHostRopeBackwardNoInputs);
    targets["jax_rope_npu_attention_fwd"] = Capsule(fs::JaxRopeNpuHostAttentionForward);
    targets["jax_rope_npu_attention_bwd"] = Capsule(fs::JaxRopeNpuHostAttentionBackward);
    return targets;
  });
  // (available, detail, SoC name): loads CANN on first call, never fails.
  m.def("npu_runtime", []() {
    const auto& state = jax_rope::npu::Runtime();
    return py::make_tuple(state.available, state.detail, state.soc_name);
  });
  m.attr("built_against_jaxlib") = JAX_ROPE_BUILT_AGAINST_JAXLIB;
  m.attr("compiler") = __VERSION__;
}
