// A simulated CANN runtime for the contract tests: the entry points jax_rope
// calls, over host memory (device memory = host memory, streams run nothing:
// every call completes at once). Each call is checked against the documented
// contract (dtypes, shapes, strides, ND format, layout codes, rotary_mode
// strings, workspace, live descriptors, one launch per executor); a violation
// returns an error status with a message for aclGetRecentErrMsg. Results come
// from jax_rope's CPU kernels; the attention operators live in attention.cc.
// Built by CMake under JAX_ROPE_BUILD_TESTS (libjax_rope_npu_sim.so, linked
// to the kernel library as it ships); tests/test_npu_contract.py installs it
// as libascendcl.so, libnnopbase.so and libopapi.so (one library).
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "device_kernels/cpu/rope_kernels.h"
#include "device_kernels/npu/acl_api.h"
#include "tests/npu_sim/sim.h"

namespace {

using jax_rope_sim::Shape;
using jax_rope_sim::Tensor;

struct Executor {
  std::string op;
  uint64_t workspace = 0;
  std::vector<const Tensor*> t;  // operands in the operator's order (null: absent)
  int64_t layout = 0;
  std::string mode;
  bool used = false;
  std::shared_ptr<jax_rope_sim::AttentionPlan> attention;  // attention operators only
};

std::mutex g_mutex;
std::set<const void*> g_tensors, g_arrays, g_executors;
std::string g_error;
int g_live_tensors = 0;

constexpr aclnnStatus kNullptr = 161001, kInvalid = 161002;

aclnnStatus Fail(aclnnStatus status, const std::string& message) {
  g_error = "EZ9999 simulated CANN: " + message;
  return status;
}

bool Live(const aclTensor* t) { return t == nullptr || g_tensors.count(t) != 0; }
const Tensor* T(const aclTensor* t) { return reinterpret_cast<const Tensor*>(t); }

// --- the RoPE contract ---------------------------------------------------------

// Forward (ApplyRotaryPosEmbV2, rope.md's A2 limits): 4-D, layout 1..3, one
// dtype, N of cos/sin 1, B and S of cos equal to query's, D and r in {64, 128}, r <= D.
std::string CheckRopeForward(const Tensor* q, const Tensor* k, const Tensor* c, const Tensor* s,
                             int64_t layout, const std::string& mode) {
  if (layout < 1 || layout > 3) return "layout must be 1 (BSND), 2 (SBND) or 3 (BNSD), got " + std::to_string(layout);
  if (mode != "half" && mode != "quarter" && mode != "interleave") return "unknown rotaryMode '" + mode + "'";
  for (const Tensor* t : {q, k, c, s}) {
    if (t->dims.size() != 4) return "tensors must be 4-D, got " + Shape(t);
    if (t->dtype != q->dtype) return "all tensors must share one dtype";
  }
  if (q->dtype != kAclFloat && q->dtype != kAclFloat16 && q->dtype != kAclBFloat16) return "unsupported dtype";
  const int head = layout == 3 ? 1 : 2;
  for (int axis = 0; axis < 4; ++axis) {
    if (axis != head && k->dims[axis] != q->dims[axis]) return "key must match query except on N";
    if (c->dims[axis] != s->dims[axis]) return "sin must have cos's shape";
  }
  if (c->dims[head] != 1) return "cos N axis must be 1, got " + Shape(c);
  const int batch = layout == 2 ? 1 : 0, seq = layout == 2 ? 0 : (layout == 3 ? 2 : 1);
  if (c->dims[batch] != q->dims[batch] || c->dims[seq] != q->dims[seq]) {
    return "cos B and S must equal query's: cos " + Shape(c) + ", query " + Shape(q);
  }
  const int64_t d = q->dims[3], r = c->dims[3];
  if ((d != 64 && d != 128) || (r != 64 && r != 128) || r > d) {
    return "D and r must be 64 or 128 with r <= D, got D=" + std::to_string(d) + " r=" + std::to_string(r);
  }
  if (q->dims[head] + k->dims[head] > 255) return "Nq + Nk must be <= 255";
  return "";
}

// Our canonical geometry for the CPU kernels (layout codes are shared).
std::string Geometry(int32_t layout, int32_t mode, const Tensor* q, const Tensor* k,
                     const Tensor* c, jax_rope::cpu::RopeGeometry* g) {
  return jax_rope::cpu::MakeRopeGeometry(layout, mode, q->dims, k->dims, c->dims, c->dims, g);
}

template <typename T>
void RunForward(const Executor& e) {
  const int32_t mode = e.mode == "half" ? 0 : e.mode == "quarter" ? 1 : 2;
  jax_rope::cpu::RopeGeometry g;
  Geometry(static_cast<int32_t>(e.layout), mode, e.t[0], e.t[1], e.t[2], &g);
  // In place: the kernel reads every element of a row before writing it.
  std::vector<T> q(static_cast<T*>(e.t[0]->data), static_cast<T*>(e.t[0]->data) + g.tokens() * g.q_heads * g.head_dim);
  std::vector<T> k(static_cast<T*>(e.t[1]->data), static_cast<T*>(e.t[1]->data) + g.tokens() * g.k_heads * g.head_dim);
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
  jax_rope::cpu::RopeBackwardArgs<T> args{p(0), p(1), p(2), p(3), p(4), p(5), p(6), p(7), p(8), p(9)};
  std::vector<float> partial(args.query != nullptr ? jax_rope::cpu::RopeBackwardPartialFloats(g) : 0);
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
  std::lock_guard<std::mutex> lock(g_mutex);
  if (handle == nullptr || g_executors.count(handle) == 0) return Fail(kNullptr, std::string(op) + ": unknown executor");
  auto* e = reinterpret_cast<Executor*>(handle);
  if (e->op != op) return Fail(kInvalid, std::string(op) + ": executor was made for " + e->op);
  if (size != e->workspace || (size > 0 && workspace == nullptr)) {
    return Fail(kInvalid, std::string(op) + ": workspace of " + std::to_string(size) +
                              " bytes given, " + std::to_string(e->workspace) + " required");
  }
  std::memset(workspace, 0xA5, size);  // the caller must really own it
  for (const Tensor* t : e->t) {
    if (t != nullptr && g_tensors.count(t) == 0) return Fail(kInvalid, std::string(op) + ": a descriptor was destroyed before launch");
  }
  if (e->attention) jax_rope_sim::RunAttention(*e->attention);
  else if (e->op == "aclnnApplyRotaryPosEmbV2") Dispatch<Fwd>(*e, e->t[0]->dtype);
  else Dispatch<Bwd>(*e, e->t[0]->dtype);
  g_executors.erase(handle);  // one launch per executor
  delete e;
  return 0;
}

}  // namespace

