// FFI handler symbols for the Ascend NPU (registered for the NPU platform
// name) and their test twins (registered by the tests for platform "cpu",
// where device memory is host memory: no stream, workspace from the heap).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_rope::ffi_support {

extern "C" XLA_FFI_Error* JaxRopeNpuRopeForward(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxRopeNpuRopeBackward(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxRopeNpuRopeBackwardNoInputs(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxRopeNpuAttentionForward(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxRopeNpuAttentionBackward(XLA_FFI_CallFrame* call_frame);

extern "C" XLA_FFI_Error* JaxRopeNpuHostRopeForward(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxRopeNpuHostRopeBackward(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxRopeNpuHostRopeBackwardNoInputs(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxRopeNpuHostAttentionForward(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxRopeNpuHostAttentionBackward(XLA_FFI_CallFrame* call_frame);

}  // namespace jax_rope::ffi_support
