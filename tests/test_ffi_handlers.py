"""The C++ handlers re-check their input: a bad call through a route that skips
the Python validation (a raw ffi_call) returns an FFI error, never a crash; and so does an
attention kernel whose scratch memory cannot be had."""

import contextlib
import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_oracle as ao
import rope_oracle as ro
import jax_rope as jr
import native_build
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


def forward_results(q, v, layout=BSND):
    """The forward's results: out, and the statistics (B, N1, Sq) or (Tq, N1)."""
    stats = (q.shape[0], q.shape[2], q.shape[1]) if layout == BSND else (q.shape[0], q.shape[1])
    return (jax.ShapeDtypeStruct(q.shape[:-1] + v.shape[-1:], q.dtype),
            jax.ShapeDtypeStruct(stats, jnp.float32), jax.ShapeDtypeStruct(stats, jnp.float32))


def call_attention(target, arrays, outs, layout=BSND, mask=None, bias_kind=0, after_scale=0,
                   dropout=0, keep_threshold=2**32, keep_scale=1.0, **extras):
    """A raw call of an attention handler: its tensors, then the optional operands."""
    operands = dict(PLACEHOLDERS, **extras)
    if mask is not None:
        operands["mask"] = mask
    fn = jax.ffi.ffi_call(target, outs)
    return jax.block_until_ready(fn(
        *arrays, *operands.values(), layout=layout, scale=np.float32(0.5),
        has_mask=np.int32(operands["mask"].size > 1), bias_kind=np.int32(bias_kind),
        bias_after_scale=np.int32(after_scale), dropout=np.int32(dropout),
        keep_threshold=np.int64(keep_threshold), keep_scale=np.float32(keep_scale)))


def call_attention_forward(q, k, v, table, layout=BSND, outs=None, **kw):
    """A raw call of the attention forward handler."""
    return call_attention("jax_rope_attention_fwd", (q, k, v, table),
                          outs or forward_results(q, v, layout), layout=layout, **kw)


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


_Q = jnp.ones((2, 8, 2, 4), jnp.float32)
_TABLE = jnp.asarray([[0, 8, 0, 8] + OPEN_BAND] * 2, jnp.int32)
_SHAPE = jax.ShapeDtypeStruct


@pytest.mark.parametrize("case, message", [
    (dict(layout=np.int32(9)), "unknown layout code 9"),
    (dict(v=jnp.ones((2, 7, 2, 4))), "key and value must agree"),
    (dict(k=jnp.ones((1, 8, 2, 4)), v=jnp.ones((1, 8, 2, 4))), "key and value must agree"),
    (dict(k=jnp.ones((2, 8, 3, 4)), v=jnp.ones((2, 8, 3, 4))), "N1 must be a multiple of N2"),
    (dict(k=jnp.ones((2, 8, 2, 6))), "need D\\(key\\) == D\\(query\\)"),
    (dict(v=jnp.ones((2, 8, 2, 6))), "Dv <= D"),
    (dict(v=jnp.ones((2, 8, 2, 4), jnp.float16)), "value must have query's dtype"),
    (dict(table=_TABLE[:, :6]), "sequence table must be int32 \\(B, 7\\)"),
    (dict(table=_TABLE[:1]), "a row per batch entry"),
    (dict(mask=np.zeros((1, 1, 4, 8), np.uint8)), "atten_mask must be"),
    (dict(mask=np.zeros((3, 1, 8, 8), np.uint8)), "atten_mask must be"),
    (dict(mask=np.zeros((2, 3, 8, 8), np.uint8)), "atten_mask must be"),
    (dict(outs=(_SHAPE((2, 8, 2, 4), jnp.float16),) + forward_results(_Q, _Q)[1:]),
     "attention_out has an unexpected shape or dtype"),
    (dict(outs=forward_results(_Q, _Q)[:1] + (_SHAPE((2, 8, 2), jnp.float32),) * 2),
     "softmax_max has an unexpected shape or dtype"),
])
def test_attention_handler_refuses_inconsistent_tensors(case, message):
    """The forward handler re-checks the tensors' geometry, the sequence table, the mask's
    shape and its results' shapes and dtypes: an FFI error naming what is wrong."""
    q, k, v = (case.pop(name, _Q) for name in ("q", "k", "v"))
    table = case.pop("table", _TABLE)
    with pytest.raises(Exception, match=message):
        call_attention_forward(q, k, v, table, **case)


