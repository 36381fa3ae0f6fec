"""jr.attention_scores against the NumPy oracle (spec/attention.md "Outputs"): the masked,
scaled scores in float32, (B, N1, Sq, Skv) or (N1, Tq, Tkv) for TND, with masked positions
(including those between different TND sequences) exactly -3.4028235e38."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import attention_oracle as ao
import jax_rope as jr
from attention_oracle import f64

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(ml_dtypes.bfloat16)}
TOL = {"float32": (2e-5, 2e-5), "float16": (2e-3, 2e-3), "bfloat16": (1e-2, 1e-2)}


def rng_for(*parts):
    import zlib
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def scores(args, kw, jit=False):
    f = functools.partial(jr.attention_scores, **kw)
    if jit:
        f = jax.jit(f)
    return np.asarray(f(*(jnp.asarray(a) for a in args[:2])))


def check_scores(got, args, kw, err=""):
    dt = np.dtype(args[0].dtype)
    exp = ao.attention_scores(*(f64(a) for a in args[:2]), **kw)
    assert got.dtype == np.float32, (got.dtype, err)
    assert got.shape == exp.shape, (got.shape, exp.shape, err)
    assert not np.isnan(got).any(), err
    masked = exp == ao.FLOAT32_LOWEST
    got_masked = got == ao.FLOAT32_LOWEST
    if not np.array_equal(got_masked, masked):
        bad = np.argwhere(got_masked != masked)
        raise AssertionError(f"{err}: {len(bad)} positions masked differently, first "
                             f"{tuple(bad[0])}: got {got[tuple(bad[0])]}, "
                             f"expected {exp[tuple(bad[0])]}")
    rtol, atol = TOL[dt.name]
    np.testing.assert_allclose(got[~masked], exp[~masked], rtol=rtol, atol=atol, err_msg=err)
    return exp


@pytest.mark.parametrize("sq,skv", [(4, 4), (3, 6), (6, 3)])
@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4, 5, 6])
def test_sparse_modes(backend, mode, sq, skv):
    rng = rng_for("scores", mode, sq, skv)
    B, N1 = 2, 4
    args, kw = ao.make_case(rng, "BSND", B=B, Sq=sq, Skv=skv, N1=N1, N2=2, D=8,
                            **ao.mode_kwargs(mode, rng, B, sq, skv, N1))
    exp = check_scores(scores(args, kw), args, kw, repr(kw))
    assert exp.shape == (B, N1, sq, skv)


@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4, 6, 7, 8])
def test_varlen_modes(backend, mode):
    """TND: (N1, Tq, Tkv), cross-sequence positions masked, with an empty sequence."""
    rng = rng_for("scores-varlen", mode)
    lq, lkv = [2, 0, 3, 3], [3, 0, 4, 4]
    args, kw = ao.make_case(rng, "TND", N1=2, N2=1, D=8, seq_q=lq, seq_kv=lkv,
                            **ao.varlen_kwargs(mode, rng, lq, lkv))
    exp = check_scores(scores(args, kw), args, kw, repr(kw))
    assert exp.shape == (2, 8, 11)
    assert np.all(exp[:, :2, 3:] == ao.FLOAT32_LOWEST)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", ao.LAYOUTS)
def test_layouts_dtypes(backend, layout, dtype):
    rng = rng_for("scores-layout", layout, dtype)
    dt = DTYPES[dtype]
    if layout == "TND":
        args, kw = ao.make_case(rng, layout, dt, N1=4, N2=2, D=16, seq_q=[3, 2],
                                seq_kv=[2, 4], sparse_mode=3)
    else:
        args, kw = ao.make_case(rng, layout, dt, B=2, Sq=3, Skv=5, N1=4, N2=2, D=16,
                                sparse_mode=3)
    check_scores(scores(args, kw), args, kw, f"{layout} {dtype}")


def test_scale_and_jit(backend):
    rng = rng_for("scores-scale")
    args, kw = ao.make_case(rng, "BNSD", B=1, Sq=3, Skv=4, N1=2, D=8, sparse_mode=2,
                            scale=0.25)
    check_scores(scores(args, kw, jit=True), args, kw)
    args, kw = ao.make_case(rng, "BNSD", B=1, Sq=3, Skv=4, N1=2, D=8, sparse_mode=0)
    got = scores(args, kw)
    check_scores(got, args, kw)
    # mode 0 without a mask: plain scaled scores, 1/sqrt(D) by default
    q, k = f64(args[0]), f64(args[1])
    np.testing.assert_allclose(got, np.einsum("bnid,bnjd->bnij", q, k) / np.sqrt(8),
                               rtol=2e-5, atol=2e-5)


def test_negative_tokens_and_invalid_rows(backend):
    rng = rng_for("scores-neg")
    args, kw = ao.make_case(rng, "BSND", B=1, Sq=5, N1=2, D=8, sparse_mode=4, pre_tokens=-1,
                            next_tokens=2)
    exp = check_scores(scores(args, kw), args, kw)
    assert np.all(exp[..., -1, :] == ao.FLOAT32_LOWEST)  # the last row sees nothing


def test_scores_consistent_with_stats(backend):
    """softmax_max is the row max of the scores; logsumexp reproduces the softmax."""
    rng = rng_for("scores-stats")
    args, kw = ao.make_case(rng, "BSND", B=2, Sq=4, Skv=6, N1=2, D=8, sparse_mode=4,
                            pre_tokens=2, next_tokens=0)
    s = scores(args, kw)
    _, mx, sm = (np.asarray(o) for o in jr.flash_attention_score(
        *(jnp.asarray(a) for a in args), **kw))
    np.testing.assert_allclose(mx, s.max(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sm, np.exp(f64(s) - f64(mx)[..., None]).sum(-1), rtol=1e-5)
