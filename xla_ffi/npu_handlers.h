// FFI handler symbols for the Ascend NPU, registered by Python for the NPU
// platform name (`npu_registrations()` of the extension).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_rope::ffi_support {

extern "C" XLA_FFI_Error* JaxRopeNpuRopeForward(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxRopeNpuRopeBackward(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxRopeNpuRopeBackwardNoInputs(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxRopeNpuRopeBackwardSingle(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxRopeNpuRopeBackwardSingleNoInputs(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxRopeNpuAttentionForward(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxRopeNpuAttentionBackward(XLA_FFI_CallFrame* call_frame);

}  // namespace jax_rope::ffi_support
