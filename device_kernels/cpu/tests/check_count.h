// The native tests' shared tally: Fail counts a failure and prints the first
// 30, checks count what was compared, and Finish prints both and gives main's
// exit status (1 on any failure).
#pragma once

#include <cstdio>
#include <string>

namespace jax_rope::cpu::check_count {

inline int g_failures = 0;
inline int g_checks = 0;

inline void Fail(const std::string& what) {
  if (++g_failures <= 30) std::printf("FAIL: %s\n", what.c_str());
}

inline int Finish() {
  std::printf("%d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}

}  // namespace jax_rope::cpu::check_count