extern "C" {

// --- libascendcl -------------------------------------------------------------
const char* aclrtGetSocName() {
  const char* soc = std::getenv("JAX_ROPE_SIM_SOC");
  return soc ? soc : "Ascend910B2";
}
const char* aclGetRecentErrMsg() { return g_error.empty() ? nullptr : g_error.c_str(); }
aclError aclrtMemcpyAsync(void* dst, size_t dest_max, const void* src, size_t count, int32_t kind,
                          aclrtStream) {
  if (count > dest_max) { g_error = "memcpy count exceeds destination"; return 107000; }
  if (kind < 0 || kind > 3) { g_error = "bad memcpy kind"; return 107000; }
  std::memcpy(dst, src, count);
  return 0;
}
aclError aclrtMemcpy(void* dst, size_t dest_max, const void* src, size_t count, int32_t kind) {
  return aclrtMemcpyAsync(dst, dest_max, src, count, kind, nullptr);
}
aclError aclrtSynchronizeStream(aclrtStream) { return 0; }
aclError aclrtMalloc(void** ptr, size_t size, int32_t) { *ptr = std::malloc(size); return *ptr ? 0 : 207001; }
aclError aclrtGetDevice(int32_t* id) { *id = 0; return 0; }

// --- libnnopbase ---------------------------------------------------------------
aclTensor* aclCreateTensor(const int64_t* view_dims, uint64_t n, int32_t dtype, const int64_t* stride,
                           int64_t offset, int32_t format, const int64_t* storage_dims,
                           uint64_t storage_n, void* data) {
  std::lock_guard<std::mutex> lock(g_mutex);
  // Our glue always passes dense row-major ND views of the whole buffer (an
  // empty tensor, for reserved outputs, may have no data).
  if (format != kAclFormatND || offset != 0 || storage_n != n) { g_error = "bad tensor"; return nullptr; }
  int64_t expect = 1;
  for (int i = static_cast<int>(n) - 1; i >= 0; --i) {
    if (view_dims[i] < 0 || stride[i] != expect || storage_dims[i] != view_dims[i]) { g_error = "non-contiguous tensor"; return nullptr; }
    expect *= view_dims[i];
  }
  if (data == nullptr && expect != 0) { g_error = "tensor without data"; return nullptr; }
  auto* t = new Tensor{std::vector<int64_t>(view_dims, view_dims + n), dtype, data};
  g_tensors.insert(t);
  ++g_live_tensors;
  return reinterpret_cast<aclTensor*>(t);
}
aclnnStatus aclDestroyTensor(const aclTensor* t) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_tensors.erase(t) == 0) return Fail(kInvalid, "aclDestroyTensor of an unknown or destroyed tensor");
  --g_live_tensors;
  delete T(t);
  return 0;
}
aclIntArray* aclCreateIntArray(const int64_t* v, uint64_t n) {
  auto* a = new std::vector<int64_t>(v, v + n);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_arrays.insert(a);
  return reinterpret_cast<aclIntArray*>(a);
}
aclnnStatus aclDestroyIntArray(const aclIntArray* a) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_arrays.erase(a) == 0) return Fail(kInvalid, "aclDestroyIntArray of an unknown array");
  delete reinterpret_cast<const std::vector<int64_t>*>(a);
  return 0;
}

