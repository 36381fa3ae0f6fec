// XLA FFI handlers for the fused Q/K RoPE: decode buffers and attributes,
// re-check the shapes, dispatch on dtype and run the CPU kernels on XLA's
// thread pool. The math lives in device_kernels/cpu.
#include "xla_ffi/rope_handlers.h"

#include <algorithm>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "device_kernels/cpu/rope_kernels.h"
#include "xla_ffi/dtype_dispatch.h"
#include "xla_ffi/huge_pages.h"
#include "xla_ffi/parallel.h"

namespace ffi = xla::ffi;

namespace jax_rope::ffi_support {
namespace {

using cpu::RopeGeometry;

ffi::Error InvalidArgument(const char* op, const std::string& message) {
  return ffi::Error::InvalidArgument(std::string("jax_rope ") + op + ": " + message);
}

// Same dtype everywhere and outputs shaped like their inputs.
ffi::Error CheckBuffers(const char* op, const std::vector<NamedBuffer>& inputs,
                        const std::vector<std::pair<NamedBuffer, NamedBuffer>>& outputs) {
  const ffi::DataType dtype = inputs.front().buffer->element_type();
  for (const NamedBuffer& in : inputs) {
    if (in.buffer->element_type() != dtype) {
      return InvalidArgument(op, std::string(in.name) + " must have the dtype of " +
                                inputs.front().name);
    }
  }
  for (const auto& [out, like] : outputs) {
    if (out.buffer->element_type() != dtype || DimsOf(*out.buffer) != DimsOf(*like.buffer)) {
      return InvalidArgument(op, std::string(out.name) + " must have the shape and dtype of " +
                                like.name);
    }
  }
  return ffi::Error::Success();
}

int64_t TokenGrain(const RopeGeometry& g) {
  // About 32K elements per task: enough to amortise scheduling.
  const int64_t per_token = std::max<int64_t>(1, (g.q_heads + g.k_heads) * g.head_dim);
  return std::max<int64_t>(1, 32768 / per_token);
}

// Fresh outputs from this size on are streamed to memory (RopeForwardArgs::
// stream_outputs; the backward's dquery and dkey too). Jitted forward, B4 S2048
// Nq16 Nk4 D128 on two Zen 4 cores (32 MiB L3), old and new builds alternated
// three times (medians): float32, 84 MB of outputs, 8.1-11.3 -> 6.7-7.6 ms into
// fresh pages and 3.2-5.2 -> 2.7-3.1 ms with malloc keeping freed memory; the
// forward+backward with the backward's outputs streamed as well, 20.6-28.9 ->
// 17.7-20.7 ms (fresh; freed memory kept: 10.9-12.4 -> 10.9-11.3). Streamed from
// 32 MiB on, bfloat16 (42 MB, freed memory kept) went 1.9-2.3 -> 2.2-2.8 ms:
// outputs of that size partly stay in the cache for the next call, whose
// buffers malloc hands out at the same addresses.
constexpr int64_t kStreamOutputBytes = int64_t{64} << 20;

}  // namespace

ffi::Error RopeForward(ffi::ThreadPool pool, ffi::AnyBuffer query, ffi::AnyBuffer key,
                       ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                       ffi::Result<ffi::AnyBuffer> query_out,
                       ffi::Result<ffi::AnyBuffer> key_out, int32_t layout,
                       int32_t rotary_mode) {
  constexpr const char* kOp = "rope forward";
  RopeGeometry g;
  std::string message = cpu::MakeRopeGeometry(layout, rotary_mode, DimsOf(query),
                                              DimsOf(key), DimsOf(cos), DimsOf(sin), &g);
  if (!message.empty()) return InvalidArgument(kOp, message);
  JAX_ROPE_RETURN_IF_FAILED(CheckBuffers(
      kOp, {{"query", &query}, {"key", &key}, {"cos", &cos}, {"sin", &sin}},
      {{{"query_out", &*query_out}, {"query", &query}}, {{"key_out", &*key_out}, {"key", &key}}}));
  // Aliased outputs (in_place: XLA passes the input buffer as the output) are
  // written in place; only fresh output buffers get the huge-page advice, and
  // large ones are streamed.
  bool fresh = true;
  for (auto [out, in] : {std::pair{&*query_out, &query}, std::pair{&*key_out, &key}}) {
    if (out->untyped_data() != in->untyped_data()) {
      AdviseHugePages(out->untyped_data(), out->size_bytes());
    } else {
      fresh = false;
    }
  }
  const bool stream =
      fresh && int64_t(query_out->size_bytes() + key_out->size_bytes()) >= kStreamOutputBytes;
  bool ran = true;
  JAX_ROPE_RETURN_IF_FAILED(DispatchFloat(kOp, query.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const cpu::RopeForwardArgs<T> args{Data<T>(query),      Data<T>(key),        Data<T>(cos),
                                       Data<T>(sin),        Data<T>(*query_out), Data<T>(*key_out),
                                       stream};
    ran = ParallelForCatchingBadAlloc(pool, g.tokens(), TokenGrain(g),
                                      [&](int64_t begin, int64_t end) {
                                        cpu::RopeForward(g, args, begin, end);
                                      });
  }));
  return ran ? ffi::Error::Success() : OutOfScratch("rope");
}

