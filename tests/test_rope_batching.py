"""Batching rules: a vmapped axis folds into the batch (or TND token) axis, so a
vmapped call is still one kernel call, and per-example gradients of shared
tables (cos batch 1 broadcast over B) are summed per example."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_rope as jr
import rope_oracle as oracle


def make(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("layout", ["BSND", "SBND", "BNSD", "TND"])
def test_vmap_is_one_kernel_call(layout):
    rng = np.random.default_rng(0)
    shapes = {"BSND": ((5, 2, 3, 4, 8), (1, 3, 1, 8)), "SBND": ((5, 3, 2, 4, 8), (3, 1, 1, 8)),
              "BNSD": ((5, 2, 4, 3, 8), (1, 1, 3, 8)), "TND": ((5, 6, 4, 8), (6, 1, 8))}
    q_shape, cos_shape = shapes[layout]
    q, c, s = make(rng, q_shape), make(rng, cos_shape), make(rng, cos_shape)
    fn = jax.vmap(lambda q: jr.apply_rotary_pos_emb(q, q, c, s, layout=layout))
    with jr.backend("ffi"):
        text = jax.jit(fn).lower(q).as_text()
        got = fn(q)
    assert text.count("@jax_rope_rope_fwd(") == 1
    for v in range(q.shape[0]):
        want = oracle.apply_rotary_pos_emb(np.asarray(q[v]), np.asarray(q[v]), np.asarray(c),
                                           np.asarray(s), layout=layout)
        np.testing.assert_allclose(np.asarray(got[0][v]), want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["ffi", "fallback"])
@pytest.mark.parametrize("cos_batch", [1, 2])
def test_vmap_of_grad_function_per_example_tables(backend, cos_batch):
    """vmap over apply_rotary_pos_emb_grad with query/key: dcos/dsin per example."""
    rng = np.random.default_rng(1)
    v, b, s_len, nq, nk, d, r = 3, 2, 4, 4, 2, 8, 6
    gq, q = make(rng, (v, b, s_len, nq, d)), make(rng, (v, b, s_len, nq, d))
    gk, k = make(rng, (v, b, s_len, nk, d)), make(rng, (v, b, s_len, nk, d))
    c, s = make(rng, (cos_batch, s_len, 1, r)), make(rng, (cos_batch, s_len, 1, r))
    fn = jax.vmap(lambda gq, gk, q, k: jr.apply_rotary_pos_emb_grad(gq, gk, c, s, q, k))
    with jr.backend(backend):
        got = jax.jit(fn)(gq, gk, q, k)
    for i in range(v):
        want = oracle.apply_rotary_pos_emb_grad(gq[i], gk[i], c, s, q[i], k[i], layout="BSND")
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g[i]), w, rtol=1e-5, atol=1e-5)
