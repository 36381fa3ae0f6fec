// Float32 scratch that each thread keeps between kernel calls: a call of a
// shape seen before writes warm pages instead of faulting fresh ones in (for
// small calls the page faults of fresh scratch cost more than the tiles, and
// whether the allocator hands back fresh pages varies from run to run). One
// buffer per (thread, ScratchRole), grown to the largest request up to
// kMaxKeptScratchBytes; a larger request, or a role already held on this
// thread, gets a buffer of its own, freed with the holder. Its contents are
// undefined (what an earlier holder left): every holder writes what it reads,
// and the native tests poison new holders with NaN to hold them to that.
#pragma once

#include <cstdint>

namespace jax_rope::cpu {

enum class ScratchRole { kWorkspace, kLanes, kAccumulator, kPackedRows, kPass, kCount };

inline constexpr int64_t kMaxKeptScratchBytes = int64_t{4} << 20;

class ThreadScratch {
 public:
  // `floats` floats of undefined contents, 64-byte aligned. Throws std::bad_alloc.
  ThreadScratch(ScratchRole role, int64_t floats);
  ~ThreadScratch();
  ThreadScratch(const ThreadScratch&) = delete;
  ThreadScratch& operator=(const ThreadScratch&) = delete;

  float* data() const { return data_; }

 private:
  float* data_ = nullptr;
  bool* held_ = nullptr;  // the kept buffer's flag, or null: data_ is this object's own
};

// Tests only: while on (any thread), every new holder's floats are set to quiet
// NaN, so a kernel that reads scratch it has not written shows NaN in its results.
void PoisonScratchForTesting(bool on);

}  // namespace jax_rope::cpu
