// The NPU handlers, written once for any device context: decode buffers and
// attributes, call the launch glue of device_kernels/npu, turn its message
// into an FFI error. `NpuHandlers<Context, CtxArgs...>` takes the handler's
// context arguments (CtxArgs, bound by Context::Bind()) first and builds the
// glue's Device from them with `Context context(ctx...)`. The shipped handlers
// (npu_handlers.cc) use XLA's stream and scratch allocator; the tests' host
// twins (tests/npu_sim/host_handlers.cc) use host memory and no stream.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "device_kernels/common/codes.h"
#include "device_kernels/npu/acl_api.h"
#include "device_kernels/npu/launch.h"
#include "xla/ffi/api/ffi.h"

namespace jax_rope::ffi_support::npu_handlers {

namespace ffi = xla::ffi;
using npu::DeviceTensor;

inline int32_t AclType(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32: return kAclFloat;
    case ffi::DataType::F16: return kAclFloat16;
    case ffi::DataType::BF16: return kAclBFloat16;
    case ffi::DataType::S32: return kAclInt32;
    case ffi::DataType::U8: return kAclUint8;
    case ffi::DataType::PRED: return kAclBool;
    default: return -1;
  }
}

inline DeviceTensor View(const ffi::AnyBuffer& buffer) {
  auto dims = buffer.dimensions();
  return DeviceTensor{buffer.untyped_data(), std::vector<int64_t>(dims.begin(), dims.end()),
                      AclType(buffer.element_type())};
}

// The glue's message ("" on success) as the handler's result.
inline ffi::Error ToFfiError(const char* op, const std::string& message) {
  if (message.empty()) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_rope NPU ") + op + ": " + message);
}

// --- bodies, shared by every context -------------------------------------------

inline ffi::Error RopeForward(const npu::Device& device, ffi::AnyBuffer query, ffi::AnyBuffer key,
                              ffi::AnyBuffer cos, ffi::AnyBuffer sin, ffi::AnyBuffer query_out,
                              ffi::AnyBuffer key_out, int32_t layout_code, int32_t mode_code) {
  RotaryMode mode;
  if (!ToRotaryMode(mode_code, &mode)) return ToFfiError("rope forward", "unknown rotary_mode code");
  Layout layout;
  if (!ToLayout(layout_code, &layout)) return ToFfiError("rope forward", "unknown layout code");
  return ToFfiError("rope forward",
                    npu::RopeForward(device, View(query), View(key), View(cos), View(sin),
                                     View(query_out), View(key_out), layout, mode));
}

inline ffi::Error RopeBackward(const npu::Device& device, ffi::AnyBuffer grad_query,
                               ffi::AnyBuffer grad_key, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                               const ffi::AnyBuffer* query, const ffi::AnyBuffer* key,
                               ffi::AnyBuffer dquery, ffi::AnyBuffer dkey, ffi::AnyBuffer* dcos,
                               ffi::AnyBuffer* dsin, int32_t layout_code, int32_t mode_code) {
  if (mode_code != static_cast<int32_t>(RotaryMode::kHalf)) {
    return ToFfiError("rope backward", "the gradient exists for half mode only");
  }
  Layout layout;
  if (!ToLayout(layout_code, &layout)) return ToFfiError("rope backward", "unknown layout code");
  std::optional<DeviceTensor> q, k, dc, ds;
  if (query != nullptr) {
    q = View(*query); k = View(*key); dc = View(*dcos); ds = View(*dsin);
  }
  return ToFfiError("rope backward",
                    npu::RopeBackward(device, View(grad_query), View(grad_key), View(cos),
                                      View(sin), q ? &*q : nullptr, k ? &*k : nullptr,
                                      View(dquery), View(dkey), dc ? &*dc : nullptr,
                                      ds ? &*ds : nullptr, layout));
}

// The single-tensor backward (aclnnRotaryPositionEmbeddingGrad, Atlas A2/A3):
// per-path dcos/dsin, added by the lowering (see launch.h).
inline ffi::Error RopeBackwardSingle(const npu::Device& device, ffi::AnyBuffer grad_query,
                                     ffi::AnyBuffer grad_key, ffi::AnyBuffer cos,
                                     ffi::AnyBuffer sin, const ffi::AnyBuffer* query,
                                     const ffi::AnyBuffer* key, ffi::AnyBuffer dquery,
                                     ffi::AnyBuffer dkey, ffi::AnyBuffer* const* tables,
                                     int32_t layout_code, int32_t mode_code) {
  if (mode_code != static_cast<int32_t>(RotaryMode::kHalf)) {
    return ToFfiError("rope backward", "the gradient exists for half mode only");
  }
  Layout layout;
  if (!ToLayout(layout_code, &layout)) return ToFfiError("rope backward", "unknown layout code");
  std::optional<DeviceTensor> q, k, t[4];
  npu::RopeSingleGrads grads;
  if (query != nullptr) {
    q = View(*query); k = View(*key);
    for (int i = 0; i < 4; ++i) t[i] = View(*tables[i]);
    grads = {&*t[0], &*t[1], &*t[2], &*t[3]};
  }
  return ToFfiError("rope backward",
                    npu::RopeBackwardSingle(device, View(grad_query), View(grad_key), View(cos),
                                            View(sin), q ? &*q : nullptr, k ? &*k : nullptr,
                                            View(dquery), View(dkey), grads, layout));
}

