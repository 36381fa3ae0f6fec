// The simulated operator libraries (tests only): the aclnn entry points
// jax_rope calls, over host memory, checked against the documented contract
// of the generation (JAX_ROPE_SIM_CANN: 80, 85 or 90) and the chip
// (aclrtGetSocName), then computed with jax_rope's CPU kernels as the real
// operator computes (which is not always what was asked: the Atlas A2/A3/310P
// RoPE kernel ignores rotaryMode). A violation returns an error status with a
// message for aclGetRecentErrMsg. The attention operators live in attention.cc.
//
// Generations, as the audit (shared/reference/cann_glue_audit.md) documents them:
//   80: one monolithic libopapi.so with the FlashAttention family only (V1
//       and the V2 forms with pseType/qStartIdx/kvStartIdx, no
//       aclnnApplyRotaryPosEmbV2, no aclnnApplyRotaryPosEmbGrad);
//   85: split install: libopapi_transformer.so with FlashAttention,
//       ApplyRotaryPosEmbV2 (every RoPE D of query, key, cos equal) and the
//       single-tensor RotaryPositionEmbeddingGrad (rope_grad.cc, A2/A3);
//   90: split install, also ApplyRotaryPosEmbGrad (Ascend 950 only), and
//       the tiling accepts partial rotary (cos D < query D).
#include <array>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "device_kernels/cpu/rope_kernels.h"
#include "device_kernels/npu/acl_api.h"
#include "tests/npu_sim/sim.h"

#ifndef JAX_ROPE_SIM_CANN
#error "JAX_ROPE_SIM_CANN (80, 85 or 90) must be defined"
#endif

