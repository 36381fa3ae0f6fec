// XLA FFI handlers for the Ascend NPU: the bodies of npu_handler_bodies.h with
// the stream and workspace XLA gives a handler on the NPU platform.
#include "xla_ffi/npu_handlers.h"

#include <cstdint>
#include <optional>

#include "xla_ffi/npu_handler_bodies.h"

namespace ffi = xla::ffi;

namespace jax_rope::ffi_support {
namespace {

// XLA's stream and scratch memory. The scratch memory is stream-ordered: freed
// when the handler returns, reused only by work queued after ours on the stream.
struct NpuContext {
  npu::Device device;

  NpuContext(void* stream, ffi::ScratchAllocator& scratch) {
    device.stream = stream;
    device.workspace = [&scratch](uint64_t bytes) -> void* {
      std::optional<void*> data = scratch.Allocate(bytes, 512);
      return data.has_value() ? *data : nullptr;
    };
  }
  static auto Bind() {
    return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<void*>>().Ctx<ffi::ScratchAllocator>();
  }
};

using Handlers = npu_handlers::NpuHandlers<NpuContext, void*, ffi::ScratchAllocator>;

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeNpuRopeForward, Handlers::RopeForwardHandler,
                              Handlers::RopeForwardBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeNpuRopeBackward, Handlers::RopeBackwardHandler,
                              Handlers::RopeBackwardBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeNpuRopeBackwardNoInputs,
                              Handlers::RopeBackwardNoInputsHandler,
                              Handlers::RopeBackwardNoInputsBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeNpuRopeBackwardSingle, Handlers::RopeBackwardSingleHandler,
                              Handlers::RopeBackwardSingleBinding());
// Same operands and results as the fused backward without inputs.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeNpuRopeBackwardSingleNoInputs,
                              Handlers::RopeBackwardSingleNoInputsHandler,
                              Handlers::RopeBackwardNoInputsBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeNpuAttentionForward, Handlers::AttentionForwardHandler,
                              Handlers::AttentionForwardBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeNpuAttentionBackward, Handlers::AttentionBackwardHandler,
                              Handlers::AttentionBackwardBinding());

}  // namespace jax_rope::ffi_support
