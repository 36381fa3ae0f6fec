// The slice of the CANN ACL / ACLNN C interface jax_rope calls, declared here
// from CANN's public documentation (no CANN headers, no link-time dependency):
// opaque handle types, the few enum values we pass, and one function-pointer
// type per entry point. AclApi (acl_runtime.h) resolves them with dlsym.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

// Opaque handles: only ever passed back to the library that made them.
struct aclTensor;
struct aclIntArray;
struct aclOpExecutor;
typedef void* aclrtStream;

typedef int aclError;          // ACL runtime status, 0 = success
typedef int32_t aclnnStatus;   // ACLNN status, 0 = success

// aclDataType values used here.
enum JaxRopeAclDataType : int32_t {
  kAclFloat = 0,
  kAclFloat16 = 1,
  kAclInt32 = 3,
  kAclUint8 = 4,
  kAclInt64 = 9,
  kAclBool = 12,
  kAclBFloat16 = 27,
};

constexpr int32_t kAclFormatND = 2;                 // aclFormat ACL_FORMAT_ND
constexpr int32_t kAclMemcpyHostToDevice = 1;       // aclrtMemcpyKind
constexpr int32_t kAclMemcpyDeviceToHost = 2;
constexpr int32_t kAclMemcpyDeviceToDevice = 3;
constexpr int32_t kAclMemMallocHugeFirst = 0;       // aclrtMemMallocPolicy

// libascendcl
typedef const char* (*AclrtGetSocNameFn)();
typedef const char* (*AclGetRecentErrMsgFn)();
typedef aclError (*AclrtMemcpyAsyncFn)(void* dst, size_t dest_max, const void* src, size_t count,
                                       int32_t kind, aclrtStream stream);
typedef aclError (*AclrtMemcpyFn)(void* dst, size_t dest_max, const void* src, size_t count,
                                  int32_t kind);
typedef aclError (*AclrtSynchronizeStreamFn)(aclrtStream stream);
typedef aclError (*AclrtMallocFn)(void** ptr, size_t size, int32_t policy);
typedef aclError (*AclrtFreeFn)(void* ptr);
typedef aclError (*AclrtGetDeviceFn)(int32_t* device_id);
// Page-locked host memory: CANN 8.0/8.1 require it for asynchronous
// device-to-host copies (aclrtMemcpyAsync's documented contract).
typedef aclError (*AclrtMallocHostFn)(void** ptr, size_t size);
typedef aclError (*AclrtFreeHostFn)(void* ptr);

// libnnopbase
typedef aclTensor* (*AclCreateTensorFn)(const int64_t* view_dims, uint64_t view_dims_num,
                                        int32_t data_type, const int64_t* stride, int64_t offset,
                                        int32_t format, const int64_t* storage_dims,
                                        uint64_t storage_dims_num, void* tensor_data);
typedef aclnnStatus (*AclDestroyTensorFn)(const aclTensor* tensor);
typedef aclIntArray* (*AclCreateIntArrayFn)(const int64_t* value, uint64_t size);
typedef aclnnStatus (*AclDestroyIntArrayFn)(const aclIntArray* array);
// Frees an executor that will not be launched (a failed workspace allocation).
typedef aclnnStatus (*AclDestroyAclOpExecutorFn)(aclOpExecutor* executor);

// The operator libraries (libcust_opapi, libopapi_<repo>, libopapi): every
// operator is a GetWorkspaceSize / launch pair, resolved per operator.
typedef aclnnStatus (*AclnnLaunchFn)(void* workspace, uint64_t workspace_size,
                                     aclOpExecutor* executor, aclrtStream stream);
typedef aclnnStatus (*AclnnRopeV2WorkspaceFn)(aclTensor* query_ref, aclTensor* key_ref,
                                              const aclTensor* cos, const aclTensor* sin,
                                              int64_t layout, char* rotary_mode,
                                              uint64_t* workspace_size, aclOpExecutor** executor);