namespace {

using jax_rope_sim::Chip;
using jax_rope_sim::Shape;
using jax_rope_sim::Shared;
using jax_rope_sim::Tensor;

constexpr int kGeneration = JAX_ROPE_SIM_CANN;

// The generation is what this library is; the core needs it for memcpy.
__attribute__((constructor)) void RegisterGeneration() { Shared().generation = kGeneration; }

struct Executor : jax_rope_sim::ExecutorBase {
  std::string op;
  uint64_t workspace = 0;
  std::vector<const Tensor*> t;  // operands in the operator's order (null: absent)
  int64_t layout = 0;
  std::string mode;
  std::shared_ptr<jax_rope_sim::AttentionPlan> attention;  // attention operators only
};

constexpr aclnnStatus kNullptr = 161001, kInvalid = 161002;

aclnnStatus Fail(aclnnStatus status, const std::string& message) {
  Shared().error = "EZ9999 simulated CANN: " + message;
  return status;
}

bool Live(const aclTensor* t) { return t == nullptr || Shared().tensors.count(t) != 0; }
const Tensor* T(const aclTensor* t) { return reinterpret_cast<const Tensor*>(t); }
std::string S(int64_t v) { return std::to_string(v); }

aclOpExecutor* Register(Executor* e) {
  jax_rope_sim::ExecutorBase* base = e;
  Shared().executors.insert(base);
  return reinterpret_cast<aclOpExecutor*>(base);
}

// --- the RoPE contract ---------------------------------------------------------

int64_t ElementSize(int32_t dtype) { return dtype == kAclFloat ? 4 : 2; }

// Atlas A2/A3/310P (ApplyRotaryPosEmbV2 docs and the old-chip tiling): layout
// 1 (BSND) or 4 (TND); D of query/key in {64, 128}; cos D equal to it (the
// 2026 tiling: cos D in {64, 128} and <= query D); B and S of cos equal
// query's; Nq + Nk <= 255; the per-token UB formula; 310P without bfloat16.
// rotaryMode is not read: the kernel computes half whatever it says.
std::string CheckOldChip(const Tensor* q, const Tensor* k, const Tensor* c, int64_t layout, Chip chip) {
  if (layout != 1 && layout != 4) return "layout is not 1 or 4, got " + S(layout);
  const size_t rank = layout == 4 ? 3 : 4;
  for (const Tensor* t : {q, k, c}) {
    if (t->dims.size() != rank) return "layout " + S(layout) + " needs " + S(rank) + "-D tensors, got " + Shape(t);
  }
  if (chip == Chip::k310P && q->dtype == kAclBFloat16) return "310P does not support bfloat16";
  const int64_t d = q->dims.back(), r = c->dims.back();
  if ((d != 64 && d != 128) || k->dims.back() != d) return "query/key D must be 64 or 128, got " + S(d);
  if (kGeneration < 90 ? r != d : (r != 64 && r != 128) || r > d) {
    return "all input dim3 must equal (query D=" + S(d) + ", cos D=" + S(r) + ")";
  }
  const int head = rank == 4 ? 2 : 1;
  const int64_t heads = q->dims[head] + k->dims[head];
  if (heads > 255) return "qkcNum > UINT8_MAX (Nq + Nk = " + S(heads) + ")";
  // aclnnApplyRotaryPosEmbV2.md: ub_required = (qn + kn) * 128 * castSize * 2
  //   + 128 * dtypeSize * 4 + (qn + kn) * 128 * castSize + (qn + kn) * 128 * castSize * 2
  //   + cast * (128 * 4 * 2), castSize 4 when computing in float32.
  const int64_t dtype_size = ElementSize(q->dtype), cast = q->dtype == kAclBFloat16;
  const int64_t cast_size = q->dtype == kAclFloat16 ? 2 : 4;
  const int64_t ub = heads * 128 * cast_size * 5 + 128 * dtype_size * 4 + cast * 128 * 4 * 2;
  const int64_t total = chip == Chip::k310P ? 256 * 1024 : 192 * 1024;
  if (ub > total) return "oneLoop " + S(ub) + " > totalUbSize " + S(total);
  return "";
}

// Ascend 950 (arch35 tiling): 4-D layouts 1..3; D <= 1024 with the mode's
// divisibility; every D equal (partial rotary only from the 2026 tiling);
// cos B 1 or B.
std::string Check950(const Tensor* q, const Tensor* k, const Tensor* c, int64_t layout, const std::string& mode) {
  if (layout < 1 || layout > 3) return "layout must be 1 (BSND), 2 (SBND) or 3 (BNSD), got " + S(layout);
  for (const Tensor* t : {q, k, c}) {
    if (t->dims.size() != 4) return "tensors must be 4-D, got " + Shape(t);
  }
  const int64_t d = q->dims[3], r = c->dims[3];
  if (k->dims[3] != d) return "D of query and key should be same";
  const int64_t unit = mode == "quarter" ? 4 : 2;
  if (d > 1024 || d % unit != 0 || r % unit != 0) return "D must be <= 1024 and divisible by " + S(unit);
  if (kGeneration < 90 ? r != d : r > d) return "D of query, key, cos, sin should be same";
  const int batch = layout == 2 ? 1 : 0;
  if (c->dims[batch] != 1 && c->dims[batch] != q->dims[batch]) return "cos B must be 1 or query's";
  return "";
}

[[maybe_unused]] std::string CheckRopeForward(const Tensor* q, const Tensor* k, const Tensor* c, const Tensor* s,
                             int64_t layout, const std::string& mode) {
  const Chip chip = jax_rope_sim::ChipOf(jax_rope_sim::Soc());
  if (chip == Chip::kUnsupported) return "not supported on SoC " + jax_rope_sim::Soc();
  if (mode != "half" && mode != "quarter" && mode != "interleave") return "unknown rotaryMode '" + mode + "'";
  for (const Tensor* t : {q, k, c, s}) {
    if (t->dtype != q->dtype) return "all tensors must share one dtype";
  }
  if (q->dtype != kAclFloat && q->dtype != kAclFloat16 && q->dtype != kAclBFloat16) return "unsupported dtype";
  if (q->dims.size() != k->dims.size() || c->dims != s->dims) return "shape mismatch";
  if (std::string e = chip == Chip::k950 ? Check950(q, k, c, layout, mode) : CheckOldChip(q, k, c, layout, chip);
      !e.empty()) {
    return e;
  }
  const size_t rank = q->dims.size();
  const int head = rank == 3 ? 1 : (layout == 3 ? 1 : 2);
  for (size_t axis = 0; axis < rank; ++axis) {
    if (static_cast<int>(axis) != head && axis + 1 != rank && k->dims[axis] != q->dims[axis]) {
      return "key must match query except on N and D";
    }
  }
  if (c->dims[head] != 1) return "cos N axis must be 1, got " + Shape(c);
  const int batch = layout == 2 ? 1 : 0, seq = rank == 3 ? 0 : (layout == 2 ? 0 : (layout == 3 ? 2 : 1));
  if ((rank == 4 && chip != Chip::k950 && c->dims[batch] != q->dims[batch]) || c->dims[seq] != q->dims[seq]) {
    return "cos B and S must equal query's: cos " + Shape(c) + ", query " + Shape(q);
  }
  return "";
}

// Our canonical geometry for the CPU kernels (layout codes are shared).
std::string Geometry(int32_t layout, int32_t mode, const Tensor* q, const Tensor* k,
                     const Tensor* c, jax_rope::cpu::RopeGeometry* g) {
  return jax_rope::cpu::MakeRopeGeometry(layout, mode, q->dims, k->dims, c->dims, c->dims, g);
}

template <typename T>
void RunForward(const Executor& e) {
  // The old chips' kernel has no rotary-mode support: it computes half.
  const bool reads_mode = jax_rope_sim::ChipOf(jax_rope_sim::Soc()) == Chip::k950;
  const int32_t mode = !reads_mode || e.mode == "half" ? 0 : e.mode == "quarter" ? 1 : 2;
  jax_rope::cpu::RopeGeometry g;
  Geometry(static_cast<int32_t>(e.layout), mode, e.t[0], e.t[1], e.t[2], &g);
  // In place: the kernel reads every element of a row before writing it.
  std::vector<T> q(static_cast<T*>(e.t[0]->data), static_cast<T*>(e.t[0]->data) + e.t[0]->elements());
  std::vector<T> k(static_cast<T*>(e.t[1]->data), static_cast<T*>(e.t[1]->data) + e.t[1]->elements());
  jax_rope::cpu::RopeForwardArgs<T> args{q.data(), k.data(), static_cast<T*>(e.t[2]->data),
                                         static_cast<T*>(e.t[3]->data),
                                         static_cast<T*>(e.t[0]->data), static_cast<T*>(e.t[1]->data)};
  jax_rope::cpu::RopeForward(g, args, 0, g.tokens());
}

template <typename T>
void RunBackward(const Executor& e) {
  jax_rope::cpu::RopeGeometry g;
  Geometry(static_cast<int32_t>(e.layout), 0, e.t[0], e.t[1], e.t[2], &g);
  auto p = [&](int i) { return e.t[i] ? static_cast<T*>(e.t[i]->data) : nullptr; };
  const bool inputs = e.t[4] != nullptr;
  if (!inputs) {  // gradCos/gradSin without query/key: zeros (nothing to reduce)
    for (int i : {8, 9}) std::memset(e.t[i]->data, 0, e.t[i]->elements() * sizeof(T));
  }
  jax_rope::cpu::RopeBackwardArgs<T> args{p(0), p(1), p(2), p(3), p(4), p(5), p(6), p(7),
                                          inputs ? p(8) : nullptr, inputs ? p(9) : nullptr};
  std::vector<float> partial(inputs ? jax_rope::cpu::RopeBackwardPartialFloats(g) : 0);
  args.partial = partial.empty() ? nullptr : partial.data();
  jax_rope::cpu::RopeBackward(g, args, 0, g.tokens());
  jax_rope::cpu::RopeReduceTables(g, args, 0, g.seq);
}

template <template <typename> class Run>
void Dispatch(const Executor& e, int32_t dtype) {
  if (dtype == kAclFloat) Run<float>{}(e);
  else if (dtype == kAclFloat16) Run<jax_rope::cpu::Float16>{}(e);
  else Run<jax_rope::cpu::BFloat16>{}(e);
}
template <typename T> struct Fwd { void operator()(const Executor& e) { RunForward<T>(e); } };
template <typename T> struct Bwd { void operator()(const Executor& e) { RunBackward<T>(e); } };

uint64_t WorkspaceFor(const Tensor* q) { return 1024 + q->dims[0] * 64; }  // some, to check use

aclnnStatus Run(void* workspace, uint64_t size, aclOpExecutor* handle, const char* op) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  if (handle == nullptr || Shared().executors.count(handle) == 0) return Fail(kNullptr, std::string(op) + ": unknown executor");
  auto* e = static_cast<Executor*>(reinterpret_cast<jax_rope_sim::ExecutorBase*>(handle));
  if (e->op != op) return Fail(kInvalid, std::string(op) + ": executor was made for " + e->op);
  if (size != e->workspace || (size > 0 && workspace == nullptr)) {
    return Fail(kInvalid, std::string(op) + ": workspace of " + S(size) + " bytes given, " +
                              S(e->workspace) + " required");
  }
  std::memset(workspace, 0xA5, size);  // the caller must really own it
  for (const Tensor* t : e->t) {
    if (t != nullptr && Shared().tensors.count(t) == 0) return Fail(kInvalid, std::string(op) + ": a descriptor was destroyed before launch");
  }
  if (e->attention) jax_rope_sim::RunAttention(*e->attention);
  else if (e->op == "aclnnApplyRotaryPosEmbV2") Dispatch<Fwd>(*e, e->t[0]->dtype);
  else Dispatch<Bwd>(*e, e->t[0]->dtype);
  Shared().executors.erase(handle);  // one launch per executor
  delete e;
  return 0;
}