// The attention attributes decoded; false (and `why`) for an unknown code.
inline bool DecodeAttention(int32_t layout, float scale, int32_t has_mask, int32_t sparse_mode,
                            int64_t pre_tokens, int64_t next_tokens, npu::AttentionConfig* config,
                            std::string* why) {
  if (!ToLayout(layout, &config->layout)) {
    *why = "unknown layout code " + std::to_string(layout);
    return false;
  }
  if (!ToSparseMode(sparse_mode, &config->sparse_mode)) {
    *why = "unknown sparse_mode code " + std::to_string(sparse_mode);
    return false;
  }
  config->scale = scale;
  config->has_mask = has_mask != 0;
  config->pre_tokens = pre_tokens;
  config->next_tokens = next_tokens;
  return true;
}

// Positional bias and dropout attributes; false (and `why`) when out of range.
inline bool DecodeBiasDropout(int32_t has_pse, int32_t pse_type, int64_t q_start_idx,
                              int64_t kv_start_idx, double keep_prob,
                              npu::AttentionConfig* config, std::string* why) {
  if (pse_type < 0 || pse_type > 3 || (has_pse == 0 && pse_type != 1)) {
    *why = "pse_type " + std::to_string(pse_type) + (has_pse ? "" : " without pse");
    return false;
  }
  if (!(keep_prob > 0.0 && keep_prob <= 1.0)) {
    *why = "keep_prob must be in (0, 1], got " + std::to_string(keep_prob);
    return false;
  }
  config->pse_type = pse_type;
  config->q_start_idx = q_start_idx;
  config->kv_start_idx = kv_start_idx;
  config->keep_prob = keep_prob;
  return true;
}

// --- the handlers, per context ----------------------------------------------------

template <typename Context, typename... CtxArgs>
struct NpuHandlers {
  static ffi::Error RopeForwardHandler(CtxArgs... ctx, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                       ffi::AnyBuffer c, ffi::AnyBuffer s,
                                       ffi::Result<ffi::AnyBuffer> qo,
                                       ffi::Result<ffi::AnyBuffer> ko, int32_t layout,
                                       int32_t mode) {
    Context context(ctx...);
    return RopeForward(context.device, q, k, c, s, *qo, *ko, layout, mode);
  }

  static ffi::Error RopeBackwardHandler(CtxArgs... ctx, ffi::AnyBuffer gq, ffi::AnyBuffer gk,
                                        ffi::AnyBuffer c, ffi::AnyBuffer s, ffi::AnyBuffer q,
                                        ffi::AnyBuffer k, ffi::Result<ffi::AnyBuffer> dq,
                                        ffi::Result<ffi::AnyBuffer> dk,
                                        ffi::Result<ffi::AnyBuffer> dc,
                                        ffi::Result<ffi::AnyBuffer> ds, int32_t layout,
                                        int32_t mode) {
    Context context(ctx...);
    return RopeBackward(context.device, gq, gk, c, s, &q, &k, *dq, *dk, &*dc, &*ds, layout, mode);
  }

  static ffi::Error RopeBackwardNoInputsHandler(CtxArgs... ctx, ffi::AnyBuffer gq,
                                                ffi::AnyBuffer gk, ffi::AnyBuffer c,
                                                ffi::AnyBuffer s, ffi::Result<ffi::AnyBuffer> dq,
                                                ffi::Result<ffi::AnyBuffer> dk, int32_t layout,
                                                int32_t mode) {
    Context context(ctx...);
    return RopeBackward(context.device, gq, gk, c, s, nullptr, nullptr, *dq, *dk, nullptr,
                        nullptr, layout, mode);
  }

  static ffi::Error RopeBackwardSingleHandler(
      CtxArgs... ctx, ffi::AnyBuffer gq, ffi::AnyBuffer gk, ffi::AnyBuffer c, ffi::AnyBuffer s,
      ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::Result<ffi::AnyBuffer> dq,
      ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dcos_q,
      ffi::Result<ffi::AnyBuffer> dsin_q, ffi::Result<ffi::AnyBuffer> dcos_k,
      ffi::Result<ffi::AnyBuffer> dsin_k, int32_t layout, int32_t mode) {
    Context context(ctx...);
    ffi::AnyBuffer* tables[] = {&*dcos_q, &*dsin_q, &*dcos_k, &*dsin_k};
    return RopeBackwardSingle(context.device, gq, gk, c, s, &q, &k, *dq, *dk, tables, layout,
                              mode);
  }

