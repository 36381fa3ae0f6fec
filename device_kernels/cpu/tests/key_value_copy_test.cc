// When the tiled forward reads a head-major copy of K and V
// (CopyKeyValueFirst) and the copy's shape (HeadMajorKeyValue), for the
// benchmark shapes and the layouts of tests/test_attention_kernel_paths.py, and
// the forward's work items as the workers grow (AttentionForwardWorkItems);
// attention_kernel_test checks that the copy gives the same bits. Built and run
// by ctest (CMake option JAX_ROPE_BUILD_TESTS); exit status 1 on failure.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "device_kernels/cpu/attention_kernels.h"
#include "device_kernels/cpu/tests/check_count.h"

namespace {

using jax_rope::Strides;
using namespace jax_rope::cpu;

constexpr int32_t kInf = 1 << 30;
using namespace jax_rope::cpu::check_count;

// Which calls the forward runs on a head-major copy of K and V (CopyKeyValueFirst).
void CheckCopyDecision() {
  struct Case {
    const char* what;
    int64_t b, sq, skv, n1, n2, d;
    int32_t hi_off;  // kInf: no mask; else causal
    bool heads_major, want;
  };
  // With one worker (AttentionGeometry's default) up to 16 lanes take every query block
  // of a head group where that leaves 4 items per worker: each key row is then read once.
  const Case cases[] = {
      {"chunked prefill (one item per kv head)", 1, 256, 8192, 32, 8, 128, 8192 - 256, false,
       false},
      {"chunked prefill, BNSD input", 1, 256, 8192, 32, 8, 128, 8192 - 256, true, false},
      {"causal S4096", 1, 4096, 4096, 8, 8, 128, 0, false, true},
      {"causal S2048 (items of 512 rows read 2.5 rows per row)", 1, 2048, 2048, 8, 8, 128, 0,
       false, false},
      {"causal S256 (one item per head)", 1, 256, 256, 8, 8, 128, 0, false, false},
      {"training S512", 16, 512, 512, 16, 16, 64, 0, false, false},
      {"one kv head: rows adjacent", 1, 4096, 4096, 8, 1, 128, 0, false, false},
      {"GQA S512 unmasked (as in test_attention_kernel_paths.py)", 2, 512, 512, 8, 2, 64, kInf,
       false, true},
      {"GQA S256 unmasked (one item per kv head)", 2, 256, 256, 8, 2, 64, kInf, false, false},
  };
  for (const Case& c : cases) {
    AttentionGeometry g;
    g.batch = c.b;
    g.q_heads = c.n1;
    g.kv_heads = c.n2;
    g.head_dim = g.value_dim = c.d;
    g.q = {c.sq * c.n1 * c.d, c.n1 * c.d, c.d};
    g.k = c.heads_major ? Strides{c.n2 * c.skv * c.d, c.d, c.skv * c.d}
                        : Strides{c.skv * c.n2 * c.d, c.n2 * c.d, c.d};
    g.v = g.k;
    g.out = g.q;
    g.stats = {c.sq * c.n1, c.n1, 1};
    const std::vector<SequenceBand> seqs(
        c.b, SequenceBand{0, int32_t(c.sq), 0, int32_t(c.skv), -kInf, c.hi_off, -kInf});
    ++g_checks;
    if (CopyKeyValueFirst(g, seqs.data(), sizeof(float)) != c.want) {
      Fail(std::string("copy decision: ") + c.what);
    }
    if (c.want && CopyKeyValueFirst(g, seqs.data(), kMaxKeyValueCopyBytes)) {
      Fail(std::string("copy decision past kMaxKeyValueCopyBytes: ") + c.what);
    }
  }
  // Packed TND, sequences of 400 and 512 rows, N1 = 8, N2 = 2, D = 64, unmasked (as in
  // test_attention_kernel_paths.py): one copy of the union of the rows.
  AttentionGeometry g;
  g.batch = 2;
  g.q_heads = 8;
  g.kv_heads = 2;
  g.head_dim = g.value_dim = 64;
  g.q = g.out = {0, 8 * 64, 64};
  g.k = g.v = {0, 2 * 64, 64};
  g.stats = {0, 8, 1};
  const SequenceBand seqs[2] = {{0, 400, 0, 400, -kInf, kInf, -kInf},
                                {400, 512, 400, 512, -kInf, kInf, -kInf}};
  const KeyValueCopy plan = HeadMajorKeyValue(g, seqs);
  ++g_checks;
  if (!CopyKeyValueFirst(g, seqs, sizeof(float)) || plan.rows != 912 ||
      plan.k.batch != 0 || plan.k.head != 912 * 64) {
    Fail("copy decision: packed TND");
  }
}

// How many forward items a call has as its workers grow: one per (sequence, head group) while
// that leaves 4 items per worker, else items of up to 8 lanes.
void CheckForwardItems() {
  struct Case {
    const char* what;
    int64_t b, sq, skv, n1, n2, workers, want;
  };
  const Case cases[] = {
      {"chunked prefill, 2 workers: one item per kv head", 1, 256, 8192, 32, 8, 2, 8},
      {"chunked prefill, 4 workers: 4 heads x 2 blocks", 1, 256, 8192, 32, 8, 4, 16},
      {"causal S4096 N8: 8 blocks per item", 1, 4096, 4096, 8, 8, 2, 64},
      {"causal S2048 N8: 8 blocks per item", 1, 2048, 2048, 8, 8, 2, 32},
      {"B2 S1200 N8/2: 4 heads x 2 blocks (19 blocks do not fit 16 lanes)", 2, 1200, 1200, 8,
       2, 1, 40},
      {"B2 S1000 N8/8: one item per head (16 blocks)", 2, 1000, 1000, 8, 8, 1, 16},
      {"B2 S1000 N8/8, 8 workers: 8 blocks per item", 2, 1000, 1000, 8, 8, 8, 32},
  };
  for (const Case& c : cases) {
    AttentionGeometry g;
    g.batch = c.b;
    g.q_heads = c.n1;
    g.kv_heads = c.n2;
    g.head_dim = g.value_dim = 128;
    g.q = g.out = {c.sq * c.n1 * 128, c.n1 * 128, 128};
    g.k = g.v = {c.skv * c.n2 * 128, c.n2 * 128, 128};
    g.stats = {c.sq * c.n1, c.n1, 1};
    g.workers = c.workers;
    const std::vector<SequenceBand> seqs(
        c.b, SequenceBand{0, int32_t(c.sq), 0, int32_t(c.skv), -kInf, kInf, -kInf});
    ++g_checks;
    const int64_t items = AttentionForwardWorkItems(g, seqs.data());
    if (items != c.want) {
      Fail(std::string("forward items: ") + c.what + ": " + std::to_string(items));
    }
  }
}

}  // namespace

int main() {
  CheckCopyDecision();
  CheckForwardItems();
  return Finish();
}