const std::vector<int64_t>* Array(const aclIntArray* a, bool* ok) {
  if (a != nullptr && Shared().arrays.count(a) == 0) *ok = false;
  return reinterpret_cast<const std::vector<int64_t>*>(a);
}

aclnnStatus PlanAttentionCall(jax_rope_sim::AttentionArgs& args, const aclTensor* const* tensors,
                              size_t count, const aclIntArray* const* arrays,
                              uint64_t* workspace, aclOpExecutor** executor) {
  if (!workspace || !executor) return Fail(kNullptr, std::string(args.op) + ": null workspaceSize or executor");
  // FlashAttentionScore's product table: Atlas A2/A3 training only.
  if (jax_rope_sim::ChipOf(jax_rope_sim::Soc()) != Chip::kA2A3) {
    return Fail(kInvalid, std::string(args.op) + ": not supported on SoC " + jax_rope_sim::Soc());
  }
  for (size_t i = 0; i < count; ++i) {
    if (!Live(tensors[i])) return Fail(kInvalid, std::string(args.op) + ": destroyed descriptor");
  }
  bool ok = true;
  args.prefix = Array(arrays[0], &ok);
  args.seq_q = Array(arrays[1], &ok);
  args.seq_kv = Array(arrays[2], &ok);
  args.q_start_idx = Array(arrays[3], &ok);
  args.kv_start_idx = Array(arrays[4], &ok);
  args.generation = kGeneration;
  if (!ok) return Fail(kInvalid, std::string(args.op) + ": unknown or destroyed aclIntArray");
  if (args.drop_mask != nullptr && args.drop_mask->dtype == kAclUint8) {
    const auto* bytes = static_cast<const uint8_t*>(args.drop_mask->data);
    Shared().last_drop_mask.assign(bytes, bytes + args.drop_mask->elements());
  }
  std::shared_ptr<jax_rope_sim::AttentionPlan> plan;
  bool null_argument = false;
  if (std::string e = jax_rope_sim::PlanAttention(args, &plan, &null_argument); !e.empty()) {
    return Fail(null_argument ? kNullptr : kInvalid, e);
  }
  auto* e = new Executor;
  e->op = args.op;
  e->workspace = WorkspaceFor(args.query);
  e->t = jax_rope_sim::PlanTensors(*plan);
  e->attention = std::move(plan);
  *workspace = e->workspace;
  *executor = Register(e);
  return 0;
}

