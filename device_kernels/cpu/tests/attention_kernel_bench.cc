// Timings of the CPU attention kernels without JAX: causal B=1 N=8 D=128
// float32, K and V head-major (as the forward's handler copies them), forward
// and the three-pass backward, on one and two threads. Built by CMake beside
// the kernel tests (option JAX_ROPE_BUILD_TESTS), not run by ctest:
//   build/tests/attention_kernel_bench
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "device_kernels/cpu/attention_kernels.h"
#include "device_kernels/cpu/tests/attention_cases.h"

namespace {

using namespace jax_rope::cpu;
using namespace jax_rope::cpu::test;
using jax_rope::Strides;

template <typename Fn>
void Parallel(int threads, int64_t n, const Fn& fn) {
  if (threads <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  // Like xla_ffi/parallel.h: up to 16 chunks per thread, claimed dynamically.
  const int64_t chunks = std::min<int64_t>(n, threads * 16);
  const int64_t chunk = (n + chunks - 1) / chunks;
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t i = next.fetch_add(1); i < chunks; i = next.fetch_add(1)) {
      fn(i * chunk, std::min(n, (i + 1) * chunk));
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
}

double Seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Bench() {
  for (int64_t s : {4096, 2048}) {
    const int64_t n = 8, d = 128;
    AttentionGeometry g;
    g.batch = 1;
    g.q_heads = g.kv_heads = n;
    g.head_dim = g.value_dim = d;
    g.scale = 1.0f / std::sqrt(float(d));
    g.q = g.out = Strides{s * n * d, n * d, d};
    g.k = g.v = Strides{s * n * d, d, s * d};
    g.stats = Strides{n * s, 1, s};
    const SequenceBand seq = Seq(0, int32_t(s), 0, int32_t(s), -kInf, 0, -kInf);
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> q(s * n * d), k(q.size()), v(q.size()), dout(q.size()), out(q.size());
    for (auto* x : {&q, &k, &v, &dout}) {
      for (float& e : *x) e = normal(rng);
    }
    std::vector<float> mx(n * s), sm(n * s), delta(n * s), dq(q.size()), dk(q.size()), dv(q.size());
    AttentionForwardArgs<float> fa{q.data(), k.data(), v.data(), out.data(), mx.data(), sm.data()};
    AttentionBackwardArgs<float> ba{q.data(),  k.data(),  v.data(),  out.data(), dout.data(),
                                    mx.data(), sm.data(), dq.data(), dk.data(),  dv.data()};
    // AttentionForward's items hold up to four query blocks each (fewer than
    // the row delta's ForwardWorkItems, whose later ones it finds empty).
    const int64_t items = ForwardWorkItems(g, &seq);
    const int64_t forward_items = AttentionForwardWorkItems(g, &seq);
    const int64_t key_items = KeyBlockWorkItems(g, &seq);
    for (int threads : {1, 2}) {
      double fwd = 1e9, bwd = 1e9;
      for (int rep = 0; rep < 3; ++rep) {
        fwd = std::min(fwd, Seconds([&] {
                         Parallel(threads, forward_items, [&](int64_t b, int64_t e) {
                           AttentionForward(g, &seq, fa, b, e);
                         });
                       }));
        bwd = std::min(bwd, Seconds([&] {
                         Parallel(threads, items, [&](int64_t b, int64_t e) {
                           AttentionRowDelta(g, &seq, ba, delta.data(), b, e);
                         });
                         Parallel(threads, key_items, [&](int64_t b, int64_t e) {
                           AttentionBackwardKeyValue(g, &seq, ba, delta.data(), b, e);
                         });
                         Parallel(threads, items, [&](int64_t b, int64_t e) {
                           AttentionBackwardQuery(g, &seq, ba, delta.data(), b, e);
                         });
                       }));
      }
      const double flops = 2.0 * 2.0 * s * s / 2 * d * n;  // two causal GEMMs
      std::printf("causal S=%ld N=%ld D=%ld f32, %d thread(s): forward %.3f s (%.1f GFLOP/s), "
                  "backward %.3f s, forward+backward %.3f s\n",
                  long(s), long(n), long(d), threads, fwd, flops / fwd / 1e9, bwd, fwd + bwd);
    }
  }
}

}  // namespace

int main() {
  Bench();
  return 0;
}