// Test hook: descriptors alive now (every call must leave none behind).
int jax_rope_sim_live_tensors() { return g_live_tensors; }

// --- libopapi: RoPE ---------------------------------------------------------------
aclnnStatus aclnnApplyRotaryPosEmbV2GetWorkspaceSize(aclTensor* q, aclTensor* k, const aclTensor* c,
                                                     const aclTensor* s, int64_t layout, char* mode,
                                                     uint64_t* workspace, aclOpExecutor** executor) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!q || !k || !c || !s || !mode || !workspace || !executor) return Fail(kNullptr, "null argument");
  if (!Live(q) || !Live(k) || !Live(c) || !Live(s)) return Fail(kInvalid, "destroyed descriptor");
  std::string message = CheckRopeForward(T(q), T(k), T(c), T(s), layout, mode);
  if (!message.empty()) return Fail(kInvalid, "aclnnApplyRotaryPosEmbV2: " + message);
  auto* e = new Executor{"aclnnApplyRotaryPosEmbV2", WorkspaceFor(T(q)), {T(q), T(k), T(c), T(s)}, layout, mode};
  g_executors.insert(e);
  *workspace = e->workspace;
  *executor = reinterpret_cast<aclOpExecutor*>(e);
  return 0;
}
aclnnStatus aclnnApplyRotaryPosEmbV2(void* w, uint64_t n, aclOpExecutor* e, aclrtStream) {
  return Run(w, n, e, "aclnnApplyRotaryPosEmbV2");
}

