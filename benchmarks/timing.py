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


def time_call(call, *, repeats: int, slow_s: float = 1.0) -> float:
    """Median wall time in milliseconds of `call()` (which must block until its result is
    ready), after one warm-up call; a call slower than `slow_s` is timed once."""
    call()
    start = time.perf_counter()
    call()
    times = [time.perf_counter() - start]
    if times[0] < slow_s:
        for _ in range(repeats - 1):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)
