// Launch glue for the CANN operators, free of XLA: aclTensor descriptors over
// device buffers, the two-phase GetWorkspaceSize / launch call on the caller's
// stream, workspace from the caller, every descriptor destroyed. Each function
// returns "" on success, else a message carrying aclGetRecentErrMsg.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "device_kernels/common/codes.h"

namespace jax_rope::npu {

// What the caller (an XLA FFI handler) provides: the stream and a workspace
// allocator whose memory lives until the stream has finished the call.
struct Device {
  void* stream = nullptr;
  std::function<void*(uint64_t bytes)> workspace;
};

// A dense row-major device buffer; `dtype` is an aclDataType value.
struct DeviceTensor {
  void* data = nullptr;
  std::vector<int64_t> dims;
  int32_t dtype = 0;
  int64_t bytes() const;
};

// ApplyRotaryPosEmbV2 on copies: query_out/key_out get query/key (device to
// device), then the in-place operator rotates them. A layout without a batch
// axis (TND) goes as the BSND view (T, 1, N, D).
std::string RopeForward(const Device& device, const DeviceTensor& query, const DeviceTensor& key,
                        const DeviceTensor& cos, const DeviceTensor& sin,
                        const DeviceTensor& query_out, const DeviceTensor& key_out,
                        Layout layout, RotaryMode mode);

// ApplyRotaryPosEmbGrad (half mode). query/key and dcos/dsin may be null
// (then the operator's required gradCos/gradSin go to scratch memory).
std::string RopeBackward(const Device& device, const DeviceTensor& grad_query,
                         const DeviceTensor& grad_key, const DeviceTensor& cos,
                         const DeviceTensor& sin, const DeviceTensor* query,
                         const DeviceTensor* key, const DeviceTensor& dquery,
                         const DeviceTensor& dkey, const DeviceTensor* dcos,
                         const DeviceTensor* dsin, Layout layout);

// RotaryPositionEmbeddingGrad (Atlas A2/A3, half mode): one call for the query
// path, one for the key path. With query/key, each call writes its path's
// dcos/dsin, reduced by the operator over the axes where cos broadcasts, into
// dcos_q/dsin_q and dcos_k/dsin_k (the caller adds them, spec/rope.md);
// without, the operator's dcosOut/dsinOut (non-null by its contract) go to
// scratch. BSND goes as it is; TND as the BSND view (1, T, N, D), so that cos
// (1, T, 1, D) is the documented 1S1D case (the (T, 1, N, D) view of the
// forward would be BS1D with B >= S, which the operator does not take).
struct RopeSingleGrads {
  const DeviceTensor* dcos_q = nullptr;
  const DeviceTensor* dsin_q = nullptr;
  const DeviceTensor* dcos_k = nullptr;
  const DeviceTensor* dsin_k = nullptr;
};
std::string RopeBackwardSingle(const Device& device, const DeviceTensor& grad_query,
                               const DeviceTensor& grad_key, const DeviceTensor& cos,
                               const DeviceTensor& sin, const DeviceTensor* query,
                               const DeviceTensor* key, const DeviceTensor& dquery,
                               const DeviceTensor& dkey, const RopeSingleGrads& tables,
                               Layout layout);

// Static attention configuration (jax_rope's AttentionOptions, decoded).
struct AttentionConfig {
  Layout layout = Layout::kBSND;  // SBND goes as SBH; TND to the VarLen operators
  double scale = 1.0;
  SparseMode sparse_mode = SparseMode::kDefaultMask;
  int64_t pre_tokens = 2147483647;
  int64_t next_tokens = 2147483647;
  bool has_mask = false;
  // Positional bias and dropout (spec/attention_bias_dropout.md): pseType
  // (1 without pse), the ALiBi start offsets (types 2/3), keepProb (1: none).
  // pseType 0/2/3 or nonzero offsets need the V2 operators.
  int64_t pse_type = 1;
  int64_t q_start_idx = 0;
  int64_t kv_start_idx = 0;
  double keep_prob = 1.0;
  bool NeedsV2() const { return pse_type != 1 || q_start_idx != 0 || kv_start_idx != 0; }
};

// The optional operands as the operators read them: `pse` (realShift /
// pseShift) in the shapes the tiling accepts (non-TND 4-D (1|B, N1, Sq|1|1024,
// Skv); TND 1-D packed or 4-D compressed; slopes (N1,) or (B, N1) float32),
// `drop_mask` the bit-packed uint8 dropMask. Null: absent.
struct AttentionExtras {
  const DeviceTensor* pse = nullptr;
  const DeviceTensor* drop_mask = nullptr;
};

// FlashAttentionScore (or its VarLen form for TND). `table` is the int32
// (B, 7) sequence table (SequenceBand rows, device_kernels/cpu/attention_kernels.h)
// on the device; it is copied to the host when the operator needs host lists
// (prefix, cumulative sequence lengths).
// softmax_max/sum are the operator's 8-wide float32 statistics. The backward
// passes dpseOut as torch_npu does (pse's shape and dtype, scratch memory:
// the kernels never write it; jax_rope computes dpse itself).
std::string AttentionForward(const Device& device, const AttentionConfig& config,
                             const DeviceTensor& query, const DeviceTensor& key,
                             const DeviceTensor& value, const DeviceTensor& table,
                             const DeviceTensor* mask, const AttentionExtras& extras,
                             const DeviceTensor& out, const DeviceTensor& softmax_max,
                             const DeviceTensor& softmax_sum);

std::string AttentionBackward(const Device& device, const AttentionConfig& config,
                              const DeviceTensor& query, const DeviceTensor& key,
                              const DeviceTensor& value, const DeviceTensor& out,
                              const DeviceTensor& dout, const DeviceTensor& softmax_max,
                              const DeviceTensor& softmax_sum, const DeviceTensor& table,
                              const DeviceTensor* mask, const AttentionExtras& extras,
                              const DeviceTensor& dquery, const DeviceTensor& dkey,
                              const DeviceTensor& dvalue);

}  // namespace jax_rope::npu