// The operands and attributes every FlashAttention entry point shares, in the
// operators' order. arrays: prefix, actualSeqQLen, actualSeqKvLen, qStartIdx,
// kvStartIdx (null where an entry point has none).
struct AttentionCommon {
  double scale, keep;
  int64_t pre, next, heads;
  char* layout;
  int64_t inner, sparse;
};

aclnnStatus PlanForward(jax_rope_sim::AttentionArgs a, const aclTensor* q, const aclTensor* k,
                        const aclTensor* v, const aclTensor* pse, const aclTensor* drop,
                        const aclTensor* pad, const aclTensor* mask,
                        std::array<const aclIntArray*, 5> arrays, const AttentionCommon& c,
                        const aclTensor* smax, const aclTensor* ssum, const aclTensor* sout,
                        const aclTensor* out, uint64_t* workspace, aclOpExecutor** executor) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  a.query = T(q), a.key = T(k), a.value = T(v), a.pse = T(pse), a.drop_mask = T(drop);
  a.padding_mask = T(pad), a.atten_mask = T(mask), a.softmax_max = T(smax), a.softmax_sum = T(ssum);
  a.softmax_io = T(sout), a.attention = T(out);
  a.scale = c.scale, a.keep_prob = c.keep, a.pre_tokens = c.pre, a.next_tokens = c.next;
  a.head_num = c.heads, a.layout = c.layout, a.inner_precise = c.inner, a.sparse_mode = c.sparse;
  const aclTensor* ts[] = {q, k, v, pse, drop, pad, mask, smax, ssum, sout, out};
  return PlanAttentionCall(a, ts, 11, arrays.data(), workspace, executor);
}

