"""Fused Q/K RoPE benchmark: the FFI kernel against its peers, in one process.

Peers: the jax.numpy fallback (same semantics, lowered by XLA), JAX autodiff of
that fallback for the backward, an XLA elementwise pass over the same bytes
(read query/key, write two outputs), and the machine's copy bandwidth measured in
the same run (benchmarks/machine.py: memcpy between buffers already faulted in,
every core). The forward is also timed with query and key donated to the jit and
`in_place=True` (the kernel then works in the donated buffers: no fresh output
pages to fault in). Last, with malloc set to keep freed memory for reuse
(benchmarks/allocator.py; the README's MALLOC_* settings), the calls into fresh
buffers are timed again. Prints a table with GB/s (bytes read + written by the
call) and one JSON line of ratios (peer time / FFI time; higher is better for the
FFI) and of bandwidth fractions.

    python benchmarks/bench_rope.py [--batch 4 --seq 2048 ...] [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_rope as jr
import allocator  # benchmarks/allocator.py, beside this script
import machine  # benchmarks/machine.py, beside this script
from timing import timeit  # benchmarks/timing.py, beside this script
from jax_rope.rope import fallback as rope_fallback
from jax_rope.rope.options import make_options


def rope(q, k, c, s):
    return jr.apply_rotary_pos_emb(q, k, c, s, layout="BSND", rotary_mode="half")


def rope_in_place(q, k, c, s):
    return jr.apply_rotary_pos_emb(q, k, c, s, layout="BSND", rotary_mode="half",
                                   in_place=True)


def timeit_donated(fn, q, k, c, s, *, repeats: int) -> float:
    """Median ms of jit(fn, donate_argnums=(0, 1)), each call fed the previous call's
    outputs (the donated inputs are consumed)."""
    step = jax.jit(fn, donate_argnums=(0, 1))
    q, k = step(q.copy(), k.copy(), c, s)  # warm-up, on copies: the caller keeps q and k
    jax.block_until_ready((q, k))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        q, k = step(q, k, c, s)
        jax.block_until_ready((q, k))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def rope_vjp(q, k, c, s, gq, gk):
    """Forward outputs and all four input gradients (nothing for XLA to drop)."""
    outs, pullback = jax.vjp(rope, q, k, c, s)
    return outs, pullback((gq, gk))


def fallback_autodiff_vjp(q, k, c, s, gq, gk):
    options = make_options("BSND", "half", "fallback")
    outs, pullback = jax.vjp(
        lambda *a: rope_fallback.rope_forward(*a, options=options), q, k, c, s)
    return outs, pullback((gq, gk))


def inputs(args, dtype):
    """query, key, cos, sin and the two output cotangents, seeded."""
    rng = np.random.default_rng(0)
    b, s, nq, nk, d = args.batch, args.seq, args.q_heads, args.k_heads, args.head_dim
    make = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    return (make(b, s, nq, d), make(b, s, nk, d), make(1, s, 1, d), make(1, s, 1, d),
            make(b, s, nq, d), make(b, s, nk, d))


def bench_fresh_buffers(data, repeats: int) -> dict[str, float]:
    """The calls that write fresh output buffers: the FFI forward and forward+backward and
    XLA's pass over the same bytes."""
    q, k, c, sn, gq, gk = data
    with jr.backend("ffi"):
        times = {"ffi fwd": timeit(jax.jit(rope), q, k, c, sn, repeats=repeats),
                 "ffi fwd+bwd": timeit(jax.jit(rope_vjp), q, k, c, sn, gq, gk,
                                       repeats=repeats)}
    times["xla copy bound"] = timeit(jax.jit(lambda q, k: (-q, -k)), q, k, repeats=repeats)
    return times


