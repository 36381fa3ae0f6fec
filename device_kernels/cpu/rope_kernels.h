// Fused Q/K rotary position embedding on the CPU (spec/rope.md).
// Arithmetic is float32; 16-bit outputs are rounded once at the end.
// Each call handles a range of work items so the caller can parallelise. Both
// directions walk tokens (batch * seq) in memory order; when cos broadcasts
// over the batch, the backward leaves per-token dcos/dsin rows in float
// scratch and a second pass sums them in batch order (race-free, deterministic).
// In place: query_out may be query and key_out key (dquery grad_query, dkey
// grad_key), the same memory exactly (XLA's input/output aliasing); other
// overlaps are not allowed.
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
  // Outputs apart from the inputs are written with non-temporal stores (same
  // values), which skip reading each output line into the cache first: for
  // outputs too large to stay there for whoever reads them next.
  bool stream_outputs = false;
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
  float* partial = nullptr;  // RopeBackwardPartialFloats(g) floats of scratch, or null
  // dquery and dkey apart from grad_query and grad_key are written with
  // non-temporal stores (RopeForwardArgs::stream_outputs).
  bool stream_outputs = false;
};

// Tokens [begin, end) of batch * seq; every mode.
template <typename T>
void RopeForward(const RopeGeometry& g, const RopeForwardArgs<T>& args, int64_t begin,
                 int64_t end);

// Floats of scratch (args.partial) the backward needs for dcos/dsin: nonzero
// only when cos broadcasts over a batch larger than 1.
inline int64_t RopeBackwardPartialFloats(const RopeGeometry& g) {
  return g.cos_batch == 1 && g.batch > 1 ? 2 * g.tokens() * g.rotary_dim : 0;
}

// Backward pass 1, tokens [begin, end); half mode only: dquery, dkey and, with
// query/key, each token's dcos/dsin (summed over heads) into dcos/dsin, or into
// args.partial when cos broadcasts over the batch.
template <typename T>
void RopeBackward(const RopeGeometry& g, const RopeBackwardArgs<T>& args, int64_t begin,
                  int64_t end);

// Backward pass 2 (only with args.partial), positions [begin, end) of seq:
// dcos/dsin = the partial rows summed over the batch, in batch order.
template <typename T>
void RopeReduceTables(const RopeGeometry& g, const RopeBackwardArgs<T>& args, int64_t begin,
                      int64_t end);

// Test hook: float16 rows convert with F16C where the CPU has it (the default),
// or with float_convert.h's selects as on CPUs without it (use = false).
void UseF16cForTesting(bool use);

}  // namespace jax_rope::cpu
