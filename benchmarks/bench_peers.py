"""Masked attention against its peers and the machine's limits, in one process.

Every row times jax_rope's `flash_attention_score` on the CPU kernels against
- torch: `torch.nn.functional.scaled_dot_product_attention` (CPU wheel; the `bench`
  extra) with the same mask (`is_causal`, or a boolean bottom-right mask) and GQA;
- jax.nn: `jax.nn.dot_product_attention(implementation="xla")` with the same mask;
- fallback: jax_rope's own jax.numpy fallback (`jr.backend("fallback")`);
and reports achieved GFLOP/s as a fraction of the FMA peak (or, for decode, GB/s of K/V
read against the copy bandwidth), both measured in the same run (benchmarks/machine.py).
jax_rope and torch are timed in interleaved rounds (one call of each per round, the median
of --repeats rounds), so that the machine's drift reaches both alike; jax.nn and the fallback
(dense score matrices) in rounds of their own after them; calls over a second are timed in
only three of the rounds.
Ratios are peer time / jax_rope time (higher is better for jax_rope). The ALiBi and
dropout rows compare jax_rope with itself: plain call time / call time with the feature.
Compute-bound rows also print their ceiling: torch's time over the time of the row's FLOPs at
the FMA peak, the largest ratio any implementation could show against torch on this machine.
bfloat16 rows take the peak of the CPU's bf16 products where it has them: AMX's tdpbf16ps, else
AVX512_BF16's vdpbf16ps.

FLOPs count only visible (query, key) pairs: forward 4 * D * pairs per head; forward +
backward 3.5x that (the backward is 2.5 forwards: FlashAttention's convention).

    python benchmarks/bench_peers.py [--quick] [--more] [--plot PATH] [--repeats N]
    JAX_ROPE_BENCH_QUICK=1 python benchmarks/bench_peers.py     # same as --quick

Without torch the torch column says so; the rest still runs. --more adds shapes beyond issue
13's table (attention without a mask as in encoders and ViT, cross-attention, head dims 80 and
96, float16, bfloat16 training, speculative decoding), to check the claim on other shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_rope as jr
import allocator  # benchmarks/allocator.py, beside this script
import machine  # benchmarks/machine.py, beside this script
from timing import time_calls  # benchmarks/timing.py, beside this script

try:
    import torch
except ImportError:  # the peer is optional (pip install 'jax_rope[bench]')
    torch = None

PEERS = ("torch", "jax.nn", "fallback")


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    batch: int
    q_len: int
    kv_len: int
    heads: int  # N1 (query heads)
    kv_heads: int  # N2
    dim: int
    dtype: str = "float32"
    mask: str = "top-left causal"  # a key of MASKS
    backward: bool = False
    memory_bound: bool = False  # decode: report GB/s of K/V against the copy bandwidth
    extra: tuple = ()  # jax_rope-only keyword arguments (ALiBi, dropout): vs the plain call

    def visible(self) -> np.ndarray:
        """A user mask's visible positions, (B, 1, Sq, Skv)."""
        masked = USER_MASKS[self.mask](self)
        return np.broadcast_to(~masked, (self.batch,) + masked.shape[1:])

    @property
    def pairs(self) -> int:
        """Visible (query, key) pairs of one head (averaged over the batch)."""
        if self.mask in USER_MASKS:
            return int(self.visible().sum() // self.batch)
        if self.mask == "no mask":
            return self.q_len * self.kv_len
        shift = self.kv_len - self.q_len if self.mask == "bottom-right causal" else 0
        rows = np.arange(self.q_len)
        return int(np.clip(rows + shift + 1, 0, self.kv_len).sum())

    @property
    def flops(self) -> float:
        return 4.0 * self.dim * self.pairs * self.batch * self.heads * (
            3.5 if self.backward else 1.0)

    @property
    def kv_bytes(self) -> int:
        """Bytes of the K/V rows some query sees (all of them without a user mask)."""
        rows = self.batch * self.kv_len
        if self.mask in USER_MASKS:
            rows = int(self.visible().any(axis=(1, 2)).sum())
        return 2 * rows * self.kv_heads * self.dim * np.dtype(jnp.dtype(self.dtype)).itemsize


def documents_mask(row):
    """Causal attention within four documents of equal length packed into one sequence."""
    i, j = np.arange(row.q_len)[:, None], np.arange(row.kv_len)[None, :]
    length = max(1, row.q_len // 4)
    return ((j > i) | (i // length != j // length))[None, None]


def padding_mask(row):
    """A padded KV cache: sequence b holds the first fractions[b] of the keys (at least one)."""
    fractions = np.resize([1.0, 0.5, 0.25, 0.75, 0.0125, 0.98, 0.37, 0.61], row.batch)
    ends = np.maximum(1, (fractions * row.kv_len).astype(int))
    return (np.arange(row.kv_len)[None, :] >= ends[:, None])[:, None, None, :]


# User masks (True = masked), (B|1, 1, Sq, Skv), which every peer gets as a mask argument
# (jax_rope: sparse_mode 1's atten_mask; torch and jax.nn: its negation, True = attend).
USER_MASKS = {"4 causal documents": documents_mask, "padding": padding_mask}

# The masks the rows use, and their sparse_mode.
MASKS = {"top-left causal": 2, "bottom-right causal": 3, "no mask": 0,
         **{name: 1 for name in USER_MASKS}}


def rows(quick: bool, more: bool = False) -> list[Row]:
    s = 16 if quick else 1  # quick: sequences 16x shorter, batches at most 2
    b = (lambda n: min(n, 2)) if quick else (lambda n: n)
    table = [
        Row("causal fwd", 1, 4096 // s, 4096 // s, 8, 8, 128),
        Row("causal fwd+bwd", 1, 2048 // s, 2048 // s, 8, 8, 128, backward=True),
        Row("decode GQA", b(8), 1, 8192 // s, 32, 8, 128, mask="bottom-right causal",
            memory_bound=True),
        Row("decode GQA bf16", b(8), 1, 8192 // s, 32, 8, 128, dtype="bfloat16",
            mask="bottom-right causal", memory_bound=True),
        Row("chunked prefill", 1, 256 // s, 8192 // s, 32, 8, 128, mask="bottom-right causal"),
        Row("causal bf16", 1, 2048 // s, 2048 // s, 8, 8, 128, dtype="bfloat16"),
        Row("train D64 fwd+bwd", b(16), 512 // s, 512 // s, 16, 16, 64, backward=True),
        Row("train D256 fwd+bwd", b(16), 512 // s, 512 // s, 16, 16, 256, backward=True),
        Row("causal ALiBi", 1, 4096 // s, 4096 // s, 8, 8, 128, extra=(("alibi", True),)),
        Row("causal dropout 0.9", 1, 4096 // s, 4096 // s, 8, 8, 128,
            extra=(("dropout", 0.9),)),
    ]
    if not more:
        return table
    return table + [
        Row("encoder fwd", b(4), 512 // s, 512 // s, 16, 16, 64, mask="no mask"),
        Row("encoder fwd+bwd", b(4), 256 // s, 256 // s, 12, 12, 64, mask="no mask",
            backward=True),
        Row("ViT-B/16 fwd+bwd", b(8), 197 // s, 197 // s, 12, 12, 64, mask="no mask",
            backward=True),
        Row("GQA full fwd+bwd", 1, 1024 // s, 1024 // s, 32, 8, 128, mask="no mask",
            backward=True),
        Row("GQA full bf16 fwd+bwd", 1, 1024 // s, 1024 // s, 32, 8, 128, dtype="bfloat16",
            mask="no mask", backward=True),
        Row("cross-attention", 1, 1024 // s, 4096 // s, 16, 16, 64, mask="no mask"),
        Row("causal D80 fwd+bwd", 1, 1024 // s, 1024 // s, 32, 32, 80, backward=True),
        Row("causal D96", 1, 1024 // s, 1024 // s, 32, 32, 96),
        Row("causal float16", 1, 1024 // s, 1024 // s, 16, 16, 128, dtype="float16"),
        Row("speculative decode", b(4), 4, 4096 // s, 32, 8, 128, mask="bottom-right causal"),
        Row("packed documents fwd+bwd", 1, 2048 // s, 2048 // s, 8, 8, 128,
            mask="4 causal documents", backward=True),
        Row("padded decode", b(8), 1, 8192 // s, 32, 8, 128, mask="padding",
            memory_bound=True),
    ]


# --- the implementations, each (row, numpy inputs) -> a blocking no-argument call ----------

def _jax_inputs(row, arrays):
    return [jnp.asarray(a).astype(row.dtype) for a in arrays]


def _extra_kwargs(row):
    extra = dict(row.extra)
    kwargs = {}
    if "alibi" in extra:  # ALiBi slopes 2^(-8 i / N1), as in the ALiBi paper
        slopes = 2.0 ** (-8.0 * np.arange(1, row.heads + 1) / row.heads)
        kwargs.update(pse=jnp.asarray(slopes, jnp.float32), pse_type=2)
    if "dropout" in extra:
        kwargs.update(keep_prob=extra["dropout"], dropout_key=jax.random.key(1))
    return kwargs


def _vjp_step(fn):
    def step(q, k, v):
        out, pullback = jax.vjp(fn, q, k, v)
        return out, pullback(out)
    return step


def _jitted(row, fn, arrays):
    fn = jax.jit(_vjp_step(fn) if row.backward else fn)
    args = _jax_inputs(row, arrays)
    return lambda: jax.block_until_ready(fn(*args))


def jax_rope_call(row, arrays, backend="ffi", with_extra=True):
    mode = MASKS[row.mask]
    kwargs = _extra_kwargs(row) if with_extra else {}
    if row.mask in USER_MASKS:
        kwargs["atten_mask"] = jnp.asarray(USER_MASKS[row.mask](row))
    fn = lambda q, k, v: jr.flash_attention_score(q, k, v, sparse_mode=mode, **kwargs)[0]
    call = _jitted(row, fn, arrays)

    def run():
        with jr.backend(backend):
            return call()
    return run


def jax_nn_call(row, arrays):
    if row.mask in USER_MASKS:
        kwargs = {"mask": jnp.asarray(~USER_MASKS[row.mask](row))}
    elif row.mask == "bottom-right causal":
        mask = jnp.tril(jnp.ones((row.q_len, row.kv_len), bool), row.kv_len - row.q_len)
        kwargs = {"mask": mask[None, None]}
    else:
        kwargs = {"is_causal": row.mask == "top-left causal"}
    return _jitted(row, lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, implementation="xla", **kwargs), arrays)


def torch_call(row, arrays):
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[row.dtype]
    # (B, S, N, D) -> (B, N, S, D), contiguous, as SDPA expects
    q, k, v = (torch.from_numpy(a).to(dtype).transpose(1, 2).contiguous() for a in arrays)
    if row.mask in USER_MASKS:
        kwargs = {"attn_mask": torch.from_numpy(~USER_MASKS[row.mask](row))}
    elif row.mask == "bottom-right causal":
        mask = torch.ones(row.q_len, row.kv_len, dtype=torch.bool).tril(row.kv_len - row.q_len)
        kwargs = {"attn_mask": mask}
    else:
        kwargs = {"is_causal": row.mask == "top-left causal"}
    kwargs["enable_gqa"] = row.heads != row.kv_heads
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if not row.backward:
        def run():
            with torch.no_grad():
                return sdpa(q, k, v, **kwargs)
        return run
    for x in (q, k, v):
        x.requires_grad_(True)

    def run_with_grad():
        out = sdpa(q, k, v, **kwargs)
        return torch.autograd.grad(out, (q, k, v), out.detach())
    return run_with_grad


# --- measuring and reporting ----------------------------------------------------------------

def _warmed(make):
    """(call, None) after a first call (compiling it), or (None, why) if building or
    calling it failed."""
    try:
        call = make()
        call()
        return call, None
    except Exception as e:  # noqa: BLE001 - a failing implementation is reported, not fatal
        return None, e


def measure_row(row, repeats):
    """{implementation: ms or a note string}. jax_rope and torch (or, for a feature row,
    jax_rope with and without the feature) alternate in the same rounds; jax.nn and the
    fallback, which build the dense score matrix, are timed after them in rounds of their
    own, so that their memory churn does not land on the pair."""
    rng = np.random.default_rng(0)
    shapes = [(row.batch, row.q_len, row.heads, row.dim)] + [
        (row.batch, row.kv_len, row.kv_heads, row.dim)] * 2
    arrays = [rng.standard_normal(shape, np.float32) for shape in shapes]
    if row.extra:  # a jax_rope feature against the plain jax_rope call
        groups = [{"jax_rope": lambda: jax_rope_call(row, arrays),
                   "plain call": lambda: jax_rope_call(row, arrays, with_extra=False)}]
    else:
        groups = [{"jax_rope": lambda: jax_rope_call(row, arrays),
                   "torch": (lambda: torch_call(row, arrays)) if torch is not None else None},
                  {"jax.nn": lambda: jax_nn_call(row, arrays),
                   "fallback": lambda: jax_rope_call(row, arrays, backend="fallback")}]
    results = {}
    for makers in groups:
        calls = {}
        for name, make in makers.items():
            if make is None:
                results[name] = "missing: torch is not installed (pip install 'jax_rope[bench]')"
                continue
            call, error = _warmed(make)
            if call is not None:
                calls[name] = call
            elif row.extra and name == "jax_rope" and isinstance(
                    error, (TypeError, NotImplementedError)):
                return {"jax_rope": f"skipped: this jax_rope has no such arguments "
                                    f"({type(error).__name__}: {str(error).splitlines()[0][:90]})"}
            elif name == "jax_rope":
                raise error
            else:
                results[name] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:90]}"
        results.update(time_calls(calls, repeats=repeats))
    order = [name for makers in groups for name in makers]
    return {name: results[name] for name in order}


def peak(row, limits):
    """(GFLOP/s, name) of the row's compute peak: bfloat16 rows against the CPU's bf16
    products where it has them (AMX tiles, else the bf16 dot instruction)."""
    if row.dtype == "bfloat16" and limits.get("amx_bf16_gflops"):
        return limits["amx_bf16_gflops"], "AMX bf16 peak"
    if row.dtype == "bfloat16" and limits.get("bf16_gflops"):
        return limits["bf16_gflops"], "bf16 peak"
    return limits["fma_gflops"], "peak"


def describe_rate(row, ms, limits):
    if row.memory_bound:
        gbps = row.kv_bytes / ms / 1e6
        return f"{gbps:7.1f} GB/s K/V = {gbps / limits['copy_gbps']:4.2f} of copy"
    gflops = row.flops / ms / 1e6
    top, name = peak(row, limits)
    return f"{gflops:7.1f} GFLOP/s = {gflops / top:4.2f} of {name}"


def report_row(row, results, limits):
    shape = (f"B{row.batch} Sq{row.q_len} Skv{row.kv_len} N{row.heads}/{row.kv_heads} "
             f"D{row.dim} {row.dtype} {row.mask}{' fwd+bwd' if row.backward else ''}")
    print(f"\n{row.name}: {shape}")
    if row.memory_bound:
        bound = row.kv_bytes / limits["copy_gbps"] / 1e6
        print(f"  memory bound: {row.kv_bytes / 1e6:.0f} MB of K/V at the copy bandwidth = "
              f"{bound:.2f} ms")
    ours = results.get("jax_rope")
    ratios = {}
    for name, value in results.items():
        if isinstance(value, str):
            print(f"  {name:10s} {value}")
            continue
        line = f"  {name:10s} {value:9.2f} ms  {describe_rate(row, value, limits)}"
        if name != "jax_rope" and isinstance(ours, float):
            ratios[name] = value / ours
            line += f"  ratio {ratios[name]:6.2f}x"
        print(line)
    torch_ms = results.get("torch")
    if not row.memory_bound and isinstance(torch_ms, float):
        # The most any implementation could reach against torch here: all of the
        # counted FLOPs at the row's peak.
        top, name = peak(row, limits)
        ceiling = torch_ms / (row.flops / top / 1e6)
        print(f"  ceiling    {ceiling:.2f}x torch at the {'FMA peak' if name == 'peak' else name} "
              f"(a ratio r needs r x {1 / ceiling:.2f} of {name})")
    return ratios


def plot(ratios, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (the bench or notebooks extra)")
        return
    labels = list(ratios)
    series = list(dict.fromkeys(p for r in ratios.values() for p in r))
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(12, 4.5))
    for n, name in enumerate(series):
        xs = [i + (n - (len(series) - 1) / 2) * width for i in range(len(labels))]
        values = [ratios[label].get(name, float("nan")) for label in labels]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), labels, rotation=15, ha="right", fontsize=8)
    ax.set_ylabel("peer time / jax_rope time (log)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        default=os.environ.get("JAX_ROPE_BENCH_QUICK", "") not in ("", "0"),
                        help="tiny shapes (16x shorter sequences): seconds, for a smoke run")
    parser.add_argument("--more", action="store_true",
                        help="also shapes beyond issue 13's table (no mask, cross-attention, "
                             "D80/D96, float16, user masks, ...)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="interleaved rounds per row (the median is reported)")
    parser.add_argument("--plot", default=None,
                        help="where to write the ratio chart ('' for none; by default "
                             "benchmarks/attention_peers.png, the README's, or "
                             "attention_peers_more.png with --more)")
    args = parser.parse_args()
    if args.plot is None:
        args.plot = os.path.join(os.path.dirname(__file__),
                                 "attention_peers_more.png" if args.more else "attention_peers.png")
    limits = machine.measure(copy_mib=64 if args.quick else 256)
    peer = f"torch {torch.__version__} ({torch.get_num_threads()} threads)" if torch else \
        "torch missing (pip install 'jax_rope[bench]')"
    print(f"jax {jax.__version__} ({jax.devices()[0].platform}), {peer}")
    bf16 = f", bf16 dot peak {limits['bf16_gflops']:.1f}" if limits.get("bf16_gflops") else ""
    if limits.get("amx_bf16_gflops"):
        bf16 += f", AMX bf16 peak {limits['amx_bf16_gflops']:.1f}"
    print(f"machine: {limits['threads']} threads, {limits['isa']} FMA peak "
          f"{limits['fma_gflops']:.1f} GFLOP/s{bf16}, copy {limits['copy_gbps']:.1f} GB/s "
          "(read + written)")
    # The training rows allocate their outputs anew each call (README: small steps in a loop).
    print(f"malloc settings in the environment: {allocator.environment()}")
    times, ratios = {}, {}
    for row in rows(args.quick, args.more):
        results = measure_row(row, args.repeats)
        times[row.name] = results
        row_ratios = report_row(row, results, limits)
        if row_ratios:
            ratios[row.name] = row_ratios
    if args.plot:
        plot({name: r for name, r in ratios.items() if "plain call" not in r}, args.plot,
             f"flash_attention_score vs peers ({'quick' if args.quick else 'full'} shapes, "
             f"{limits['threads']} threads)")
    rounded = lambda d: {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}
    print(json.dumps({"benchmark": "attention_peers", "quick": args.quick, "more": args.more,
                      "machine": limits,
                      "malloc": allocator.environment(),
                      "ms": {k: rounded(v) for k, v in times.items()},
                      "ratios": {k: rounded(v) for k, v in ratios.items()}}))


if __name__ == "__main__":
    main()
