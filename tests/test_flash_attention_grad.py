"""jax.grad of jr.flash_attention_score wrt query, key and value (spec/attention.md
"Gradients") against the oracle's analytic float64 backward and against jax.grad of a plain
dense masked softmax written here in jnp float32: every sparse mode, layouts, GQA, Dv < D,
varlen with empty sequences, the mode 7/8 worked examples, fully masked rows (zero gradient,
never NaN), low precision, traced varlen lengths, random calls across tiles, and
jax.test_util.check_grads."""


import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

import attention_oracle as ao
import jax_rope as jr
from attention_oracle import f64
from conftest import require_backend
from test_flash_attention import TILE_EXAMPLES, tile_case

N_EXAMPLES = max(3, settings.default.max_examples // 4)
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(ml_dtypes.bfloat16)}
# (rtol, atol relative to the largest expected magnitude)
GTOL = {"float32": (1e-4, 1e-4), "float16": (1e-2, 1e-2), "bfloat16": (3e-2, 3e-2)}


def rng_for(*parts):
    import zlib
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


# the dense jnp reference, from the spec ---------------------------------------------------

def jnp_to_bnsd(x, layout, heads):
    if layout == "BSND":
        return jnp.transpose(x, (0, 2, 1, 3))
    if layout == "BNSD":
        return x
    if layout == "BSH":
        b, s, h = x.shape
        return jnp.transpose(x.reshape(b, s, heads, h // heads), (0, 2, 1, 3))
    if layout == "SBH":
        s, b, h = x.shape
        return jnp.transpose(x.reshape(s, b, heads, h // heads), (1, 2, 0, 3))
    return jnp.transpose(x, (1, 0, 2))[None]  # TND


def jnp_from_bnsd(y, layout):
    b, n, s, d = y.shape
    if layout == "BSND":
        return jnp.transpose(y, (0, 2, 1, 3))
    if layout == "BNSD":
        return y
    if layout == "BSH":
        return jnp.transpose(y, (0, 2, 1, 3)).reshape(b, s, n * d)
    if layout == "SBH":
        return jnp.transpose(y, (2, 0, 1, 3)).reshape(s, b, n * d)
    return jnp.transpose(y[0], (1, 0, 2))


def dense_attention(q, k, v, visible, *, layout, n1, n2, scale):
    """Plain masked softmax attention in float32; visible: bool (B, N1, Sq, Skv). Rows with no
    visible key give 0 (the spec's invalid-row convention)."""
    q4 = jnp_to_bnsd(q.astype(jnp.float32), layout, n1)
    k4 = jnp.repeat(jnp_to_bnsd(k.astype(jnp.float32), layout, n2), n1 // n2, axis=1)
    v4 = jnp.repeat(jnp_to_bnsd(v.astype(jnp.float32), layout, n2), n1 // n2, axis=1)
    s = scale * jnp.einsum("bnid,bnjd->bnij", q4, k4)
    m = jnp.max(jnp.where(visible, s, -jnp.inf), axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.where(visible, jnp.exp(jnp.where(visible, s, m) - m), 0.0)
    den = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(den > 0, den, 1.0)
    return jnp_from_bnsd(jnp.einsum("bnij,bnjd->bnid", p, v4), layout)


def dense_grads(args, kw, dout):
    layout = kw.get("input_layout", "BSND")
    n1, n2, d = ao.head_counts(args[0], args[1], layout, kw.get("head_num"))
    scale = kw.get("scale") or 1.0 / np.sqrt(d)
    visible = jnp.asarray(ao.visible_mask(*(f64(a) for a in args[:2]), **kw))

    def loss(q, k, v, visible, dout):
        out = dense_attention(q, k, v, visible, layout=layout, n1=n1, n2=n2, scale=scale)
        return jnp.sum(out * dout)

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(
        *(jnp.asarray(f64(a), jnp.float32) for a in args), visible, jnp.asarray(dout))
    return [np.asarray(x) for x in g]


# the library ------------------------------------------------------------------------------

def lib_loss(kw, dout):
    def loss(q, k, v):
        out = jr.flash_attention_score(q, k, v, **kw)[0]
        return jnp.sum(out.astype(jnp.float32) * dout)
    return loss


def lib_grads(args, kw, dout, jit=True):
    g = jax.grad(lib_loss(kw, jnp.asarray(dout, jnp.float32)), argnums=(0, 1, 2))
    if jit:
        g = jax.jit(g)
    return [np.asarray(x) for x in g(*(jnp.asarray(a) for a in args))]


def cotangent(args, kw, rng):
    out = ao.flash_attention_score(*(f64(a) for a in args), **kw)[0]
    return rng.standard_normal(out.shape).astype(np.float32)


def assert_grads_close(got, exp, dtype, what):
    rtol, atol = GTOL[np.dtype(dtype).name]
    for name, g, e in zip(("dq", "dk", "dv"), got, exp):
        assert g.shape == e.shape, (what, name, g.shape, e.shape)
        assert not np.isnan(f64(g)).any(), f"{what}: NaN in {name}"
        scale = max(1.0, float(np.max(np.abs(e)))) if e.size else 1.0
        np.testing.assert_allclose(f64(g), f64(e), rtol=rtol, atol=atol * scale,
                                   err_msg=f"{what}: {name}")


def check_grads_vs_refs(args, kw, rng, jit=True, dense=True, err=""):
    dout = cotangent(args, kw, rng)
    got = lib_grads(args, kw, dout, jit)
    dt = np.dtype(args[0].dtype)
    for g, a in zip(got, args):
        assert g.dtype == dt and g.shape == a.shape, (g.dtype, g.shape, a.shape)
    exp = ao.flash_attention_grad(*(f64(a) for a in args), f64(dout), **kw)
    assert_grads_close(got, exp, dt, f"{err or kw} vs oracle")
    if dense:
        assert_grads_close(got, dense_grads(args, kw, dout), dt, f"{err or kw} vs dense jnp")
    return got, exp


# tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("sq,skv", [(3, 6), (6, 3)])
@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4, 5, 6])
def test_sparse_modes(backend, mode, sq, skv):
    rng = rng_for("grad", mode, sq, skv)
    B, N1 = 2, 4
    args, kw = ao.make_case(rng, "BSND", B=B, Sq=sq, Skv=skv, N1=N1, N2=2, D=8,
                            **ao.mode_kwargs(mode, rng, B, sq, skv, N1))
    check_grads_vs_refs(args, kw, rng)


@pytest.mark.parametrize("layout", ao.LAYOUTS)
def test_layouts_gqa_dv(backend, layout):
    """Every layout, GQA 4 on 2, Dv < D, Sq != Skv (TND with an empty sequence)."""
    rng = rng_for("grad-layout", layout)
    if layout == "TND":
        args, kw = ao.make_case(rng, layout, N1=4, N2=2, D=8, Dv=4, seq_q=[3, 0, 2],
                                seq_kv=[2, 0, 4], sparse_mode=3)
    else:
        args, kw = ao.make_case(rng, layout, B=2, Sq=3, Skv=5, N1=4, N2=2, D=8, Dv=4,
                                sparse_mode=4, pre_tokens=1, next_tokens=0)
    check_grads_vs_refs(args, kw, rng, jit=False)  # eager grad here, jitted elsewhere


@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4, 6, 7, 8])
def test_varlen_modes(backend, mode):
    rng = rng_for("grad-varlen", mode)
    lq, lkv = [2, 0, 3, 3], [3, 0, 4, 4]
    args, kw = ao.make_case(rng, "TND", N1=2, N2=1, D=8, seq_q=lq, seq_kv=lkv,
                            **ao.varlen_kwargs(mode, rng, lq, lkv))
    check_grads_vs_refs(args, kw, rng)


@pytest.mark.parametrize("example", ["mode7", "mode8"])
def test_worked_example_stitch(backend, example):
    """The device pieces' gradients: dq rows stitch back and dk/dv add up to the uncut ones."""
    if example == "mode7":
        uncut = (4, 6, 3)
        devs = [(dict(sparse_mode=7, actual_seq_qlen=[3, 5], actual_seq_kvlen=[3, 9],
                      pre_tokens=6, next_tokens=-2), 1, slice(0, 2)),
                (dict(sparse_mode=3, actual_seq_qlen=[2, 7, 11],
                      actual_seq_kvlen=[6, 11, 15]), 0, slice(2, 4))]
    else:
        uncut = (5, 4, 2)
        devs = [(dict(sparse_mode=2, actual_seq_qlen=[3, 5], actual_seq_kvlen=[3, 7]), 1,
                 slice(0, 2)),
                (dict(sparse_mode=8, actual_seq_qlen=[3, 8, 12], actual_seq_kvlen=[4, 9, 13],
                      pre_tokens=4, next_tokens=1), 0, slice(2, 5))]
    rng = rng_for("grad-stitch", example)
    sq, skv, mode = uncut
    q = rng.standard_normal((1, sq, 2, 8)).astype(np.float32)
    k = rng.standard_normal((1, skv, 1, 8)).astype(np.float32)
    v = rng.standard_normal((1, skv, 1, 8)).astype(np.float32)
    dout = rng.standard_normal((1, sq, 2, 8)).astype(np.float32)
    full = lib_grads([q, k, v], dict(sparse_mode=mode), dout)
    dq_rows, dk, dv = [], 0.0, 0.0
    for cfg, seq, rows in devs:
        lq, lkv = ao.seq_lens(cfg["actual_seq_qlen"]), ao.seq_lens(cfg["actual_seq_kvlen"])
        cq, ckv = [0] + cfg["actual_seq_qlen"], [0] + cfg["actual_seq_kvlen"]
        pq = rng.standard_normal((sum(lq), 2, 8)).astype(np.float32)
        pk = rng.standard_normal((sum(lkv), 1, 8)).astype(np.float32)
        pv = rng.standard_normal((sum(lkv), 1, 8)).astype(np.float32)
        pd = np.zeros((sum(lq), 2, 8), np.float32)  # only the piece carries a cotangent
        pq[cq[seq]:cq[seq + 1]] = q[0, rows]
        pk[ckv[seq]:ckv[seq + 1]] = k[0]
        pv[ckv[seq]:ckv[seq + 1]] = v[0]
        pd[cq[seq]:cq[seq + 1]] = dout[0, rows]
        kw = dict(cfg, input_layout="TND")
        g = lib_grads([pq, pk, pv], kw, pd)
        exp = ao.flash_attention_grad(f64(pq), f64(pk), f64(pv), f64(pd), **kw)
        assert_grads_close(g, exp, np.float32, f"{example} device piece vs oracle")
        dq_rows.append(g[0][cq[seq]:cq[seq + 1]])
        dk = dk + g[1][ckv[seq]:ckv[seq + 1]]
        dv = dv + g[2][ckv[seq]:ckv[seq + 1]]
    np.testing.assert_allclose(np.concatenate(dq_rows), full[0][0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dk, full[1][0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dv, full[2][0], rtol=1e-4, atol=1e-4)


def test_fully_masked_rows_zero_gradient(backend):
    rng = rng_for("grad-invalid")
    # rightDownCausal with Sq=5 > Skv=3: query rows 0, 1 see nothing
    args, kw = ao.make_case(rng, "BSND", B=1, Sq=5, Skv=3, N1=2, D=8, sparse_mode=3)
    got, _ = check_grads_vs_refs(args, kw, rng)
    assert np.all(got[0][:, :2] == 0)
    # everything masked: all gradients exactly zero
    args, kw = ao.make_case(rng, "BSND", B=1, Sq=3, Skv=4, N1=2, D=8, sparse_mode=1,
                            atten_mask=np.ones((3, 4), bool))
    got = lib_grads(args, kw, np.ones((1, 3, 2, 8), np.float32))
    for g in got:
        assert np.all(g == 0)


def test_large_outputs_on_huge_pages():
    """Outputs of 4 MiB and more (the CPU handlers advise huge pages for them before the
    kernels' first write): forward and gradients still match the oracle."""
    require_backend("ffi")
    rng = rng_for("huge pages")
    args, kw = ao.make_case(rng, B=1, Sq=1024, Skv=1024, N1=8, N2=8, D=128, sparse_mode=2)
    assert args[0].nbytes >= 4 << 20
    with jr.backend("ffi"):
        out = np.asarray(jax.jit(lambda *a: jr.flash_attention_score(*a, **kw)[0])(*args))
        ref = ao.flash_attention_score(*(f64(a) for a in args), **kw)[0]
        np.testing.assert_allclose(f64(out), ref, rtol=2e-5, atol=2e-5)
        check_grads_vs_refs(args, kw, rng, dense=False)


def test_masked_keys_get_exact_zero(backend):
    """Keys no query sees (leftUpCausal, Skv > Sq) get exactly zero dk and dv."""
    rng = rng_for("grad-zero-keys")
    args, kw = ao.make_case(rng, "BNSD", B=2, Sq=3, Skv=6, N1=2, N2=1, D=8, sparse_mode=2)
    got, _ = check_grads_vs_refs(args, kw, rng)
    assert np.all(got[1][:, :, 3:] == 0) and np.all(got[2][:, :, 3:] == 0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_low_precision(backend, layout, dtype):
    rng = rng_for("grad-lp", layout, dtype)
    dt = DTYPES[dtype]
    if layout == "TND":
        args, kw = ao.make_case(rng, layout, dt, N1=4, N2=2, D=16, seq_q=[3, 0, 4],
                                seq_kv=[4, 0, 4], sparse_mode=3)
    else:
        args, kw = ao.make_case(rng, layout, dt, B=2, Sq=5, Skv=6, N1=4, N2=2, D=16,
                                sparse_mode=3)
    check_grads_vs_refs(args, kw, rng, dense=False)


@pytest.mark.parametrize("mode,tok", [(2, {}), (4, dict(pre_tokens=1, next_tokens=1))])
def test_check_grads(backend, mode, tok):
    rng = rng_for("check_grads", mode)
    args, kw = ao.make_case(rng, "BSND", B=1, Sq=3, Skv=3, N1=2, N2=1, D=4, sparse_mode=mode,
                            **tok)

    def f(q, k, v):
        return jr.flash_attention_score(q, k, v, **kw)[0]

    check_grads(f, tuple(jnp.asarray(a) for a in args), order=1, modes=["rev"], atol=1e-2,
                rtol=1e-2)


def test_traced_varlen_grad_no_retrace(backend):
    traces = [0]
    rng = rng_for("grad-traced")

    @jax.jit
    def g(q, k, v, dout, cq, ckv):
        traces[0] += 1

        def loss(q, k, v):
            out = jr.flash_attention_score(q, k, v, input_layout="TND", sparse_mode=3,
                                           actual_seq_qlen=cq, actual_seq_kvlen=ckv)[0]
            return jnp.sum(out * dout)
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    for lq, lkv in (([2, 3], [3, 2]), ([0, 5], [1, 4])):
        args, kw = ao.make_case(rng, "TND", N1=2, N2=1, D=8, seq_q=lq, seq_kv=lkv,
                                sparse_mode=3)
        dout = cotangent(args, kw, rng)
        got = g(*(jnp.asarray(a) for a in args), jnp.asarray(dout),
                jnp.asarray(kw["actual_seq_qlen"], jnp.int32),
                jnp.asarray(kw["actual_seq_kvlen"], jnp.int32))
        exp = ao.flash_attention_grad(*(f64(a) for a in args), f64(dout), **kw)
        assert_grads_close([np.asarray(x) for x in got], exp, np.float32, f"traced {lq}")
    assert traces[0] == 1, f"retraced {traces[0]} times"


@pytest.mark.parametrize("mode,tok", [(2, {}), (4, dict(pre_tokens=37, next_tokens=5))],
                         ids=["causal", "band"])
def test_multi_tile(backend, mode, tok):
    rng = rng_for("grad-tiles", mode)
    args, kw = ao.make_case(rng, "BSND", B=1, Sq=150, Skv=200, N1=2, N2=1, D=32,
                            sparse_mode=mode, **tok)
    check_grads_vs_refs(args, kw, rng, jit=True, dense=False)


@pytest.mark.parametrize("mode", [3, 7])
def test_multi_tile_varlen(backend, mode):
    rng = rng_for("grad-tiles-varlen", mode)
    lq, lkv = [70, 0, 130], [90, 0, 140]
    args, kw = ao.make_case(rng, "TND", N1=2, N2=1, D=32, seq_q=lq, seq_kv=lkv,
                            **ao.varlen_kwargs(mode, rng, lq, lkv))
    check_grads_vs_refs(args, kw, rng, dense=False)


@st.composite
def grad_case(draw):
    layout = draw(st.sampled_from(ao.LAYOUTS))
    n2 = draw(st.integers(1, 2))
    n1 = n2 * draw(st.integers(1, 2))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    if layout == "TND":
        lq = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3)) + [1]
        lkv = draw(st.lists(st.integers(0, 4), min_size=len(lq) - 1, max_size=len(lq) - 1))
        lkv = lkv + [2]
        mode = draw(st.sampled_from([0, 2, 3, 4]))
        return ao.make_case(rng, layout, N1=n1, N2=n2, D=4, seq_q=lq, seq_kv=lkv,
                            **ao.varlen_kwargs(mode, rng, lq, lkv)), rng
    sq, skv = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    mode = draw(st.sampled_from(list(range(7))))
    return ao.make_case(rng, layout, B=2, Sq=sq, Skv=skv, N1=n1, N2=n2, D=4,
                        **ao.mode_kwargs(mode, rng, 2, sq, skv, n1)), rng


@settings(max_examples=N_EXAMPLES)
@given(grad_case())
def test_property(backend, case):
    (args, kw), rng = case
    check_grads_vs_refs(args, kw, rng, dense=False)


@settings(max_examples=TILE_EXAMPLES)
@given(tile_case())
def test_property_across_tiles(backend, case):
    """The gradients of test_flash_attention.py's tile-crossing cases (every dtype, mode and
    layout; the split decode's short query blocks) against the oracle."""
    (args, kw), rng = case
    check_grads_vs_refs(args, kw, rng, dense=False)
