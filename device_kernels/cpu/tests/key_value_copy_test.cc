// When the tiled forward reads a head-major copy of K and V
// (CopyKeyValueFirst) and the copy's shape (HeadMajorKeyValue), for the
// benchmark shapes and the layouts of tests/test_attention_kernel_paths.py;
// attention_kernel_test checks that the copy gives the same bits. Built and run
// by ctest (CMake option JAX_ROPE_BUILD_TESTS); exit status 1 on failure.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "device_kernels/cpu/attention_kernels.h"

namespace {

using jax_rope::Strides;
using namespace jax_rope::cpu;

constexpr int32_t kInf = 1 << 30;
int g_failures = 0;
int g_checks = 0;

void Fail(const std::string& what) {
  if (++g_failures <= 30) std::printf("FAIL: %s\n", what.c_str());
}

// Which calls the forward runs on a head-major copy of K and V (CopyKeyValueFirst).
void CheckCopyDecision() {
  struct Case {
    const char* what;
    int64_t b, sq, skv, n1, n2, d;
    int32_t hi_off;  // kInf: no mask; else causal
    bool heads_major, want;
  };
  const Case cases[] = {
      {"chunked prefill", 1, 256, 8192, 32, 8, 128, 8192 - 256, false, true},
      {"chunked prefill, BNSD input", 1, 256, 8192, 32, 8, 128, 8192 - 256, true, false},
      {"causal S4096", 1, 4096, 4096, 8, 8, 128, 0, false, true},
      {"causal S2048", 1, 2048, 2048, 8, 8, 128, 0, false, true},
      {"causal S256 (one item per head)", 1, 256, 256, 8, 8, 128, 0, false, false},
      {"training S512", 16, 512, 512, 16, 16, 64, 0, false, false},
      {"one kv head: rows adjacent", 1, 4096, 4096, 8, 1, 128, 0, false, false},
      {"GQA S256 unmasked (as in test_attention_kernel_paths.py)", 2, 256, 256, 8, 2, 64, kInf,
       false, true},
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
  // Packed TND, sequences of 200 and 256 rows, N1 = 8, N2 = 2, D = 64, unmasked (as in
  // test_attention_kernel_paths.py): one copy of the union of the rows.
  AttentionGeometry g;
  g.batch = 2;
  g.q_heads = 8;
  g.kv_heads = 2;
  g.head_dim = g.value_dim = 64;
  g.q = g.out = {0, 8 * 64, 64};
  g.k = g.v = {0, 2 * 64, 64};
  g.stats = {0, 8, 1};
  const SequenceBand seqs[2] = {{0, 200, 0, 200, -kInf, kInf, -kInf},
                                {200, 256, 200, 256, -kInf, kInf, -kInf}};
  const KeyValueCopy plan = HeadMajorKeyValue(g, seqs);
  ++g_checks;
  if (!CopyKeyValueFirst(g, seqs, sizeof(float)) || plan.rows != 456 ||
      plan.k.batch != 0 || plan.k.head != 456 * 64) {
    Fail("copy decision: packed TND");
  }
}

}  // namespace

int main() {
  CheckCopyDecision();
  std::printf("%d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
