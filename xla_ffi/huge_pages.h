// Large output buffers from XLA are often fresh anonymous mappings, and the
// first write to each 4 KiB page faults: for memory-bound kernels the faults,
// not the arithmetic, dominate. Asking for transparent huge pages on the
// 2 MiB-aligned interior of such a buffer (advice only, contents untouched)
// makes those faults 512x rarer where the kernel allows it.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace jax_rope::ffi_support {

inline void AdviseHugePages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < 2 * kHuge) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

}  // namespace jax_rope::ffi_support