typedef aclnnStatus (*AclnnRopeGradWorkspaceFn)(
    const aclTensor* grad_query, const aclTensor* grad_key, const aclTensor* cos,
    const aclTensor* sin, const aclTensor* query, const aclTensor* key, char* rotary_mode,
    int64_t layout, const aclTensor* dquery, const aclTensor* dkey, const aclTensor* dcos,
    const aclTensor* dsin, uint64_t* workspace_size, aclOpExecutor** executor);
// aclnnRotaryPositionEmbeddingGrad: one tensor; mode 0 = half, 1 = interleave
// (A2/A3). dcosOut/dsinOut must be non-null; computed only when x is given.
typedef aclnnStatus (*AclnnRopeSingleGradWorkspaceFn)(
    const aclTensor* dy, const aclTensor* cos, const aclTensor* sin, const aclTensor* x,
    int64_t mode, const aclTensor* dx, const aclTensor* dcos, const aclTensor* dsin,
    uint64_t* workspace_size, aclOpExecutor** executor);
typedef aclnnStatus (*AclnnFlashAttentionWorkspaceFn)(
    const aclTensor* query, const aclTensor* key, const aclTensor* value,
    const aclTensor* real_shift, const aclTensor* drop_mask, const aclTensor* padding_mask,
    const aclTensor* atten_mask, const aclIntArray* prefix, double scale, double keep_prob,
    int64_t pre_tokens, int64_t next_tokens, int64_t head_num, char* input_layout,
    int64_t inner_precise, int64_t sparse_mode, const aclTensor* softmax_max,
    const aclTensor* softmax_sum, const aclTensor* softmax_out, const aclTensor* attention_out,
    uint64_t* workspace_size, aclOpExecutor** executor);
typedef aclnnStatus (*AclnnFlashAttentionVarLenWorkspaceFn)(
    const aclTensor* query, const aclTensor* key, const aclTensor* value,
    const aclTensor* real_shift, const aclTensor* drop_mask, const aclTensor* padding_mask,
    const aclTensor* atten_mask, const aclIntArray* prefix, const aclIntArray* actual_seq_qlen,
    const aclIntArray* actual_seq_kvlen, double scale, double keep_prob, int64_t pre_tokens,
    int64_t next_tokens, int64_t head_num, char* input_layout, int64_t inner_precise,
    int64_t sparse_mode, const aclTensor* softmax_max, const aclTensor* softmax_sum,
    const aclTensor* softmax_out, const aclTensor* attention_out, uint64_t* workspace_size,
    aclOpExecutor** executor);
typedef aclnnStatus (*AclnnFlashAttentionGradWorkspaceFn)(
    const aclTensor* query, const aclTensor* key, const aclTensor* value, const aclTensor* dy,
    const aclTensor* pse_shift, const aclTensor* drop_mask, const aclTensor* padding_mask,
    const aclTensor* atten_mask, const aclTensor* softmax_max, const aclTensor* softmax_sum,
    const aclTensor* softmax_in, const aclTensor* attention_in, const aclIntArray* prefix,
    double scale, double keep_prob, int64_t pre_tokens, int64_t next_tokens, int64_t head_num,
    char* input_layout, int64_t inner_precise, int64_t sparse_mode, const aclTensor* dq,
    const aclTensor* dk, const aclTensor* dv, const aclTensor* dpse, uint64_t* workspace_size,
    aclOpExecutor** executor);
typedef aclnnStatus (*AclnnFlashAttentionVarLenGradWorkspaceFn)(
    const aclTensor* query, const aclTensor* key, const aclTensor* value, const aclTensor* dy,
    const aclTensor* pse_shift, const aclTensor* drop_mask, const aclTensor* padding_mask,
    const aclTensor* atten_mask, const aclTensor* softmax_max, const aclTensor* softmax_sum,
    const aclTensor* softmax_in, const aclTensor* attention_in, const aclIntArray* prefix,
    const aclIntArray* actual_seq_qlen, const aclIntArray* actual_seq_kvlen, double scale,
    double keep_prob, int64_t pre_tokens, int64_t next_tokens, int64_t head_num,
    char* input_layout, int64_t inner_precise, int64_t sparse_mode, const aclTensor* dq,
    const aclTensor* dk, const aclTensor* dv, const aclTensor* dpse, uint64_t* workspace_size,
    aclOpExecutor** executor);