  static ffi::Error RopeBackwardSingleNoInputsHandler(
      CtxArgs... ctx, ffi::AnyBuffer gq, ffi::AnyBuffer gk, ffi::AnyBuffer c, ffi::AnyBuffer s,
      ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk, int32_t layout,
      int32_t mode) {
    Context context(ctx...);
    return RopeBackwardSingle(context.device, gq, gk, c, s, nullptr, nullptr, *dq, *dk, nullptr,
                              layout, mode);
  }

  static ffi::Error AttentionForwardHandler(
      CtxArgs... ctx, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer table,
      ffi::AnyBuffer mask, ffi::AnyBuffer pse, ffi::AnyBuffer drop_mask,
      ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> smax,
      ffi::Result<ffi::AnyBuffer> ssum, int32_t layout, float scale, int32_t has_mask,
      int32_t sparse_mode, int64_t pre, int64_t next, int32_t has_pse, int32_t pse_type,
      int64_t q_start_idx, int64_t kv_start_idx, double keep_prob) {
    npu::AttentionConfig config;
    std::string why;
    if (!DecodeAttention(layout, scale, has_mask, sparse_mode, pre, next, &config, &why) ||
        !DecodeBiasDropout(has_pse, pse_type, q_start_idx, kv_start_idx, keep_prob, &config,
                           &why)) {
      return ToFfiError("attention forward", why);
    }
    Context context(ctx...);
    const DeviceTensor m = View(mask), p = View(pse), d = View(drop_mask);
    const npu::AttentionExtras extras{has_pse ? &p : nullptr, keep_prob < 1.0 ? &d : nullptr};
    return ToFfiError("attention forward",
                      npu::AttentionForward(context.device, config, View(q), View(k), View(v),
                                            View(table), config.has_mask ? &m : nullptr, extras,
                                            View(*out), View(*smax), View(*ssum)));
  }

  static ffi::Error AttentionBackwardHandler(
      CtxArgs... ctx, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
      ffi::AnyBuffer dout, ffi::AnyBuffer smax, ffi::AnyBuffer ssum, ffi::AnyBuffer table,
      ffi::AnyBuffer mask, ffi::AnyBuffer pse, ffi::AnyBuffer drop_mask,
      ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
      ffi::Result<ffi::AnyBuffer> dv, int32_t layout, float scale, int32_t has_mask,
      int32_t sparse_mode, int64_t pre, int64_t next, int32_t has_pse, int32_t pse_type,
      int64_t q_start_idx, int64_t kv_start_idx, double keep_prob) {
    npu::AttentionConfig config;
    std::string why;
    if (!DecodeAttention(layout, scale, has_mask, sparse_mode, pre, next, &config, &why) ||
        !DecodeBiasDropout(has_pse, pse_type, q_start_idx, kv_start_idx, keep_prob, &config,
                           &why)) {
      return ToFfiError("attention backward", why);
    }
    Context context(ctx...);
    const DeviceTensor m = View(mask), p = View(pse), d = View(drop_mask);
    const npu::AttentionExtras extras{has_pse ? &p : nullptr, keep_prob < 1.0 ? &d : nullptr};
    return ToFfiError("attention backward",
                      npu::AttentionBackward(context.device, config, View(q), View(k), View(v),
                                             View(out), View(dout), View(smax), View(ssum),
                                             View(table), config.has_mask ? &m : nullptr, extras,
                                             View(*dq), View(*dk), View(*dv)));
  }

  // --- bindings: the context's arguments, then operands, results, attributes ---

  static auto RopeForwardBinding() {
    return Context::Bind()
        .template Arg<ffi::AnyBuffer>()  // query
        .template Arg<ffi::AnyBuffer>()  // key
        .template Arg<ffi::AnyBuffer>()  // cos
        .template Arg<ffi::AnyBuffer>()  // sin
        .template Ret<ffi::AnyBuffer>()  // query_out
        .template Ret<ffi::AnyBuffer>()  // key_out
        .template Attr<int32_t>("layout")
        .template Attr<int32_t>("rotary_mode");
  }

