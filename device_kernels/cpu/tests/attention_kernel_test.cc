// Standalone check of the CPU attention kernels against a double-precision
// reference written from spec/attention.md (no JAX), every case twice: with this
// CPU's tile routines, then with the branches those leave out (B blocks copied
// or in place, bfloat16 scores on a bf16_gemm or widened; see main), and a
// third time on vdpbf16ps where the bf16 GEMMs run on AMX. Built by CMake with the
// kernel library as it ships (option JAX_ROPE_BUILD_TESTS; `make kernel-test`
// builds it in build/tests and runs ctest); exit status 1 on failure. Timings:
// attention_kernel_bench.cc.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "device_kernels/cpu/attention_kernels.h"
#include "device_kernels/cpu/attention_tiles.h"
#include "device_kernels/cpu/tests/attention_cases.h"
#include "device_kernels/cpu/tests/attention_reference.h"
#include "device_kernels/cpu/tests/bf16_gemm_emulated.h"
#include "device_kernels/cpu/tests/check_count.h"
#include "device_kernels/cpu/thread_scratch.h"

namespace {

using namespace jax_rope::cpu;
using namespace jax_rope::cpu::test;
using jax_rope::Strides;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

using namespace jax_rope::cpu::check_count;

int g_copied_cases = 0;  // cases run through the head-major K/V copy
int g_reshaped_cases = 0;  // cases whose forward items change with the workers

// ---------------------------------------------------------------------------
// Running the kernels the way the FFI handlers do.

// Rows inside some sequence (the kernels must write them; the caller fills the rest).
std::vector<char> RowsInside(const Problem& p, const Strides& s, int64_t size, int64_t heads,
                             int64_t dim, bool kv) {
  std::vector<char> inside(size, 0);
  for (size_t b = 0; b < p.seqs.size(); ++b) {
    const int64_t start = kv ? p.seqs[b].kv_start : p.seqs[b].q_start;
    const int64_t len = kv ? p.seqs[b].kv_len : p.seqs[b].q_len;
    for (int64_t i = 0; i < len; ++i) {
      for (int64_t n = 0; n < heads; ++n) {
        for (int64_t e = 0; e < dim; ++e) inside[Off(s, b, start + i, n) + e] = 1;
      }
    }
  }
  return inside;
}

// Caller's pre-fill outside sequences, garbage inside (which the kernels must overwrite).
template <typename T>
std::vector<T> Prefilled(const std::vector<char>& inside, float outside) {
  std::vector<T> x(inside.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = FromFloat<T>(inside[i] ? 777.0f : outside);
  return x;
}

// Runs fn over [0, n) in uneven chunks, in reverse order (items must be independent).
void RunChunks(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  std::vector<std::pair<int64_t, int64_t>> chunks;
  for (int64_t b = 0, step = 1; b < n; b += step, step = step * 2 + 1) {
    chunks.push_back({b, std::min(n, b + step)});
  }
  std::reverse(chunks.begin(), chunks.end());
  for (auto [b, e] : chunks) fn(b, e);
  fn(n, n + 5);  // empty and out-of-range ranges are no-ops
}

template <typename T>
std::vector<float> ToFloats(const std::vector<T>& x) {
  std::vector<float> f(x.size());
  for (size_t i = 0; i < x.size(); ++i) f[i] = ToFloat(x[i]);
  return f;
}

// |got - ref| <= tol * (max |ref| + |ref|), and no NaN/inf.
void Compare(const std::string& what, const std::vector<float>& got,
             const std::vector<double>& ref, double tol) {
  ++g_checks;
  double scale = 1e-3;
  for (double r : ref) {
    if (std::abs(r) < 1e37) scale = std::max(scale, std::abs(r));
  }
  double worst = 0.0;
  int64_t worst_at = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i]) && std::isfinite(ref[i])) {
      Fail(what + ": non-finite at " + std::to_string(i));
      return;
    }
    const double err = std::abs(got[i] - ref[i]) / (scale + std::abs(ref[i]));
    if (err > worst) {
      worst = err;
      worst_at = static_cast<int64_t>(i);
    }
  }
  if (worst > tol) {
    Fail(what + ": error " + std::to_string(worst) + " at " + std::to_string(worst_at) +
         " got " + std::to_string(got[worst_at]) + " want " + std::to_string(ref[worst_at]));
  }
}

