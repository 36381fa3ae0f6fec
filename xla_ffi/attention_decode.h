// Decoding of the attention handlers' operands and attributes (attention_handlers.cc):
// buffers and attributes into an AttentionGeometry, each shape and the run-time
// sequence table re-checked, and the optional operands (positional bias, ALiBi
// offsets, dropout keys/rows/mask) checked against the kind their attributes
// select. Every failure is an InvalidArgument FFI error naming the operand.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "device_kernels/cpu/attention_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace jax_rope::ffi_support::attention_decode {

namespace ffi = xla::ffi;

// InvalidArgument with the handlers' prefix.
ffi::Error Fail(const std::string& message);

// Everything a handler needs, checked once.
struct Decoded {
  cpu::AttentionGeometry geometry;
  const cpu::SequenceBand* seqs = nullptr;
  int64_t q_rows = 0;   // Sq or Tq
  int64_t kv_rows = 0;  // Skv or Tkv
  bool packed = false;
  std::vector<int64_t> bias_base;  // geometry.bias.seq_base points here
};

// Layout, scale, shapes of query/key/value, the sequence table and the element
// mask (has_mask) into out->geometry, out->seqs and the row counts.
ffi::Error Decode(int32_t layout, float scale, int32_t has_mask, const ffi::AnyBuffer& query,
                  const ffi::AnyBuffer& key, const std::vector<int64_t>& value_dims,
                  const ffi::Buffer<ffi::S32>& table, const ffi::Buffer<ffi::U8>& mask,
                  Decoded* out);

// The positional bias operand for bias_kind (attention_kernels.h: PositionBias).
ffi::Error DecodeBias(int32_t kind, int32_t after_scale, const ffi::AnyBuffer& query,
                      const ffi::AnyBuffer& bias, const ffi::Buffer<ffi::S32>& offsets,
                      Decoded* d);

// The dropout operands for mode `dropout` (attention_kernels.h: Dropout).
ffi::Error DecodeDropout(int32_t dropout, int64_t keep_threshold, float keep_scale,
                         const ffi::Buffer<ffi::U32>& drop_keys,
                         const ffi::Buffer<ffi::U32>& drop_rows,
                         const ffi::Buffer<ffi::U8>& drop_mask, Decoded* d);

// A result buffer has the shape and dtype the handler is about to write.
ffi::Error CheckResult(const ffi::AnyBuffer& result, const std::vector<int64_t>& dims,
                       ffi::DataType dtype, const char* name);

// Dimensions of softmax_max / softmax_sum: (B, N1, Sq), or (Tq, N1) packed.
std::vector<int64_t> StatsDims(const Decoded& d);

}  // namespace jax_rope::ffi_support::attention_decode
