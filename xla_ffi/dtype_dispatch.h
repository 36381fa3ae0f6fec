// Shared by the FFI handlers: buffer accessors, early return on an FFI error,
// the out-of-memory error, and dtype dispatch (XLA element types to kernel types).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "device_kernels/cpu/float_convert.h"
#include "xla/ffi/api/ffi.h"

// Returns from the enclosing handler with the error of `expr` if it failed.
#define JAX_ROPE_RETURN_IF_FAILED(expr)             \
  do {                                              \
    if (auto error_ = (expr); error_.failure()) {   \
      return error_;                                \
    }                                               \
  } while (0)

namespace jax_rope::ffi_support {

inline std::vector<int64_t> DimsOf(const xla::ffi::AnyBuffer& buffer) {
  auto dims = buffer.dimensions();
  return std::vector<int64_t>(dims.begin(), dims.end());
}

// The error of a call whose kernels' scratch cannot be had (std::bad_alloc):
// "jax_rope <op>: out of memory for kernel scratch".
inline xla::ffi::Error OutOfScratch(const char* op) {
  return xla::ffi::Error(xla::ffi::ErrorCode::kResourceExhausted,
                         std::string("jax_rope ") + op + ": out of memory for kernel scratch");
}

template <typename T>
T* Data(const xla::ffi::AnyBuffer& buffer) {
  return static_cast<T*>(buffer.untyped_data());
}

struct NamedBuffer {
  const char* name;
  const xla::ffi::AnyBuffer* buffer;
};

// Calls `fn(T{})` with T = float, cpu::Float16 or cpu::BFloat16.
template <typename Fn>
xla::ffi::Error DispatchFloat(const char* op, xla::ffi::DataType dtype, Fn&& fn) {
  switch (dtype) {
    case xla::ffi::DataType::F32:
      fn(float{});
      return xla::ffi::Error::Success();
    case xla::ffi::DataType::F16:
      fn(cpu::Float16{});
      return xla::ffi::Error::Success();
    case xla::ffi::DataType::BF16:
      fn(cpu::BFloat16{});
      return xla::ffi::Error::Success();
    default:
      return xla::ffi::Error::InvalidArgument(
          std::string("jax_rope ") + op +
          ": dtype must be float32, float16 or bfloat16, got XLA type code " +
          std::to_string(static_cast<int>(dtype)));
  }
}

}  // namespace jax_rope::ffi_support