template <typename T>
double Tolerance() {
  if (std::is_same_v<T, float>) return 2e-5;
  if (std::is_same_v<T, Float16>) return 4e-3;
  return 3e-2;
}

template <typename T>
void RunProblem(const Problem& p, uint32_t seed) {
  std::mt19937 rng(seed);
  Tensors t = MakeTensors<T>(p, rng);
  const Reference ref = ComputeReference(p, t);
  AttentionGeometry g = t.g;
  std::vector<T> bias(t.bias.size());  // tensor kinds: the query's dtype
  for (size_t i = 0; i < bias.size(); ++i) bias[i] = FromFloat<T>(t.bias[i]);
  if (g.bias.kind != BiasKind::kNone && g.bias.kind != BiasKind::kAlibi &&
      g.bias.kind != BiasKind::kAlibiSqrt) {
    g.bias.data = bias.data();
  }
  const std::string name = p.name + (std::is_same_v<T, float> ? " f32" :
                                     std::is_same_v<T, Float16> ? " f16" : " bf16");
  auto typed = [](const std::vector<float>& x) {
    std::vector<T> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = FromFloat<T>(x[i]);
    return y;
  };
  const std::vector<T> q = typed(t.q), k = typed(t.k), v = typed(t.v), dout = typed(t.dout);
  const auto o_inside = RowsInside(p, g.out, t.o_size, p.n1, p.dv, false);
  const auto s_inside = RowsInside(p, g.stats, t.stat_size, p.n1, 1, false);
  std::vector<T> out = Prefilled<T>(o_inside, 0.0f);
  std::vector<float> smax = Prefilled<float>(s_inside, kMaskValue);
  std::vector<float> ssum = Prefilled<float>(s_inside, kDeadRowSum);

  const int64_t items = ForwardWorkItems(g, p.seqs.data());
  AttentionForwardArgs<T> fa{q.data(), k.data(), v.data(), out.data(), smax.data(), ssum.data()};
  RunChunks(AttentionForwardWorkItems(g, p.seqs.data()),
            [&](int64_t b, int64_t e) { AttentionForward(g, p.seqs.data(), fa, b, e); });
  const double tol =
      std::is_same_v<T, float> ? std::max(p.out_tol, Tolerance<T>()) : Tolerance<T>();
  Compare(name + " out", ToFloats(out), ref.out, tol);
  Compare(name + " softmax_max", smax, ref.max, p.stat_tol);
  Compare(name + " softmax_sum", ssum, ref.sum, std::is_same_v<T, float> ? p.stat_tol : tol);
  for (int64_t i = 0; i < t.stat_size; ++i) {
    if (!ref.live[i] && (smax[i] != kMaskValue || ssum[i] != kDeadRowSum)) {
      Fail(name + ": dead row statistics at " + std::to_string(i));
      break;
    }
  }

  // The forward again, with other geometry (strides, workers) over key and value rows kx, vx:
  // whether it gives the same bits.
  auto same_forward = [&](const AttentionGeometry& gx, const T* kx, const T* vx) {
    std::vector<T> out_x = Prefilled<T>(o_inside, 0.0f);
    std::vector<float> mx_x = Prefilled<float>(s_inside, kMaskValue);
    std::vector<float> sm_x = Prefilled<float>(s_inside, kDeadRowSum);
    AttentionForwardArgs<T> fx{q.data(), kx, vx, out_x.data(), mx_x.data(), sm_x.data()};
    RunChunks(AttentionForwardWorkItems(gx, p.seqs.data()),
              [&](int64_t b, int64_t e) { AttentionForward(gx, p.seqs.data(), fx, b, e); });
    ++g_checks;
    return std::memcmp(out.data(), out_x.data(), out.size() * sizeof(T)) == 0 &&
           std::memcmp(smax.data(), mx_x.data(), smax.size() * sizeof(float)) == 0 &&
           std::memcmp(ssum.data(), sm_x.data(), ssum.size() * sizeof(float)) == 0;
  };

  // Through a head-major copy of K and V (rows nothing copies stay NaN): the same bits.
  const KeyValueCopy copy_plan = HeadMajorKeyValue(g, p.seqs.data());
  if (copy_plan.items > 0) {
    ++g_copied_cases;
    std::vector<T> copy(copy_plan.elements, FromFloat<T>(kNaN));
    RunChunks(copy_plan.items, [&](int64_t b, int64_t e) {
      CopyKeyValue(g, p.seqs.data(), copy_plan, k.data(), v.data(), copy.data(), b, e);
    });
    AttentionGeometry gc = g;
    gc.k = copy_plan.k;
    gc.v = copy_plan.v;
    if (!same_forward(gc, copy.data(), copy.data() + copy_plan.value_offset)) {
      Fail(name + ": forward through the head-major K/V copy differs");
    }
  }

  // With so many workers that no item takes a whole head group's query blocks (g has one
  // worker): other items, the same bits.
  AttentionGeometry gw = g;
  gw.workers = int64_t{1} << 20;
  if (AttentionForwardWorkItems(gw, p.seqs.data()) != AttentionForwardWorkItems(g, p.seqs.data())) {
    ++g_reshaped_cases;
    if (!same_forward(gw, k.data(), v.data())) {
      Fail(name + ": forward with narrower work items differs");
    }
  }

  const SplitForwardPlan split = PlanSplitForward(g, p.seqs.data());
  if (split.groups > 0) {  // the flash-decoding path, in chunks and in one go: same bits
    std::vector<T> out1 = Prefilled<T>(o_inside, 0.0f), out2 = out1;
    std::vector<float> mx1 = Prefilled<float>(s_inside, kMaskValue), mx2 = mx1;
    std::vector<float> sm1 = Prefilled<float>(s_inside, kDeadRowSum), sm2 = sm1;
    std::vector<float> scratch(split.scratch, kNaN), scratch2 = scratch;
    AttentionForwardArgs<T> f1{q.data(), k.data(), v.data(), out1.data(), mx1.data(), sm1.data()};
    AttentionForwardArgs<T> f2{q.data(), k.data(), v.data(), out2.data(), mx2.data(), sm2.data()};
    RunChunks(split.items, [&](int64_t b, int64_t e) {
      AttentionForwardSplit(g, p.seqs.data(), f1, scratch.data(), b, e);
    });
    RunChunks(split.groups, [&](int64_t b, int64_t e) {
      AttentionForwardMerge(g, p.seqs.data(), f1, scratch.data(), b, e);
    });
    AttentionForwardSplit(g, p.seqs.data(), f2, scratch2.data(), 0, 1 << 30);
    AttentionForwardMerge(g, p.seqs.data(), f2, scratch2.data(), 0, 1 << 30);
    Compare(name + " split out", ToFloats(out1), ref.out, tol);
    Compare(name + " split softmax_max", mx1, ref.max, p.stat_tol);
    Compare(name + " split softmax_sum", sm1, ref.sum, std::is_same_v<T, float> ? p.stat_tol : tol);
    ++g_checks;
    if (std::memcmp(out1.data(), out2.data(), out1.size() * sizeof(T)) != 0 ||
        std::memcmp(mx1.data(), mx2.data(), mx1.size() * sizeof(float)) != 0 ||
        std::memcmp(sm1.data(), sm2.data(), sm1.size() * sizeof(float)) != 0) {
      Fail(name + ": split forward depends on the chunking");
    }
    for (int64_t i = 0; i < t.stat_size; ++i) {
      if (!ref.live[i] && (mx1[i] != kMaskValue || sm1[i] != kDeadRowSum)) {
        Fail(name + ": split dead row statistics at " + std::to_string(i));
        break;
      }
    }
  }

  std::vector<float> scores(t.score_size, kMaskValue);
  RunChunks(items, [&](int64_t b, int64_t e) {
    AttentionScores(g, p.seqs.data(), q.data(), k.data(), scores.data(), t.score_strides, b, e);
  });
  Compare(name + " scores", scores, ref.scores, std::is_same_v<T, float> ? 2e-6 : 2e-5);
  for (int64_t i = 0; i < t.score_size; ++i) {
    if ((ref.scores[i] == kMaskValue) != (scores[i] == kMaskValue)) {
      Fail(name + ": scores mask pattern at " + std::to_string(i));
      break;
    }
  }

  const auto q_inside = RowsInside(p, g.q, t.q_size, p.n1, p.d, false);
  const auto k_inside = RowsInside(p, g.k, t.k_size, p.n2, p.d, true);
  const auto v_inside = RowsInside(p, g.v, t.v_size, p.n2, p.dv, true);
  std::vector<T> dq = Prefilled<T>(q_inside, 0.0f), dk = Prefilled<T>(k_inside, 0.0f);
  std::vector<T> dv = Prefilled<T>(v_inside, 0.0f);
  std::vector<float> delta(t.stat_size, kNaN);  // as undefined as the handlers' scratch
  AttentionBackwardArgs<T> ba{q.data(),    k.data(),    v.data(),  out.data(), dout.data(),
                              smax.data(), ssum.data(), dq.data(), dk.data(),  dv.data()};
  RunChunks(items, [&](int64_t b, int64_t e) {
    AttentionRowDelta(g, p.seqs.data(), ba, delta.data(), b, e);
  });
  RunChunks(KeyBlockWorkItems(g, p.seqs.data()), [&](int64_t b, int64_t e) {
    AttentionBackwardKeyValue(g, p.seqs.data(), ba, delta.data(), b, e);
  });
  RunChunks(items, [&](int64_t b, int64_t e) {
    AttentionBackwardQuery(g, p.seqs.data(), ba, delta.data(), b, e);
  });
  // One chunk instead of many: bitwise the same (no atomics, fixed summation order).
  std::vector<T> dq2 = dq, dk2 = dk, dv2 = dv;
  AttentionBackwardArgs<T> ba2 = ba;
  ba2.dquery = dq2.data();
  ba2.dkey = dk2.data();
  ba2.dvalue = dv2.data();
  AttentionBackwardKeyValue(g, p.seqs.data(), ba2, delta.data(), 0, 1 << 30);
  AttentionBackwardQuery(g, p.seqs.data(), ba2, delta.data(), 0, 1 << 30);
  ++g_checks;
  if (std::memcmp(dq.data(), dq2.data(), dq.size() * sizeof(T)) != 0 ||
      std::memcmp(dk.data(), dk2.data(), dk.size() * sizeof(T)) != 0 ||
      std::memcmp(dv.data(), dv2.data(), dv.size() * sizeof(T)) != 0) {
    Fail(name + ": gradients depend on the chunking");
  }
  // The one-pass backward over (sequence, kv head) items, in chunks, with row
  // deltas of its own (its scratch starts undefined): the same bits as the
  // three passes (same products, same summation order).
  std::vector<T> dq3 = Prefilled<T>(q_inside, 0.0f), dk3 = Prefilled<T>(k_inside, 0.0f);
  std::vector<T> dv3 = Prefilled<T>(v_inside, 0.0f);
  std::vector<float> delta3(t.stat_size, kNaN);
  AttentionBackwardArgs<T> ba3 = ba;
  ba3.dquery = dq3.data();
  ba3.dkey = dk3.data();
  ba3.dvalue = dv3.data();
  RunChunks(FusedBackwardWorkItems(g), [&](int64_t b, int64_t e) {
    AttentionBackwardFused(g, p.seqs.data(), ba3, delta3.data(), b, e);
  });
  ++g_checks;
  if (std::memcmp(dq.data(), dq3.data(), dq.size() * sizeof(T)) != 0 ||
      std::memcmp(dk.data(), dk3.data(), dk.size() * sizeof(T)) != 0 ||
      std::memcmp(dv.data(), dv3.data(), dv.size() * sizeof(T)) != 0) {
    Fail(name + ": one-pass backward differs from the three passes");
  }
  const double gtol = std::is_same_v<T, float> ? 1e-4 : 2 * tol;
  Compare(name + " dq", ToFloats(dq), ref.dq, gtol);
  Compare(name + " dk", ToFloats(dk), ref.dk, gtol);
  Compare(name + " dv", ToFloats(dv), ref.dv, gtol);
  // Rows without a visible key: exactly zero gradient.
  for (size_t b = 0; b < p.seqs.size(); ++b) {
    for (int64_t i = 0; i < p.seqs[b].q_len; ++i) {
      for (int64_t n = 0; n < p.n1; ++n) {
        if (ref.live[Off(g.stats, b, p.seqs[b].q_start + i, n)]) continue;
        const int64_t qo = Off(g.q, b, p.seqs[b].q_start + i, n);
        for (int64_t e = 0; e < p.d; ++e) {
          if (ToFloat(dq[qo + e]) != 0.0f) {
            Fail(name + ": dead row with nonzero dq");
            return;
          }
        }
      }
    }
  }
}

}  // namespace

