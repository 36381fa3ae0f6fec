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


def time_calls(calls, *, repeats: int, slow_s: float = 1.0, slow_repeats: int = 3,
               burst_s: float = 0.03, settle_s: float = 0.02) -> dict:
    """Median wall time in milliseconds of each `calls[name]()` (which must block until its
    result is ready and has been called once already, so it is compiled), timed in `repeats`
    interleaved rounds: the machine's drift over a row (this VM's speed moves by 10-15%
    within a minute) reaches every implementation alike. A first round times one call of
    each: a call slower than `slow_s` is timed in only `slow_repeats` of the rounds (that
    first call, the second after compiling, also faults in memory the later ones reuse: in
    a B16 S512 N16 D256 training step it took 1.1-1.2 s where the later calls took 0.75-0.82,
    and a single time was all these rows had); a call shorter than `burst_s`
    is then timed as bursts of calls lasting about `burst_s`, each after one untimed call, so
    that what the previous implementation leaves behind (its memory churn) lands on the
    untimed call rather than on a sub-millisecond measurement. Each turn starts `settle_s`
    after the previous one ended: torch's OpenMP threads spin for about 10 ms after a call,
    on the cores the next implementation runs on (on two cores they slowed the 30 ms of
    jax_rope calls after them by 10-20%)."""
    first = {}
    for name, call in calls.items():
        time.sleep(settle_s)
        start = time.perf_counter()
        call()
        first[name] = time.perf_counter() - start
    times = {name: [] for name in calls}
    for round_index in range(repeats):
        for name, call in calls.items():
            if first[name] >= slow_s and round_index >= slow_repeats:
                continue
            count = max(1, min(1000, round(burst_s / max(first[name], 1e-6))))
            time.sleep(settle_s)
            if count > 1:
                call()
            start = time.perf_counter()
            for _ in range(count):
                call()
            times[name].append((time.perf_counter() - start) / count)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}
