// The simulated aclnnRotaryPositionEmbeddingGrad (tests only), part of the
// operator libraries of generations 85 and 90 (the op is documented for Atlas
// A2/A3 from the CANN 8.3 docs on; jax_rope's generation 8.0 lacks it). The
// contract modelled is the A2/A3 one of
// posembedding/rotary_position_embedding_grad/docs/aclnnRotaryPositionEmbeddingGrad.md:
//   - dy, cos, sin, dxOut, dcosOut, dsinOut non-null (ACLNN_ERR_PARAM_NULLPTR);
//     xOptional may be null: then dcosOut/dsinOut are not computed;
//   - one dtype among float32/float16/bfloat16; 4-D (3-D TND from generation
//     90 only: the 8.3 docs say 4-D); dy, x and dx one shape; cos, sin, dcos
//     and dsin one shape; every D equal, even and < 896;
//   - mode 0 (half) or 1 (interleave) on A2/A3;
//   - half: cos/sin broadcast as 1S1D, BS1D (B < S) or BSND for BSND dy;
//     11SD, B1SD (B < S) or BNSD for BNSD; S11D, SB1D or SBND for SBND (the
//     operator has no layout argument: the pattern names the layout, in the
//     tiling's order); B < 1000, N < 1000 and, with x, B * N <= 1024.
// Computed with jax_rope's CPU RoPE kernels (half mode): dy as the query, an
// all-zero key, so dcos/dsin are the query path's own reduction. Interleave
// and Ascend 950's wider contract are not modelled (rejected as such); the
// other chips do not have the operator.
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "device_kernels/cpu/rope_kernels.h"
#include "device_kernels/npu/acl_api.h"
#include "tests/npu_sim/sim.h"

#ifndef JAX_ROPE_SIM_CANN
#error "JAX_ROPE_SIM_CANN (80, 85 or 90) must be defined"
#endif

