// Test-only (CMake option JAX_ROPE_BUILD_TESTS; never in the wheel): the CPU
// attention and RoPE handlers of xla_ffi/attention_handlers.cc and
// rope_handlers.cc built again, with their
// own copy of the kernel library, into libjax_rope_scratch_limit_handlers.so,
// beside the limit on that copy's scratch (LimitScratchForTesting). The tests
// load it with ctypes and register the handlers under their own target names
// (tests/test_ffi_handlers.py), so that the kernels' scratch requests can be
// made to fail as failed allocations do, without a test hook in the shipped
// module.
#include <cstdint>

#include "device_kernels/cpu/thread_scratch.h"
#include "xla_ffi/attention_handlers.h"
#include "xla_ffi/rope_handlers.h"

#define JAX_ROPE_TEST_EXPORT extern "C" __attribute__((visibility("default")))

namespace fs = jax_rope::ffi_support;

JAX_ROPE_TEST_EXPORT XLA_FFI_Error* JaxRopeTestAttentionForward(XLA_FFI_CallFrame* frame) {
  return fs::JaxRopeAttentionForward(frame);
}
JAX_ROPE_TEST_EXPORT XLA_FFI_Error* JaxRopeTestAttentionScores(XLA_FFI_CallFrame* frame) {
  return fs::JaxRopeAttentionScores(frame);
}
JAX_ROPE_TEST_EXPORT XLA_FFI_Error* JaxRopeTestAttentionBackward(XLA_FFI_CallFrame* frame) {
  return fs::JaxRopeAttentionBackward(frame);
}
JAX_ROPE_TEST_EXPORT XLA_FFI_Error* JaxRopeTestRopeForward(XLA_FFI_CallFrame* frame) {
  return fs::JaxRopeRopeForward(frame);
}
JAX_ROPE_TEST_EXPORT XLA_FFI_Error* JaxRopeTestRopeBackward(XLA_FFI_CallFrame* frame) {
  return fs::JaxRopeRopeBackward(frame);
}
// While on, new scratch holders of this copy start as quiet NaN (PoisonScratchForTesting).
JAX_ROPE_TEST_EXPORT void jax_rope_test_poison_scratch(int32_t on) {
  jax_rope::cpu::PoisonScratchForTesting(on != 0);
}
// Scratch requests above `bytes` throw std::bad_alloc; 0 lifts the limit.
JAX_ROPE_TEST_EXPORT void jax_rope_test_limit_scratch(int64_t bytes) {
  jax_rope::cpu::LimitScratchForTesting(bytes);
}
