"""jr.dot_product_attention against jax.nn.dot_product_attention (spec/api.md, issue 15):
outputs and gradients for causal, window, lengths, masks and GQA, on both backends.

jax.nn is the reference here only where its semantics are the documented ones: every compared
case keeps at least one visible key per query row (jax.nn averages value on a fully masked row,
where jax_rope gives 0; that difference has its own test).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_rope as jr

RNG = np.random.default_rng(1515)


def _inputs(b, t, s, n, k, h=8, dtype=jnp.float32):
    q = RNG.standard_normal((b, t, n, h))
    kk = RNG.standard_normal((b, s, k, h))
    v = RNG.standard_normal((b, s, k, h))
    return tuple(jnp.asarray(x, dtype) for x in (q, kk, v))


def _mask(shape, t, s):
    """A random bool mask (True = attend) that keeps j = min(i, s-1) visible in every row."""
    m = RNG.random(shape) < 0.6
    diag = np.arange(s)[None, :] == np.minimum(np.arange(t), s - 1)[:, None]
    return jnp.asarray(m | diag.reshape((1,) * (len(shape) - 2) + (t, s)))


# (id, B, T, S, N, K, keywords for both functions): few cases, each covering several features,
# because every one compiles a forward and a backward on each backend.
CASES = [
    ("causal_gqa", 2, 7, 7, 4, 2, lambda: {"is_causal": True}),
    ("causal_mqa_T_gt_S", 1, 9, 6, 4, 1, lambda: {"is_causal": True}),
    ("window_T_lt_S", 1, 6, 10, 4, 2, lambda: {"local_window_size": (3, 1)}),
    ("window_causal_T_gt_S", 2, 9, 6, 2, 2, lambda: {"local_window_size": (4, 2),
                                                     "is_causal": True}),
    ("lengths_causal", 3, 6, 8, 2, 1, lambda: {
        "is_causal": True, "query_seq_lengths": jnp.array([6, 3, 1], jnp.int32),
        "key_value_seq_lengths": jnp.array([8, 2, 5], jnp.int32)}),
    ("mask_BNTS_gqa", 2, 6, 7, 4, 2, lambda: {"mask": _mask((2, 4, 6, 7), 6, 7)}),
    ("mask_heads_only_qlen_window", 2, 8, 8, 4, 2, lambda: {
        "mask": _mask((1, 4, 8, 8), 8, 8), "local_window_size": 2,
        "query_seq_lengths": jnp.array([5, 8], jnp.int32)}),
    ("mask_rank2_keypad_scale", 2, 5, 7, 2, 2, lambda: {
        "mask": _mask((5, 7), 5, 7), "key_value_seq_lengths": jnp.array([4, 7], jnp.int32),
        "scale": 0.3}),
    ("bias_BNTS_causal", 2, 6, 6, 4, 2, lambda: {
        "bias": jnp.asarray(RNG.standard_normal((2, 4, 6, 6)), jnp.float32), "is_causal": True}),
    ("bias_rank2_window", 1, 5, 7, 2, 1, lambda: {
        "bias": jnp.asarray(RNG.standard_normal((5, 7)), jnp.float32), "local_window_size": 2}),
]


def _value_and_grads(fn, kw, cot):
    """One jitted function: the output and the gradients of <out, cot> w.r.t. q, k, v (and
    bias, when the case has one)."""
    kw = dict(kw)
    bias = kw.pop("bias", None)

    def run(q, k, v):
        if bias is None:
            out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **kw), q, k, v)
        else:
            out, vjp = jax.vjp(lambda q, k, v, b: fn(q, k, v, b, **kw), q, k, v, bias)
        return out, vjp(cot)
    return jax.jit(run)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_jax_nn_outputs_and_gradients(backend, case):
    _, b, t, s, n, k, make = case
    q, kk, v = _inputs(b, t, s, n, k)
    kw = make()
    cot = jnp.asarray(RNG.standard_normal(q.shape), jnp.float32)
    ours, g_ours = _value_and_grads(jr.dot_product_attention, kw, cot)(q, kk, v)
    ref, g_ref = _value_and_grads(jax.nn.dot_product_attention, kw, cot)(q, kk, v)
    np.testing.assert_allclose(ours, ref, atol=2e-6, rtol=1e-5)
    for a, r in zip(g_ours, g_ref):
        np.testing.assert_allclose(a, r, atol=1e-5, rtol=1e-5)


def test_unbatched_and_bfloat16(backend):
    q, k, v = _inputs(1, 6, 6, 4, 2)
    out = jr.dot_product_attention(q[0], k[0], v[0], is_causal=True)
    assert out.shape == (6, 4, 8)
    np.testing.assert_allclose(out, jax.nn.dot_product_attention(q[0], k[0], v[0],
                                                                 is_causal=True), atol=2e-6)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    out = jr.dot_product_attention(*bf, local_window_size=(2, 0))
    assert out.dtype == jnp.bfloat16
    ref = jax.nn.dot_product_attention(*[x.astype(jnp.float32) for x in bf],
                                       local_window_size=(2, 0))
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=2e-2)


def test_traced_lengths_do_not_retrace(backend):
    q, k, v = _inputs(2, 6, 6, 2, 2)
    traces = []

    @jax.jit
    def f(q, k, v, lq, lkv):
        traces.append(1)
        return jr.dot_product_attention(q, k, v, query_seq_lengths=lq, key_value_seq_lengths=lkv)

    for lq, lkv in (([6, 2], [3, 6]), ([1, 4], [6, 1])):
        lq, lkv = jnp.array(lq, jnp.int32), jnp.array(lkv, jnp.int32)
        np.testing.assert_allclose(
            f(q, k, v, lq, lkv), jax.nn.dot_product_attention(
                q, k, v, query_seq_lengths=lq, key_value_seq_lengths=lkv), atol=2e-6)
    assert len(traces) == 1


def test_fully_masked_rows_give_zero_where_jax_nn_averages_value(backend):
    q, k, v = _inputs(2, 4, 5, 2, 2)
    lkv = jnp.array([0, 5], jnp.int32)  # batch 0 sees no key at all

    @jax.jit
    def both(q, k, v):
        ours, vjp = jax.vjp(lambda v: jr.dot_product_attention(q, k, v,
                                                               key_value_seq_lengths=lkv), v)
        ref = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lkv)
        return ours, vjp(jnp.ones_like(ours))[0], ref

    ours, dv, ref = both(q, k, v)
    np.testing.assert_array_equal(ours[0], 0.0)
    np.testing.assert_allclose(ref[0], jnp.broadcast_to(v[0].mean(0), ref[0].shape), atol=1e-6)
    np.testing.assert_allclose(ours[1], ref[1], atol=2e-6)
    np.testing.assert_array_equal(dv[0], 0.0)


def _options(f, *args):
    """The AttentionOptions the call binds (sparse mode, band, backend)."""
    text = str(jax.make_jaxpr(f)(*args))
    return text[text.index("AttentionOptions("):].split(")", 1)[0]


def test_translation_uses_the_sparse_modes():
    q, k, v = _inputs(1, 4, 6, 2, 2)
    dpa = jr.dot_product_attention
    assert "sparse_mode=2" in _options(lambda q, k, v: dpa(q, k, v, is_causal=True), q, k, v)
    band = _options(lambda q, k, v: dpa(q, k, v, local_window_size=(3, 1)), q, k, v)
    # mode 4 counts from the bottom-right corner: pre = 3 + delta, next = 1 - delta, delta = 2.
    assert "sparse_mode=4" in band and "pre_tokens=5" in band and "next_tokens=-1" in band
    masked = _options(lambda q, k, v: dpa(q, k, v, is_causal=True,
                                          key_value_seq_lengths=jnp.array([3])), q, k, v)
    assert "sparse_mode=0" in masked and "next_tokens=0" in masked and "has_mask=True" in masked
    with jr.backend("ffi"):
        assert "backend='fallback'" in _options(
            lambda q, k, v: dpa(q, k, v, implementation="xla"), q, k, v)
        assert "backend='ffi'" in _options(lambda q, k, v: dpa(q, k, v), q, k, v)


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"bias": jnp.zeros((1, 3, 4, 6))}, ValueError, r"bias must be broadcastable to "
                                                    r"\(B, N, T, S\) = \(1, 2, 4, 6\)"),
    ({"mask": jnp.ones((1, 3, 4, 6), bool)}, ValueError, r"mask must be broadcastable to "
                                                         r"\(B, N, T, S\) = \(1, 2, 4, 6\)"),
    ({"mask": jnp.ones((1, 1, 1, 4, 6), bool)}, ValueError, "mask must be broadcastable"),
    ({"mask": jnp.ones((4, 6), jnp.int32)}, TypeError, "mask must be a bool array"),
    ({"query_seq_lengths": jnp.array([1, 2], jnp.int32)}, ValueError,
     r"query_seq_lengths must have shape \(B,\) = \(1,\), got \(2,\)"),
    ({"key_value_seq_lengths": jnp.array([1.0])}, TypeError,
     "key_value_seq_lengths must be an integer array"),
    ({"local_window_size": -1}, ValueError, "local_window_size must be None, a non-negative"),
    ({"local_window_size": (1, 2, 3)}, ValueError, "local_window_size must be"),
    ({"is_causal": "yes"}, TypeError, "is_causal must be a bool"),
    ({"implementation": "cudnn"}, ValueError, "implementation must be None, 'xla'"),
])
def test_errors_at_trace_time(kwargs, exc, match):
    q, k, v = _inputs(1, 4, 6, 2, 2)
    with pytest.raises(exc, match=match):
        jax.jit(lambda q, k, v: jr.dot_product_attention(q, k, v, **kwargs))(q, k, v)


def test_rank_mismatch_is_an_error():
    q, k, v = _inputs(1, 4, 6, 2, 2)
    with pytest.raises(ValueError, match="all be BTNH"):
        jr.dot_product_attention(q[0], k, v)