#if JAX_ROPE_SIM_CANN >= 85
namespace {

using jax_rope_sim::Chip;
using jax_rope_sim::Shape;
using jax_rope_sim::Shared;
using jax_rope_sim::Tensor;

constexpr aclnnStatus kNullptr = 161001, kInvalid = 161002, kTiling = 561002;
constexpr const char* kOp = "aclnnRotaryPositionEmbeddingGrad";

aclnnStatus Fail(aclnnStatus status, const std::string& message) {
  Shared().error = std::string("EZ9999 simulated CANN: ") + kOp + ": " + message;
  return status;
}

const Tensor* T(const aclTensor* t) { return reinterpret_cast<const Tensor*>(t); }
std::string S(int64_t v) { return std::to_string(v); }

struct GradExecutor : jax_rope_sim::ExecutorBase {
  uint64_t workspace = 0;
  const Tensor *dy, *cos, *sin, *x, *dx, *dcos, *dsin;
  int32_t layout;  // jax_rope's layout code of the pattern the shapes matched
};
std::set<const void*>& Mine() {  // executors this operator made
  static std::set<const void*> mine;
  return mine;
}

struct Pattern {
  int32_t layout;  // 1 BSND, 2 SBND, 3 BNSD (jax_rope's codes)
  int64_t batch, heads;
};

// The documented half-mode broadcast patterns of cos against dy (4-D), in the
// tiling's order; false when none fits.
bool MatchHalf(const std::vector<int64_t>& x, const std::vector<int64_t>& c, Pattern* p) {
  const bool same = x == c;
  if (same || (c[0] == 1 && c[1] == x[1] && c[2] == 1) ||
      (c[0] == x[0] && c[1] == x[1] && c[2] == 1 && x[0] < x[1])) {
    *p = {1, x[0], x[2]};  // BSND: 1S1D, BS1D (B < S), BSND
    return true;
  }
  if ((c[0] == 1 && c[1] == 1 && c[2] == x[2]) ||
      (c[0] == x[0] && c[1] == 1 && c[2] == x[2] && x[0] < x[2])) {
    *p = {3, x[0], x[1]};  // BNSD: 11SD, B1SD (B < S)
    return true;
  }
  if (c[0] == x[0] && c[2] == 1 && (c[1] == 1 || c[1] == x[1])) {
    *p = {2, x[1], x[2]};  // SBND: S11D, SB1D
    return true;
  }
  return false;
}

std::string Check(const Tensor* dy, const Tensor* c, const Tensor* s, const Tensor* x,
                  const Tensor* dx, const Tensor* dc, const Tensor* ds, int64_t mode, Pattern* p) {
  const Chip chip = jax_rope_sim::ChipOf(jax_rope_sim::Soc());
  if (chip == Chip::k950) return "Ascend 950's contract is not modelled by the simulator";
  if (chip != Chip::kA2A3) return "not supported on SoC " + jax_rope_sim::Soc();
  for (const Tensor* t : {c, s, x, dx, dc, ds}) {
    if (t != nullptr && t->dtype != dy->dtype) return "every tensor must have dy's dtype";
  }
  if (dy->dtype != kAclFloat && dy->dtype != kAclFloat16 && dy->dtype != kAclBFloat16) {
    return "dtype must be float32, float16 or bfloat16";
  }
  const size_t rank = dy->dims.size();
  if (rank != 4 && !(rank == 3 && JAX_ROPE_SIM_CANN >= 90)) {
    return "dy must be 4-D" + std::string(JAX_ROPE_SIM_CANN >= 90 ? " or 3-D" : "") +
           ", got " + Shape(dy);
  }
  if (c->dims.size() != rank) return "cos and dy must have the same rank";
  if (dx->dims != dy->dims || (x != nullptr && x->dims != dy->dims)) {
    return "dy, xOptional and dxOut must have one shape";
  }
  if (s->dims != c->dims || dc->dims != c->dims || ds->dims != c->dims) {
    return "cos, sin, dcosOut and dsinOut must have one shape";
  }
  const int64_t d = dy->dims.back();
  if (c->dims.back() != d || d >= 896 || d % 2 != 0) {
    return "D must be equal for dy and cos, even and < 896: dy " + Shape(dy) + ", cos " + Shape(c);
  }
  if (mode == 1) return "interleave (mode 1) is not modelled by the simulator";
  if (mode != 0) return "mode must be 0 (half) or 1 (interleave) on Atlas A2/A3, got " + S(mode);
  std::vector<int64_t> xd = dy->dims, cd = c->dims;
  if (rank == 3) {  // TND: T1D or TND, as B = 1
    xd.insert(xd.begin(), 1);
    cd.insert(cd.begin(), 1);
  }
  if (!MatchHalf(xd, cd, p)) {
    return "cos " + Shape(c) + " does not broadcast to dy " + Shape(dy) + " in a documented way";
  }
  if (p->batch >= 1000 || p->heads >= 1000) return "B and N must be < 1000";
  if (x != nullptr && p->batch * p->heads > 1024) {
    return "B * N = " + S(p->batch * p->heads) + " > 1024 with dcos/dsin";
  }
  return "";
}

template <typename E>
void Compute(const GradExecutor& e) {
  const Tensor& dy = *e.dy;
  std::vector<int64_t> xd = dy.dims, cd = e.cos->dims;
  if (xd.size() == 3) {
    xd.insert(xd.begin(), 1);
    cd.insert(cd.begin(), 1);
  }
  // The CPU kernels take cos with head axis 1: a full BSND cos (N > 1) was
  // matched only when N == 1, so cd's head axis is 1 here.
  jax_rope::cpu::RopeGeometry g;
  if (!jax_rope::cpu::MakeRopeGeometry(e.layout, 0, xd, xd, cd, cd, &g).empty()) return;
  const int64_t n = dy.elements();
  std::vector<E> zeros(n), dkey(n);  // value-initialised: all bits 0, i.e. 0.0
  auto p = [](const Tensor* t) { return t ? static_cast<E*>(t->data) : nullptr; };
  const bool with_x = e.x != nullptr;
  jax_rope::cpu::RopeBackwardArgs<E> args{
      p(e.dy), zeros.data(), p(e.cos), p(e.sin), with_x ? p(e.x) : nullptr,
      with_x ? zeros.data() : nullptr, p(e.dx), dkey.data(), with_x ? p(e.dcos) : nullptr,
      with_x ? p(e.dsin) : nullptr};
  if (!with_x) {  // not computed: whatever the caller reads there is garbage
    std::memset(e.dcos->data, 0x7F, e.dcos->elements() * sizeof(E));
    std::memset(e.dsin->data, 0x7F, e.dsin->elements() * sizeof(E));
  }
  std::vector<float> partial(with_x ? jax_rope::cpu::RopeBackwardPartialFloats(g) : 0);
  args.partial = partial.empty() ? nullptr : partial.data();
  jax_rope::cpu::RopeBackward(g, args, 0, g.tokens());
  jax_rope::cpu::RopeReduceTables(g, args, 0, g.seq);
}

}  // namespace

