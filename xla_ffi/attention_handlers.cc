// XLA FFI handlers for masked attention: decode buffers and attributes into an
// AttentionGeometry and re-check every shape and the run-time sequence table
// (attention_decode.cc: varlen lengths may be traced, so only here are their
// values known), then run the tiled kernels of device_kernels/cpu on XLA's
// thread pool. Every handler takes every optional operand (mask, positional
// bias, ALiBi offsets, dropout keys/rows/mask; the lowering passes small
// placeholders for absent ones) and re-checks the ones its attributes select.
#include "xla_ffi/attention_handlers.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "device_kernels/common/layout_roles.h"
#include "device_kernels/cpu/attention_kernels.h"
#include "device_kernels/cpu/thread_scratch.h"
#include "xla_ffi/attention_decode.h"
#include "xla_ffi/dtype_dispatch.h"
#include "xla_ffi/huge_pages.h"
#include "xla_ffi/parallel.h"

namespace ffi = xla::ffi;

namespace jax_rope::ffi_support {
namespace {

using cpu::AttentionGeometry;
using cpu::SequenceBand;
using attention_decode::CheckResult;
using attention_decode::Decode;
using attention_decode::Decoded;
using attention_decode::DecodeBias;
using attention_decode::DecodeDropout;
using attention_decode::Fail;
using attention_decode::StatsDims;


template <typename T>
void Fill(T* data, size_t count, T value) {
  std::fill(data, data + count, value);
}

// Floating-point operations of a pass that does `per_pair` of them for every
// (query row, key column, query head) of every sequence: an upper bound (the
// whole rectangle, masked or not), enough to size the pass's chunks.
double PairWork(const Decoded& d, double per_pair) {
  double pairs = 0.0;
  for (int64_t b = 0; b < d.geometry.batch; ++b) {
    pairs += double(std::max(d.seqs[b].q_len, 0)) * double(std::max(d.seqs[b].kv_len, 0));
  }
  return pairs * double(d.geometry.q_heads) * per_pair;
}

// How a pass of n items doing `work` flops in all is split. A pool thread woken
// for it may start tens of microseconds later, and the caller does not wait
// for it (parallel.h): the chunks it has not taken, the caller takes. So the
// chunks are small (kChunkWork flops, a few microseconds of tile products;
// ParallelFor's threads x 16 at most), and a helper that starts late still
// finds work; a pass takes a thread for each kWorkerWork flops or part of
// them. Cut into two chunks of 4e6 flops or more, as before, a B2 S32 N16 D64
// forward without a mask took 0.075 ms where the helper took one, but 0.14 ms
// in the median call, where the caller ran both. Now (two Zen 4 cores, jitted,
// medians) it takes 0.09 ms against 0.13-0.14, B1 S32 N16 (one thread before)
// 0.05 against 0.075 ms, a causal B2 S32 N16 D64 forward + backward 0.30-0.32
// against 0.33-0.36 ms; from S128 up the passes split as before.
struct Chunking {
  int64_t grain;    // items per chunk
  int64_t workers;  // threads at most, the caller included
};
Chunking ChunkingFor(int64_t n, double work) {
  constexpr double kChunkWork = 2.5e5;
  constexpr double kWorkerWork = 4e6;  // about 40 microseconds of tile products on one core
  const double chunks = std::clamp(work / kChunkWork, 1.0, double(std::max<int64_t>(n, 1)));
  return {(n + int64_t(chunks) - 1) / int64_t(chunks),
          std::max<int64_t>(1, int64_t(std::ceil(work / kWorkerWork)))};
}

// A pass's float32 scratch of `floats` (undefined contents; the calling thread's
// kept buffer when small, cpu::ThreadScratch), or an FFI error when out of memory.
ffi::Error PassScratch(std::optional<cpu::ThreadScratch>& scratch, int64_t floats) {
  try {
    scratch.emplace(cpu::ScratchRole::kPass, floats);
  } catch (const std::bad_alloc&) {
    return OutOfScratch("attention");
  }
  return ffi::Error::Success();
}

// Outputs are fresh buffers more often than not, written once by the kernels:
// with huge-page advice (huge_pages.h) their first touch faults 512x less often
// (jitted B16 S512 N16 D64 causal training step on two AVX2 cores: 39k -> 2k
// page faults, 316 -> 277 ms; at D=256 1229 -> 1068 ms).
void AdviseOutputs(std::initializer_list<ffi::AnyBuffer*> outputs) {
  for (ffi::AnyBuffer* buffer : outputs) {
    AdviseHugePages(buffer->untyped_data(), buffer->size_bytes());
  }
}

// ParallelFor for kernels that allocate their scratch: an allocation failure in
// any chunk becomes an FFI error instead of terminating the process.
template <typename Fn>
ffi::Error GuardedParallelFor(ffi::ThreadPool& pool, int64_t n, double work, const Fn& fn) {
  const Chunking chunking = ChunkingFor(n, work);
  return ParallelForCatchingBadAlloc(pool, n, chunking.grain, fn, chunking.workers)
             ? ffi::Error::Success()
             : OutOfScratch("attention");
}

// Whether the backward runs as one pass over (sequence, kv head) items
// (cpu::AttentionBackwardFused: five tile products instead of seven, the same
// bits as the two passes, so the choice may follow the thread count): when
// those items keep every thread busy and the per-thread dquery accumulator
// (group x q_len x head_dim floats) stays small.
bool UseFusedBackward(const cpu::AttentionGeometry& g, const cpu::SequenceBand* seqs,
                      int64_t threads) {
  const int64_t items = cpu::FusedBackwardWorkItems(g);
  threads = std::max<int64_t>(threads, 1);
  if (items < 2 * threads && items % threads != 0) return false;
  if (items == 0) return false;
  int64_t longest = 0;
  for (int64_t b = 0; b < g.batch; ++b) longest = std::max<int64_t>(longest, seqs[b].q_len);
  const int64_t dp = (g.head_dim + 15) / 16 * 16;
  constexpr int64_t kMaxAccumulatorFloats = int64_t{1} << 25;  // 128 MiB
  return (g.q_heads / g.kv_heads) * longest * dp <= kMaxAccumulatorFloats;
}

}  // namespace

ffi::Error AttentionForwardImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer query, ffi::AnyBuffer key, ffi::AnyBuffer value,
    ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::U8> mask, ffi::AnyBuffer bias,
    ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::U32> drop_keys,
    ffi::Buffer<ffi::U32> drop_rows, ffi::Buffer<ffi::U8> drop_mask,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> softmax_max,
    ffi::Result<ffi::AnyBuffer> softmax_sum, int32_t layout, float scale, int32_t has_mask,
    int32_t bias_kind, int32_t bias_after_scale, int32_t dropout, int64_t keep_threshold,
    float keep_scale) {
  Decoded d;
  JAX_ROPE_RETURN_IF_FAILED(
      Decode(layout, scale, has_mask, query, key, DimsOf(value), table, mask, &d));
  JAX_ROPE_RETURN_IF_FAILED(DecodeBias(bias_kind, bias_after_scale, query, bias, offsets, &d));
  JAX_ROPE_RETURN_IF_FAILED(DecodeDropout(dropout, keep_threshold, keep_scale, drop_keys,
                                          drop_rows, drop_mask, &d));
  if (value.element_type() != query.element_type()) return Fail("value must have query's dtype");
  std::vector<int64_t> out_dims = DimsOf(query);
  out_dims.back() = d.geometry.value_dim;
  for (auto [buffer, dims, dtype, name] :
       {std::tuple{&*out, out_dims, query.element_type(), "attention_out"},
        std::tuple{&*softmax_max, StatsDims(d), ffi::DataType::F32, "softmax_max"},
        std::tuple{&*softmax_sum, StatsDims(d), ffi::DataType::F32, "softmax_sum"}}) {
    JAX_ROPE_RETURN_IF_FAILED(CheckResult(*buffer, dims, dtype, name));
  }
  AdviseOutputs({&*out, &*softmax_max, &*softmax_sum});
  const AttentionGeometry& g = d.geometry;
  ffi::Error status = ffi::Error::Success();
  ffi::Error dispatched = DispatchFloat("attention forward", query.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const cpu::AttentionForwardArgs<T> args{Data<T>(query), Data<T>(key), Data<T>(value),
                                            Data<T>(*out), Data<float>(*softmax_max),
                                            Data<float>(*softmax_sum)};
    if (d.packed) {  // rows outside every sequence keep these values
      Fill(args.out, out->element_count(), cpu::FromFloat<T>(0.0f));
      Fill(args.softmax_max, softmax_max->element_count(), cpu::kMaskValue);
      Fill(args.softmax_sum, softmax_sum->element_count(), cpu::kDeadRowSum);
    }
    const cpu::SplitForwardPlan split = cpu::PlanSplitForward(g, d.seqs);
    const double forward_work = PairWork(d, 2.0 * (g.head_dim + g.value_dim));
    if (split.groups == 0) {
      // The forward reads a head-major copy of K and V where it pays (cpu::CopyKeyValueFirst);
      // without memory for the copy it reads K and V in place.
      cpu::AttentionGeometry read = g;
      read.workers = std::max<int64_t>(pool.num_threads(), 1);  // shapes the work items
      cpu::AttentionForwardArgs<T> read_args = args;
      std::optional<cpu::ThreadScratch> copy;
      if (cpu::CopyKeyValueFirst(read, d.seqs, sizeof(T))) {
        const cpu::KeyValueCopy plan = cpu::HeadMajorKeyValue(read, d.seqs);
        const int64_t bytes = plan.elements * int64_t{sizeof(T)};
        if (PassScratch(copy, (bytes + 3) / 4).success()) {
          AdviseHugePages(copy->data(), bytes);
          T* copied = reinterpret_cast<T*>(copy->data());
          status = GuardedParallelFor(pool, plan.items, double(bytes), [&](int64_t b, int64_t e) {
            cpu::CopyKeyValue(g, d.seqs, plan, args.key, args.value, copied, b, e);
          });
          if (status.failure()) return;
          read.k = plan.k;
          read.v = plan.v;
          read_args.key = copied;
          read_args.value = copied + plan.value_offset;
        }
      }
      status = GuardedParallelFor(pool, cpu::AttentionForwardWorkItems(read, d.seqs), forward_work,
                                  [&](int64_t b, int64_t e) {
        cpu::AttentionForward(read, d.seqs, read_args, b, e);
      });
      return;
    }
    // Short query blocks: key chunks in parallel, then an in-order merge per group.
    std::optional<cpu::ThreadScratch> scratch;
    status = PassScratch(scratch, split.scratch);
    if (status.failure()) return;
    status = GuardedParallelFor(pool, split.items, forward_work, [&](int64_t b, int64_t e) {
      cpu::AttentionForwardSplit(g, d.seqs, args, scratch->data(), b, e);
    });
    if (status.success()) {
      status = GuardedParallelFor(pool, split.groups, double(split.scratch),
                                  [&](int64_t b, int64_t e) {
        cpu::AttentionForwardMerge(g, d.seqs, args, scratch->data(), b, e);
      });
    }
  });
  return dispatched.failure() ? std::move(dispatched) : std::move(status);
}

