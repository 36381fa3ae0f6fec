// FFI handler symbols for masked attention (CPU platform).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_rope::ffi_support {

// query, key, value, table, mask -> attention_out, softmax_max, softmax_sum
extern "C" XLA_FFI_Error* JaxRopeAttentionForward(XLA_FFI_CallFrame* call_frame);
// query, key, table, mask -> scores
extern "C" XLA_FFI_Error* JaxRopeAttentionScores(XLA_FFI_CallFrame* call_frame);
// query, key, value, out, dout, softmax_max, softmax_sum, table, mask -> dq, dk, dv
extern "C" XLA_FFI_Error* JaxRopeAttentionBackward(XLA_FFI_CallFrame* call_frame);

}  // namespace jax_rope::ffi_support
