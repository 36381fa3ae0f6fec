// Splits [0, n) into chunks run on XLA's intra-op thread pool (no threads of
// our own). The calling thread takes chunks too and only waits for chunks that
// a pool thread has already started, so a busy or absent pool never deadlocks.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <new>

#include "xla/ffi/api/ffi.h"

namespace jax_rope::ffi_support {

// Progress of one ParallelFor, shared with the pool tasks (which may outlive it).
struct ParallelState {
  std::atomic<int64_t> next{0};
  int64_t done = 0;
  std::mutex mutex;
  std::condition_variable finished;
};

// Runs chunks until none are left; touches `fn` only for a claimed chunk, so a
// task that starts after the caller returned exits without using it.
template <typename Fn>
void DrainChunks(ParallelState& state, int64_t chunk, int64_t chunks, int64_t n,
                 const Fn* fn) {
  for (int64_t i = state.next.fetch_add(1); i < chunks; i = state.next.fetch_add(1)) {
    (*fn)(i * chunk, std::min(n, (i + 1) * chunk));
    std::lock_guard<std::mutex> lock(state.mutex);
    if (++state.done == chunks) state.finished.notify_one();
  }
}

// `fn(begin, end)` is called on disjoint ranges covering [0, n). `grain` is the
// smallest range worth a task; at most `max_workers` threads take part, the
// caller included.
template <typename Fn>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, int64_t grain, const Fn& fn,
                 int64_t max_workers = std::numeric_limits<int64_t>::max()) {
  grain = std::max<int64_t>(grain, 1);
  const int64_t threads = std::min<int64_t>(pool.num_threads(), std::max<int64_t>(max_workers, 1));
  const int64_t chunks = std::min<int64_t>((n + grain - 1) / grain,
                                           std::max<int64_t>(threads, 1) * 16);
  if (threads <= 1 || chunks <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  auto state = std::make_shared<ParallelState>();
  const int64_t chunk = (n + chunks - 1) / chunks;
  // The caller is one of the `threads` workers (XLA calls the handler outside
  // its intra-op pool, which has a thread per core): a helper for every pool
  // thread as well ran three threads on two cores, time-slicing every chunk
  // (jitted causal S2048 fwd+bwd on two AVX2 cores: 223 -> 215 ms without).
  const int64_t helpers = std::min<int64_t>(threads - 1, chunks - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([state, chunk, chunks, n, fn_ptr = &fn]() {
      DrainChunks(*state, chunk, chunks, n, fn_ptr);
    });
  }
  DrainChunks(*state, chunk, chunks, n, &fn);
  std::unique_lock<std::mutex> lock(state->mutex);
  state->finished.wait(lock, [&] { return state->done == chunks; });
}

// ParallelFor for kernels that allocate their scratch: a std::bad_alloc in any
// chunk (the caller's or a pool thread's) is caught there, where it would have
// terminated the process, and the other chunks still run. Whether none failed.
template <typename Fn>
bool ParallelForCatchingBadAlloc(xla::ffi::ThreadPool& pool, int64_t n, int64_t grain,
                                 const Fn& fn,
                                 int64_t max_workers = std::numeric_limits<int64_t>::max()) {
  std::atomic<bool> failed{false};
  ParallelFor(pool, n, grain, [&](int64_t begin, int64_t end) {
    try {
      fn(begin, end);
    } catch (const std::bad_alloc&) {
      failed = true;
    }
  }, max_workers);
  return !failed;
}

}  // namespace jax_rope::ffi_support