// Backward (Ascend 950 limits): half only, layouts 1/2/4, r == D <= 1024.
aclnnStatus aclnnApplyRotaryPosEmbGradGetWorkspaceSize(
    const aclTensor* gq, const aclTensor* gk, const aclTensor* c, const aclTensor* s,
    const aclTensor* q, const aclTensor* k, char* mode, int64_t layout, const aclTensor* dq,
    const aclTensor* dk, const aclTensor* dc, const aclTensor* ds, uint64_t* workspace,
    aclOpExecutor** executor) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!gq || !gk || !c || !s || !dq || !dk || !workspace || !executor) return Fail(kNullptr, "null argument");
  for (const aclTensor* t : {gq, gk, c, s, q, k, dq, dk, dc, ds}) if (!Live(t)) return Fail(kInvalid, "destroyed descriptor");
  if (mode == nullptr || std::string(mode) != "half") return Fail(kInvalid, "rotaryMode must be \"half\"");
  if (layout != 1 && layout != 2 && layout != 4) return Fail(kInvalid, "layout must be 1, 2 or 4, got " + std::to_string(layout));
  if ((q == nullptr) != (k == nullptr) || (q != nullptr) != (dc != nullptr && ds != nullptr)) {
    return Fail(kInvalid, "query and key (with gradCos/gradSin) together or not at all");
  }
  const size_t rank = layout == 4 ? 3 : 4;
  for (const aclTensor* t : {gq, gk, c, s, q, k, dq, dk, dc, ds}) {
    if (t && (T(t)->dims.size() != rank || T(t)->dtype != T(gq)->dtype)) return Fail(kInvalid, "rank or dtype mismatch");
  }
  if (T(dq)->dims != T(gq)->dims || T(dk)->dims != T(gk)->dims || (q && T(q)->dims != T(gq)->dims) ||
      (dc && (T(dc)->dims != T(c)->dims || T(ds)->dims != T(c)->dims))) {
    return Fail(kInvalid, "output shapes must match their inputs");
  }
  if (T(c)->dims.back() != T(gq)->dims.back() || T(gq)->dims.back() > 1024) return Fail(kInvalid, "r must equal D <= 1024");
  jax_rope::cpu::RopeGeometry g;
  if (std::string m = Geometry(static_cast<int32_t>(layout), 0, T(gq), T(gk), T(c), &g); !m.empty()) {
    return Fail(kInvalid, "aclnnApplyRotaryPosEmbGrad: " + m);
  }
  auto* e = new Executor{"aclnnApplyRotaryPosEmbGrad", WorkspaceFor(T(gq)),
                         {T(gq), T(gk), T(c), T(s), q ? T(q) : nullptr, k ? T(k) : nullptr, T(dq), T(dk),
                          dc ? T(dc) : nullptr, ds ? T(ds) : nullptr}, layout, "half"};
  g_executors.insert(e);
  *workspace = e->workspace;
  *executor = reinterpret_cast<aclOpExecutor*>(e);
  return 0;
}
aclnnStatus aclnnApplyRotaryPosEmbGrad(void* w, uint64_t n, aclOpExecutor* e, aclrtStream) {
  return Run(w, n, e, "aclnnApplyRotaryPosEmbGrad");
}

}  // extern "C"

// --- libopapi: attention (checked and computed in attention.cc) ------------------

namespace {

const std::vector<int64_t>* Array(const aclIntArray* a, bool* ok) {
  if (a != nullptr && g_arrays.count(a) == 0) *ok = false;
  return reinterpret_cast<const std::vector<int64_t>*>(a);
}

aclnnStatus PlanAttentionCall(jax_rope_sim::AttentionArgs& args, const aclTensor* const* tensors,
                              size_t count, const aclIntArray* const* arrays,
                              uint64_t* workspace, aclOpExecutor** executor) {
  if (!workspace || !executor) return Fail(kNullptr, std::string(args.op) + ": null workspaceSize or executor");
  for (size_t i = 0; i < count; ++i) {
    if (!Live(tensors[i])) return Fail(kInvalid, std::string(args.op) + ": destroyed descriptor");
  }
  bool ok = true;
  args.prefix = Array(arrays[0], &ok);
  args.seq_q = Array(arrays[1], &ok);
  args.seq_kv = Array(arrays[2], &ok);
  if (!ok) return Fail(kInvalid, std::string(args.op) + ": unknown or destroyed aclIntArray");
  std::shared_ptr<jax_rope_sim::AttentionPlan> plan;
  bool null_argument = false;
  if (std::string e = jax_rope_sim::PlanAttention(args, &plan, &null_argument); !e.empty()) {
    return Fail(null_argument ? kNullptr : kInvalid, e);
  }
  auto* e = new Executor{args.op, WorkspaceFor(args.query), jax_rope_sim::PlanTensors(*plan), 0, ""};
  e->attention = std::move(plan);
  g_executors.insert(e);
  *workspace = e->workspace;
  *executor = reinterpret_cast<aclOpExecutor*>(e);
  return 0;
}

}  // namespace