def bench_dtype(data, repeats: int) -> dict[str, float]:
    q, k, c, sn, gq, gk = data
    r = repeats
    fresh = bench_fresh_buffers(data, r)
    times = {"ffi fwd": fresh["ffi fwd"]}
    with jr.backend("ffi"):
        times["ffi fwd, donated, in_place"] = timeit_donated(rope_in_place, q, k, c, sn,
                                                             repeats=r)
    times["ffi fwd+bwd"] = fresh["ffi fwd+bwd"]
    with jr.backend("fallback"):
        times["fallback fwd"] = timeit(jax.jit(rope), q, k, c, sn, repeats=r)
        times["fallback fwd+bwd (fused formula)"] = timeit(
            jax.jit(rope_vjp), q, k, c, sn, gq, gk, repeats=r)
    times["fallback fwd+bwd (JAX autodiff)"] = timeit(
        jax.jit(fallback_autodiff_vjp), q, k, c, sn, gq, gk, repeats=r)
    with jr.backend("fallback"):
        times["fallback fwd, donated"] = timeit_donated(rope, q, k, c, sn, repeats=r)
    times["xla copy bound"] = fresh["xla copy bound"]
    return times


def print_rows(times: dict[str, float], moved: int, copy: float) -> None:
    for label, ms in times.items():
        extra = (f"  {moved / ms / 1e6:6.1f} GB/s = {moved / ms / 1e6 / copy:4.2f} of copy"
                 if "bwd" not in label else "")
        print(f"  {label:34s} {ms:9.2f} ms{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--q-heads", type=int, default=16)
    parser.add_argument("--k-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, "
          f"B={args.batch} S={args.seq} Nq={args.q_heads} Nk={args.k_heads} D={args.head_dim}")
    limits = machine.measure()
    copy = limits["copy_gbps"]
    print(f"machine: copy {copy:.1f} GB/s (memcpy, read + written, {limits['threads']} threads)")
    print(f"malloc settings in the environment: {allocator.environment()}")
    moved = {name: 2 * args.batch * args.seq * (args.q_heads + args.k_heads) * args.head_dim
             * jnp.dtype(name).itemsize for name in args.dtypes}  # query/key read and written
    ratios, fractions = {}, {}
    for name in args.dtypes:
        times = bench_dtype(inputs(args, jnp.dtype(name)), args.repeats)
        print(f"\n{name} (a forward moves {moved[name] / 1e6:.0f} MB)")
        print_rows(times, moved[name], copy)
        fractions[name] = {
            "fwd": moved[name] / times["ffi fwd"] / 1e6 / copy,
            "fwd_donated_in_place":
                moved[name] / times["ffi fwd, donated, in_place"] / 1e6 / copy,
            "fallback_fwd_donated": moved[name] / times["fallback fwd, donated"] / 1e6 / copy,
        }
        ratios[name] = {
            "fwd_vs_fallback": times["fallback fwd"] / times["ffi fwd"],
            "fwd_vs_copy_bound": times["xla copy bound"] / times["ffi fwd"],
            "fwd_bwd_vs_fallback_autodiff":
                times["fallback fwd+bwd (JAX autodiff)"] / times["ffi fwd+bwd"],
            "fwd_bwd_vs_fallback_fused":
                times["fallback fwd+bwd (fused formula)"] / times["ffi fwd+bwd"],
        }
    # Last, as it changes malloc for the rest of the process.
    if allocator.keep_freed_memory():
        print("\nmalloc keeping freed memory for reuse (mmap and trim thresholds 256 MiB, "
              "benchmarks/allocator.py):")
        for name in args.dtypes:
            times = bench_fresh_buffers(inputs(args, jnp.dtype(name)), args.repeats)
            print(name)
            print_rows(times, moved[name], copy)
            fractions[name]["fwd_freed_memory_kept"] = \
                moved[name] / times["ffi fwd"] / 1e6 / copy
    else:
        print("\n(no mallopt here: no run with freed memory kept)")
    print()
    rounded = lambda table: {dt: {k: round(v, 2) for k, v in r.items()}
                             for dt, r in table.items()}
    print(json.dumps({"benchmark": "rope", "ratios": rounded(ratios),
                      "fraction_of_copy_bandwidth": rounded(fractions),
                      "copy_gbps": round(copy, 2)}))


if __name__ == "__main__":
    main()