def test_attention_handler_refuses_a_packed_pse_of_the_wrong_size():
    q = jnp.ones((12, 2, 4), jnp.float32)
    table = jnp.asarray([[0, 4, 0, 4] + OPEN_BAND, [4, 8, 4, 8] + OPEN_BAND], jnp.int32)
    cells = 4 * 4 + 8 * 8
    with pytest.raises(Exception, match=f"packed pse must be \\(N1, sum of q_len \\* kv_len\\)"
                                        f" = \\(2, {cells}\\)"):
        call_attention_forward(q, q, q, table, layout=TND, bias_kind=3,
                               bias=np.zeros((2, cells - 1), np.float32))
    call_attention_forward(q, q, q, table, layout=TND, bias_kind=3,
                           bias=np.zeros((2, cells), np.float32))


@pytest.mark.parametrize("wrong, message", [
    ("dout", "grad of attention_out has an unexpected shape or dtype"),
    ("softmax_sum", "softmax_sum has an unexpected shape or dtype"),
    ("dkey", "dkey has an unexpected shape or dtype"),
])
def test_attention_backward_handler_refuses_inconsistent_tensors(wrong, message):
    """The backward handler checks its saved tensors and its results as the forward does."""
    q = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, 2, 4)), jnp.float32)
    out, smax, ssum = call_attention_forward(q, q, q, _TABLE)
    saved = dict(out=out, dout=out, softmax_max=smax, softmax_sum=ssum)
    results = dict(dquery=_SHAPE(q.shape, q.dtype), dkey=_SHAPE(q.shape, q.dtype),
                   dvalue=_SHAPE(q.shape, q.dtype))

    def call():
        return call_attention("jax_rope_attention_bwd", (q, q, q, *saved.values(), _TABLE),
                              tuple(results.values()))
    dq, dk, dv = call()  # the good call
    assert np.isfinite(np.asarray(dq)).all() and np.abs(np.asarray(dv)).sum() > 0
    if wrong in saved:
        saved[wrong] = saved[wrong][:, :, :1]
    else:
        results[wrong] = _SHAPE(q.shape, jnp.float16)
    with pytest.raises(Exception, match=message):
        call()


# --- kernel scratch that cannot be had -----------------------------------------------------

@pytest.fixture(scope="module")
def scratch_limit():
    """The CPU attention and RoPE handlers built again with a limit on their kernels'
    scratch (tests/native/scratch_limit_handlers.cc), registered as
    jax_rope_test_attention_{fwd,scores,bwd} and jax_rope_test_rope_{fwd,bwd}; returns a
    context manager: inside it, their scratch requests above n bytes fail as a failed
    allocation does (std::bad_alloc)."""
    try:
        lib = ctypes.CDLL(str(native_build.build_dir() / native_build.SCRATCH_LIMIT_HANDLERS))
    except native_build.Unavailable as why:
        pytest.skip(str(why))
    for op, kind, symbol in [("attention", "fwd", "Forward"), ("attention", "scores", "Scores"),
                             ("attention", "bwd", "Backward"), ("rope", "fwd", "Forward"),
                             ("rope", "bwd", "Backward")]:
        handler = jax.ffi.pycapsule(getattr(lib, f"JaxRopeTest{op.title()}{symbol}"))
        jax.ffi.register_ffi_target(f"jax_rope_test_{op}_{kind}", handler, platform="cpu")
    lib.jax_rope_test_limit_scratch.argtypes = [ctypes.c_int64]
    lib.jax_rope_test_poison_scratch.argtypes = [ctypes.c_int32]

    @contextlib.contextmanager
    def limited_to(nbytes):
        lib.jax_rope_test_limit_scratch(nbytes)
        try:
            yield
        finally:
            lib.jax_rope_test_limit_scratch(0)

    @contextlib.contextmanager
    def poisoned():  # new scratch holders start as NaN: a kernel reading what it did not write
        lib.jax_rope_test_poison_scratch(1)
        try:
            yield
        finally:
            lib.jax_rope_test_poison_scratch(0)
    limited_to.poisoned = poisoned
    return limited_to


