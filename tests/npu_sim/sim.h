// Shared by the simulated CANN runtime's translation units (tests only).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace jax_rope_sim {

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
  double scale = 1.0, keep_prob = 1.0;
  int64_t pre_tokens = 0, next_tokens = 0, head_num = 0;
  const char* layout = nullptr;
  int64_t inner_precise = 0, sparse_mode = 0;
};

// A checked call, ready to run with jax_rope's CPU attention kernels.
struct AttentionPlan;

// "" and a plan when the call keeps the documented contract, else why not;
// *null_argument tells ACLNN_ERR_PARAM_NULLPTR from ACLNN_ERR_PARAM_INVALID.
std::string PlanAttention(const AttentionArgs& args, std::shared_ptr<AttentionPlan>* plan,
                          bool* null_argument);
void RunAttention(const AttentionPlan& plan);
// Every descriptor the plan reads or writes (must still be alive at launch).
std::vector<const Tensor*> PlanTensors(const AttentionPlan& plan);

}  // namespace jax_rope_sim