// The V2 forms (Atlas A2/A3; ScoreV2 and ScoreGradV2 also Ascend 950): the
// same arguments plus qStartIdx/kvStartIdx (host int arrays, element 0 read)
// after prefix (VarLen: after the cumulative lengths) and pseType after
// sparseMode (aclnn_flash_attention_score.h, aclnn_flash_attention_score_grad.h).
typedef aclnnStatus (*AclnnFlashAttentionV2WorkspaceFn)(
    const aclTensor* query, const aclTensor* key, const aclTensor* value,
    const aclTensor* real_shift, const aclTensor* drop_mask, const aclTensor* padding_mask,
    const aclTensor* atten_mask, const aclIntArray* prefix, const aclIntArray* q_start_idx,
    const aclIntArray* kv_start_idx, double scale, double keep_prob, int64_t pre_tokens,
    int64_t next_tokens, int64_t head_num, char* input_layout, int64_t inner_precise,
    int64_t sparse_mode, int64_t pse_type, const aclTensor* softmax_max,
    const aclTensor* softmax_sum, const aclTensor* softmax_out, const aclTensor* attention_out,
    uint64_t* workspace_size, aclOpExecutor** executor);
typedef aclnnStatus (*AclnnFlashAttentionVarLenV2WorkspaceFn)(
    const aclTensor* query, const aclTensor* key, const aclTensor* value,
    const aclTensor* real_shift, const aclTensor* drop_mask, const aclTensor* padding_mask,
    const aclTensor* atten_mask, const aclIntArray* prefix, const aclIntArray* actual_seq_qlen,
    const aclIntArray* actual_seq_kvlen, const aclIntArray* q_start_idx,
    const aclIntArray* kv_start_idx, double scale, double keep_prob, int64_t pre_tokens,
    int64_t next_tokens, int64_t head_num, char* input_layout, int64_t inner_precise,
    int64_t sparse_mode, int64_t pse_type, const aclTensor* softmax_max,
    const aclTensor* softmax_sum, const aclTensor* softmax_out, const aclTensor* attention_out,
    uint64_t* workspace_size, aclOpExecutor** executor);
typedef aclnnStatus (*AclnnFlashAttentionGradV2WorkspaceFn)(
    const aclTensor* query, const aclTensor* key, const aclTensor* value, const aclTensor* dy,
    const aclTensor* pse_shift, const aclTensor* drop_mask, const aclTensor* padding_mask,
    const aclTensor* atten_mask, const aclTensor* softmax_max, const aclTensor* softmax_sum,
    const aclTensor* softmax_in, const aclTensor* attention_in, const aclIntArray* prefix,
    const aclIntArray* q_start_idx, const aclIntArray* kv_start_idx, double scale,
    double keep_prob, int64_t pre_tokens, int64_t next_tokens, int64_t head_num,
    char* input_layout, int64_t inner_precise, int64_t sparse_mode, int64_t pse_type,
    const aclTensor* dq, const aclTensor* dk, const aclTensor* dv, const aclTensor* dpse,
    uint64_t* workspace_size, aclOpExecutor** executor);
typedef aclnnStatus (*AclnnFlashAttentionVarLenGradV2WorkspaceFn)(
    const aclTensor* query, const aclTensor* key, const aclTensor* value, const aclTensor* dy,
    const aclTensor* pse_shift, const aclTensor* drop_mask, const aclTensor* padding_mask,
    const aclTensor* atten_mask, const aclTensor* softmax_max, const aclTensor* softmax_sum,
    const aclTensor* softmax_in, const aclTensor* attention_in, const aclIntArray* prefix,
    const aclIntArray* actual_seq_qlen, const aclIntArray* actual_seq_kvlen,
    const aclIntArray* q_start_idx, const aclIntArray* kv_start_idx, double scale,
    double keep_prob, int64_t pre_tokens, int64_t next_tokens, int64_t head_num,
    char* input_layout, int64_t inner_precise, int64_t sparse_mode, int64_t pse_type,
    const aclTensor* dq, const aclTensor* dk, const aclTensor* dv, const aclTensor* dpse,
    uint64_t* workspace_size, aclOpExecutor** executor);

}  // extern "C"
