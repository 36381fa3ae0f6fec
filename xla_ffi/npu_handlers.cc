// XLA FFI handlers for the Ascend NPU: decode buffers and attributes, take the
// stream and workspace from XLA, and call the launch glue of device_kernels/npu.
// Each handler exists twice: for the NPU (PlatformStream + ScratchAllocator)
// and as a host twin the tests register for "cpu" to run the same glue against
// the simulated runtime (tests/npu_sim), where device memory is host memory.
#include "xla_ffi/npu_handlers.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "device_kernels/npu/acl_api.h"
#include "device_kernels/npu/launch.h"

namespace ffi = xla::ffi;

namespace jax_rope::ffi_support {
namespace {

using npu::Device;
using npu::DeviceTensor;

int32_t AclType(ffi::DataType type) {
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

DeviceTensor View(const ffi::AnyBuffer& buffer) {
  auto dims = buffer.dimensions();
  return DeviceTensor{buffer.untyped_data(), std::vector<int64_t>(dims.begin(), dims.end()),
                      AclType(buffer.element_type())};
}

ffi::Error Result(const char* op, const std::string& message) {
  if (message.empty()) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_rope NPU ") + op + ": " + message);
}

const char* ModeName(int32_t code) {
  switch (code) {
    case 0: return "half";
    case 1: return "quarter";
    case 2: return "interleave";
    default: return nullptr;
  }
}

// How a handler gets its stream and workspace.
struct NpuContext {
  static Device Make(void* stream, ffi::ScratchAllocator& scratch) {
    Device device;
    device.stream = stream;
    // XLA's scratch memory is stream-ordered: freed when the handler returns,
    // reused only by work queued after ours on the same stream.
    device.workspace = [&scratch](uint64_t bytes) -> void* {
      std::optional<void*> data = scratch.Allocate(bytes, 512);
      return data.has_value() ? *data : nullptr;
    };
    return device;
  }
};

struct HostWorkspace {
  std::vector<std::vector<uint8_t>> blocks;  // lives until the handler returns
  Device Make() {
    Device device;
    device.workspace = [this](uint64_t bytes) -> void* {
      blocks.emplace_back(bytes);
      return blocks.back().data();
    };
    return device;
  }
};

npu::AttentionConfig Config(int32_t layout, float scale, int32_t has_mask, int32_t sparse_mode,
                            int64_t pre_tokens, int64_t next_tokens) {
  npu::AttentionConfig config;
  config.layout = layout;
  config.scale = scale;
  config.has_mask = has_mask != 0;
  config.sparse_mode = sparse_mode;
  config.pre_tokens = pre_tokens;
  config.next_tokens = next_tokens;
  return config;
}

// --- handler bodies, shared by both contexts ---------------------------------

ffi::Error RopeForwardBody(const Device& device, ffi::AnyBuffer query, ffi::AnyBuffer key,
                           ffi::AnyBuffer cos, ffi::AnyBuffer sin, ffi::AnyBuffer query_out,
                           ffi::AnyBuffer key_out, int32_t layout, int32_t rotary_mode) {
  const char* mode = ModeName(rotary_mode);
  if (mode == nullptr) return Result("rope forward", "unknown rotary_mode code");
  if (layout < 1 || layout > 4) return Result("rope forward", "unknown layout code");
  return Result("rope forward",
                npu::RopeForward(device, View(query), View(key), View(cos), View(sin),
                                 View(query_out), View(key_out), layout, mode));
}

ffi::Error RopeBackwardBody(const Device& device, ffi::AnyBuffer grad_query,
                            ffi::AnyBuffer grad_key, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                            const ffi::AnyBuffer* query, const ffi::AnyBuffer* key,
                            ffi::AnyBuffer dquery, ffi::AnyBuffer dkey, ffi::AnyBuffer* dcos,
                            ffi::AnyBuffer* dsin, int32_t layout, int32_t rotary_mode) {
  if (rotary_mode != 0) return Result("rope backward", "the gradient exists for half mode only");
  std::optional<DeviceTensor> q, k, dc, ds;
  if (query != nullptr) {
    q = View(*query); k = View(*key); dc = View(*dcos); ds = View(*dsin);
  }
  return Result("rope backward",
                npu::RopeBackward(device, View(grad_query), View(grad_key), View(cos), View(sin),
                                  q ? &*q : nullptr, k ? &*k : nullptr, View(dquery), View(dkey),
                                  dc ? &*dc : nullptr, ds ? &*ds : nullptr, layout));
}

ffi::Error AttentionForwardBody(const Device& device, ffi::AnyBuffer query, ffi::AnyBuffer key,
                                ffi::AnyBuffer value, ffi::AnyBuffer table, ffi::AnyBuffer mask,
                                ffi::AnyBuffer out, ffi::AnyBuffer softmax_max,
                                ffi::AnyBuffer softmax_sum, const npu::AttentionConfig& config) {
  const DeviceTensor m = View(mask);
  return Result("attention forward",
                npu::AttentionForward(device, config, View(query), View(key), View(value),
                                      View(table), config.has_mask ? &m : nullptr, View(out),
                                      View(softmax_max), View(softmax_sum)));
}

ffi::Error AttentionBackwardBody(const Device& device, ffi::AnyBuffer query, ffi::AnyBuffer key,
                                 ffi::AnyBuffer value, ffi::AnyBuffer out, ffi::AnyBuffer dout,
                                 ffi::AnyBuffer softmax_max, ffi::AnyBuffer softmax_sum,
                                 ffi::AnyBuffer table, ffi::AnyBuffer mask, ffi::AnyBuffer dquery,
                                 ffi::AnyBuffer dkey, ffi::AnyBuffer dvalue,
                                 const npu::AttentionConfig& config) {
  const DeviceTensor m = View(mask);
  return Result("attention backward",
                npu::AttentionBackward(device, config, View(query), View(key), View(value),
                                       View(out), View(dout), View(softmax_max),
                                       View(softmax_sum), View(table),
                                       config.has_mask ? &m : nullptr, View(dquery), View(dkey),
                                       View(dvalue)));
}

}  // namespace

// --- bindings ------------------------------------------------------------------
// The same operands, results and attributes for both contexts; only the
// leading context arguments differ. JAX_ROPE_NPU_BIND prepends them.

#define JAX_ROPE_ROPE_FWD_SIG                                                              \
  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>() \
      .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()                                          \
      .Attr<int32_t>("layout").Attr<int32_t>("rotary_mode")
#define JAX_ROPE_ROPE_BWD_SIG                                                              \
  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>() \
      .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()                                          \
      .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>() \
      .Attr<int32_t>("layout").Attr<int32_t>("rotary_mode")
#define JAX_ROPE_ROPE_BWD_NI_SIG                                                           \
  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>() \
      .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()                                          \
      .Attr<int32_t>("layout").Attr<int32_t>("rotary_mode")
#define JAX_ROPE_ATTN_ATTRS                                                        \
  .Attr<int32_t>("layout").Attr<float>("scale").Attr<int32_t>("has_mask")          \
      .Attr<int32_t>("sparse_mode").Attr<int64_t>("pre_tokens")                     \
      .Attr<int64_t>("next_tokens")
#define JAX_ROPE_ATTN_FWD_SIG                                                              \
  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>() \
      .Arg<ffi::AnyBuffer>()                                                                \
      .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>() JAX_ROPE_ATTN_ATTRS
#define JAX_ROPE_ATTN_BWD_SIG                                                              \
  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>() \
      .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()                    \
      .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()                                          \
      .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>() JAX_ROPE_ATTN_ATTRS

#define JAX_ROPE_NPU_CTX .Ctx<ffi::PlatformStream<void*>>().Ctx<ffi::ScratchAllocator>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxRopeNpuRopeForward,
    [](void* stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer q, ffi::AnyBuffer k,
       ffi::AnyBuffer c, ffi::AnyBuffer s, ffi::Result<ffi::AnyBuffer> qo,
       ffi::Result<ffi::AnyBuffer> ko, int32_t layout, int32_t mode) {
      return RopeForwardBody(NpuContext::Make(stream, scratch), q, k, c, s, *qo, *ko, layout, mode);
    },
    ffi::Ffi::Bind() JAX_ROPE_NPU_CTX JAX_ROPE_ROPE_FWD_SIG);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxRopeNpuRopeBackward,
    [](void* stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer gq, ffi::AnyBuffer gk,
       ffi::AnyBuffer c, ffi::AnyBuffer s, ffi::AnyBuffer q, ffi::AnyBuffer k,
       ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
       ffi::Result<ffi::AnyBuffer> dc, ffi::Result<ffi::AnyBuffer> ds, int32_t layout,
       int32_t mode) {
      return RopeBackwardBody(NpuContext::Make(stream, scratch), gq, gk, c, s, &q, &k, *dq, *dk,
                              &*dc, &*ds, layout, mode);
    },
    ffi::Ffi::Bind() JAX_ROPE_NPU_CTX JAX_ROPE_ROPE_BWD_SIG);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxRopeNpuRopeBackwardNoInputs,
    [](void* stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer gq, ffi::AnyBuffer gk,
       ffi::AnyBuffer c, ffi::AnyBuffer s, ffi::Result<ffi::AnyBuffer> dq,
       ffi::Result<ffi::AnyBuffer> dk, int32_t layout, int32_t mode) {
      return RopeBackwardBody(NpuContext::Make(stream, scratch), gq, gk, c, s, nullptr, nullptr,
                              *dq, *dk, nullptr, nullptr, layout, mode);
    },
    ffi::Ffi::Bind() JAX_ROPE_NPU_CTX JAX_ROPE_ROPE_BWD_NI_SIG);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxRopeNpuAttentionForward,
    [](void* stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer q, ffi::AnyBuffer k,
       ffi::AnyBuffer v, ffi::AnyBuffer table, ffi::AnyBuffer mask,
       ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> smax,
       ffi::Result<ffi::AnyBuffer> ssum, int32_t layout, float scale, int32_t has_mask,
       int32_t sparse_mode, int64_t pre, int64_t next) {
      return AttentionForwardBody(NpuContext::Make(stream, scratch), q, k, v, table, mask, *out,
                                  *smax, *ssum, Config(layout, scale, has_mask, sparse_mode, pre, next));
    },
    ffi::Ffi::Bind() JAX_ROPE_NPU_CTX JAX_ROPE_ATTN_FWD_SIG);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxRopeNpuAttentionBackward,
    [](void* stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer q, ffi::AnyBuffer k,
       ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer dout, ffi::AnyBuffer smax,
       ffi::AnyBuffer ssum, ffi::AnyBuffer table, ffi::AnyBuffer mask,
       ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
       ffi::Result<ffi::AnyBuffer> dv, int32_t layout, float scale, int32_t has_mask,
       int32_t sparse_mode, int64_t pre, int64_t next) {
      return AttentionBackwardBody(NpuContext::Make(stream, scratch), q, k, v, out, dout, smax,
                                   ssum, table, mask, *dq, *dk, *dv,
                                   Config(layout, scale, has_mask, sparse_mode, pre, next));
    },
    ffi::Ffi::Bind() JAX_ROPE_NPU_CTX JAX_ROPE_ATTN_BWD_SIG);

