"""Masked attention benchmark: the FFI kernel against jax.nn.dot_product_attention
(implementation="xla", the same mask), in one process, plus the peak memory of a
long band attention in a child process (where the dense peer cannot run).

Prints a table and one JSON line of ratios (peer time / FFI time).

    python benchmarks/bench_attention.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import jax
import jax.numpy as jnp

import jax_rope as jr
from timing import timeit  # benchmarks/timing.py, beside this script


def inputs(seq, heads=8, dim=128, batch=1):
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(k, (batch, seq, heads, dim), jnp.float32) for k in keys]


def ours(sparse_mode, **kw):
    return lambda q, k, v: jr.flash_attention_score(q, k, v, sparse_mode=sparse_mode, **kw)[0]


def peer(**kw):
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)


def fwd_bwd(fn):
    def step(q, k, v):
        out, pullback = jax.vjp(fn, q, k, v)
        return out, pullback(out)
    return step


def peak_rss_gib() -> float:
    """This process's peak resident memory. VmHWM belongs to the current program
    image; ru_maxrss would include the parent's peak inherited through fork."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20  # KiB -> GiB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def band_peak_memory_child(seq: int, backward: bool) -> None:
    """Run in a child process: one band forward (or forward+backward) at `seq`;
    prints the peak memory of the whole process."""
    q, k, v = inputs(seq)
    fn = ours(4, pre_tokens=256, next_tokens=0)
    fn = jax.jit(fwd_bwd(fn) if backward else fn)
    with jr.backend("ffi"):
        jax.block_until_ready(fn(q, k, v))
    print(peak_rss_gib())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--band-memory-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--with-backward", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.band_memory_child:
        return band_peak_memory_child(args.band_memory_child, args.with_backward)
    scale = 8 if args.quick else 1
    cases = [  # name, seq, ours, peer, wrap
        ("causal fwd", 4096 // scale, ours(2), peer(is_causal=True), lambda f: f),
        ("causal fwd+bwd", 2048 // scale, ours(2), peer(is_causal=True), fwd_bwd),
        ("band fwd (pre 256, next 0)", 8192 // scale, ours(4, pre_tokens=256, next_tokens=0),
         peer(local_window_size=(256, 0)), lambda f: f),
    ]
    print(f"jax {jax.__version__}, B=1 N=8 D=128 float32")
    ratios = {}
    for name, seq, mine, theirs, wrap in cases:
        q, k, v = inputs(seq)
        with jr.backend("ffi"):
            t_ffi = timeit(jax.jit(wrap(mine)), q, k, v, repeats=3)
        t_peer = timeit(jax.jit(wrap(theirs)), q, k, v, repeats=1 if seq >= 8192 else 3)
        ratios[f"{name} S={seq}"] = t_peer / t_ffi
        print(f"  {name:28s} S={seq:5d}: ffi {t_ffi:9.1f} ms, dot_product_attention "
              f"{t_peer:9.1f} ms, ratio {t_peer / t_ffi:5.2f}x")
    long_seq = 32768 // scale
    peaks = {}
    for label, extra in (("fwd", []), ("fwd+bwd", ["--with-backward"])):
        child = subprocess.run(
            [sys.executable, __file__, "--band-memory-child", str(long_seq)] + extra,
            capture_output=True, text=True, check=True)
        peaks[label] = float(child.stdout.strip().splitlines()[-1])
        print(f"  band {label:7s} S={long_seq}: peak memory {peaks[label]:.2f} GiB "
              "(whole process, inputs included)")
    print(json.dumps({"benchmark": "attention",
                      "ratios": {k: round(v, 2) for k, v in ratios.items()},
                      "band_peak_gib": {k: round(v, 2) for k, v in peaks.items()},
                      "band_seq": long_seq}))


if __name__ == "__main__":
    main()