aclnnStatus PlanBackward(jax_rope_sim::AttentionArgs a, const aclTensor* q, const aclTensor* k,
                         const aclTensor* v, const aclTensor* dy, const aclTensor* pse,
                         const aclTensor* drop, const aclTensor* pad, const aclTensor* mask,
                         const aclTensor* smax, const aclTensor* ssum, const aclTensor* sin,
                         const aclTensor* attn, std::array<const aclIntArray*, 5> arrays,
                         const AttentionCommon& c, const aclTensor* dq, const aclTensor* dk,
                         const aclTensor* dv, const aclTensor* dpse, uint64_t* workspace,
                         aclOpExecutor** executor) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  a.backward = true;
  a.query = T(q), a.key = T(k), a.value = T(v), a.dy = T(dy), a.pse = T(pse), a.drop_mask = T(drop);
  a.padding_mask = T(pad), a.atten_mask = T(mask), a.softmax_max = T(smax), a.softmax_sum = T(ssum);
  a.softmax_io = T(sin), a.attention = T(attn), a.dq = T(dq), a.dk = T(dk), a.dv = T(dv), a.dpse = T(dpse);
  a.scale = c.scale, a.keep_prob = c.keep, a.pre_tokens = c.pre, a.next_tokens = c.next;
  a.head_num = c.heads, a.layout = c.layout, a.inner_precise = c.inner, a.sparse_mode = c.sparse;
  const aclTensor* ts[] = {q, k, v, dy, pse, drop, pad, mask, smax, ssum, sin, attn, dq, dk, dv, dpse};
  return PlanAttentionCall(a, ts, 16, arrays.data(), workspace, executor);
}

// Which entry point: its name, varlen (actualSeq*Len) and V2 (pseType, q/kvStartIdx).
jax_rope_sim::AttentionArgs Entry(const char* op, bool varlen, bool v2, int64_t pse_type = 1) {
  jax_rope_sim::AttentionArgs a;
  a.op = op;
  a.varlen = varlen, a.v2 = v2, a.pse_type = pse_type;
  return a;
}

}  // namespace

extern "C" {

#if JAX_ROPE_SIM_CANN >= 85
JAX_ROPE_SIM_EXPORT aclnnStatus aclnnApplyRotaryPosEmbV2GetWorkspaceSize(
    aclTensor* q, aclTensor* k, const aclTensor* c, const aclTensor* s, int64_t layout, char* mode,
    uint64_t* workspace, aclOpExecutor** executor) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  if (!q || !k || !c || !s || !mode || !workspace || !executor) return Fail(kNullptr, "null argument");
  if (!Live(q) || !Live(k) || !Live(c) || !Live(s)) return Fail(kInvalid, "destroyed descriptor");
  std::string message = CheckRopeForward(T(q), T(k), T(c), T(s), layout, mode);
  if (!message.empty()) return Fail(kInvalid, "aclnnApplyRotaryPosEmbV2: " + message);
  auto* e = new Executor;
  e->op = "aclnnApplyRotaryPosEmbV2";
  e->workspace = WorkspaceFor(T(q));
  e->t = {T(q), T(k), T(c), T(s)};
  e->layout = layout;
  e->mode = mode;
  *workspace = e->workspace;
  *executor = Register(e);
  return 0;
}
JAX_ROPE_SIM_EXPORT aclnnStatus aclnnApplyRotaryPosEmbV2(void* w, uint64_t n, aclOpExecutor* e, aclrtStream) {
  return Run(w, n, e, "aclnnApplyRotaryPosEmbV2");
}
#endif

