#include "device_kernels/cpu/thread_scratch.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <new>

namespace jax_rope::cpu {
namespace {

constexpr std::align_val_t kAlign{64};

struct KeptBuffer {
  float* data = nullptr;
  int64_t capacity = 0;  // floats
  bool held = false;
};

// Freed when the thread exits.
struct KeptBuffers {
  KeptBuffer buffers[static_cast<int>(ScratchRole::kCount)];
  ~KeptBuffers() {
    for (KeptBuffer& b : buffers) ::operator delete[](b.data, kAlign);
  }
};

thread_local KeptBuffers kept;

std::atomic<bool> poison{false};
std::atomic<int64_t> limit{0};

}  // namespace

ThreadScratch::ThreadScratch(ScratchRole role, int64_t floats) {
  floats = std::max<int64_t>(floats, 1);
  const int64_t most = limit.load(std::memory_order_relaxed);
  if (most > 0 && floats * int64_t{sizeof(float)} > most) throw std::bad_alloc();
  KeptBuffer& b = kept.buffers[static_cast<int>(role)];
  if (!b.held && floats * int64_t{sizeof(float)} <= KeptScratchBytes(role)) {
    if (b.capacity < floats) {
      float* grown = new (kAlign) float[floats];
      ::operator delete[](b.data, kAlign);
      b.data = grown;
      b.capacity = floats;
    }
    b.held = true;
    held_ = &b.held;
    data_ = b.data;
  } else {
    data_ = new (kAlign) float[floats];
  }
  if (poison.load(std::memory_order_relaxed)) {
    std::fill(data_, data_ + floats, std::numeric_limits<float>::quiet_NaN());
  }
}

ThreadScratch::~ThreadScratch() {
  if (held_ != nullptr) {
    *held_ = false;
  } else {
    ::operator delete[](data_, kAlign);
  }
}

void PoisonScratchForTesting(bool on) { poison.store(on, std::memory_order_relaxed); }

void LimitScratchForTesting(int64_t bytes) { limit.store(bytes, std::memory_order_relaxed); }

}  // namespace jax_rope::cpu
