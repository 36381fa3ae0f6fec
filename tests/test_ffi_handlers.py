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


# What the lowering passes for absent optional operands (attention/primitives.py).
PLACEHOLDERS = dict(mask=np.zeros((1, 1, 1, 1), np.uint8), bias=np.zeros((1,), np.float32),
                    offsets=np.zeros((1, 2), np.int32), drop_keys=np.zeros((1, 2), np.uint32),
                    drop_rows=np.zeros((1, 1), np.uint32), drop_mask=np.zeros((1,), np.uint8))


def call_attention_forward(q, k, v, table, layout=BSND, mask=None, bias_kind=0, after_scale=0,
                           dropout=0, keep_threshold=2**32, keep_scale=1.0, **extras):
    """A raw call of the attention forward handler (statistics (B, N1, Sq) or (Tq, N1))."""
    stats = (q.shape[0], q.shape[2], q.shape[1]) if layout == BSND else (q.shape[0], q.shape[1])
    outs = (jax.ShapeDtypeStruct(q.shape[:-1] + v.shape[-1:], q.dtype),
            jax.ShapeDtypeStruct(stats, jnp.float32), jax.ShapeDtypeStruct(stats, jnp.float32))
    operands = dict(PLACEHOLDERS, **extras)
    if mask is not None:
        operands["mask"] = mask
    fn = jax.ffi.ffi_call("jax_rope_attention_fwd", outs)
    return jax.block_until_ready(fn(
        q, k, v, table, *operands.values(), layout=layout, scale=np.float32(0.5),
        has_mask=np.int32(operands["mask"].size > 1), bias_kind=np.int32(bias_kind),
        bias_after_scale=np.int32(after_scale), dropout=np.int32(dropout),
        keep_threshold=np.int64(keep_threshold), keep_scale=np.float32(keep_scale)))


_B, _S, _N = 2, 8, 2
_ROWS = np.arange(_B * _N, dtype=np.uint32).reshape(_B, _N) * (_S * _S)
_KEYS = np.zeros((_B, 2), np.uint32)
_DROP = dict(dropout=1, keep_threshold=2**31, keep_scale=2.0, drop_keys=_KEYS, drop_rows=_ROWS)


@pytest.mark.parametrize("extras, match", [
    (dict(bias_kind=1, bias=np.zeros((1, _N, _S, _S), np.float16)), "pse must have query's"),
    (dict(bias_kind=1, bias=np.zeros((1, _N, _S, _S - 1), np.float32)), "pse must be"),
    (dict(bias_kind=1, bias=np.zeros((3, _N, _S, _S), np.float32)), "pse must be"),
    (dict(bias_kind=2, bias=np.zeros((1, _N, 1023, _S), np.float32)), "1024"),
    (dict(bias_kind=3, bias=np.zeros((_N, _B * _S * _S), np.float32)), "TND"),
    (dict(bias_kind=4, after_scale=1, bias=np.ones((1, _N), np.float16),
          offsets=np.zeros((_B, 2), np.int32)), "float32"),
    (dict(bias_kind=5, after_scale=1, bias=np.ones((1, _N), np.float32)), "offsets"),
    (dict(bias_kind=7), "bias_kind"),
    (dict(_DROP, keep_threshold=2**32), "keep_threshold"),
    (dict(_DROP, drop_keys=np.zeros((1, 2), np.uint32)), "drop_keys"),
    (dict(_DROP, drop_rows=np.zeros((_B, _N + 1), np.uint32)), "drop_rows"),
    (dict(_DROP, dropout=2, drop_mask=np.zeros((_B * _N * _S * _S // 8 - 1,), np.uint8)),
     "dropout_mask has 31 bytes"),
    (dict(_DROP, dropout=3), "unknown dropout mode"),
])
def test_attention_handler_refuses_bad_bias_and_dropout_operands(extras, match):
    """The C++ handler re-checks every optional operand against its kind: an FFI error, never
    a crash (the Python side never builds these)."""
    q = jnp.ones((_B, _S, _N, 4), jnp.float32)
    big = 1 << 30
    table = jnp.asarray([[0, _S, 0, _S, -big, big, -big]] * _B, jnp.int32)
    with pytest.raises(Exception, match=match):
        call_attention_forward(q, q, q, table, **extras)
    call_attention_forward(q, q, q, table, **_DROP)  # the good call runs


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