# JAX raises it as a JaxRuntimeError, or as a ValueError where the same executable has run
# before: the tests match the message.
OUT_OF_SCRATCH = "RESOURCE_EXHAUSTED: jax_rope attention: out of memory for kernel scratch"


def _open_case(seed, B, Sq, Skv, N1, N2, D):
    """(q, k, v) in BSND with a table that lets every query see every key (the raw calls'
    scale: 0.5)."""
    args, _ = ao.make_case(np.random.default_rng(seed), B=B, Sq=Sq, Skv=Skv, N1=N1, N2=N2, D=D)
    table = jnp.asarray([[0, Sq, 0, Skv] + OPEN_BAND] * B, jnp.int32)
    return [jnp.asarray(a) for a in args], table


def _limited_forward(q, k, v, table):
    return call_attention("jax_rope_test_attention_fwd", (q, k, v, table), forward_results(q, v))


# The tiled forward; the split (decode) forward, whose pass scratch (5 KiB here) fails at
# 1 byte and its kernels' own scratch (64 KiB a thread) at 8 KiB.
@pytest.mark.parametrize("shape, limit", [
    (dict(B=1, Sq=64, Skv=64, N1=4, N2=2, D=32), 1),
    (dict(B=2, Sq=1, Skv=2048, N1=8, N2=2, D=32), 1),
    (dict(B=2, Sq=1, Skv=2048, N1=8, N2=2, D=32), 8 << 10),
], ids=["tiled", "split pass", "split kernels"])
def test_attention_forward_without_scratch_is_an_error_not_a_crash(scratch_limit, shape, limit):
    """A forward whose scratch cannot be had fails with RESOURCE_EXHAUSTED and the process
    goes on; the same call then computes the oracle's numbers."""
    (q, k, v), table = _open_case(7, **shape)
    with scratch_limit(limit), pytest.raises(Exception, match=OUT_OF_SCRATCH):
        _limited_forward(q, k, v, table)
    out = _limited_forward(q, k, v, table)[0]
    want = ao.flash_attention_score(*(ao.f64(a) for a in (q, k, v)), scale=0.5)[0]
    np.testing.assert_allclose(ao.f64(out), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("limit", [1, 4 << 10], ids=["pass", "kernels"])
def test_attention_backward_without_scratch_is_an_error_not_a_crash(scratch_limit, limit):
    """The same for the backward: its pass scratch (1 KiB here) at 1 byte, its kernels'
    scratch at 4 KiB."""
    (q, k, v), table = _open_case(8, B=1, Sq=64, Skv=64, N1=4, N2=2, D=32)
    out, smax, ssum = _limited_forward(q, k, v, table)
    dout = jnp.asarray(np.random.default_rng(9).standard_normal(out.shape), jnp.float32)

    def backward():
        return call_attention("jax_rope_test_attention_bwd",
                              (q, k, v, out, dout, smax, ssum, table),
                              tuple(_SHAPE(x.shape, x.dtype) for x in (q, k, v)))
    with scratch_limit(limit), pytest.raises(Exception, match=OUT_OF_SCRATCH):
        backward()
    want = ao.flash_attention_grad(*(ao.f64(a) for a in (q, k, v, dout)), scale=0.5)
    for got, w in zip(backward(), want):
        np.testing.assert_allclose(ao.f64(got), w, rtol=1e-4, atol=1e-4)


def test_attention_scores_without_scratch_is_an_error_not_a_crash(scratch_limit):
    """The same for the scores."""
    (q, k, _), table = _open_case(10, B=1, Sq=64, Skv=64, N1=4, N2=2, D=32)
    scores = jax.ffi.ffi_call("jax_rope_test_attention_scores", _SHAPE((1, 4, 64, 64), jnp.float32))

    def call():  # the scores take the mask, bias and offsets operands only
        return jax.block_until_ready(scores(
            q, k, table, PLACEHOLDERS["mask"], PLACEHOLDERS["bias"], PLACEHOLDERS["offsets"],
            layout=BSND, scale=np.float32(0.5), has_mask=np.int32(0), bias_kind=np.int32(0),
            bias_after_scale=np.int32(0)))
    with scratch_limit(1), pytest.raises(Exception, match=OUT_OF_SCRATCH):
        call()
    got = call()
    want = ao.attention_scores(ao.f64(q), ao.f64(k), scale=0.5)
    np.testing.assert_allclose(ao.f64(got), want, rtol=2e-5, atol=2e-5)


def test_attention_forward_reads_key_value_in_place_without_memory_for_their_copy(
        scratch_limit):
    """Where the forward would read a head-major copy of K and V (each key row read by many
    query blocks) and that copy cannot be had, it reads K and V where they lie: the call
    succeeds with the oracle's numbers."""
    (q, k, v), table = _open_case(11, B=1, Sq=2048, Skv=512, N1=4, N2=2, D=32)
    copy_bytes = k.nbytes + v.nbytes  # 256 KiB; the kernels' own scratch: 134 KiB a thread
    with scratch_limit(copy_bytes - (32 << 10)):
        out = _limited_forward(q, k, v, table)[0]
    with scratch_limit(64 << 10), pytest.raises(Exception, match=OUT_OF_SCRATCH):
        _limited_forward(q, k, v, table)  # the limit does reach this call's scratch
    want = ao.flash_attention_score(*(ao.f64(a) for a in (q, k, v)), scale=0.5)[0]
    np.testing.assert_allclose(ao.f64(out), want, rtol=2e-5, atol=2e-5)


ROPE_OUT_OF_SCRATCH = "RESOURCE_EXHAUSTED: jax_rope rope: out of memory for kernel scratch"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_without_scratch_is_an_error_not_a_crash(scratch_limit, dtype):
    """RoPE's forward and backward (with query and key: dcos and dsin too) whose per-thread
    rows cannot be had fail with RESOURCE_EXHAUSTED, on the calling thread and on the pool's
    (2048 tokens: several chunks), and the process goes on; the same calls then compute
    the oracle's numbers."""
    rng = np.random.default_rng(12)
    q, k, gq, gk = (jnp.asarray(rng.standard_normal((2, 1024, n, 64)), dtype)
                    for n in (4, 2, 4, 2))
    angle = rng.uniform(0, 6, (1, 1024, 1, 64))
    cos, sin = (jnp.asarray(f(angle), dtype) for f in (np.cos, np.sin))
    attrs = dict(layout=np.int32(Layout.BSND), rotary_mode=np.int32(RotaryMode.HALF))
    shapes = lambda *xs: tuple(_SHAPE(x.shape, x.dtype) for x in xs)
    forward = jax.ffi.ffi_call("jax_rope_test_rope_fwd", shapes(q, k))
    backward = jax.ffi.ffi_call("jax_rope_test_rope_bwd", shapes(q, k, cos, sin))
    calls = [lambda: jax.block_until_ready(forward(q, k, cos, sin, **attrs)),
             lambda: jax.block_until_ready(backward(gq, gk, cos, sin, q, k, **attrs))]
    for call in calls:
        with scratch_limit(1), pytest.raises(Exception, match=ROPE_OUT_OF_SCRATCH):
            call()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=5e-2)
    f64 = lambda *xs: [np.asarray(x, np.float64) for x in xs]
    with scratch_limit.poisoned():  # (the kept rows' contents are undefined: none is read)
        outs, grads = calls[0](), calls[1]()
    for got, want in zip(outs, ro.apply_rotary_pos_emb(*f64(q, k, cos, sin))):
        np.testing.assert_allclose(f64(got)[0], want, **tol)
    want = ro.apply_rotary_pos_emb_grad(*f64(gq, gk, cos, sin), query=f64(q)[0], key=f64(k)[0])
    for got, w in zip(grads, want):
        np.testing.assert_allclose(f64(got)[0], w, **tol)
