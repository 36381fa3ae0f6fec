"""`python -m jax_rope demo`: a short tour on two toy models.

1. RoPE on the query/key projections of an attention-free toy model;
2. a causal attention block (RoPE + flash attention, sparse_mode 2).
Each runs under jax.jit and jax.grad, checks the FFI result against the
fallback, shows what each call lowered to, and times both.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_rope as jr


def rope_tables(seq_len: int, rotary_dim: int, base: float = 10000.0):
    """Half-mode cos/sin of shape (1, S, 1, r): cat(f, f) with f = pos * inv_freq."""
    inv_freq = base ** (-np.arange(0, rotary_dim, 2) / rotary_dim)
    freqs = np.arange(seq_len)[:, None] * inv_freq[None, :]
    angles = np.concatenate([freqs, freqs], axis=-1)[None, :, None, :]
    return jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)


def init_params(key, model_dim: int, q_heads: int, k_heads: int, head_dim: int):
    kq, kk = jax.random.split(key)
    scale = model_dim ** -0.5
    return {"wq": scale * jax.random.normal(kq, (model_dim, q_heads, head_dim)),
            "wk": scale * jax.random.normal(kk, (model_dim, k_heads, head_dim))}


def loss_fn(params, x, cos, sin):
    """Rotated q.k similarity of neighbouring tokens (GQA: key heads repeat)."""
    q = jnp.einsum("bsm,mnd->bsnd", x, params["wq"])
    k = jnp.einsum("bsm,mnd->bsnd", x, params["wk"])
    q, k = jr.apply_rotary_pos_emb(q, k, cos, sin, layout="BSND", rotary_mode="half")
    k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
    scores = jnp.einsum("bsnd,bsnd->bsn", q[:, 1:], k[:, :-1])
    return jnp.mean((scores - 1.0) ** 2)


def attention_block_loss(params, x, cos, sin):
    """One causal attention block with GQA: RoPE, flash attention, projection."""
    q = jnp.einsum("bsm,mnd->bsnd", x, params["wq"])
    k = jnp.einsum("bsm,mnd->bsnd", x, params["wk"])
    v = jnp.einsum("bsm,mnd->bsnd", x, params["wv"])
    q, k = jr.apply_rotary_pos_emb(q, k, cos, sin)
    out, _, _ = jr.flash_attention_score(q, k, v, input_layout="BSND", sparse_mode=2)
    y = jnp.einsum("bsnd,ndm->bsm", out, params["wo"])
    return jnp.mean((y[:, :-1] - x[:, 1:]) ** 2)  # predict the next token's embedding


def lowered_to(fn, *args) -> str:
    text = jax.jit(fn).lower(*args).as_text()
    targets = sorted({t for t in jr.FFI_TARGETS if f"@{t}(" in text})
    return "XLA FFI kernel (" + ", ".join(targets) + ")" if targets else "jnp fallback"


def time_ms(fn, *args, repeats: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return 1e3 * (time.perf_counter() - start) / repeats


def compare(title, loss, params, x, cos, sin) -> bool:
    """Runs loss and gradient under both backends; prints targets, agreement, times."""
    step = jax.value_and_grad(loss)
    print(f"\n{title} under jax.jit(jax.value_and_grad(loss))")
    results, times = {}, {}
    for name in ("ffi", "fallback"):
        with jr.backend(name):
            print(f"  backend {name!r:11}: gradient step -> {lowered_to(step, params, x, cos, sin)}")
            compiled = jax.jit(step)
            results[name] = compiled(params, x, cos, sin)
            times[name] = time_ms(compiled, params, x, cos, sin)
    (loss_ffi, grads_ffi), (loss_fb, grads_fb) = results["ffi"], results["fallback"]
    diffs = [float(jnp.max(jnp.abs(a - b))) for a, b in
             zip(jax.tree.leaves(grads_ffi), jax.tree.leaves(grads_fb))]
    agree = abs(float(loss_ffi) - float(loss_fb)) <= 1e-4 * max(1.0, abs(float(loss_fb)))
    agree = agree and max(diffs) < 1e-4
    print(f"  loss ffi {float(loss_ffi):.6f} vs fallback {float(loss_fb):.6f}; "
          f"max |grad difference| {max(diffs):.2e} -> {'agree' if agree else 'DISAGREE'}")
    print(f"  step time: ffi {times['ffi']:.2f} ms vs fallback {times['fallback']:.2f} ms "
          f"({times['fallback'] / times['ffi']:.2f}x)")
    return agree


def attention_demo() -> bool:
    batch, seq, model_dim, q_heads, k_heads, head_dim = 2, 512, 128, 4, 2, 32
    keys = jax.random.split(jax.random.key(2), 3)
    params = init_params(keys[0], model_dim, q_heads, k_heads, head_dim)
    params["wv"] = model_dim ** -0.5 * jax.random.normal(keys[1], (model_dim, k_heads, head_dim))
    params["wo"] = (q_heads * head_dim) ** -0.5 * jax.random.normal(
        keys[2], (q_heads, head_dim, model_dim))
    x = jax.random.normal(jax.random.key(3), (batch, seq, model_dim))
    cos, sin = rope_tables(seq, head_dim)
    return compare(f"Causal attention block: B={batch} S={seq} Nq={q_heads} Nk={k_heads} "
                   f"D={head_dim}, RoPE + flash_attention_score(sparse_mode=2)",
                   attention_block_loss, params, x, cos, sin)


def rope_demo() -> bool:
    batch, seq, model_dim, q_heads, k_heads, head_dim = 4, 512, 256, 8, 2, 64
    params = init_params(jax.random.key(0), model_dim, q_heads, k_heads, head_dim)
    x = jax.random.normal(jax.random.key(1), (batch, seq, model_dim))
    cos, sin = rope_tables(seq, head_dim)
    agree = compare(f"Attention-free toy model: B={batch} S={seq} Nq={q_heads} Nk={k_heads} "
                    f"D={head_dim}, RoPE on the q/k projections", loss_fn, params, x, cos, sin)
    q = jnp.einsum("bsm,mnd->bsnd", x, params["wq"])
    k = jnp.einsum("bsm,mnd->bsnd", x, params["wk"])
    rope_only = jax.grad(lambda q, k: sum(jnp.sum(jnp.sin(o)) for o in
                                          jr.apply_rotary_pos_emb(q, k, cos, sin)), (0, 1))
    times = {}
    for name in ("ffi", "fallback"):
        with jr.backend(name):
            times[name] = time_ms(jax.jit(rope_only), q, k)
    print(f"  RoPE forward+gradient alone: ffi {times['ffi']:.2f} ms vs fallback "
          f"{times['fallback']:.2f} ms ({times['fallback'] / times['ffi']:.2f}x)")
    return agree


def main() -> int:
    print(jr.describe())
    agree = rope_demo()
    agree = attention_demo() and agree
    return 0 if agree else 1
