// Dtype dispatch shared by the FFI handlers: XLA element types to kernel types.
#pragma once

#include <string>
#include <utility>

#include "device_kernels/cpu/float_convert.h"
#include "xla/ffi/api/ffi.h"

namespace jax_rope::ffi_support {

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