  static auto RopeBackwardBinding() {
    return Context::Bind()
        .template Arg<ffi::AnyBuffer>()  // grad_query
        .template Arg<ffi::AnyBuffer>()  // grad_key
        .template Arg<ffi::AnyBuffer>()  // cos
        .template Arg<ffi::AnyBuffer>()  // sin
        .template Arg<ffi::AnyBuffer>()  // query
        .template Arg<ffi::AnyBuffer>()  // key
        .template Ret<ffi::AnyBuffer>()  // dquery
        .template Ret<ffi::AnyBuffer>()  // dkey
        .template Ret<ffi::AnyBuffer>()  // dcos
        .template Ret<ffi::AnyBuffer>()  // dsin
        .template Attr<int32_t>("layout")
        .template Attr<int32_t>("rotary_mode");
  }

  static auto RopeBackwardNoInputsBinding() {
    return Context::Bind()
        .template Arg<ffi::AnyBuffer>()  // grad_query
        .template Arg<ffi::AnyBuffer>()  // grad_key
        .template Arg<ffi::AnyBuffer>()  // cos
        .template Arg<ffi::AnyBuffer>()  // sin
        .template Ret<ffi::AnyBuffer>()  // dquery
        .template Ret<ffi::AnyBuffer>()  // dkey
        .template Attr<int32_t>("layout")
        .template Attr<int32_t>("rotary_mode");
  }

  // dquery, dkey, then dcos/dsin of the query path and of the key path.
  static auto RopeBackwardSingleBinding() {
    return Context::Bind()
        .template Arg<ffi::AnyBuffer>()  // grad_query
        .template Arg<ffi::AnyBuffer>()  // grad_key
        .template Arg<ffi::AnyBuffer>()  // cos
        .template Arg<ffi::AnyBuffer>()  // sin
        .template Arg<ffi::AnyBuffer>()  // query
        .template Arg<ffi::AnyBuffer>()  // key
        .template Ret<ffi::AnyBuffer>()  // dquery
        .template Ret<ffi::AnyBuffer>()  // dkey
        .template Ret<ffi::AnyBuffer>()  // dcos, query path
        .template Ret<ffi::AnyBuffer>()  // dsin, query path
        .template Ret<ffi::AnyBuffer>()  // dcos, key path
        .template Ret<ffi::AnyBuffer>()  // dsin, key path
        .template Attr<int32_t>("layout")
        .template Attr<int32_t>("rotary_mode");
  }

  template <typename Binding>
  static auto AttentionAttrs(Binding binding) {
    return std::move(binding).template Attr<int32_t>("layout")
        .template Attr<float>("scale")
        .template Attr<int32_t>("has_mask")
        .template Attr<int32_t>("sparse_mode")
        .template Attr<int64_t>("pre_tokens")
        .template Attr<int64_t>("next_tokens")
        .template Attr<int32_t>("has_pse")
        .template Attr<int32_t>("pse_type")
        .template Attr<int64_t>("q_start_idx")
        .template Attr<int64_t>("kv_start_idx")
        .template Attr<double>("keep_prob");
  }

  static auto AttentionForwardBinding() {
    return AttentionAttrs(Context::Bind()
                              .template Arg<ffi::AnyBuffer>()    // query
                              .template Arg<ffi::AnyBuffer>()    // key
                              .template Arg<ffi::AnyBuffer>()    // value
                              .template Arg<ffi::AnyBuffer>()    // sequence table
                              .template Arg<ffi::AnyBuffer>()    // mask
                              .template Arg<ffi::AnyBuffer>()    // pse (as the operator reads it)
                              .template Arg<ffi::AnyBuffer>()    // dropMask (packed bits)
                              .template Ret<ffi::AnyBuffer>()    // attention_out
                              .template Ret<ffi::AnyBuffer>()    // softmax_max
                              .template Ret<ffi::AnyBuffer>());  // softmax_sum
  }

  static auto AttentionBackwardBinding() {
    return AttentionAttrs(Context::Bind()
                              .template Arg<ffi::AnyBuffer>()    // query
                              .template Arg<ffi::AnyBuffer>()    // key
                              .template Arg<ffi::AnyBuffer>()    // value
                              .template Arg<ffi::AnyBuffer>()    // out
                              .template Arg<ffi::AnyBuffer>()    // dout
                              .template Arg<ffi::AnyBuffer>()    // softmax_max
                              .template Arg<ffi::AnyBuffer>()    // softmax_sum
                              .template Arg<ffi::AnyBuffer>()    // sequence table
                              .template Arg<ffi::AnyBuffer>()    // mask
                              .template Arg<ffi::AnyBuffer>()    // pse (as the operator reads it)
                              .template Arg<ffi::AnyBuffer>()    // dropMask (packed bits)
                              .template Ret<ffi::AnyBuffer>()    // dquery
                              .template Ret<ffi::AnyBuffer>()    // dkey
                              .template Ret<ffi::AnyBuffer>());  // dvalue
  }
};

}  // namespace jax_rope::ffi_support::npu_handlers
