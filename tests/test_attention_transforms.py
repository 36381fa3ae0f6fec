"""flash_attention_score / attention_scores under JAX transformations: jit, vmap over a leading
axis, grad inside vmap, jax.checkpoint, lax.scan over two layers, and what each backend lowers
to (a jax_rope_attention* custom_call for "ffi", none for "fallback")."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_oracle as ao
import jax_rope as jr
from attention_oracle import f64
from conftest import require_backend

TOL = dict(rtol=2e-5, atol=2e-5)
GTOL = dict(rtol=1e-4, atol=1e-4)


def rng_for(*parts):
    import zlib
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


CASES = {
    "BSND-causal": dict(layout="BSND", B=2, Sq=4, Skv=5, N1=4, N2=2, D=8, sparse_mode=2),
    "BNSD-band": dict(layout="BNSD", B=1, Sq=5, Skv=5, N1=2, N2=1, D=8, Dv=4, sparse_mode=4,
                      pre_tokens=2, next_tokens=0),
    "BSH-mask": dict(layout="BSH", B=2, Sq=3, Skv=4, N1=2, N2=2, D=4, sparse_mode=0,
                     atten_mask=np.array([[0, 1, 0, 0], [0, 0, 1, 0], [1, 1, 1, 1]], bool)),
    "TND-rdc": dict(layout="TND", N1=2, N2=1, D=8, seq_q=[2, 0, 3], seq_kv=[3, 0, 2],
                    sparse_mode=3),
}


def stacked_case(name, V=3):
    """V independent inputs of one case stacked on a new leading axis, plus the kwargs."""
    c = dict(CASES[name])
    layout = c.pop("layout")
    rng = rng_for("transforms", name)
    cases = [ao.make_case(rng, layout, **c) for _ in range(V)]
    kw = cases[0][1]
    stacked = [np.stack([cs[0][i] for cs in cases]) for i in range(3)]
    return stacked, kw


def fa(kw):
    return functools.partial(jr.flash_attention_score, **kw)


def loss_fn(kw, dout):
    def loss(q, k, v):
        return jnp.sum(jr.flash_attention_score(q, k, v, **kw)[0] * dout)
    return loss


@pytest.mark.parametrize("name", list(CASES))
def test_jit(backend, name):
    (q, k, v), kw = stacked_case(name, 1)
    got = jax.jit(fa(kw))(q[0], k[0], v[0])
    ref = ao.flash_attention_score(f64(q[0]), f64(k[0]), f64(v[0]), **kw)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(np.asarray(g), r, **TOL)
    s = jax.jit(functools.partial(jr.attention_scores, **kw))(q[0], k[0])
    np.testing.assert_allclose(np.asarray(s), ao.attention_scores(f64(q[0]), f64(k[0]), **kw),
                               **TOL)


@pytest.mark.parametrize("name", list(CASES))
def test_vmap(backend, name):
    (q, k, v), kw = stacked_case(name)
    got = jax.vmap(fa(kw))(q, k, v)
    for i in range(q.shape[0]):
        ref = ao.flash_attention_score(f64(q[i]), f64(k[i]), f64(v[i]), **kw)
        for g, r in zip(got, ref):
            np.testing.assert_allclose(np.asarray(g)[i], r, **TOL)
    s = jax.vmap(functools.partial(jr.attention_scores, **kw))(q, k)
    for i in range(q.shape[0]):
        np.testing.assert_allclose(np.asarray(s)[i],
                                   ao.attention_scores(f64(q[i]), f64(k[i]), **kw), **TOL)


def test_vmap_shared_kv_and_jit(backend):
    """in_axes (0, None, None) under jit, and a vmapped axis that is not leading."""
    (q, k, v), kw = stacked_case("BSND-causal")
    got = jax.jit(jax.vmap(fa(kw), in_axes=(0, None, None)))(q, k[0], v[0])
    for i in range(q.shape[0]):
        ref = ao.flash_attention_score(f64(q[i]), f64(k[0]), f64(v[0]), **kw)
        np.testing.assert_allclose(np.asarray(got[0])[i], ref[0], **TOL)
    qm, km, vm = (np.moveaxis(x, 0, 2) for x in (q, k, v))
    got = jax.vmap(fa(kw), in_axes=2, out_axes=0)(qm, km, vm)
    for i in range(q.shape[0]):
        ref = ao.flash_attention_score(f64(q[i]), f64(k[i]), f64(v[i]), **kw)
        np.testing.assert_allclose(np.asarray(got[0])[i], ref[0], **TOL)


@pytest.mark.parametrize("name", ["BSND-causal", "TND-rdc"])
def test_grad_inside_vmap(backend, name):
    (q, k, v), kw = stacked_case(name)
    rng = rng_for("vmap-grad", name)
    out_shape = ao.flash_attention_score(f64(q[0]), f64(k[0]), f64(v[0]), **kw)[0].shape
    dout = rng.standard_normal((q.shape[0],) + out_shape).astype(np.float32)

    def one(q, k, v, d):
        return jax.grad(lambda a, b, c: jnp.sum(jr.flash_attention_score(a, b, c, **kw)[0]
                                                * d), argnums=(0, 1, 2))(q, k, v)

    got = jax.vmap(one)(q, k, v, dout)
    for i in range(q.shape[0]):
        ref = ao.flash_attention_grad(f64(q[i]), f64(k[i]), f64(v[i]), f64(dout[i]), **kw)
        for g, r in zip(got, ref):
            np.testing.assert_allclose(np.asarray(g)[i], r, **GTOL)


@pytest.mark.parametrize("name", ["BNSD-band", "BSH-mask"])
def test_checkpoint(backend, name):
    (q, k, v), kw = stacked_case(name, 1)
    q, k, v = q[0], k[0], v[0]
    out = ao.flash_attention_score(f64(q), f64(k), f64(v), **kw)[0]
    dout = rng_for("ckpt", name).standard_normal(out.shape).astype(np.float32)
    got = jax.jit(jax.grad(jax.checkpoint(loss_fn(kw, dout)), argnums=(0, 1, 2)))(q, k, v)
    ref = ao.flash_attention_grad(f64(q), f64(k), f64(v), f64(dout), **kw)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(np.asarray(g), r, **GTOL)


def test_scan_two_layers(backend):
    """x_{l+1} = attention(x_l, k_l, v_l) for two layers with lax.scan, forward and grad
    (against the oracle applied twice and against the unrolled loop)."""
    rng = rng_for("scan")
    B, S, N1, N2, D = 2, 5, 4, 2, 8
    x = rng.standard_normal((B, S, N1, D)).astype(np.float32)
    ks = rng.standard_normal((2, B, S, N2, D)).astype(np.float32)
    vs = rng.standard_normal((2, B, S, N2, D)).astype(np.float32)
    kw = dict(sparse_mode=3)

    def layer(h, kv):
        return jr.flash_attention_score(h, kv[0], kv[1], **kw)[0], None

    def scanned(x, ks, vs):
        return jax.lax.scan(layer, x, (ks, vs))[0]

    def unrolled(x, ks, vs):
        for i in range(2):
            x = layer(x, (ks[i], vs[i]))[0]
        return x

    got = np.asarray(jax.jit(scanned)(x, ks, vs))
    h = f64(x)
    for i in range(2):
        h = ao.flash_attention_score(h, f64(ks[i]), f64(vs[i]), **kw)[0]
    np.testing.assert_allclose(got, h, **TOL)
    g1 = jax.grad(lambda *a: jnp.sum(scanned(*a) ** 2), argnums=(0, 1, 2))(x, ks, vs)
    g2 = jax.grad(lambda *a: jnp.sum(unrolled(*a) ** 2), argnums=(0, 1, 2))(x, ks, vs)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **GTOL)
    # the first layer's gradient through the oracle: dL/dx = J1^T J2^T (2 h2)
    h1 = ao.flash_attention_score(f64(x), f64(ks[0]), f64(vs[0]), **kw)[0]
    dh1 = ao.flash_attention_grad(h1, f64(ks[1]), f64(vs[1]), 2 * h, **kw)[0]
    dx = ao.flash_attention_grad(f64(x), f64(ks[0]), f64(vs[0]), dh1, **kw)[0]
    np.testing.assert_allclose(np.asarray(g1[0]), dx, **GTOL)


# lowering -----------------------------------------------------------------------------------

def custom_call_targets(text):
    return (re.findall(r"custom_call\s*@([\w.$-]+)", text)
            + re.findall(r'call_target_name\s*=\s*"([^"]+)"', text))


@pytest.mark.parametrize("name", ["BSND-causal", "TND-rdc"])
@pytest.mark.parametrize("backend_name", ["ffi", "fallback"])
def test_lowering(backend_name, name):
    require_backend(backend_name)
    (q, k, v), kw = stacked_case(name, 1)
    q, k, v = q[0], k[0], v[0]
    with jr.backend(backend_name):
        fwd = jax.jit(fa(kw)).lower(q, k, v).as_text()
        out = ao.flash_attention_score(f64(q), f64(k), f64(v), **kw)[0]
        dout = np.ones(out.shape, np.float32)
        bwd = jax.jit(jax.grad(loss_fn(kw, dout), argnums=(0, 1, 2))).lower(q, k, v).as_text()
    fwd_t = [t for t in custom_call_targets(fwd) if t.startswith("jax_rope_attention")]
    bwd_t = [t for t in custom_call_targets(bwd) if t.startswith("jax_rope_attention")]
    if backend_name == "ffi":
        assert fwd_t, f"no jax_rope_attention custom_call in:\n{fwd[:3000]}"
        assert len(bwd_t) >= 2, f"grad should lower to a forward and a fused backward: {bwd_t}"
    else:
        assert not [t for t in custom_call_targets(fwd) + custom_call_targets(bwd)
                    if t.startswith("jax_rope")], custom_call_targets(fwd)