#if JAX_ROPE_SIM_CANN >= 90
// Backward (Ascend 950 only): half only, layouts 1/2/4, r == D <= 1024;
// gradCosOut and gradSinOut are REQUIRED outputs (the op definition).
JAX_ROPE_SIM_EXPORT aclnnStatus aclnnApplyRotaryPosEmbGradGetWorkspaceSize(
    const aclTensor* gq, const aclTensor* gk, const aclTensor* c, const aclTensor* s,
    const aclTensor* q, const aclTensor* k, char* mode, int64_t layout, const aclTensor* dq,
    const aclTensor* dk, const aclTensor* dc, const aclTensor* ds, uint64_t* workspace,
    aclOpExecutor** executor) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  if (jax_rope_sim::ChipOf(jax_rope_sim::Soc()) != Chip::k950) {
    return Fail(kInvalid, "aclnnApplyRotaryPosEmbGrad: not supported on SoC " + jax_rope_sim::Soc());
  }
  if (!gq || !gk || !c || !s || !dq || !dk || !workspace || !executor) return Fail(kNullptr, "null argument");
  if (!dc || !ds) return Fail(kNullptr, "aclnnApplyRotaryPosEmbGrad: gradCosOut and gradSinOut are required outputs");
  for (const aclTensor* t : {gq, gk, c, s, q, k, dq, dk, dc, ds}) if (!Live(t)) return Fail(kInvalid, "destroyed descriptor");
  if (mode == nullptr || std::string(mode) != "half") return Fail(kInvalid, "rotaryMode must be \"half\"");
  if (layout != 1 && layout != 2 && layout != 4) return Fail(kInvalid, "layout must be 1, 2 or 4, got " + S(layout));
  if ((q == nullptr) != (k == nullptr)) return Fail(kInvalid, "queryOptional and keyOptional together or not at all");
  const size_t rank = layout == 4 ? 3 : 4;
  for (const aclTensor* t : {gq, gk, c, s, q, k, dq, dk, dc, ds}) {
    if (t && (T(t)->dims.size() != rank || T(t)->dtype != T(gq)->dtype)) return Fail(kInvalid, "rank or dtype mismatch");
  }
  if (T(dq)->dims != T(gq)->dims || T(dk)->dims != T(gk)->dims || (q && T(q)->dims != T(gq)->dims) ||
      T(dc)->dims != T(c)->dims || T(ds)->dims != T(c)->dims) {
    return Fail(kInvalid, "output shapes must match their inputs");
  }
  if (T(c)->dims.back() != T(gq)->dims.back() || T(gq)->dims.back() > 1024) return Fail(kInvalid, "r must equal D <= 1024");
  jax_rope::cpu::RopeGeometry g;
  if (std::string m = Geometry(static_cast<int32_t>(layout), 0, T(gq), T(gk), T(c), &g); !m.empty()) {
    return Fail(kInvalid, "aclnnApplyRotaryPosEmbGrad: " + m);
  }
  auto* e = new Executor;
  e->op = "aclnnApplyRotaryPosEmbGrad";
  e->workspace = WorkspaceFor(T(gq));
  e->t = {T(gq), T(gk), T(c), T(s), q ? T(q) : nullptr, k ? T(k) : nullptr, T(dq), T(dk), T(dc), T(ds)};
  e->layout = layout;
  e->mode = "half";
  *workspace = e->workspace;
  *executor = Register(e);
  return 0;
}
JAX_ROPE_SIM_EXPORT aclnnStatus aclnnApplyRotaryPosEmbGrad(void* w, uint64_t n, aclOpExecutor* e, aclrtStream) {
  return Run(w, n, e, "aclnnApplyRotaryPosEmbGrad");
}
#endif

// --- attention (checked and computed in attention.cc): every generation ---------------

JAX_ROPE_SIM_EXPORT aclnnStatus aclnnFlashAttentionScoreGetWorkspaceSize(
    const aclTensor* q, const aclTensor* k, const aclTensor* v, const aclTensor* pse,
    const aclTensor* drop, const aclTensor* pad, const aclTensor* mask, const aclIntArray* prefix,
    double scale, double keep, int64_t pre, int64_t next, int64_t heads, char* layout,
    int64_t inner, int64_t sparse, const aclTensor* smax, const aclTensor* ssum,
    const aclTensor* sout, const aclTensor* out, uint64_t* workspace, aclOpExecutor** executor) {
  return PlanForward(
      Entry("aclnnFlashAttentionScore", false, false), q, k, v, pse, drop, pad, mask,
      {prefix, nullptr, nullptr, nullptr, nullptr},
      {scale, keep, pre, next, heads, layout, inner, sparse}, smax, ssum, sout, out, workspace,
      executor);
}
JAX_ROPE_SIM_EXPORT aclnnStatus aclnnFlashAttentionScore(void* w, uint64_t n, aclOpExecutor* e, aclrtStream) {
  return Run(w, n, e, "aclnnFlashAttentionScore");
}

JAX_ROPE_SIM_EXPORT aclnnStatus aclnnFlashAttentionVarLenScoreGetWorkspaceSize(
    const aclTensor* q, const aclTensor* k, const aclTensor* v, const aclTensor* pse,
    const aclTensor* drop, const aclTensor* pad, const aclTensor* mask, const aclIntArray* prefix,
    const aclIntArray* seq_q, const aclIntArray* seq_kv, double scale, double keep, int64_t pre,
    int64_t next, int64_t heads, char* layout, int64_t inner, int64_t sparse,
    const aclTensor* smax, const aclTensor* ssum, const aclTensor* sout, const aclTensor* out,
    uint64_t* workspace, aclOpExecutor** executor) {
  return PlanForward(
      Entry("aclnnFlashAttentionVarLenScore", true, false), q, k, v, pse, drop, pad, mask,
      {prefix, seq_q, seq_kv, nullptr, nullptr},
      {scale, keep, pre, next, heads, layout, inner, sparse}, smax, ssum, sout, out, workspace,
      executor);
}
JAX_ROPE_SIM_EXPORT aclnnStatus aclnnFlashAttentionVarLenScore(void* w, uint64_t n, aclOpExecutor* e, aclrtStream) {
  return Run(w, n, e, "aclnnFlashAttentionVarLenScore");
}

