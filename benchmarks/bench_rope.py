"""Fused Q/K RoPE benchmark: the FFI kernel against its peers, in one process.

Peers: the jax.numpy fallback (same semantics, lowered by XLA), JAX autodiff of
that fallback for the backward, and an XLA elementwise pass over the same bytes
(read query/key, write two outputs: the memory bound). Prints a table and one
JSON line of ratios (peer time / FFI time; higher is better for the FFI).

    python benchmarks/bench_rope.py [--batch 4 --seq 2048 ...] [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import jax_rope as jr
from timing import timeit  # benchmarks/timing.py, beside this script
from jax_rope.rope import fallback as rope_fallback
from jax_rope.rope.options import make_options


def rope(q, k, c, s):
    return jr.apply_rotary_pos_emb(q, k, c, s, layout="BSND", rotary_mode="half")


def rope_vjp(q, k, c, s, gq, gk):
    """Forward outputs and all four input gradients (nothing for XLA to drop)."""
    outs, pullback = jax.vjp(rope, q, k, c, s)
    return outs, pullback((gq, gk))


def fallback_autodiff_vjp(q, k, c, s, gq, gk):
    options = make_options("BSND", "half", "fallback")
    outs, pullback = jax.vjp(
        lambda *a: rope_fallback.rope_forward(*a, options=options), q, k, c, s)
    return outs, pullback((gq, gk))


def bench_dtype(args, dtype) -> dict[str, float]:
    rng = np.random.default_rng(0)
    b, s, nq, nk, d = args.batch, args.seq, args.q_heads, args.k_heads, args.head_dim
    make = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    q, k = make(b, s, nq, d), make(b, s, nk, d)
    c, sn = make(1, s, 1, d), make(1, s, 1, d)
    gq, gk = make(b, s, nq, d), make(b, s, nk, d)
    r = args.repeats
    times = {}
    with jr.backend("ffi"):
        times["ffi fwd"] = timeit(jax.jit(rope), q, k, c, sn, repeats=r)
        times["ffi fwd+bwd"] = timeit(jax.jit(rope_vjp), q, k, c, sn, gq, gk, repeats=r)
    with jr.backend("fallback"):
        times["fallback fwd"] = timeit(jax.jit(rope), q, k, c, sn, repeats=r)
        times["fallback fwd+bwd (fused formula)"] = timeit(
            jax.jit(rope_vjp), q, k, c, sn, gq, gk, repeats=r)
    times["fallback fwd+bwd (JAX autodiff)"] = timeit(
        jax.jit(fallback_autodiff_vjp), q, k, c, sn, gq, gk, repeats=r)
    times["xla copy bound"] = timeit(jax.jit(lambda q, k: (-q, -k)), q, k, repeats=r)
    return times


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
    ratios = {}
    for name in args.dtypes:
        times = bench_dtype(args, jnp.dtype(name))
        print(f"\n{name}")
        for label, ms in times.items():
            print(f"  {label:34s} {ms:9.2f} ms")
        ratios[name] = {
            "fwd_vs_fallback": times["fallback fwd"] / times["ffi fwd"],
            "fwd_vs_copy_bound": times["xla copy bound"] / times["ffi fwd"],
            "fwd_bwd_vs_fallback_autodiff":
                times["fallback fwd+bwd (JAX autodiff)"] / times["ffi fwd+bwd"],
            "fwd_bwd_vs_fallback_fused":
                times["fallback fwd+bwd (fused formula)"] / times["ffi fwd+bwd"],
        }
    print()
    print(json.dumps({"benchmark": "rope", "ratios": {
        dt: {k: round(v, 2) for k, v in r.items()} for dt, r in ratios.items()}}))


if __name__ == "__main__":
    main()