// --- host twins (tests only) ------------------------------------------------------

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxRopeNpuHostRopeForward,
    [](ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer c, ffi::AnyBuffer s,
       ffi::Result<ffi::AnyBuffer> qo, ffi::Result<ffi::AnyBuffer> ko, int32_t layout,
       int32_t mode) {
      HostWorkspace host;
      return RopeForwardBody(host.Make(), q, k, c, s, *qo, *ko, layout, mode);
    },
    ffi::Ffi::Bind() JAX_ROPE_ROPE_FWD_SIG);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxRopeNpuHostRopeBackward,
    [](ffi::AnyBuffer gq, ffi::AnyBuffer gk, ffi::AnyBuffer c, ffi::AnyBuffer s,
       ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::Result<ffi::AnyBuffer> dq,
       ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dc,
       ffi::Result<ffi::AnyBuffer> ds, int32_t layout, int32_t mode) {
      HostWorkspace host;
      return RopeBackwardBody(host.Make(), gq, gk, c, s, &q, &k, *dq, *dk, &*dc, &*ds, layout,
                              mode);
    },
    ffi::Ffi::Bind() JAX_ROPE_ROPE_BWD_SIG);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxRopeNpuHostRopeBackwardNoInputs,
    [](ffi::AnyBuffer gq, ffi::AnyBuffer gk, ffi::AnyBuffer c, ffi::AnyBuffer s,
       ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk, int32_t layout,
       int32_t mode) {
      HostWorkspace host;
      return RopeBackwardBody(host.Make(), gq, gk, c, s, nullptr, nullptr, *dq, *dk, nullptr,
                              nullptr, layout, mode);
    },
    ffi::Ffi::Bind() JAX_ROPE_ROPE_BWD_NI_SIG);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxRopeNpuHostAttentionForward,
    [](ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer table,
       ffi::AnyBuffer mask, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> smax,
       ffi::Result<ffi::AnyBuffer> ssum, int32_t layout, float scale, int32_t has_mask,
       int32_t sparse_mode, int64_t pre, int64_t next) {
      HostWorkspace host;
      return AttentionForwardBody(host.Make(), q, k, v, table, mask, *out, *smax, *ssum,
                                  Config(layout, scale, has_mask, sparse_mode, pre, next));
    },
    ffi::Ffi::Bind() JAX_ROPE_ATTN_FWD_SIG);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxRopeNpuHostAttentionBackward,
    [](ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
       ffi::AnyBuffer dout, ffi::AnyBuffer smax, ffi::AnyBuffer ssum, ffi::AnyBuffer table,
       ffi::AnyBuffer mask, ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
       ffi::Result<ffi::AnyBuffer> dv, int32_t layout, float scale, int32_t has_mask,
       int32_t sparse_mode, int64_t pre, int64_t next) {
      HostWorkspace host;
      return AttentionBackwardBody(host.Make(), q, k, v, out, dout, smax, ssum, table, mask, *dq,
                                   *dk, *dv, Config(layout, scale, has_mask, sparse_mode, pre, next));
    },
    ffi::Ffi::Bind() JAX_ROPE_ATTN_BWD_SIG);

}  // namespace jax_rope::ffi_support
