// The machine's own limits, for the benchmarks' "fraction of peak" columns:
//   fma:  float32 FMA throughput of a register-only loop (no memory traffic), the
//         widest of AVX-512 / AVX2+FMA the CPU has, on every core at once;
//   bf16: the same for AVX512_BF16's vdpbf16ps (bfloat16 pairs multiplied and
//         added into float32 lanes), where the CPU has it (else 0);
//   amx_bf16: the same for AMX-BF16's tdpbf16ps on four 16 x 16 float32 tiles
//         (the operand tiles loaded once), where the CPU has it and Linux lets
//         the process use the tile state (else 0);
//   copy: memcpy between two buffers already faulted in (read + write bytes / s),
//         on every core at once, each thread on its own slice.
// Built by benchmarks/machine.py with the project's compiler (the one CMake found)
// at benchmark time; prints one JSON line. Not part of the library.
//
//   machine_limits [threads] [copy_mib]
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kAcc = 12;  // independent accumulators: > FMA latency x ports

// Each returns the flops done; `seed` keeps the compiler from folding the loop.
__attribute__((target("avx512f"))) double FmaAvx512(long iters, float seed, float* sink) {
  __m512 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(seed + i);
  const __m512 mul = _mm512_set1_ps(0.999999f), add = _mm512_set1_ps(1e-7f);
  for (long n = 0; n < iters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_fmadd_ps(acc[i], mul, add);
  }
  __m512 sum = acc[0];
  for (int i = 1; i < kAcc; ++i) sum = _mm512_add_ps(sum, acc[i]);
  *sink = _mm512_reduce_add_ps(sum);
  return 2.0 * 16 * kAcc * static_cast<double>(iters);
}

__attribute__((target("avx2,fma"))) double FmaAvx2(long iters, float seed, float* sink) {
  __m256 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_set1_ps(seed + i);
  const __m256 mul = _mm256_set1_ps(0.999999f), add = _mm256_set1_ps(1e-7f);
  for (long n = 0; n < iters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_fmadd_ps(acc[i], mul, add);
  }
  __m256 sum = acc[0];
  for (int i = 1; i < kAcc; ++i) sum = _mm256_add_ps(sum, acc[i]);
  float lanes[8];
  _mm256_storeu_ps(lanes, sum);
  *sink = lanes[0] + lanes[7];
  return 2.0 * 8 * kAcc * static_cast<double>(iters);
}

__attribute__((target("avx512f,avx512bf16"))) double DotBf16(long iters, float seed,
                                                            float* sink) {
  __m512 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(seed + i);
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.999f), _mm512_set1_ps(1e-3f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(-0.999f));
  for (long n = 0; n < iters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  }
  __m512 sum = acc[0];
  for (int i = 1; i < kAcc; ++i) sum = _mm512_add_ps(sum, acc[i]);
  *sink = _mm512_reduce_add_ps(sum);
  return 2.0 * 32 * kAcc * static_cast<double>(iters);
}

// Whether the CPU has AMX-BF16 and Linux grants this process the tile data
// state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
bool AmxUsable() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!((edx >> 22) & 1) || !((edx >> 24) & 1)) return false;  // AMX-BF16, AMX-TILE
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

struct alignas(64) TileConfig {
  unsigned char palette, start_row, reserved[14];
  unsigned short colsb[16];
  unsigned char rows[16];
};

__attribute__((target("amx-tile,amx-bf16"))) double DotAmx(long iters, float seed, float* sink) {
  static TileConfig config = [] {
    TileConfig c{};
    c.palette = 1;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    return c;
  }();
  _tile_loadconfig(&config);  // per thread
  alignas(64) unsigned short a[16 * 32], b[16 * 32];
  alignas(64) float c[16 * 16];
  unsigned bits;
  std::memcpy(&bits, &seed, sizeof(bits));
  for (int i = 0; i < 16 * 32; ++i) {
    a[i] = static_cast<unsigned short>(bits >> 16);
    b[i] = 0x3a83;  // about 1e-3
  }
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (long n = 0; n < iters; ++n) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 64);
  _tile_release();
  *sink = c[0];
  return 2.0 * 16 * 16 * 32 * 4 * static_cast<double>(iters);
}

// Runs body(thread) on `threads` threads at once; returns the wall seconds.
template <typename Body>
double OnAllThreads(int threads, Body body) {
  std::vector<std::thread> pool;
  const auto start = Clock::now();
  for (int t = 0; t < threads; ++t) pool.emplace_back(body, t);
  for (auto& th : pool) th.join();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1])
                               : std::max(1u, std::thread::hardware_concurrency());
  const size_t copy_bytes = (argc > 2 ? std::atol(argv[2]) : 256) << 20;
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const char* isa = avx512 ? "avx512" : avx2 ? "avx2" : "none";

  const bool bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
  // Best of 10 spread over a second: the machine may be shared, and on a VM a
  // core can be away for a while (started right after another benchmark's
  // process had ended, a best of 10 back to back read half the peak).
  auto run = [&](auto loop, long iters, std::chrono::milliseconds pause) {
    double best = 0.0;
    for (int rep = 0; rep < 10; ++rep) {
      if (rep > 0) std::this_thread::sleep_for(pause);
      std::vector<double> flops(threads);
      std::vector<float> sink(threads);
      const double seconds = OnAllThreads(threads, [&](int t) {
        flops[t] = loop(iters, 1.0f + t, &sink[t]);
      });
      double total = 0.0;
      for (double f : flops) total += f;
      best = std::max(best, total / seconds / 1e9);
    }
    return best;
  };
  double fma_gflops = 0.0, bf16_gflops = 0.0;
  if (avx512 || avx2) {
    auto fma = avx512 ? FmaAvx512 : FmaAvx2;
    run(fma, 1 << 16, std::chrono::milliseconds(0));  // warm up (clocks, thread start-up)
    fma_gflops = run(fma, 1 << 22, std::chrono::milliseconds(100));
  }
  if (bf16) bf16_gflops = run(DotBf16, 1 << 21, std::chrono::milliseconds(100));
  double amx_bf16_gflops = 0.0;
  if (AmxUsable()) amx_bf16_gflops = run(DotAmx, 1 << 19, std::chrono::milliseconds(100));

  // Copy: buffers touched first (no page faults in the timing), best of 7.
  std::vector<char> src(copy_bytes, 1), dst(copy_bytes, 0);
  double copy_gbps = 0.0;
  for (int rep = 0; rep < 7; ++rep) {
    const size_t slice = copy_bytes / threads;
    const double seconds = OnAllThreads(threads, [&](int t) {
      const size_t begin = t * slice, end = t + 1 == threads ? copy_bytes : begin + slice;
      std::memcpy(dst.data() + begin, src.data() + begin, end - begin);
    });
    copy_gbps = std::max(copy_gbps, 2.0 * copy_bytes / seconds / 1e9);
  }
  std::printf(
      "{\"isa\": \"%s\", \"threads\": %d, \"fma_gflops\": %.1f, \"bf16_gflops\": %.1f, "
      "\"amx_bf16_gflops\": %.1f, \"copy_gbps\": %.2f, \"copy_mib\": %zu, \"check\": %d}\n",
      isa, threads, fma_gflops, bf16_gflops, amx_bf16_gflops, copy_gbps, copy_bytes >> 20,
      dst[copy_bytes / 2]);
  return 0;
}
