// FFI handler symbols for masked attention (CPU platform).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_rope::ffi_support {

// Operands after the sequence table: mask, bias, offsets (+ drop_keys, drop_rows,
// drop_mask for forward and backward); attributes layout, scale, has_mask,
// bias_kind, bias_after_scale (+ dropout, keep_threshold, keep_scale).
// query, key, value, table, extras -> attention_out, softmax_max, softmax_sum
extern "C" XLA_FFI_Error* JaxRopeAttentionForward(XLA_FFI_CallFrame* call_frame);
// query, key, table, mask, bias, offsets -> scores
extern "C" XLA_FFI_Error* JaxRopeAttentionScores(XLA_FFI_CallFrame* call_frame);
// query, key, value, out, dout, softmax_max, softmax_sum, table, extras -> dq, dk, dv
extern "C" XLA_FFI_Error* JaxRopeAttentionBackward(XLA_FFI_CallFrame* call_frame);

}  // namespace jax_rope::ffi_support
