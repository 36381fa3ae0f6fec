// Shared by the simulated CANN runtime's translation units (tests only).
//
// The simulator is several libraries, laid out by the contract tests like a
// CANN install of one generation: the core (sim_core.cc: libascendcl and
// libnnopbase, with the descriptor and executor bookkeeping every library
// shares) and the operator libraries (sim_ops.cc + rope_grad.cc + attention.cc, compiled once
// per generation with JAX_ROPE_SIM_CANN = 80, 85 or 90), each exporting only
// the aclnn entry points its generation has.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "device_kernels/cpu/attention_kernels.h"

#define JAX_ROPE_SIM_EXPORT __attribute__((visibility("default")))

namespace jax_rope_sim {

// --- the core's shared state (sim_core.cc) ----------------------------------------

// An executor made by an operator library; the core frees it on
// aclDestroyAclOpExecutor.
struct ExecutorBase {
  virtual ~ExecutorBase() = default;
};

struct State {
  std::mutex mutex;
  std::set<const void*> tensors, arrays, executors;
  std::string error;
  int live_tensors = 0;
  // The bytes of the last dropMask an attention operator was given (tests read
  // them back with jax_rope_sim_last_drop_mask).
  std::vector<uint8_t> last_drop_mask;
  int generation = 0;  // CANN generation x 10 (80, 85, 90), set by the operator libraries
  // Device memory (aclrtMalloc): each block and the device it was taken on, and
  // the device aclrtGetDevice reports now (jax_rope_sim_set_device).
  std::map<const void*, int32_t> device_blocks;
  int32_t device = 0;
  // Failures the checks inject (jax_rope_sim_fail_next): runtime function -> the
  // status its next call returns.
  std::map<std::string, int32_t> failures;
  int device_copies = 0;  // device-to-device aclrtMemcpyAsync calls so far
};
JAX_ROPE_SIM_EXPORT State& Shared();
// The SoC aclrtGetSocName reports (JAX_ROPE_SIM_SOC; default Ascend910B2).
JAX_ROPE_SIM_EXPORT std::string Soc();

// Chip families as the operators' product tables group them.
enum class Chip { kA2A3, k310P, k950, kUnsupported };
JAX_ROPE_SIM_EXPORT Chip ChipOf(const std::string& soc);

// What an aclTensor handle points at: a dense row-major ND view.
struct Tensor {
  std::vector<int64_t> dims;
  int32_t dtype;
  void* data;
  int64_t elements() const {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    return n;
  }
};

inline std::string Shape(const Tensor* t) {
  std::string s = "(";
  for (size_t i = 0; i < t->dims.size(); ++i) s += (i ? ", " : "") + std::to_string(t->dims[i]);
  return s + ")";
}

// The arguments of the four FlashAttention entry points, in one record
// (forward: dy..dv null; non-varlen: seq_q/seq_kv null).
struct AttentionArgs {
  const char* op;
  bool varlen = false, backward = false;
  const Tensor *query = nullptr, *key = nullptr, *value = nullptr, *dy = nullptr;
  const Tensor *pse = nullptr, *drop_mask = nullptr, *padding_mask = nullptr, *atten_mask = nullptr;
  const Tensor *softmax_max = nullptr, *softmax_sum = nullptr;
  const Tensor *softmax_io = nullptr;  // forward: softmaxOutOut; backward: softmaxInOptional
  const Tensor *attention = nullptr;   // forward: attentionOutOut; backward: attentionInOptional
  const Tensor *dq = nullptr, *dk = nullptr, *dv = nullptr, *dpse = nullptr;
  const std::vector<int64_t> *prefix = nullptr, *seq_q = nullptr, *seq_kv = nullptr;
  // The V2 entry points: qStartIdx/kvStartIdx host arrays and pseType.
  bool v2 = false;
  const std::vector<int64_t> *q_start_idx = nullptr, *kv_start_idx = nullptr;
  int64_t pse_type = 1;
  double scale = 1.0, keep_prob = 1.0;
  int64_t pre_tokens = 0, next_tokens = 0, head_num = 0;
  const char* layout = nullptr;
  int64_t inner_precise = 0, sparse_mode = 0;
  int generation = 0;
};

// How the kernels read realShift/pse and dropMask (bias_dropout.h): set by
// the checks, used by the dense computation that runs any call with either.
enum class PseForm { kNone, kFull, kRow, kCompressed, kTndFull, kTndRow, kTndCompressed, kSlopes };
struct BiasDropoutPlan {
  PseForm form = PseForm::kNone;
  int64_t pse_type = 1;
  int64_t pse_batch = 1;                   // 1 or B (slopes: 1 for (N,))
  int64_t pse_rows = 0, pse_cols = 0;      // 4-D forms: the last two dims
  int64_t q_start_idx = 0, kv_start_idx = 0;  // what the tiling keeps (element 0 of both)
  bool drop = false;
  float keep_scale = 1.0f;
};

// A checked call, ready to run with jax_rope's CPU attention kernels
// (attention.cc plans it, attention_compute.cc runs it).
struct AttentionPlan {
  AttentionArgs a;
  jax_rope::cpu::AttentionGeometry g;
  std::vector<jax_rope::cpu::SequenceBand> seqs;
  // The tiling's "invalid line" mode: only with it do fully masked rows get
  // 0 / -FLT_MAX / FLT_MAX. innerPrecise=2 forces it; the tiling turns it on
  // by itself for band, rightDown and prefix geometries, not where a user
  // mask alone kills a row (modes 0 with a mask, 1, 5).
  bool invalid_line = true;
  int64_t n1 = 0, q_rows = 0;  // for the varlen statistics' NTD order
  BiasDropoutPlan bias;        // pse / dropMask: computed densely (bias_dropout.h)
};

// "" and a plan when the call keeps the documented contract, else why not;
// *null_argument tells ACLNN_ERR_PARAM_NULLPTR from ACLNN_ERR_PARAM_INVALID.
std::string PlanAttention(const AttentionArgs& args, std::shared_ptr<AttentionPlan>* plan,
                          bool* null_argument);
void RunAttention(const AttentionPlan& plan);
// Every descriptor the plan reads or writes (must still be alive at launch).
std::vector<const Tensor*> PlanTensors(const AttentionPlan& plan);

}  // namespace jax_rope_sim
