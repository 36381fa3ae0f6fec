"""Every validation rule of spec/attention_bias_dropout.md section 5 for the positional bias
(pse, pse_type, ALiBi start offsets) of jr.flash_attention_score and jr.attention_scores:
each is checked at trace time (jax.eval_shape, nothing computed) for the error type and the
message naming the argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_oracle as ao
import jax_rope as jr


def qkv(layout="BSND", B=2, Sq=4, Skv=5, N1=2, D=8, dtype=jnp.float32, lq=(2, 2), lkv=(2, 3)):
    """Abstract inputs (jax.ShapeDtypeStruct) and the layout keywords."""
    kw = {"input_layout": layout}
    if layout == "TND":
        q, k = (sum(lq), N1, D), (sum(lkv), N1, D)
        kw.update(actual_seq_qlen=ao.cumulative(lq), actual_seq_kvlen=ao.cumulative(lkv))
    else:
        q, k = ao.layout_shape(layout, B, Sq, N1, D), ao.layout_shape(layout, B, Skv, N1, D)
    if layout in ("BSH", "SBH"):
        kw["head_num"] = N1
    return [jax.ShapeDtypeStruct(s, dtype) for s in (q, k, k)], kw


def trace(abstract, kw, pse=None, scores=False, **extra):
    """Traces the call (nothing computed). pse: a ShapeDtypeStruct, an array or other."""
    arrays = dict(extra)
    if isinstance(pse, jax.ShapeDtypeStruct):
        def f(q, k, v, p):
            if scores:
                return jr.attention_scores(q, k, pse=p, **kw, **arrays)
            return jr.flash_attention_score(q, k, v, pse=p, **kw, **arrays)
        return jax.eval_shape(f, *abstract, pse)

    def g(q, k, v):
        if scores:
            return jr.attention_scores(q, k, pse=pse, **kw, **arrays)
        return jr.flash_attention_score(q, k, v, pse=pse, **kw, **arrays)
    return jax.eval_shape(g, *abstract)


def S(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("pse_type", [4, -1, 1.0, "1", None])
def test_bad_pse_type(pse_type):
    a, kw = qkv()
    with pytest.raises(ValueError, match="pse_type"):
        trace(a, dict(kw, pse_type=pse_type), S(2, 2, 4, 5))


@pytest.mark.parametrize("pse_type", [0, 2, 3])
def test_pse_type_without_pse(pse_type):
    a, kw = qkv()
    with pytest.raises(ValueError, match="pse"):
        trace(a, dict(kw, pse_type=pse_type))
    with pytest.raises(ValueError, match="pse"):
        trace(a, dict(kw, pse_type=pse_type), scores=True)


@pytest.mark.parametrize("pse", ["alibi", 1.5])
def test_pse_not_array(pse):
    a, kw = qkv()
    with pytest.raises(TypeError, match="pse"):
        trace(a, kw, pse)


@pytest.mark.parametrize("pse_type,pse", [
    (1, S(2, 2, 4, 5, dtype=jnp.float16)), (0, S(1, 2, 1, 5, dtype=jnp.bfloat16)),
    (2, S(2, dtype=jnp.float16)), (3, S(2, 2, dtype=jnp.int32)),
    (2, S(2, dtype=jnp.bfloat16))])
def test_pse_dtype(pse_type, pse):
    a, kw = qkv()
    with pytest.raises(TypeError, match="pse"):
        trace(a, dict(kw, pse_type=pse_type), pse)


def test_pse_dtype_low_precision_query():
    a, kw = qkv(dtype=jnp.bfloat16)
    with pytest.raises(TypeError, match="pse"):
        trace(a, dict(kw, pse_type=1), S(2, 2, 4, 5))  # float32 pse, bfloat16 query
    trace(a, dict(kw, pse_type=1), S(2, 2, 4, 5, dtype=jnp.bfloat16))
    trace(a, dict(kw, pse_type=2), S(2))  # slopes stay float32


BAD_SHAPES = {  # B=2, N1=2, Sq=4, Skv=5
    0: [(2, 2, 4, 6), (2, 2, 3, 5), (3, 2, 4, 5), (2, 1, 4, 5), (2, 4, 5), (4, 5), (2, 2, 1),
        (1, 2, 1024, 5), (2, 2, 4, 5, 1), (20,)],
    2: [(3,), (2, 2, 1), (2, 1), (3, 2), (1,), (2, 2, 4, 5), ()],
}


@pytest.mark.parametrize("pse_type,shape", [(t, s) for t in (0, 1, 2, 3)
                                            for s in BAD_SHAPES[0 if t < 2 else 2]])
def test_pse_bad_shape(pse_type, shape):
    """ValueError naming pse, listing the accepted shapes and the one given."""
    a, kw = qkv()
    with pytest.raises(ValueError, match="pse") as err:
        trace(a, dict(kw, pse_type=pse_type), S(*shape))
    msg = str(err.value)
    assert str(shape) in msg, msg
    accepted = ["(2,)", "(2, 2)"] if pse_type >= 2 else ["(2, 2, 4, 5)", "(1, 2, 1, 5)"]
    assert all(a in msg for a in accepted), msg


@pytest.mark.parametrize("layout", ["BNSD", "BSH", "SBH"])
def test_pse_shapes_per_layout(layout):
    """[B, N1, Sq, Skv] order whatever the layout (BSH/SBH: head_num is N1)."""
    a, kw = qkv(layout)
    for shape in [(2, 2, 4, 5), (1, 2, 4, 5), (2, 2, 1, 5), (1, 2, 1, 5)]:
        trace(a, dict(kw, pse_type=1), S(*shape))
        trace(a, dict(kw, pse_type=0), S(*shape), scores=True)
    for shape in [(2,), (2, 2)]:
        trace(a, dict(kw, pse_type=2), S(*shape))
    for shape in [(2, 4, 2, 5), (2, 2, 5, 4), (2, 5)]:
        with pytest.raises(ValueError, match="pse"):
            trace(a, dict(kw, pse_type=1), S(*shape))


def test_tnd_shapes():
    """TND: packed full (N1*sum Sq_b*Skv_b), packed row (N1*sum Skv_b), compressed only with
    Sq_b == Skv_b, slopes (N1,)/(B, N1) with B sequences."""
    a, kw = qkv("TND", N1=2, lq=(2, 2), lkv=(2, 3))  # packed full 2*(4+6)=20, row 2*5=10
    for shape in [(20,), (10,)]:
        trace(a, dict(kw, pse_type=1), S(*shape))
    for shape in [(21,), (5,), (2, 2, 4, 5), (1, 2, 1024, 3), (2, 10), (1, 20)]:
        with pytest.raises(ValueError, match="pse"):
            trace(a, dict(kw, pse_type=1), S(*shape))
    trace(a, dict(kw, pse_type=2), S(2, 2))
    trace(a, dict(kw, pse_type=3), S(2))
    with pytest.raises(ValueError, match="pse"):
        trace(a, dict(kw, pse_type=2), S(3, 2))
    eq, ekw = qkv("TND", N1=2, lq=(2, 3), lkv=(2, 3))
    trace(eq, dict(ekw, pse_type=0), S(2, 2, 1024, 3))
    trace(eq, dict(ekw, pse_type=0), S(1, 2, 1024, 3))


def test_compressed_rules():
    a, kw = qkv("BNSD", B=1, Sq=1030, Skv=1030, N1=1, D=4)
    trace(a, dict(kw, pse_type=1), S(1, 1, 1024, 1030))
    for mode in (2, 3):
        trace(a, dict(kw, pse_type=1, sparse_mode=mode), S(1, 1, 1024, 1030))
    for mode, extra in ((4, {"pre_tokens": 5, "next_tokens": 5}), (1, {}), (6, {})):
        if mode == 1:
            extra = {"atten_mask": np.zeros((1030, 1030), bool)}
        if mode == 6:
            extra = {"prefix": [1030]}
        with pytest.raises(ValueError, match="pse|sparse_mode"):
            trace(a, dict(kw, pse_type=1, sparse_mode=mode, **extra), S(1, 1, 1024, 1030))
    b, kwb = qkv("BNSD", B=1, Sq=1030, Skv=1031, N1=1, D=4)
    with pytest.raises(ValueError, match="pse"):
        trace(b, dict(kwb, pse_type=1), S(1, 1, 1024, 1031))
    c, kwc = qkv("BNSD", B=1, Sq=1000, Skv=1000, N1=1, D=4)
    with pytest.raises(ValueError, match="pse"):
        trace(c, dict(kwc, pse_type=1), S(1, 1, 1024, 1000))
    t, kwt = qkv("TND", N1=2, lq=(2, 3), lkv=(2, 4))
    with pytest.raises(ValueError, match="pse"):
        trace(t, dict(kwt, pse_type=1), S(1, 2, 1024, 4))
    e, kwe = qkv("TND", N1=2, lq=(2, 3), lkv=(2, 3))
    with pytest.raises(ValueError, match="pse|sparse_mode"):
        trace(e, dict(kwe, pse_type=1, sparse_mode=8, pre_tokens=2, next_tokens=0),
              S(1, 2, 1024, 3))


def test_tnd_packed_needs_concrete_lengths():
    a, kw = qkv("TND", N1=2, lq=(2, 2), lkv=(2, 3))
    cq, ckv = kw.pop("actual_seq_qlen"), kw.pop("actual_seq_kvlen")

    def f(q, k, v, p, sq, skv):
        return jr.flash_attention_score(q, k, v, pse=p, actual_seq_qlen=sq,
                                        actual_seq_kvlen=skv, **kw)[0]

    lens = (jnp.asarray(cq, jnp.int32), jnp.asarray(ckv, jnp.int32))
    for shape in [(20,), (10,)]:
        with pytest.raises(ValueError, match="pse|actual_seq"):
            jax.eval_shape(f, *a, S(*shape), *lens)
    # slopes do not need concrete lengths
    kw2 = dict(kw, pse_type=2)
    jax.eval_shape(lambda q, k, v, p, sq, skv: jr.flash_attention_score(
        q, k, v, pse=p, actual_seq_qlen=sq, actual_seq_kvlen=skv, **kw2)[0], *a, S(2), *lens)


def test_pse_mode7_rejected():
    a, kw = qkv("TND", N1=2, lq=(2, 3), lkv=(2, 3))
    for t, p in ((1, S(2 * (4 + 9))), (2, S(2))):
        with pytest.raises(ValueError, match="sparse_mode|pse"):
            trace(a, dict(kw, pse_type=t, sparse_mode=7, pre_tokens=3, next_tokens=0), p)


def test_pse_mode8_allowed():
    a, kw = qkv("TND", N1=2, lq=(2, 3), lkv=(2, 3))
    trace(a, dict(kw, pse_type=1, sparse_mode=8, pre_tokens=2, next_tokens=0), S(26))
    trace(a, dict(kw, pse_type=2, sparse_mode=8, pre_tokens=2, next_tokens=0, q_start_idx=1),
          S(2))


@pytest.mark.parametrize("name", ["q_start_idx", "kv_start_idx"])
def test_offsets_validation(name):
    a, kw = qkv()
    kw2 = dict(kw, pse_type=2)
    for ok in (3, -4, [2], (5,), jnp.int32(2), np.asarray(7, np.int32)):
        trace(a, dict(kw2, **{name: ok}), S(2))
    for bad in (1.0, "1", [1, 2], (), np.zeros(2, np.int32), None):
        with pytest.raises(TypeError, match=name):
            trace(a, dict(kw2, **{name: bad}), S(2))
    for bad in (2 ** 31, -(2 ** 31) - 1, [2 ** 40]):
        with pytest.raises(ValueError, match=name):
            trace(a, dict(kw2, **{name: bad}), S(2))
    for t, p in ((1, S(2, 2, 4, 5)), (0, S(2, 2, 4, 5))):
        with pytest.raises(ValueError, match=name):
            trace(a, dict(kw, pse_type=t, **{name: 1}), p)
        trace(a, dict(kw, pse_type=t, **{name: 0}), p)
    with pytest.raises(ValueError, match=name):
        trace(a, dict(kw, **{name: 2}))  # no pse at all
    with pytest.raises(ValueError, match=name):
        trace(a, dict(kw, **{name: 2}), scores=True)


def test_traced_offsets_need_alibi():
    a, kw = qkv()

    def f(pse_type, p):
        def g(q, k, v, off):
            return jr.flash_attention_score(q, k, v, pse=p, pse_type=pse_type, q_start_idx=off,
                                            **kw)[0]
        return g

    jax.eval_shape(f(2, jnp.ones(2)), *a, S(dtype=jnp.int32))
    jax.eval_shape(f(3, jnp.ones((2, 2))), *a, S(dtype=jnp.int32))
    with pytest.raises(ValueError, match="q_start_idx"):
        jax.eval_shape(f(1, jnp.ones((2, 2, 4, 5))), *a, S(dtype=jnp.int32))
    with pytest.raises(ValueError, match="q_start_idx"):
        jax.eval_shape(f(0, jnp.ones((2, 2, 4, 5))), *a, S(dtype=jnp.int32))
