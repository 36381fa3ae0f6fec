// Fused Q/K rotary position embedding on the CPU (spec/rope.md).
// Arithmetic is float32; 16-bit outputs are rounded once at the end.
// Each call handles a range of work items so the caller can parallelise:
// the forward over tokens (batch * seq), the backward over cos rows
// (cos_batch * seq), which keeps the dcos/dsin reduction race-free and
// deterministic.
#pragma once

#include <cstdint>

#include "device_kernels/cpu/float_convert.h"
#include "device_kernels/cpu/rope_geometry.h"

namespace jax_rope::cpu {

template <typename T>
struct RopeForwardArgs {
  const T* query;
  const T* key;
  const T* cos;
  const T* sin;
  T* query_out;
  T* key_out;
};

template <typename T>
struct RopeBackwardArgs {
  const T* grad_query;
  const T* grad_key;
  const T* cos;
  const T* sin;
  const T* query;  // null together with key: dcos/dsin are not computed
  const T* key;
  T* dquery;
  T* dkey;
  T* dcos;  // null when query/key are null
  T* dsin;
};

// Tokens [begin, end) of batch * seq; every mode.
template <typename T>
void RopeForward(const RopeGeometry& g, const RopeForwardArgs<T>& args, int64_t begin,
                 int64_t end);

// Cos rows [begin, end) of cos_batch * seq; half mode only.
template <typename T>
void RopeBackward(const RopeGeometry& g, const RopeBackwardArgs<T>& args, int64_t begin,
                  int64_t end);

}  // namespace jax_rope::cpu
