// FFI handler symbols for the fused Q/K RoPE (CPU platform).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_rope::ffi_support {

extern "C" XLA_FFI_Error* JaxRopeRopeForward(XLA_FFI_CallFrame* call_frame);
// Backward with query/key given: returns dquery, dkey, dcos, dsin.
extern "C" XLA_FFI_Error* JaxRopeRopeBackward(XLA_FFI_CallFrame* call_frame);
// Backward without query/key: returns dquery, dkey only.
extern "C" XLA_FFI_Error* JaxRopeRopeBackwardNoInputs(XLA_FFI_CallFrame* call_frame);

}  // namespace jax_rope::ffi_support
