// Float32 scratch that each thread keeps between kernel calls: a call of a
// shape seen before writes warm pages instead of faulting fresh ones in (for
// small calls the page faults of fresh scratch cost more than the tiles, and
// whether the allocator hands back fresh pages varies from run to run). One
// buffer per (thread, ScratchRole), grown to the largest request up to
// KeptScratchBytes(role); a larger request, or a role already held on this
// thread, gets a buffer of its own, freed with the holder. Its contents are
// undefined (what an earlier holder left): every holder writes what it reads,
// and the native tests poison new holders with NaN to hold them to that. A
// thread keeps what it grew until it exits: at most 6 x 4 MiB for the other
// roles and 64 MiB for kPass (KeptScratchBytes).
#pragma once

#include <cstdint>

namespace jax_rope::cpu {

enum class ScratchRole {
  kWorkspace, kLanes, kAccumulator, kPackedRows, kKeyBlocks, kPass, kRopeRows, kCount
};

// The largest buffer a thread keeps for `role`. kPass holds a call's scratch
// for a whole pass, the forward's head-major copy of K and V among them (32 MiB
// for a causal B1 S4096 N8 D128 float32 call): fresh, its pages took 7-11 ms to
// fault in on two Zen 4 cores, with huge-page advice, against a 3 ms copy into
// kept pages (the jitted forward 3% faster in interleaved runs).
constexpr int64_t KeptScratchBytes(ScratchRole role) {
  return role == ScratchRole::kPass ? int64_t{64} << 20 : int64_t{4} << 20;
}

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

// Tests only: while bytes > 0 (any thread), a request for more than `bytes`
// throws std::bad_alloc, as an allocation that fails does, kept buffer or not;
// 0 lifts the limit.
void LimitScratchForTesting(int64_t bytes);

}  // namespace jax_rope::cpu