ffi::Error AttentionScoresImpl(ffi::ThreadPool pool, ffi::AnyBuffer query, ffi::AnyBuffer key,
                               ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::U8> mask,
                               ffi::AnyBuffer bias, ffi::Buffer<ffi::S32> offsets,
                               ffi::Result<ffi::AnyBuffer> scores, int32_t layout, float scale,
                               int32_t has_mask, int32_t bias_kind, int32_t bias_after_scale) {
  Decoded d;
  JAX_ROPE_RETURN_IF_FAILED(
      Decode(layout, scale, has_mask, query, key, DimsOf(key), table, mask, &d));
  JAX_ROPE_RETURN_IF_FAILED(DecodeBias(bias_kind, bias_after_scale, query, bias, offsets, &d));
  const AttentionGeometry& g = d.geometry;
  const std::vector<int64_t> dims =
      d.packed ? std::vector<int64_t>{g.q_heads, d.q_rows, d.kv_rows}
               : std::vector<int64_t>{g.batch, g.q_heads, d.q_rows, d.kv_rows};
  JAX_ROPE_RETURN_IF_FAILED(CheckResult(*scores, dims, ffi::DataType::F32, "scores"));
  const int64_t strides[3] = {d.packed ? 0 : g.q_heads * d.q_rows * d.kv_rows,
                              d.q_rows * d.kv_rows, d.kv_rows};
  AdviseOutputs({&*scores});
  float* data = Data<float>(*scores);
  Fill(data, scores->element_count(), cpu::kMaskValue);
  ffi::Error status = ffi::Error::Success();
  ffi::Error dispatched = DispatchFloat("attention scores", query.element_type(), [&](auto tag) {
    using T = decltype(tag);
    status = GuardedParallelFor(pool, cpu::ForwardWorkItems(g, d.seqs),
                                PairWork(d, 2.0 * g.head_dim), [&](int64_t b, int64_t e) {
      cpu::AttentionScores(g, d.seqs, Data<T>(query), Data<T>(key), data, strides, b, e);
    });
  });
  return dispatched.failure() ? std::move(dispatched) : std::move(status);
}

