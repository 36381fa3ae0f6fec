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


def time_calls(calls, *, repeats: int, slow_s: float = 1.0) -> dict:
    """Median wall time in milliseconds of each `calls[name]()` (which must block until its
    result is ready and has been called once already, so it is compiled), timed in `repeats`
    interleaved rounds of one call each: the machine's drift over a row (this VM's speed
    moves by 10-15% within a minute) reaches every implementation alike. A call slower than
    `slow_s` in the first round is timed once."""
    times = {name: [] for name in calls}
    for round_ in range(repeats):
        for name, call in calls.items():
            if round_ > 0 and times[name][0] >= slow_s:
                continue
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}