extern "C" {

aclnnStatus aclnnFlashAttentionScoreGetWorkspaceSize(
    const aclTensor* q, const aclTensor* k, const aclTensor* v, const aclTensor* pse,
    const aclTensor* drop, const aclTensor* pad, const aclTensor* mask, const aclIntArray* prefix,
    double scale, double keep, int64_t pre, int64_t next, int64_t heads, char* layout,
    int64_t inner, int64_t sparse, const aclTensor* smax, const aclTensor* ssum,
    const aclTensor* sout, const aclTensor* out, uint64_t* workspace, aclOpExecutor** executor) {
  std::lock_guard<std::mutex> lock(g_mutex);
  jax_rope_sim::AttentionArgs a;
  a.op = "aclnnFlashAttentionScore";
  a.query = T(q), a.key = T(k), a.value = T(v), a.pse = T(pse), a.drop_mask = T(drop);
  a.padding_mask = T(pad), a.atten_mask = T(mask), a.softmax_max = T(smax), a.softmax_sum = T(ssum);
  a.softmax_io = T(sout), a.attention = T(out);
  a.scale = scale, a.keep_prob = keep, a.pre_tokens = pre, a.next_tokens = next, a.head_num = heads;
  a.layout = layout, a.inner_precise = inner, a.sparse_mode = sparse;
  const aclTensor* ts[] = {q, k, v, pse, drop, pad, mask, smax, ssum, sout, out};
  const aclIntArray* arrays[] = {prefix, nullptr, nullptr};
  return PlanAttentionCall(a, ts, 11, arrays, workspace, executor);
}
aclnnStatus aclnnFlashAttentionScore(void* w, uint64_t n, aclOpExecutor* e, aclrtStream) {
  return Run(w, n, e, "aclnnFlashAttentionScore");
}

aclnnStatus aclnnFlashAttentionVarLenScoreGetWorkspaceSize(
    const aclTensor* q, const aclTensor* k, const aclTensor* v, const aclTensor* pse,
    const aclTensor* drop, const aclTensor* pad, const aclTensor* mask, const aclIntArray* prefix,
    const aclIntArray* seq_q, const aclIntArray* seq_kv, double scale, double keep, int64_t pre,
    int64_t next, int64_t heads, char* layout, int64_t inner, int64_t sparse,
    const aclTensor* smax, const aclTensor* ssum, const aclTensor* sout, const aclTensor* out,
    uint64_t* workspace, aclOpExecutor** executor) {
  std::lock_guard<std::mutex> lock(g_mutex);
  jax_rope_sim::AttentionArgs a;
  a.op = "aclnnFlashAttentionVarLenScore";
  a.varlen = true;
  a.query = T(q), a.key = T(k), a.value = T(v), a.pse = T(pse), a.drop_mask = T(drop);
  a.padding_mask = T(pad), a.atten_mask = T(mask), a.softmax_max = T(smax), a.softmax_sum = T(ssum);
  a.softmax_io = T(sout), a.attention = T(out);
  a.scale = scale, a.keep_prob = keep, a.pre_tokens = pre, a.next_tokens = next, a.head_num = heads;
  a.layout = layout, a.inner_precise = inner, a.sparse_mode = sparse;
  const aclTensor* ts[] = {q, k, v, pse, drop, pad, mask, smax, ssum, sout, out};
  const aclIntArray* arrays[] = {prefix, seq_q, seq_kv};
  return PlanAttentionCall(a, ts, 11, arrays, workspace, executor);
}
aclnnStatus aclnnFlashAttentionVarLenScore(void* w, uint64_t n, aclOpExecutor* e, aclrtStream) {
  return Run(w, n, e, "aclnnFlashAttentionVarLenScore");
}

aclnnStatus aclnnFlashAttentionScoreGradGetWorkspaceSize(
    const aclTensor* q, const aclTensor* k, const aclTensor* v, const aclTensor* dy,
    const aclTensor* pse, const aclTensor* drop, const aclTensor* pad, const aclTensor* mask,
    const aclTensor* smax, const aclTensor* ssum, const aclTensor* sin, const aclTensor* attn,
    const aclIntArray* prefix, double scale, double keep, int64_t pre, int64_t next,
    int64_t heads, char* layout, int64_t inner, int64_t sparse, const aclTensor* dq,
    const aclTensor* dk, const aclTensor* dv, const aclTensor* dpse, uint64_t* workspace,
    aclOpExecutor** executor) {
  std::lock_guard<std::mutex> lock(g_mutex);
  jax_rope_sim::AttentionArgs a;
  a.op = "aclnnFlashAttentionScoreGrad";
  a.backward = true;
  a.query = T(q), a.key = T(k), a.value = T(v), a.dy = T(dy), a.pse = T(pse), a.drop_mask = T(drop);
  a.padding_mask = T(pad), a.atten_mask = T(mask), a.softmax_max = T(smax), a.softmax_sum = T(ssum);
  a.softmax_io = T(sin), a.attention = T(attn), a.dq = T(dq), a.dk = T(dk), a.dv = T(dv), a.dpse = T(dpse);
  a.scale = scale, a.keep_prob = keep, a.pre_tokens = pre, a.next_tokens = next, a.head_num = heads;
  a.layout = layout, a.inner_precise = inner, a.sparse_mode = sparse;
  const aclTensor* ts[] = {q, k, v, dy, pse, drop, pad, mask, smax, ssum, sin, attn, dq, dk, dv, dpse};
  const aclIntArray* arrays[] = {prefix, nullptr, nullptr};
  return PlanAttentionCall(a, ts, 16, arrays, workspace, executor);
}
aclnnStatus aclnnFlashAttentionScoreGrad(void* w, uint64_t n, aclOpExecutor* e, aclrtStream) {
  return Run(w, n, e, "aclnnFlashAttentionScoreGrad");
}

aclnnStatus aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize(
    const aclTensor* q, const aclTensor* k, const aclTensor* v, const aclTensor* dy,
    const aclTensor* pse, const aclTensor* drop, const aclTensor* pad, const aclTensor* mask,
    const aclTensor* smax, const aclTensor* ssum, const aclTensor* sin, const aclTensor* attn,
    const aclIntArray* prefix, const aclIntArray* seq_q, const aclIntArray* seq_kv, double scale,
    double keep, int64_t pre, int64_t next, int64_t heads, char* layout, int64_t inner,
    int64_t sparse, const aclTensor* dq, const aclTensor* dk, const aclTensor* dv,
    const aclTensor* dpse, uint64_t* workspace, aclOpExecutor** executor) {
  std::lock_guard<std::mutex> lock(g_mutex);
  jax_rope_sim::AttentionArgs a;
  a.op = "aclnnFlashAttentionUnpaddingScoreGrad";
  a.varlen = a.backward = true;
  a.query = T(q), a.key = T(k), a.value = T(v), a.dy = T(dy), a.pse = T(pse), a.drop_mask = T(drop);
  a.padding_mask = T(pad), a.atten_mask = T(mask), a.softmax_max = T(smax), a.softmax_sum = T(ssum);
  a.softmax_io = T(sin), a.attention = T(attn), a.dq = T(dq), a.dk = T(dk), a.dv = T(dv), a.dpse = T(dpse);
  a.scale = scale, a.keep_prob = keep, a.pre_tokens = pre, a.next_tokens = next, a.head_num = heads;
  a.layout = layout, a.inner_precise = inner, a.sparse_mode = sparse;
  const aclTensor* ts[] = {q, k, v, dy, pse, drop, pad, mask, smax, ssum, sin, attn, dq, dk, dv, dpse};
  const aclIntArray* arrays[] = {prefix, seq_q, seq_kv};
  return PlanAttentionCall(a, ts, 16, arrays, workspace, executor);
}
aclnnStatus aclnnFlashAttentionUnpaddingScoreGrad(void* w, uint64_t n, aclOpExecutor* e, aclrtStream) {
  return Run(w, n, e, "aclnnFlashAttentionUnpaddingScoreGrad");
}

}  // extern "C"
