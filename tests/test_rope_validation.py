"""One test per rule of spec/rope.md "Validation", each raised eagerly, under jax.jit and under
jax.eval_shape (all at trace time), with a message naming the argument."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_rope as jr

F32, F16, BF16, I32 = jnp.float32, jnp.float16, jnp.bfloat16, jnp.int32
ERR = (ValueError, TypeError)


def sds(shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


def good(layout="BSND", B=2, S=3, Nq=4, Nk=2, D=8, r=None, cb=None):
    """A valid (query, key, cos, sin) of ShapeDtypeStructs for a layout."""
    r = D if r is None else r
    cb = B if cb is None else cb
    if layout in ("BSND", "BSH"):
        q, k, c = (B, S, Nq, D), (B, S, Nk, D), (cb, S, 1, r)
    elif layout == "SBND":
        q, k, c = (S, B, Nq, D), (S, B, Nk, D), (S, cb, 1, r)
    elif layout == "BNSD":
        q, k, c = (B, Nq, S, D), (B, Nk, S, D), (cb, 1, S, r)
    else:
        q, k, c = (B * S, Nq, D), (B * S, Nk, D), (B * S, 1, r)
    return [sds(q), sds(k), sds(c), sds(c)]


def replace(args, **kw):
    """Replace some of (query, key, cos, sin) by a shape tuple or a ShapeDtypeStruct."""
    out = list(args)
    for i, name in enumerate(("query", "key", "cos", "sin")):
        if name in kw:
            v = kw[name]
            out[i] = v if isinstance(v, jax.ShapeDtypeStruct) else sds(v, out[i].dtype)
    return out


def with_dtype(args, **dtypes):
    out = list(args)
    for i, name in enumerate(("query", "key", "cos", "sin")):
        if name in dtypes:
            out[i] = sds(out[i].shape, dtypes[name])
    return out


# (id, args, layout, rotary_mode, exception types, match) for apply_rotary_pos_emb
FWD_CASES = []


def case(cid, args, layout="BSND", mode="half", exc=ERR, match=None):
    FWD_CASES.append(pytest.param(args, layout, mode, exc, match, id=cid))


# dtypes: one of the four differs from the others (TypeError)
for odd in ("query", "key", "cos", "sin"):
    case(f"dtype-mismatch-{odd}-f16", with_dtype(good(), **{odd: F16}), exc=TypeError,
         match=odd)
    case(f"dtype-mismatch-{odd}-bf16", with_dtype(good("TND"), **{odd: BF16}), layout="TND",
         exc=TypeError, match=odd)
case("dtype-f16-vs-bf16", with_dtype(good(), query=F16, key=F16, cos=BF16, sin=BF16),
     exc=TypeError, match="cos|key|query")
# unsupported dtype (int32; float64 cannot be made with x64 disabled)
case("dtype-int32", with_dtype(good(), query=I32, key=I32, cos=I32, sin=I32), exc=TypeError,
     match="query|int32")
# cos.shape == sin.shape
case("sin-shape-differs", replace(good(r=8), sin=(2, 3, 1, 4)), match="sin|cos")
case("sin-rank-differs", replace(good(), sin=(2, 3, 8)), match="sin|cos")
# ranks fit the layout
case("query-rank3-bsnd", replace(good(), query=(2, 3, 32)), match="query")
case("all-rank3-bsnd", good("TND"), layout="BSND", match="query")
case("all-rank3-bsh", good("TND"), layout="BSH", match="query|BSH")
case("all-rank4-tnd", good("BSND"), layout="TND", match="query|TND")
case("query-rank5", replace(good(), query=(1, 2, 3, 4, 8)), match="query")
case("key-rank3-bsnd", replace(good(), key=(2, 3, 16)), match="key")
case("cos-sin-rank3-bsnd", replace(good(), cos=(3, 1, 8), sin=(3, 1, 8)), match="cos")
case("cos-sin-rank4-tnd", replace(good("TND"), cos=(1, 6, 1, 8), sin=(1, 6, 1, 8)),
     layout="TND", match="cos")
# rotary_mode and layout names
for bad_mode in ("full", "rotate_half", "", "HALF "):
    case(f"rotary-mode-{bad_mode!r}", good(), mode=bad_mode, match="rotary_mode")
for bad_layout in ("BSDN", "NSD", "", "BHSD"):
    case(f"layout-{bad_layout!r}", good(), layout=bad_layout, match="layout")
# divisibility of D and r per mode, and r <= D
case("half-D-odd", good(D=7, r=6), mode="half", match="query|key|D|head")
case("half-r-odd", good(D=8, r=5), mode="half", match="cos")
case("interleave-D-odd", good(D=9, r=4), mode="interleave", match="query|key|D|head")
case("interleave-r-odd", good(D=8, r=3), mode="interleave", match="cos")
case("quarter-D-not-4", good(D=10, r=8), mode="quarter", match="query|key|D|head")
case("quarter-r-not-4", good(D=8, r=6), mode="quarter", match="cos")
case("quarter-D-and-r-6", good(D=6, r=6), mode="quarter", match="query|key|cos")
case("r-greater-than-D", good(D=8, r=12), match="cos|query")
case("r-greater-than-D-tnd", good("TND", D=4, r=8), layout="TND", match="cos|query")
# no axis of size 0
case("query-zero-heads", good(Nq=0), match="query")
case("key-zero-heads", good(Nk=0), match="key")
case("zero-seq", good(S=0), match="query|key|cos")
case("zero-batch-sbnd", good("SBND", B=0, cb=0), layout="SBND", match="query|key|cos")
case("zero-D", good(D=0, r=0), match="query|key|cos")
case("cos-zero-width", good(D=8, r=0), match="cos")
case("zero-tokens-tnd", good("TND", S=0), layout="TND", match="query|key|cos")
# every axis of key other than N matches query
case("key-batch-bsnd", replace(good(), key=(3, 3, 2, 8)), match="key")
case("key-seq-bsnd", replace(good(), key=(2, 4, 2, 8)), match="key")
case("key-D-bsnd", replace(good(), key=(2, 3, 2, 16)), match="key")
case("key-seq-sbnd", replace(good("SBND"), key=(4, 2, 2, 8)), layout="SBND", match="key")
case("key-batch-bnsd", replace(good("BNSD"), key=(1, 2, 3, 8)), layout="BNSD", match="key")
case("key-seq-bnsd", replace(good("BNSD"), key=(2, 2, 5, 8)), layout="BNSD", match="key")
case("key-tokens-tnd", replace(good("TND"), key=(7, 2, 8)), layout="TND", match="key")
case("key-D-tnd", replace(good("TND"), key=(6, 2, 4)), layout="TND", match="key")
# cos/sin head axis must be 1, even where it would broadcast
case("cos-heads-bsnd", replace(good(Nq=2, Nk=2), cos=(2, 3, 2, 8), sin=(2, 3, 2, 8)),
     match="cos")
case("cos-heads-bnsd", replace(good("BNSD", Nq=2, Nk=2), cos=(2, 2, 3, 8), sin=(2, 2, 3, 8)),
     layout="BNSD", match="cos")
case("cos-heads-tnd", replace(good("TND", Nq=2, Nk=2), cos=(6, 2, 8), sin=(6, 2, 8)),
     layout="TND", match="cos")
# cos/sin batch axis is 1 or B
case("cos-batch-bsnd", replace(good(B=3), cos=(2, 3, 1, 8), sin=(2, 3, 1, 8)), match="cos")
case("cos-batch-sbnd", replace(good("SBND", B=3), cos=(3, 2, 1, 8), sin=(3, 2, 1, 8)),
     layout="SBND", match="cos")
case("cos-batch-bnsd", replace(good("BNSD", B=2), cos=(4, 1, 3, 8), sin=(4, 1, 3, 8)),
     layout="BNSD", match="cos")
# cos/sin sequence length matches query
case("cos-seq-bsnd", replace(good(), cos=(2, 4, 1, 8), sin=(2, 4, 1, 8)), match="cos")
case("cos-seq-short-bsnd", replace(good(), cos=(2, 1, 1, 8), sin=(2, 1, 1, 8)), match="cos")
case("cos-seq-sbnd", replace(good("SBND"), cos=(2, 2, 1, 8), sin=(2, 2, 1, 8)),
     layout="SBND", match="cos")
case("cos-seq-bnsd", replace(good("BNSD"), cos=(2, 1, 4, 8), sin=(2, 1, 4, 8)),
     layout="BNSD", match="cos")
case("cos-tokens-tnd", replace(good("TND"), cos=(5, 1, 8), sin=(5, 1, 8)), layout="TND",
     match="cos")


def concrete(args):
    return [jnp.zeros(a.shape, a.dtype) for a in args]


CALLS = ["eager", "jit", "eval_shape"]


def call_fwd(how, args, layout, mode):
    f = functools.partial(jr.apply_rotary_pos_emb, layout=layout, rotary_mode=mode)
    if how == "eager":
        return f(*concrete(args))
    if how == "jit":
        return jax.jit(f)(*concrete(args))
    return jax.eval_shape(f, *args)


@pytest.mark.parametrize("how", CALLS)
@pytest.mark.parametrize("args,layout,mode,exc,match", FWD_CASES)
def test_forward_rejects(backend, how, args, layout, mode, exc, match):
    with pytest.raises(exc, match=f"(?i){match}"):
        call_fwd(how, args, layout, mode)


@pytest.mark.parametrize("layout", ["BSND", "BSH", "SBND", "BNSD", "TND"])
@pytest.mark.parametrize("mode", ["half", "quarter", "interleave"])
def test_valid_shapes_pass_eval_shape(layout, mode):
    """The valid counterparts of the cases above are accepted (so the errors are specific)."""
    args = good(layout, Nq=4, Nk=2, D=16, r=8, cb=1 if layout != "TND" else None)
    q_out, k_out = jax.eval_shape(
        functools.partial(jr.apply_rotary_pos_emb, layout=layout, rotary_mode=mode), *args)
    assert (q_out.shape, q_out.dtype) == (args[0].shape, args[0].dtype)
    assert (k_out.shape, k_out.dtype) == (args[1].shape, args[1].dtype)
    for dt in (F16, BF16):
        out = jax.eval_shape(functools.partial(jr.apply_rotary_pos_emb, layout=layout,
                                               rotary_mode=mode),
                             *with_dtype(args, query=dt, key=dt, cos=dt, sin=dt))
        assert out[0].dtype == dt and out[1].dtype == dt


def test_bad_input_never_computes(backend):
    """An error comes before any computation: the call raises, and a later good call works."""
    args = good()
    with pytest.raises(ERR):
        jr.apply_rotary_pos_emb(*concrete(replace(args, cos=(2, 4, 1, 8), sin=(2, 4, 1, 8))))
    q, k = jr.apply_rotary_pos_emb(*concrete(args))
    assert q.shape == args[0].shape and k.shape == args[1].shape


# apply_rotary_pos_emb_grad: (id, positional (gq, gk, cos, sin), query, key, layout, mode,
# exception, match)
GRAD_CASES = []


def gcase(cid, args, query=None, key=None, layout="BSND", mode="half", exc=ERR, match=None):
    GRAD_CASES.append(pytest.param(args, query, key, layout, mode, exc, match, id=cid))


_g = good()
gcase("query-without-key", _g, query=_g[0], match="key|query")
gcase("key-without-query", _g, key=_g[1], match="key|query")
gcase("mode-quarter", _g, mode="quarter", exc=ValueError, match="quarter|rotary_mode")
gcase("mode-interleave", _g, query=_g[0], key=_g[1], mode="interleave", exc=ValueError,
      match="interleave|rotary_mode")
gcase("mode-unknown", _g, mode="full", exc=ValueError, match="rotary_mode|full")
gcase("layout-unknown", _g, layout="BSDN", match="layout")
gcase("gq-seq-vs-gk", replace(_g, query=(2, 4, 4, 8)), match="grad")
gcase("grads-seq-vs-cos", replace(_g, query=(2, 4, 4, 8), key=(2, 4, 2, 8)), match="cos")
gcase("grads-batch-vs-cos", replace(_g, query=(3, 3, 4, 8), key=(3, 3, 2, 8)), match="cos")
gcase("grads-tokens-vs-cos-tnd", replace(good("TND"), query=(5, 4, 8), key=(5, 2, 8)),
      layout="TND", match="cos")
gcase("gq-rank", replace(_g, query=(2, 3, 32)), match="grad|query")
gcase("gq-gk-batch", replace(_g, key=(3, 3, 2, 8)), match="grad|key")
gcase("cos-sin-shape", replace(_g, sin=(2, 3, 1, 4)), match="sin|cos")
gcase("cos-heads", replace(_g, cos=(2, 3, 2, 8), sin=(2, 3, 2, 8)), match="cos")
gcase("r-greater-than-D", good(D=4, r=8), match="cos|grad|query")
gcase("half-r-odd", good(D=8, r=5), match="cos")
gcase("dtype-gq", with_dtype(_g, query=F16), exc=TypeError, match="grad|query")
gcase("dtype-cos", with_dtype(_g, cos=BF16), exc=TypeError, match="cos")
gcase("dtype-query-arg", _g, query=sds(_g[0].shape, F16), key=_g[1], exc=TypeError,
      match="query")
gcase("query-shape-vs-gq", _g, query=sds((2, 3, 2, 8)), key=_g[1], match="query|grad")
gcase("key-shape-vs-gk", _g, query=_g[0], key=sds((2, 3, 4, 8)), match="key|grad")
gcase("zero-size", good(S=0), match="grad|query|key|cos")
gcase("tnd-rank4", good("BSND"), layout="TND", match="grad|query|TND")


def call_grad(how, args, query, key, layout, mode):
    def f(gq, gk, c, s, q, k):
        return jr.apply_rotary_pos_emb_grad(gq, gk, c, s, query=q, key=k, layout=layout,
                                            rotary_mode=mode)
    if how == "eval_shape":
        return jax.eval_shape(f, *args, query, key)
    conc = concrete(args)
    q = None if query is None else jnp.zeros(query.shape, query.dtype)
    k = None if key is None else jnp.zeros(key.shape, key.dtype)
    if how == "jit":
        return jax.jit(f)(*conc, q, k)
    return f(*conc, q, k)


@pytest.mark.parametrize("how", CALLS)
@pytest.mark.parametrize("args,query,key,layout,mode,exc,match", GRAD_CASES)
def test_grad_function_rejects(backend, how, args, query, key, layout, mode, exc, match):
    with pytest.raises(exc, match=f"(?i){match}"):
        call_grad(how, args, query, key, layout, mode)


def test_grad_function_valid_eval_shape():
    args = good("SBND", Nq=3, Nk=1, D=12, r=8, cb=1)
    out = jax.eval_shape(functools.partial(jr.apply_rotary_pos_emb_grad, layout="SBND"),
                         *args, args[0], args[1])
    assert [o.shape for o in out] == [a.shape for a in args]
    dq, dk, dcos, dsin = jax.eval_shape(
        functools.partial(jr.apply_rotary_pos_emb_grad, layout="SBND"), *args)
    assert dcos is None and dsin is None
    assert dq.shape == args[0].shape and dk.shape == args[1].shape


def test_errors_under_grad_trace(backend):
    """Validation also runs when the forward is traced by jax.grad."""
    args = concrete(replace(good(), cos=(2, 4, 1, 8), sin=(2, 4, 1, 8)))

    def loss(q, k, c, s):
        qo, ko = jr.apply_rotary_pos_emb(q, k, c, s)
        return jnp.sum(qo) + jnp.sum(ko)

    with pytest.raises(ERR, match="(?i)cos"):
        jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
    with pytest.raises(ERR, match="(?i)cos"):
        jax.vmap(lambda q, k: jr.apply_rotary_pos_emb(q, k, args[2], args[3]))(
            args[0][None], args[1][None])


def test_set_backend_rejects_unknown_name():
    with pytest.raises(ERR, match="(?i)backend|gpu"):
        jr.set_backend("gpu")
    with pytest.raises(ERR, match="(?i)backend|nope"):
        with jr.backend("nope"):
            pass


def test_describe_mentions_version_and_extension():
    text = jr.describe()
    assert isinstance(text, str)
    assert "extension" in text.lower()
    import re
    assert re.search(r"\d+\.\d+", text)


def test_set_backend_round_trip():
    """set_backend changes the backend in force; restoring "auto" leaves the default working."""
    args = concrete(good())
    try:
        jr.set_backend("fallback")
        a = jr.apply_rotary_pos_emb(*args)
    finally:
        jr.set_backend("auto")
    b = jr.apply_rotary_pos_emb(*args)
    np.testing.assert_allclose(np.asarray(a[0]), np.asarray(b[0]))