JAX_ROPE_SIM_EXPORT aclnnStatus aclnnFlashAttentionScoreGradGetWorkspaceSize(
    const aclTensor* q, const aclTensor* k, const aclTensor* v, const aclTensor* dy,
    const aclTensor* pse, const aclTensor* drop, const aclTensor* pad, const aclTensor* mask,
    const aclTensor* smax, const aclTensor* ssum, const aclTensor* sin, const aclTensor* attn,
    const aclIntArray* prefix, double scale, double keep, int64_t pre, int64_t next,
    int64_t heads, char* layout, int64_t inner, int64_t sparse, const aclTensor* dq,
    const aclTensor* dk, const aclTensor* dv, const aclTensor* dpse, uint64_t* workspace,
    aclOpExecutor** executor) {
  return PlanBackward(
      Entry("aclnnFlashAttentionScoreGrad", false, false), q, k, v, dy, pse, drop, pad, mask, smax,
      ssum, sin, attn, {prefix, nullptr, nullptr, nullptr, nullptr},
      {scale, keep, pre, next, heads, layout, inner, sparse}, dq, dk, dv, dpse, workspace, executor);
}
JAX_ROPE_SIM_EXPORT aclnnStatus aclnnFlashAttentionScoreGrad(void* w, uint64_t n, aclOpExecutor* e, aclrtStream) {
  return Run(w, n, e, "aclnnFlashAttentionScoreGrad");
}

JAX_ROPE_SIM_EXPORT aclnnStatus aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize(
    const aclTensor* q, const aclTensor* k, const aclTensor* v, const aclTensor* dy,
    const aclTensor* pse, const aclTensor* drop, const aclTensor* pad, const aclTensor* mask,
    const aclTensor* smax, const aclTensor* ssum, const aclTensor* sin, const aclTensor* attn,
    const aclIntArray* prefix, const aclIntArray* seq_q, const aclIntArray* seq_kv, double scale,
    double keep, int64_t pre, int64_t next, int64_t heads, char* layout, int64_t inner,
    int64_t sparse, const aclTensor* dq, const aclTensor* dk, const aclTensor* dv,
    const aclTensor* dpse, uint64_t* workspace, aclOpExecutor** executor) {
  return PlanBackward(
      Entry("aclnnFlashAttentionUnpaddingScoreGrad", true, false), q, k, v, dy, pse, drop, pad,
      mask, smax, ssum, sin, attn, {prefix, seq_q, seq_kv, nullptr, nullptr},
      {scale, keep, pre, next, heads, layout, inner, sparse}, dq, dk, dv, dpse, workspace, executor);
}
JAX_ROPE_SIM_EXPORT aclnnStatus aclnnFlashAttentionUnpaddingScoreGrad(void* w, uint64_t n, aclOpExecutor* e, aclrtStream) {
  return Run(w, n, e, "aclnnFlashAttentionUnpaddingScoreGrad");
}

// --- the V2 forms (every generation here; A2/A3): pseType and qStartIdx/kvStartIdx ---

JAX_ROPE_SIM_EXPORT aclnnStatus aclnnFlashAttentionScoreV2GetWorkspaceSize(
    const aclTensor* q, const aclTensor* k, const aclTensor* v, const aclTensor* pse,
    const aclTensor* drop, const aclTensor* pad, const aclTensor* mask, const aclIntArray* prefix,
    const aclIntArray* q_start, const aclIntArray* kv_start, double scale, double keep, int64_t pre,
    int64_t next, int64_t heads, char* layout, int64_t inner, int64_t sparse, int64_t pse_type,
    const aclTensor* smax, const aclTensor* ssum, const aclTensor* sout, const aclTensor* out,
    uint64_t* workspace, aclOpExecutor** executor) {
  return PlanForward(
      Entry("aclnnFlashAttentionScoreV2", false, true, pse_type), q, k, v, pse, drop, pad, mask,
      {prefix, nullptr, nullptr, q_start, kv_start},
      {scale, keep, pre, next, heads, layout, inner, sparse}, smax, ssum, sout, out, workspace,
      executor);
}
JAX_ROPE_SIM_EXPORT aclnnStatus aclnnFlashAttentionScoreV2(void* w, uint64_t n, aclOpExecutor* e, aclrtStream) {
  return Run(w, n, e, "aclnnFlashAttentionScoreV2");
}

