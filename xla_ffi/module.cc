// The compiled extension `jax_rope._jax_rope_ffi`: the CPU FFI handlers, the
// Ascend NPU FFI handlers and the CANN loader's status, as capsule dicts that
// Python registers in one loop, plus the operator codes of
// device_kernels/common/codes.h and the build facts.
#include <pybind11/pybind11.h>

#include "device_kernels/common/codes.h"
#include "device_kernels/common/layout_roles.h"
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

template <typename Enum, size_t N>
py::dict Names(const jax_rope::NamedCode<Enum> (&table)[N]) {
  py::dict out;
  for (const auto& entry : table) out[entry.name] = static_cast<int32_t>(entry.code);
  return out;
}

}  // namespace

PYBIND11_MODULE(_jax_rope_ffi, m) {
  m.doc() = "jax_rope's XLA FFI handlers (CPU kernels and Ascend NPU launch glue), "
            "the CANN loader and the operator codes";
  m.def("registrations", []() {
    namespace fs = jax_rope::ffi_support;
    py::dict targets;
    targets["jax_rope_rope_fwd"] = Capsule(fs::JaxRopeRopeForward);
    targets["jax_rope_rope_bwd"] = Capsule(fs::JaxRopeRopeBackward);
    targets["jax_rope_rope_bwd_no_inputs"] = Capsule(fs::JaxRopeRopeBackwardNoInputs);
    targets["jax_rope_attention_fwd"] = Capsule(fs::JaxRopeAttentionForward);
    targets["jax_rope_attention_scores"] = Capsule(fs::JaxRopeAttentionScores);
    targets["jax_rope_attention_bwd"] = Capsule(fs::JaxRopeAttentionBackward);
    return targets;
  }, "CPU handlers: {target name: capsule}, registered for platform 'cpu'.");
  m.def("npu_registrations", []() {
    namespace fs = jax_rope::ffi_support;
    py::dict targets;
    targets["jax_rope_npu_rope_fwd"] = Capsule(fs::JaxRopeNpuRopeForward);
    targets["jax_rope_npu_rope_bwd"] = Capsule(fs::JaxRopeNpuRopeBackward);
    targets["jax_rope_npu_rope_bwd_no_inputs"] = Capsule(fs::JaxRopeNpuRopeBackwardNoInputs);
    targets["jax_rope_npu_rope_single_bwd"] = Capsule(fs::JaxRopeNpuRopeBackwardSingle);
    targets["jax_rope_npu_rope_single_bwd_no_inputs"] =
        Capsule(fs::JaxRopeNpuRopeBackwardSingleNoInputs);
    targets["jax_rope_npu_attention_fwd"] = Capsule(fs::JaxRopeNpuAttentionForward);
    targets["jax_rope_npu_attention_bwd"] = Capsule(fs::JaxRopeNpuAttentionBackward);
    return targets;
  }, "Ascend NPU handlers: {target name: capsule}, registered for the NPU platform name.");
  m.def("npu_runtime", []() {
    const auto& state = jax_rope::npu::Runtime();
    py::dict operators;  // aclnn name -> library that defines it ("" when missing)
    for (const auto& [name, library] : state.operators) operators[py::str(name)] = library;
    return py::make_tuple(state.available, state.detail, state.soc_name, state.acl_library,
                          operators);
  }, "(available, detail, SoC name, libascendcl path, {operator: library or ''}): loads "
     "CANN on first call, never fails.");
  m.def("codes", []() {
    py::dict roles;
    for (const auto& entry : jax_rope::kLayouts) {
      const jax_rope::AxisRoles r = jax_rope::LayoutRoles(entry.code);
      roles[py::int_(static_cast<int32_t>(entry.code))] =
          py::make_tuple(r.rank, r.batch, r.seq, r.head);
    }
    py::dict out;
    out["layout"] = Names(jax_rope::kLayouts);
    out["rotary_mode"] = Names(jax_rope::kRotaryModes);
    out["sparse_mode"] = Names(jax_rope::kSparseModes);
    out["layout_roles"] = roles;
    return out;
  }, "The operator codes of device_kernels/common/codes.h, as jax_rope.core.codes.tables().");
  m.attr("built_against_jaxlib") = JAX_ROPE_BUILT_AGAINST_JAXLIB;
  m.attr("compiler") = __VERSION__;
}