extern "C" {

JAX_ROPE_SIM_EXPORT aclnnStatus aclnnRotaryPositionEmbeddingGradGetWorkspaceSize(
    const aclTensor* dy, const aclTensor* cos, const aclTensor* sin, const aclTensor* x,
    int64_t mode, const aclTensor* dx, const aclTensor* dcos, const aclTensor* dsin,
    uint64_t* workspace, aclOpExecutor** executor) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  if (!dy || !cos || !sin || !dx || !dcos || !dsin || !workspace || !executor) {
    return Fail(kNullptr, "dy, cos, sin, dxOut, dcosOut and dsinOut must not be null");
  }
  for (const aclTensor* t : {dy, cos, sin, x, dx, dcos, dsin}) {
    if (t != nullptr && Shared().tensors.count(t) == 0) {
      return Fail(kInvalid, "destroyed descriptor");
    }
  }
  Pattern p{};
  if (std::string why = Check(T(dy), T(cos), T(sin), T(x), T(dx), T(dcos), T(dsin), mode, &p);
      !why.empty()) {
    // Chip and dtype problems are PARAM_INVALID; shape and mode ones come from the tiling.
    const bool param =
        why.find("dtype") != std::string::npos || why.find("SoC") != std::string::npos;
    return Fail(param ? kInvalid : kTiling, why);
  }
  auto* e = new GradExecutor;
  e->workspace = 2048;
  e->dy = T(dy), e->cos = T(cos), e->sin = T(sin), e->x = T(x), e->dx = T(dx);
  e->dcos = T(dcos), e->dsin = T(dsin), e->layout = p.layout;
  jax_rope_sim::ExecutorBase* base = e;
  Shared().executors.insert(base);
  Mine().insert(base);
  *workspace = e->workspace;
  *executor = reinterpret_cast<aclOpExecutor*>(base);
  return 0;
}

JAX_ROPE_SIM_EXPORT aclnnStatus aclnnRotaryPositionEmbeddingGrad(void* workspace, uint64_t size,
                                                                 aclOpExecutor* handle,
                                                                 aclrtStream) {
  std::lock_guard<std::mutex> lock(Shared().mutex);
  if (handle == nullptr || Shared().executors.count(handle) == 0 || Mine().count(handle) == 0) {
    return Fail(kNullptr, "unknown executor");
  }
  auto* e = static_cast<GradExecutor*>(reinterpret_cast<jax_rope_sim::ExecutorBase*>(handle));
  if (size != e->workspace || workspace == nullptr) {
    return Fail(kInvalid,
                "workspace of " + S(size) + " bytes given, " + S(e->workspace) + " required");
  }
  std::memset(workspace, 0xA5, size);  // the caller must really own it
  for (const Tensor* t : {e->dy, e->cos, e->sin, e->x, e->dx, e->dcos, e->dsin}) {
    if (t != nullptr && Shared().tensors.count(t) == 0) {
      return Fail(kInvalid, "a descriptor was destroyed before launch");
    }
  }
  if (e->dy->dtype == kAclFloat) Compute<float>(*e);
  else if (e->dy->dtype == kAclFloat16) Compute<jax_rope::cpu::Float16>(*e);
  else Compute<jax_rope::cpu::BFloat16>(*e);
  Shared().executors.erase(handle);  // one launch per executor
  Mine().erase(handle);
  delete e;
  return 0;
}

}  // extern "C"
#endif  // JAX_ROPE_SIM_CANN >= 85
