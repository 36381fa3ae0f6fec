"""The C++ handlers re-check their input: a bad call through a route that skips
the Python validation (a raw ffi_call) returns an FFI error, never a crash."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_rope as jr
from jax_rope.core import extension as _extension
from jax_rope.core.codes import Layout, RotaryMode

pytestmark = pytest.mark.skipif(not _extension.STATUS.loaded,
                                reason="compiled extension not loaded")

HALF, QUARTER = np.int32(RotaryMode.HALF), np.int32(RotaryMode.QUARTER)
BSND, TND = np.int32(Layout.BSND), np.int32(Layout.TND)


def call_forward(query, key, cos, sin, layout=BSND, rotary_mode=HALF, out_shapes=None):
    out_shapes = out_shapes or (jax.ShapeDtypeStruct(query.shape, query.dtype),
                                jax.ShapeDtypeStruct(key.shape, key.dtype))
    fn = jax.ffi.ffi_call("jax_rope_rope_fwd", out_shapes)
    return jax.block_until_ready(fn(query, key, cos, sin, layout=layout, rotary_mode=rotary_mode))


def arrays(q_shape=(2, 3, 4, 8), k_shape=(2, 3, 2, 8), cos_shape=(1, 3, 1, 8), dtype=jnp.float32):
    rng = np.random.default_rng(0)
    make = lambda shape: jnp.asarray(rng.standard_normal(shape), dtype)
    return make(q_shape), make(k_shape), make(cos_shape), make(cos_shape)


def test_raw_call_matches_public_api():
    q, k, c, s = arrays()
    raw = call_forward(q, k, c, s)
    with jr.backend("ffi"):
        public = jr.apply_rotary_pos_emb(q, k, c, s)
    for a, b in zip(raw, public):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("case, message", [
    (dict(layout=np.int32(7)), "layout code"),
    (dict(rotary_mode=np.int32(9)), "rotary_mode code"),
    (dict(layout=TND), "rank 3"),
    (dict(cos_shape=(1, 3, 1, 6), rotary_mode=QUARTER), "divisible by 4"),
    (dict(cos_shape=(1, 3, 1, 16)), "<= head dim"),
    (dict(cos_shape=(1, 3, 2, 8)), "head axis 1"),
    (dict(cos_shape=(1, 4, 1, 8)), "sequence length"),
    (dict(cos_shape=(3, 3, 1, 8)), "batch must be 1 or 2"),
    (dict(k_shape=(2, 4, 2, 8)), "key must match query"),
    (dict(k_shape=(2, 3, 2, 8), sin_shape=(1, 3, 1, 4)), "sin must have the shape of cos"),
    (dict(dtype=jnp.int32), "dtype must be float32"),
    (dict(key_dtype=jnp.float16), "must have the dtype of query"),
    (dict(out_shape=(2, 3, 4, 4)), "query_out must have the shape"),
])
def test_handler_rejects_bad_call(case, message):
    q, k, c, s = arrays(case.get("q_shape", (2, 3, 4, 8)), case.get("k_shape", (2, 3, 2, 8)),
                        case.get("cos_shape", (1, 3, 1, 8)), case.get("dtype", jnp.float32))
    if "sin_shape" in case:
        s = jnp.zeros(case["sin_shape"], q.dtype)
    if "key_dtype" in case:
        k = k.astype(case["key_dtype"])
    out_shapes = None
    if "out_shape" in case:
        out_shapes = (jax.ShapeDtypeStruct(case["out_shape"], q.dtype),
                      jax.ShapeDtypeStruct(k.shape, k.dtype))
    with pytest.raises(Exception, match=message):
        call_forward(q, k, c, s, layout=case.get("layout", BSND),
                     rotary_mode=case.get("rotary_mode", HALF), out_shapes=out_shapes)


def test_backward_handler_rejects_non_half_mode():
    q, k, c, s = arrays()
    fn = jax.ffi.ffi_call("jax_rope_rope_bwd_no_inputs",
                          (jax.ShapeDtypeStruct(q.shape, q.dtype),
                           jax.ShapeDtypeStruct(k.shape, k.dtype)))
    with pytest.raises(Exception, match="half"):
        jax.block_until_ready(fn(q, k, c, s, layout=BSND, rotary_mode=QUARTER))


def test_process_survives_and_still_computes_after_errors():
    q, k, c, s = arrays()
    with pytest.raises(Exception):
        call_forward(q, k, c, s, layout=np.int32(0))
    out = call_forward(q, k, c, s)
    assert np.isfinite(np.asarray(out[0])).all()


def call_attention_forward(q, k, v, table, layout=BSND, mask=None):
    """A raw call of the attention forward handler (statistics (B, N1, Sq) or (Tq, N1))."""
    stats = (q.shape[0], q.shape[2], q.shape[1]) if layout == BSND else (q.shape[0], q.shape[1])
    outs = (jax.ShapeDtypeStruct(q.shape[:-1] + v.shape[-1:], q.dtype),
            jax.ShapeDtypeStruct(stats, jnp.float32), jax.ShapeDtypeStruct(stats, jnp.float32))
    mask = jnp.zeros((1, 1, 1, 1), jnp.uint8) if mask is None else mask
    fn = jax.ffi.ffi_call("jax_rope_attention_fwd", outs)
    return jax.block_until_ready(fn(q, k, v, table, mask, layout=layout,
                                    scale=np.float32(0.5), has_mask=np.int32(mask.size > 1)))


OPEN_BAND = [-(1 << 30), 1 << 30, -(1 << 30)]


@pytest.mark.parametrize("case, message", [
    # a padded row that does not cover the sequence would leave rows unwritten
    (dict(table=[[0, 2, 0, 4] + OPEN_BAND]), "must cover the padded sequence"),
    (dict(table=[[0, 4, 0, 3] + OPEN_BAND]), "must cover the padded sequence"),
    # D = 0: nothing to compute, outputs would be left uninitialised
    (dict(d=0), "D > 0"),
    (dict(table=[[0, 4, 0, 5] + OPEN_BAND]), "outside the tensors"),
])
def test_attention_handler_refuses_tables_and_shapes_it_cannot_fill(case, message):
    d = case.get("d", 8)
    q = jnp.ones((1, 4, 2, d), jnp.float32)
    table = jnp.asarray(case.get("table", [[0, 4, 0, 4] + OPEN_BAND]), jnp.int32)
    with pytest.raises(Exception, match=message):
        call_attention_forward(q, q, q, table)


def test_attention_handler_zero_fills_tnd_padding():
    """TND tokens beyond the last cumulative length belong to no sequence: zeros and the
    dead-row statistics, never uninitialised memory."""
    q = jnp.full((6, 1, 8), 3.0, jnp.float32)
    table = jnp.asarray([[0, 4, 0, 4] + OPEN_BAND], jnp.int32)
    out, smax, ssum = call_attention_forward(q, q, q, table, layout=TND)
    np.testing.assert_array_equal(np.asarray(out)[4:], 0.0)
    np.testing.assert_array_equal(np.asarray(smax)[4:], np.float32(-3.4028235e38))
    np.testing.assert_array_equal(np.asarray(ssum)[4:], np.float32(3.4028235e38))
    np.testing.assert_allclose(np.asarray(out)[:4], 3.0)