int main() {
  PoisonScratchForTesting(true);  // a kernel reading scratch it did not write shows NaN
  auto run_cases = [] {
    uint32_t seed = 1;
    for (const Problem& p : Cases()) {
      RunProblem<float>(p, seed);
      RunProblem<Float16>(p, seed);
      RunProblem<BFloat16>(p, seed);
      ++seed;
    }
  };
  run_cases();
  ++g_checks;
  if (g_copied_cases == 0) Fail("no case ran through the head-major K/V copy");
  if (g_reshaped_cases == 0) Fail("no case had forward items that change with the workers");
  // Again with the branches this CPU's routines leave out, each the other way round:
  // B blocks copied or read in place, and bfloat16 scores and P V widened or on the
  // bf16 GEMMs (emulated where the CPU has none: bf16_gemm_emulated.h); the bf16 dot scores of
  // the decode path (no emulation) are left out where the CPU has them.
  TileOps other = GetTileOps();
  other.copy_b_blocks = !other.copy_b_blocks;
  const bool emulated = other.bf16_gemm == nullptr;
  other.bf16_gemm = emulated ? EmulatedBf16Gemm : nullptr;
  other.bf16_pairs_gemm = emulated ? EmulatedBf16PairsGemm : nullptr;
  other.bf16_dot_scores = nullptr;
  UseTileOpsForTesting(&other);
  run_cases();
  UseTileOpsForTesting(nullptr);
  ++g_checks;
  if (emulated && g_emulated_bf16_gemm_calls.load() == 0) Fail("no case ran the bf16_gemm");
  // Where the bf16 GEMMs run on AMX tiles, once more on AVX512_BF16's vdpbf16ps.
  const bool amx = TileOpsFor(TileIsa::kAvx512Amx) != nullptr;
  if (amx) {
    UseTileOpsForTesting(TileOpsFor(TileIsa::kAvx512));
    run_cases();
    UseTileOpsForTesting(nullptr);
    ++g_checks;
  }
  std::printf("%d checks, %d failures (%d cases also through the K/V copy; second pass: B "
              "blocks %s, bf16_gemm %s; bf16 GEMMs on AMX %s)\n",
              g_checks, g_failures, g_copied_cases, other.copy_b_blocks ? "copied" : "in place",
              emulated ? "emulated" : "none (widened)",
              amx ? "in the first pass, vdpbf16ps in a third" : "not on this CPU");
  return g_failures == 0 ? 0 : 1;
}