ffi::Error RopeBackward(ffi::ThreadPool pool, ffi::AnyBuffer grad_query,
                        ffi::AnyBuffer grad_key, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                        const ffi::AnyBuffer* query, const ffi::AnyBuffer* key,
                        ffi::AnyBuffer dquery, ffi::AnyBuffer dkey, ffi::AnyBuffer* dcos,
                        ffi::AnyBuffer* dsin, int32_t layout, int32_t rotary_mode) {
  constexpr const char* kOp = "rope backward";
  if (rotary_mode != static_cast<int32_t>(RotaryMode::kHalf)) {
    return InvalidArgument(kOp, "the gradient exists for rotary_mode half (0) only, got code " +
                               std::to_string(rotary_mode));
  }
  RopeGeometry g;
  std::string message =
      cpu::MakeRopeGeometry(layout, rotary_mode, DimsOf(grad_query), DimsOf(grad_key),
                            DimsOf(cos), DimsOf(sin), &g);
  if (!message.empty()) return InvalidArgument(kOp, message);
  std::vector<NamedBuffer> inputs = {
      {"grad_query", &grad_query}, {"grad_key", &grad_key}, {"cos", &cos}, {"sin", &sin}};
  std::vector<std::pair<NamedBuffer, NamedBuffer>> outputs = {
      {{"dquery", &dquery}, {"grad_query", &grad_query}},
      {{"dkey", &dkey}, {"grad_key", &grad_key}}};
  if (query != nullptr) {
    outputs.push_back({{"query", query}, {"grad_query", &grad_query}});
    outputs.push_back({{"key", key}, {"grad_key", &grad_key}});
    outputs.push_back({{"dcos", dcos}, {"cos", &cos}});
    outputs.push_back({{"dsin", dsin}, {"sin", &sin}});
  }
  JAX_ROPE_RETURN_IF_FAILED(CheckBuffers(kOp, inputs, outputs));
  for (ffi::AnyBuffer* out : {&dquery, &dkey}) {
    AdviseHugePages(out->untyped_data(), out->size_bytes());
  }
  const bool stream = dquery.untyped_data() != grad_query.untyped_data() &&
                      dkey.untyped_data() != grad_key.untyped_data() &&
                      int64_t(dquery.size_bytes() + dkey.size_bytes()) >= kStreamOutputBytes;
  bool ran = true;
  JAX_ROPE_RETURN_IF_FAILED(DispatchFloat(kOp, grad_query.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const bool with_inputs = query != nullptr;
    cpu::RopeBackwardArgs<T> args{
        Data<T>(grad_query),
        Data<T>(grad_key),
        Data<T>(cos),
        Data<T>(sin),
        with_inputs ? Data<T>(*query) : nullptr,
        with_inputs ? Data<T>(*key) : nullptr,
        Data<T>(dquery),
        Data<T>(dkey),
        with_inputs ? Data<T>(*dcos) : nullptr,
        with_inputs ? Data<T>(*dsin) : nullptr};
    std::vector<float> partial;
    try {
      partial.resize(with_inputs ? cpu::RopeBackwardPartialFloats(g) : 0);
    } catch (const std::bad_alloc&) {
      ran = false;
      return;
    }
    args.partial = partial.empty() ? nullptr : partial.data();
    args.stream_outputs = stream;
    ran = ParallelForCatchingBadAlloc(pool, g.tokens(), TokenGrain(g),
                                      [&](int64_t begin, int64_t end) {
                                        cpu::RopeBackward(g, args, begin, end);
                                      });
    if (ran && args.partial != nullptr) {  // dcos/dsin: sum the per-token rows over the batch
      ran = ParallelForCatchingBadAlloc(
          pool, g.seq, std::max<int64_t>(1, 32768 / (2 * g.batch * g.rotary_dim)),
          [&](int64_t begin, int64_t end) { cpu::RopeReduceTables(g, args, begin, end); });
    }
  }));
  return ran ? ffi::Error::Success() : OutOfScratch("rope");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeRopeForward, RopeForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // query
                                  .Arg<ffi::AnyBuffer>()  // key
                                  .Arg<ffi::AnyBuffer>()  // cos
                                  .Arg<ffi::AnyBuffer>()  // sin
                                  .Ret<ffi::AnyBuffer>()  // query_out
                                  .Ret<ffi::AnyBuffer>()  // key_out
                                  .Attr<int32_t>("layout")
                                  .Attr<int32_t>("rotary_mode"));