JAX_ROPE_SIM_EXPORT aclnnStatus aclnnFlashAttentionVarLenScoreV2GetWorkspaceSize(
    const aclTensor* q, const aclTensor* k, const aclTensor* v, const aclTensor* pse,
    const aclTensor* drop, const aclTensor* pad, const aclTensor* mask, const aclIntArray* prefix,
    const aclIntArray* seq_q, const aclIntArray* seq_kv, const aclIntArray* q_start,
    const aclIntArray* kv_start, double scale, double keep, int64_t pre, int64_t next,
    int64_t heads, char* layout, int64_t inner, int64_t sparse, int64_t pse_type,
    const aclTensor* smax, const aclTensor* ssum, const aclTensor* sout, const aclTensor* out,
    uint64_t* workspace, aclOpExecutor** executor) {
  return PlanForward(
      Entry("aclnnFlashAttentionVarLenScoreV2", true, true, pse_type), q, k, v, pse, drop, pad,
      mask, {prefix, seq_q, seq_kv, q_start, kv_start},
      {scale, keep, pre, next, heads, layout, inner, sparse}, smax, ssum, sout, out, workspace,
      executor);
}
JAX_ROPE_SIM_EXPORT aclnnStatus aclnnFlashAttentionVarLenScoreV2(void* w, uint64_t n, aclOpExecutor* e, aclrtStream) {
  return Run(w, n, e, "aclnnFlashAttentionVarLenScoreV2");
}

JAX_ROPE_SIM_EXPORT aclnnStatus aclnnFlashAttentionScoreGradV2GetWorkspaceSize(
    const aclTensor* q, const aclTensor* k, const aclTensor* v, const aclTensor* dy,
    const aclTensor* pse, const aclTensor* drop, const aclTensor* pad, const aclTensor* mask,
    const aclTensor* smax, const aclTensor* ssum, const aclTensor* sin, const aclTensor* attn,
    const aclIntArray* prefix, const aclIntArray* q_start, const aclIntArray* kv_start,
    double scale, double keep, int64_t pre, int64_t next, int64_t heads, char* layout,
    int64_t inner, int64_t sparse, int64_t pse_type, const aclTensor* dq, const aclTensor* dk,
    const aclTensor* dv, const aclTensor* dpse, uint64_t* workspace, aclOpExecutor** executor) {
  return PlanBackward(
      Entry("aclnnFlashAttentionScoreGradV2", false, true, pse_type), q, k, v, dy, pse, drop, pad,
      mask, smax, ssum, sin, attn, {prefix, nullptr, nullptr, q_start, kv_start},
      {scale, keep, pre, next, heads, layout, inner, sparse}, dq, dk, dv, dpse, workspace, executor);
}
JAX_ROPE_SIM_EXPORT aclnnStatus aclnnFlashAttentionScoreGradV2(void* w, uint64_t n, aclOpExecutor* e, aclrtStream) {
  return Run(w, n, e, "aclnnFlashAttentionScoreGradV2");
}

JAX_ROPE_SIM_EXPORT aclnnStatus aclnnFlashAttentionUnpaddingScoreGradV2GetWorkspaceSize(
    const aclTensor* q, const aclTensor* k, const aclTensor* v, const aclTensor* dy,
    const aclTensor* pse, const aclTensor* drop, const aclTensor* pad, const aclTensor* mask,
    const aclTensor* smax, const aclTensor* ssum, const aclTensor* sin, const aclTensor* attn,
    const aclIntArray* prefix, const aclIntArray* seq_q, const aclIntArray* seq_kv,
    const aclIntArray* q_start, const aclIntArray* kv_start, double scale, double keep,
    int64_t pre, int64_t next, int64_t heads, char* layout, int64_t inner, int64_t sparse,
    int64_t pse_type, const aclTensor* dq, const aclTensor* dk, const aclTensor* dv,
    const aclTensor* dpse, uint64_t* workspace, aclOpExecutor** executor) {
  return PlanBackward(
      Entry("aclnnFlashAttentionUnpaddingScoreGradV2", true, true, pse_type), q, k, v, dy, pse,
      drop, pad, mask, smax, ssum, sin, attn, {prefix, seq_q, seq_kv, q_start, kv_start},
      {scale, keep, pre, next, heads, layout, inner, sparse}, dq, dk, dv, dpse, workspace, executor);
}
JAX_ROPE_SIM_EXPORT aclnnStatus aclnnFlashAttentionUnpaddingScoreGradV2(void* w, uint64_t n, aclOpExecutor* e, aclrtStream) {
  return Run(w, n, e, "aclnnFlashAttentionUnpaddingScoreGradV2");
}

}  // extern "C"
