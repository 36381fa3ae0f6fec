// Test-only host twins of the NPU handlers (built by CMake under
// JAX_ROPE_BUILD_TESTS into libjax_rope_npu_host_handlers.so, never shipped):
// the bodies of xla_ffi/npu_handler_bodies.h with host memory for the
// workspace and no stream. contract_checks.py loads the library with ctypes
// and registers these symbols for platform "cpu" under the NPU target names,
// so the NPU lowering runs the real launch glue against the simulated CANN.
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "xla_ffi/npu_handler_bodies.h"

#define JAX_ROPE_TEST_EXPORT extern "C" __attribute__((visibility("default")))

JAX_ROPE_TEST_EXPORT XLA_FFI_Error* JaxRopeNpuHostRopeForward(XLA_FFI_CallFrame* call_frame);
JAX_ROPE_TEST_EXPORT XLA_FFI_Error* JaxRopeNpuHostRopeBackward(XLA_FFI_CallFrame* call_frame);
JAX_ROPE_TEST_EXPORT XLA_FFI_Error* JaxRopeNpuHostRopeBackwardNoInputs(
    XLA_FFI_CallFrame* call_frame);
JAX_ROPE_TEST_EXPORT XLA_FFI_Error* JaxRopeNpuHostRopeBackwardSingle(XLA_FFI_CallFrame* call_frame);
JAX_ROPE_TEST_EXPORT XLA_FFI_Error* JaxRopeNpuHostRopeBackwardSingleNoInputs(
    XLA_FFI_CallFrame* call_frame);
JAX_ROPE_TEST_EXPORT XLA_FFI_Error* JaxRopeNpuHostAttentionForward(XLA_FFI_CallFrame* call_frame);
JAX_ROPE_TEST_EXPORT XLA_FFI_Error* JaxRopeNpuHostAttentionBackward(XLA_FFI_CallFrame* call_frame);

namespace {

namespace ffi = xla::ffi;

// Device memory is host memory in the simulator: the workspace comes from the
// heap and lives until the handler returns.
struct HostContext {
  std::vector<std::vector<uint8_t>> blocks;
  jax_rope::npu::Device device;

  HostContext() {
    device.workspace = [this](uint64_t bytes) -> void* {
      // A test hook: JAX_ROPE_NPU_HOST_WORKSPACE_LIMIT makes larger requests
      // fail, as XLA's scratch allocator can.
      const char* limit = std::getenv("JAX_ROPE_NPU_HOST_WORKSPACE_LIMIT");
      if (limit != nullptr && bytes > std::strtoull(limit, nullptr, 10)) return nullptr;
      blocks.emplace_back(bytes);
      return blocks.back().data();
    };
  }
  HostContext(const HostContext&) = delete;
  HostContext& operator=(const HostContext&) = delete;
  static auto Bind() { return ffi::Ffi::Bind(); }
};

using Handlers = jax_rope::ffi_support::npu_handlers::NpuHandlers<HostContext>;

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeNpuHostRopeForward, Handlers::RopeForwardHandler,
                              Handlers::RopeForwardBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeNpuHostRopeBackward, Handlers::RopeBackwardHandler,
                              Handlers::RopeBackwardBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeNpuHostRopeBackwardNoInputs,
                              Handlers::RopeBackwardNoInputsHandler,
                              Handlers::RopeBackwardNoInputsBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeNpuHostRopeBackwardSingle,
                              Handlers::RopeBackwardSingleHandler,
                              Handlers::RopeBackwardSingleBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeNpuHostRopeBackwardSingleNoInputs,
                              Handlers::RopeBackwardSingleNoInputsHandler,
                              Handlers::RopeBackwardNoInputsBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeNpuHostAttentionForward, Handlers::AttentionForwardHandler,
                              Handlers::AttentionForwardBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeNpuHostAttentionBackward,
                              Handlers::AttentionBackwardHandler,
                              Handlers::AttentionBackwardBinding());