static ffi::Error RopeBackwardWithInputs(
    ffi::ThreadPool pool, ffi::AnyBuffer grad_query, ffi::AnyBuffer grad_key,
    ffi::AnyBuffer cos, ffi::AnyBuffer sin, ffi::AnyBuffer query, ffi::AnyBuffer key,
    ffi::Result<ffi::AnyBuffer> dquery, ffi::Result<ffi::AnyBuffer> dkey,
    ffi::Result<ffi::AnyBuffer> dcos, ffi::Result<ffi::AnyBuffer> dsin, int32_t layout,
    int32_t rotary_mode) {
  return RopeBackward(pool, grad_query, grad_key, cos, sin, &query, &key, *dquery, *dkey,
                      &*dcos, &*dsin, layout, rotary_mode);
}

static ffi::Error RopeBackwardNoInputs(ffi::ThreadPool pool, ffi::AnyBuffer grad_query,
                                       ffi::AnyBuffer grad_key, ffi::AnyBuffer cos,
                                       ffi::AnyBuffer sin,
                                       ffi::Result<ffi::AnyBuffer> dquery,
                                       ffi::Result<ffi::AnyBuffer> dkey, int32_t layout,
                                       int32_t rotary_mode) {
  return RopeBackward(pool, grad_query, grad_key, cos, sin, nullptr, nullptr, *dquery,
                      *dkey, nullptr, nullptr, layout, rotary_mode);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeRopeBackward, RopeBackwardWithInputs,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // grad_query
                                  .Arg<ffi::AnyBuffer>()  // grad_key
                                  .Arg<ffi::AnyBuffer>()  // cos
                                  .Arg<ffi::AnyBuffer>()  // sin
                                  .Arg<ffi::AnyBuffer>()  // query
                                  .Arg<ffi::AnyBuffer>()  // key
                                  .Ret<ffi::AnyBuffer>()  // dquery
                                  .Ret<ffi::AnyBuffer>()  // dkey
                                  .Ret<ffi::AnyBuffer>()  // dcos
                                  .Ret<ffi::AnyBuffer>()  // dsin
                                  .Attr<int32_t>("layout")
                                  .Attr<int32_t>("rotary_mode"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeRopeBackwardNoInputs, RopeBackwardNoInputs,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // grad_query
                                  .Arg<ffi::AnyBuffer>()  // grad_key
                                  .Arg<ffi::AnyBuffer>()  // cos
                                  .Arg<ffi::AnyBuffer>()  // sin
                                  .Ret<ffi::AnyBuffer>()  // dquery
                                  .Ret<ffi::AnyBuffer>()  // dkey
                                  .Attr<int32_t>("layout")
                                  .Attr<int32_t>("rotary_mode"));

}  // namespace jax_rope::ffi_support
