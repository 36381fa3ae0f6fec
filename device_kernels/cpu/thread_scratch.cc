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

}  // namespace

ThreadScratch::ThreadScratch(ScratchRole role, int64_t floats) {
  floats = std::max<int64_t>(floats, 1);
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

}  // namespace jax_rope::cpu