ffi::Error AttentionBackwardImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer query, ffi::AnyBuffer key, ffi::AnyBuffer value,
    ffi::AnyBuffer out, ffi::AnyBuffer dout, ffi::AnyBuffer softmax_max,
    ffi::AnyBuffer softmax_sum, ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::U8> mask,
    ffi::AnyBuffer bias, ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::U32> drop_keys,
    ffi::Buffer<ffi::U32> drop_rows, ffi::Buffer<ffi::U8> drop_mask,
    ffi::Result<ffi::AnyBuffer> dquery, ffi::Result<ffi::AnyBuffer> dkey,
    ffi::Result<ffi::AnyBuffer> dvalue, int32_t layout, float scale, int32_t has_mask,
    int32_t bias_kind, int32_t bias_after_scale, int32_t dropout, int64_t keep_threshold,
    float keep_scale) {
  Decoded d;
  JAX_ROPE_RETURN_IF_FAILED(
      Decode(layout, scale, has_mask, query, key, DimsOf(value), table, mask, &d));
  JAX_ROPE_RETURN_IF_FAILED(DecodeBias(bias_kind, bias_after_scale, query, bias, offsets, &d));
  JAX_ROPE_RETURN_IF_FAILED(DecodeDropout(dropout, keep_threshold, keep_scale, drop_keys,
                                          drop_rows, drop_mask, &d));
  const ffi::DataType dtype = query.element_type();
  std::vector<int64_t> out_dims = DimsOf(query);
  out_dims.back() = d.geometry.value_dim;
  for (auto [buffer, dims, type, name] :
       {std::tuple{&value, DimsOf(value), dtype, "value"},
        std::tuple{&out, out_dims, dtype, "attention_out"},
        std::tuple{&dout, out_dims, dtype, "grad of attention_out"},
        std::tuple{&softmax_max, StatsDims(d), ffi::DataType::F32, "softmax_max"},
        std::tuple{&softmax_sum, StatsDims(d), ffi::DataType::F32, "softmax_sum"},
        std::tuple{&*dquery, DimsOf(query), dtype, "dquery"},
        std::tuple{&*dkey, DimsOf(key), dtype, "dkey"},
        std::tuple{&*dvalue, DimsOf(value), dtype, "dvalue"}}) {
    JAX_ROPE_RETURN_IF_FAILED(CheckResult(*buffer, dims, type, name));
  }
  AdviseOutputs({&*dquery, &*dkey, &*dvalue});
  const AttentionGeometry& g = d.geometry;
  ffi::Error status = ffi::Error::Success();
  ffi::Error dispatched = DispatchFloat("attention backward", dtype, [&](auto tag) {
    using T = decltype(tag);
    const cpu::AttentionBackwardArgs<T> args{
        Data<T>(query),          Data<T>(key),           Data<T>(value),  Data<T>(out),
        Data<T>(dout),           Data<float>(softmax_max), Data<float>(softmax_sum),
        Data<T>(*dquery),        Data<T>(*dkey),         Data<T>(*dvalue)};
    if (d.packed) {  // rows outside every sequence get zero gradient
      for (auto* buffer : {&*dquery, &*dkey, &*dvalue}) {
        Fill(Data<T>(*buffer), buffer->element_count(), cpu::FromFloat<T>(0.0f));
      }
    }
    std::optional<cpu::ThreadScratch> row_delta;
    status = PassScratch(row_delta, softmax_max.element_count());
    if (status.failure()) return;
    float* delta = row_delta->data();
    const int64_t query_items = cpu::ForwardWorkItems(g, d.seqs);
    // Per pass of the backward: the score, dP and one or two gradient products.
    const double pass_work = PairWork(d, 2.0 * (2 * g.head_dim + g.value_dim));
    if (UseFusedBackward(g, d.seqs, pool.num_threads())) {  // row deltas included
      status = GuardedParallelFor(pool, cpu::FusedBackwardWorkItems(g), pass_work,
                                  [&](int64_t b, int64_t e) {
        cpu::AttentionBackwardFused(g, d.seqs, args, delta, b, e);
      });
      return;
    }
    status = GuardedParallelFor(pool, query_items,
                                2.0 * double(softmax_max.element_count()) * g.value_dim,
                                [&](int64_t b, int64_t e) {
      cpu::AttentionRowDelta(g, d.seqs, args, delta, b, e);
    });
    if (status.success()) {
      status = GuardedParallelFor(pool, cpu::KeyBlockWorkItems(g, d.seqs), pass_work,
                                  [&](int64_t b, int64_t e) {
        cpu::AttentionBackwardKeyValue(g, d.seqs, args, delta, b, e);
      });
    }
    if (status.success()) {
      status = GuardedParallelFor(pool, query_items, pass_work, [&](int64_t b, int64_t e) {
        cpu::AttentionBackwardQuery(g, d.seqs, args, delta, b, e);
      });
    }
  });
  return dispatched.failure() ? std::move(dispatched) : std::move(status);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeAttentionForward, AttentionForwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // query
                                  .Arg<ffi::AnyBuffer>()         // key
                                  .Arg<ffi::AnyBuffer>()         // value
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sequence table
                                  .Arg<ffi::Buffer<ffi::U8>>()   // element mask
                                  .Arg<ffi::AnyBuffer>()         // positional bias
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ALiBi offsets
                                  .Arg<ffi::Buffer<ffi::U32>>()  // dropout keys
                                  .Arg<ffi::Buffer<ffi::U32>>()  // dropout row words
                                  .Arg<ffi::Buffer<ffi::U8>>()   // dropout mask
                                  .Ret<ffi::AnyBuffer>()         // attention_out
                                  .Ret<ffi::AnyBuffer>()         // softmax_max
                                  .Ret<ffi::AnyBuffer>()         // softmax_sum
                                  .Attr<int32_t>("layout")
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("has_mask")
                                  .Attr<int32_t>("bias_kind")
                                  .Attr<int32_t>("bias_after_scale")
                                  .Attr<int32_t>("dropout")
                                  .Attr<int64_t>("keep_threshold")
                                  .Attr<float>("keep_scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeAttentionScores, AttentionScoresImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // query
                                  .Arg<ffi::AnyBuffer>()         // key
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sequence table
                                  .Arg<ffi::Buffer<ffi::U8>>()   // element mask
                                  .Arg<ffi::AnyBuffer>()         // positional bias
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ALiBi offsets
                                  .Ret<ffi::AnyBuffer>()         // scores
                                  .Attr<int32_t>("layout")
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("has_mask")
                                  .Attr<int32_t>("bias_kind")
                                  .Attr<int32_t>("bias_after_scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxRopeAttentionBackward, AttentionBackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // query
                                  .Arg<ffi::AnyBuffer>()         // key
                                  .Arg<ffi::AnyBuffer>()         // value
                                  .Arg<ffi::AnyBuffer>()         // attention_out
                                  .Arg<ffi::AnyBuffer>()         // grad of attention_out
                                  .Arg<ffi::AnyBuffer>()         // softmax_max
                                  .Arg<ffi::AnyBuffer>()         // softmax_sum
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sequence table
                                  .Arg<ffi::Buffer<ffi::U8>>()   // element mask
                                  .Arg<ffi::AnyBuffer>()         // positional bias
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ALiBi offsets
                                  .Arg<ffi::Buffer<ffi::U32>>()  // dropout keys
                                  .Arg<ffi::Buffer<ffi::U32>>()  // dropout row words
                                  .Arg<ffi::Buffer<ffi::U8>>()   // dropout mask
                                  .Ret<ffi::AnyBuffer>()         // dquery
                                  .Ret<ffi::AnyBuffer>()         // dkey
                                  .Ret<ffi::AnyBuffer>()         // dvalue
                                  .Attr<int32_t>("layout")
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("has_mask")
                                  .Attr<int32_t>("bias_kind")
                                  .Attr<int32_t>("bias_after_scale")
                                  .Attr<int32_t>("dropout")
                                  .Attr<int64_t>("keep_threshold")
                                  .Attr<float>("keep_scale"));

}  // namespace jax_rope::ffi_support
