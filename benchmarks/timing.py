"""The one timing rule of the benchmarks: median wall time of a compiled call."""

from __future__ import annotations

import statistics
import time

import jax


def timeit(fn, *args, repeats: int) -> float:
    """Median wall time in milliseconds of `fn(*args)`, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)
