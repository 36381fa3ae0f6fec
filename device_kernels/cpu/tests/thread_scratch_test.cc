// The kernels' kept per-thread scratch (thread_scratch.h) and the finiteness
// test of MaskedGemm (attention_masking.h):
//   - every holder gets 64-byte aligned floats; with PoisonScratchForTesting on,
//     all of them quiet NaN, also after a previous holder of the role wrote into
//     them; with it off, a reused buffer comes back as its last holder left it
//     (no clearing pass);
//   - a role released and asked for again, no larger, reuses the thread's
//     buffer; a role already held, or a request beyond KeptScratchBytes (4 MiB,
//     64 MiB for kPass), gets a buffer of its own; threads never share a buffer;
//   - with LimitScratchForTesting(n), a request above n bytes throws
//     std::bad_alloc, a kept buffer's role included, and one of n bytes does not;
//     0 lifts the limit;
//   - AllFinite finds one Inf or NaN (either sign) anywhere in a strided block,
//     and ignores what lies between its rows.
// Built and run by ctest (CMake option JAX_ROPE_BUILD_TESTS); exit status 1 on failure.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <new>
#include <thread>
#include <vector>

#include "device_kernels/cpu/attention_masking.h"
#include "device_kernels/cpu/thread_scratch.h"

namespace {

using jax_rope::cpu::KeptScratchBytes;
using jax_rope::cpu::ScratchRole;
using jax_rope::cpu::ThreadScratch;
using jax_rope::cpu::attention::AllFinite;

int g_failures = 0, g_checks = 0;

void Check(bool ok, const char* what) {
  ++g_checks;
  if (!ok && ++g_failures <= 30) std::printf("FAIL: %s\n", what);
}

bool Poisoned(const ThreadScratch& s, int64_t floats) {
  for (int64_t i = 0; i < floats; ++i) {
    if (!std::isnan(s.data()[i])) return false;
  }
  return true;
}

bool Aligned(const float* p) { return reinterpret_cast<uintptr_t>(p) % 64 == 0; }

void CheckKeptBuffers() {
  jax_rope::cpu::PoisonScratchForTesting(true);
  const float* first = nullptr;
  {
    ThreadScratch a(ScratchRole::kWorkspace, 1000);
    Check(Poisoned(a, 1000) && Aligned(a.data()), "a fresh buffer is poisoned and aligned");
    for (int i = 0; i < 1000; ++i) a.data()[i] = 1.0f;
    first = a.data();
    ThreadScratch b(ScratchRole::kWorkspace, 10);  // the role is held: a buffer of its own
    Check(b.data() != a.data() && Poisoned(b, 10), "a held role gives a separate poisoned buffer");
    ThreadScratch c(ScratchRole::kLanes, 10);
    Check(c.data() != a.data() && c.data() != b.data(), "roles have separate buffers");
  }
  {
    ThreadScratch again(ScratchRole::kWorkspace, 500);
    Check(again.data() == first, "a released role's buffer is reused");
    Check(Poisoned(again, 500), "a reused buffer is poisoned for its next holder");
  }
  {
    ThreadScratch grown(ScratchRole::kWorkspace, 5000);
    Check(Poisoned(grown, 5000) && Aligned(grown.data()), "a grown buffer is poisoned and aligned");
    for (int i = 0; i < 5000; ++i) grown.data()[i] = float(i);
  }
  jax_rope::cpu::PoisonScratchForTesting(false);
  {
    ThreadScratch again(ScratchRole::kWorkspace, 5000);
    bool kept_as_left = true;
    for (int i = 0; i < 5000; ++i) kept_as_left &= again.data()[i] == float(i);
    Check(kept_as_left, "unpoisoned, a reused buffer is handed over as left (no clearing pass)");
  }
  jax_rope::cpu::PoisonScratchForTesting(true);
  for (ScratchRole role : {ScratchRole::kAccumulator, ScratchRole::kPass}) {
    const int64_t limit = KeptScratchBytes(role) / int64_t{sizeof(float)};
    const float* kept = nullptr;
    {
      ThreadScratch largest(role, limit);  // grows the kept buffer to the limit
      kept = largest.data();
    }
    {
      ThreadScratch big(role, limit + 1);
      Check(big.data() != kept, "a request beyond the kept size gets a buffer of its own");
      Check(Poisoned(big, limit + 1) && Aligned(big.data()),
            "a large buffer is poisoned and aligned");
    }
    {
      ThreadScratch small(role, 16);
      Check(small.data() == kept, "a large request leaves the kept buffer as it was");
    }
  }
  const float* other = nullptr;
  std::thread([&] {
    ThreadScratch s(ScratchRole::kWorkspace, 500);
    other = s.data();
    Check(Poisoned(s, 500), "another thread's buffer is poisoned");
  }).join();
  ThreadScratch mine(ScratchRole::kWorkspace, 500);
  Check(other != mine.data(), "threads keep separate buffers");
}

bool Throws(ScratchRole role, int64_t floats) {
  try {
    ThreadScratch s(role, floats);
  } catch (const std::bad_alloc&) {
    return true;
  }
  return false;
}

void CheckLimit() {
  { ThreadScratch kept(ScratchRole::kLanes, 64); }  // the role's kept buffer holds 64 floats
  jax_rope::cpu::LimitScratchForTesting(128);
  Check(Throws(ScratchRole::kLanes, 64), "over the limit: a kept buffer's size throws too");
  Check(Throws(ScratchRole::kPass, 1 << 20), "over the limit: a large request throws");
  Check(!Throws(ScratchRole::kLanes, 32), "a request of the limit's bytes is served");
  jax_rope::cpu::LimitScratchForTesting(0);
  Check(!Throws(ScratchRole::kLanes, 64) && !Throws(ScratchRole::kPass, 1 << 20),
        "0 lifts the limit");
}

void CheckAllFinite() {
  const float specials[] = {std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            -std::numeric_limits<float>::quiet_NaN()};
  const int64_t rows = 5, cols = 37, ld = 41;
  std::vector<float> block(rows * ld);
  for (int64_t i = 0; i < rows * ld; ++i) {
    block[i] = std::ldexp(float(i % 7) - 3.0f, int(i % 200) - 100);
  }
  block[3] = std::numeric_limits<float>::max();
  block[4] = std::numeric_limits<float>::denorm_min();
  Check(AllFinite(block.data(), rows, cols, ld), "a finite block (extremes included) is finite");
  for (int64_t p = 0; p < rows; ++p) {
    for (int64_t d = cols; d < ld; ++d) block[p * ld + d] = specials[2];
  }
  Check(AllFinite(block.data(), rows, cols, ld), "entries between the rows are not read");
  for (float special : specials) {
    for (int64_t p = 0; p < rows; ++p) {
      for (int64_t d : {int64_t{0}, int64_t{17}, cols - 1}) {
        const float kept = block[p * ld + d];
        block[p * ld + d] = special;
        Check(!AllFinite(block.data(), rows, cols, ld), "one non-finite entry is found");
        block[p * ld + d] = kept;
      }
    }
  }
}

}  // namespace

int main() {
  CheckKeptBuffers();
  CheckLimit();
  CheckAllFinite();
  std::printf("%d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
