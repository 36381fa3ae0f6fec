// The native tests' walk over the instruction sets of the tile routines
// (attention_tiles.h): fn(ops, name) for each one this CPU has, the others
// reported as skipped.
#pragma once

#include <cstdio>

#include "device_kernels/cpu/attention_tiles.h"

namespace jax_rope::cpu::check_count {

template <class Fn>
void ForEachTileIsa(Fn&& fn) {
  const char* names[] = {"avx512+amx", "avx512", "avx2", "baseline"};
  const TileIsa isas[] = {TileIsa::kAvx512Amx, TileIsa::kAvx512, TileIsa::kAvx2,
                          TileIsa::kBaseline};
  for (int which = 0; which < 4; ++which) {
    const TileOps* ops = TileOpsFor(isas[which]);
    if (ops == nullptr) {
      std::printf("tile ops %s: not supported here, skipped\n", names[which]);
      continue;
    }
    fn(*ops, names[which]);
  }
}

}  // namespace jax_rope::cpu::check_count
