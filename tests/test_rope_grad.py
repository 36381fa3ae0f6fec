"""Gradient of apply_rotary_pos_emb (half mode) and apply_rotary_pos_emb_grad against the
oracle's adjoint formulas (spec/rope.md, "Gradient")."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from jax.test_util import check_grads

import helpers
import jax_rope as jr
import rope_oracle as oracle
from conftest import require_backend
from helpers import DTYPES, GRAD_TOL, args_of, assert_close, f64, make_inputs, rng_for

GRAD_NAMES = ("dq", "dk", "dcos", "dsin")


def make_loss(layout, mode="half"):
    """Scalar loss sum(q_out * wq) + sum(k_out * wk), accumulated in float32: its cotangents
    for q_out and k_out are exactly wq and wk."""
    def loss(q, k, c, s, wq, wk):
        qo, ko = jr.apply_rotary_pos_emb(q, k, c, s, layout=layout, rotary_mode=mode)
        return (jnp.sum(qo.astype(jnp.float32) * wq.astype(jnp.float32))
                + jnp.sum(ko.astype(jnp.float32) * wk.astype(jnp.float32)))
    return loss


def weights(rng, inp):
    dt = inp["query"].dtype
    return (helpers.random_array(rng, inp["query"].shape, dt),
            helpers.random_array(rng, inp["key"].shape, dt))


def expected_grads(inp, wq, wk, layout):
    q, k, c, s = (f64(a) for a in args_of(inp))
    return oracle.apply_rotary_pos_emb_grad(f64(wq), f64(wk), c, s, q, k, layout)


def check_grads_against_oracle(got, inp, wq, wk, layout, dtype, names=GRAD_NAMES):
    exp = dict(zip(GRAD_NAMES, expected_grads(inp, wq, wk, layout)))
    shapes = {"dq": inp["query"].shape, "dk": inp["key"].shape, "dcos": inp["cos"].shape,
              "dsin": inp["sin"].shape}
    dt = DTYPES[dtype]
    for name, g in zip(names, got):
        g = np.asarray(g)
        assert g.shape == shapes[name], (name, g.shape, shapes[name])
        assert g.dtype == dt, (name, g.dtype, dt)
        assert_close(g, exp[name], dt, tol=GRAD_TOL, err_msg=name)


GRAD_LAYOUT_CASES = [(lay, one) for lay in ("BSND", "BSH", "SBND", "BNSD") for one in (False, True)]
GRAD_LAYOUT_CASES.append(("TND", False))


@pytest.mark.parametrize("layout,cos_batch_one", GRAD_LAYOUT_CASES)
def test_jax_grad_all_inputs(backend, layout, cos_batch_one):
    """Partial rotary (r=8 < D=16) and GQA (Nq=4, Nk=2), cos batch 1 or B."""
    rng = rng_for("grad", layout, cos_batch_one)
    inp = make_inputs(rng, layout, "float32", B=2, S=3, Nq=4, Nk=2, D=16, r=8,
                      cos_batch_one=cos_batch_one)
    wq, wk = weights(rng, inp)
    grads = jax.grad(make_loss(layout), argnums=(0, 1, 2, 3))(*args_of(inp), wq, wk)
    check_grads_against_oracle(grads, inp, wq, wk, layout, "float32")
    # the pass-through part of dx is the cotangent itself
    np.testing.assert_array_equal(np.asarray(grads[0])[..., 8:], wq[..., 8:])
    np.testing.assert_array_equal(np.asarray(grads[1])[..., 8:], wk[..., 8:])


@pytest.mark.parametrize("argnums", [0, 1, 2, 3, (0, 1), (2, 3), (0, 2), (1, 3)])
def test_jax_grad_argnum_subsets(backend, argnums):
    """Gradients wrt any subset of the inputs (dcos/dsin are only needed for cos/sin)."""
    rng = rng_for("subsets", argnums)
    inp = make_inputs(rng, "BSND", "float32", B=2, S=3, Nq=3, Nk=1, D=12, r=12,
                      cos_batch_one=True)
    wq, wk = weights(rng, inp)
    got = jax.grad(make_loss("BSND"), argnums=argnums)(*args_of(inp), wq, wk)
    idx = (argnums,) if isinstance(argnums, int) else argnums
    got = (got,) if isinstance(argnums, int) else got
    check_grads_against_oracle(got, inp, wq, wk, "BSND", "float32",
                               names=[GRAD_NAMES[i] for i in idx])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["BSND", "BNSD", "TND"])
@pytest.mark.parametrize("D,r", [(16, 8), (128, 96)])  # 96: whole vectors and a remainder
def test_jax_grad_low_precision(backend, layout, dtype, D, r):
    rng = rng_for("grad-lp", layout, dtype, D)
    inp = make_inputs(rng, layout, dtype, B=2, S=3, Nq=4, Nk=2, D=D, r=r, cos_batch_one=True)
    wq, wk = weights(rng, inp)
    grads = jax.grad(make_loss(layout), argnums=(0, 1, 2, 3))(*args_of(inp), wq, wk)
    check_grads_against_oracle(grads, inp, wq, wk, layout, dtype)
    # dq/dk need no reduction: within 1 ulp of the float64 adjoint rounded once
    exp = expected_grads(inp, wq, wk, layout)
    helpers.assert_within_ulp(grads[0], exp[0], DTYPES[dtype], err_msg="dq")
    helpers.assert_within_ulp(grads[1], exp[1], DTYPES[dtype], err_msg="dk")


@pytest.mark.parametrize("layout", ["BSND", "SBND", "BNSD", "TND"])
def test_check_grads_rev(backend, layout):
    """Finite-difference check of the VJP (float32; the map is bilinear, so a large step is
    exact up to rounding)."""
    inp = make_inputs(rng_for("check_grads", layout), layout, "float32", B=2, S=2, Nq=2, Nk=1,
                      D=8, r=4, cos_batch_one=(layout == "SBND"))
    f = functools.partial(jr.apply_rotary_pos_emb, layout=layout, rotary_mode="half")
    check_grads(f, tuple(jnp.asarray(a) for a in args_of(inp)), order=1, modes=["rev"],
                atol=1e-2, rtol=1e-2, eps=1e-2)


def test_grad_of_jit_and_jit_of_grad(backend):
    rng = rng_for("jitgrad")
    inp = make_inputs(rng, "SBND", "float32", B=2, S=4, Nq=2, Nk=2, D=8, cos_batch_one=True)
    wq, wk = weights(rng, inp)
    loss = make_loss("SBND")
    a = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args_of(inp), wq, wk)
    b = jax.grad(jax.jit(loss), argnums=(0, 1, 2, 3))(*args_of(inp), wq, wk)
    check_grads_against_oracle(a, inp, wq, wk, "SBND", "float32")
    check_grads_against_oracle(b, inp, wq, wk, "SBND", "float32")


def test_vjp_matches_grad_function(backend):
    """jax.vjp of the forward equals apply_rotary_pos_emb_grad called directly."""
    rng = rng_for("vjp")
    inp = make_inputs(rng, "BNSD", "float32", B=2, S=3, Nq=4, Nk=2, D=16, r=8)
    wq, wk = weights(rng, inp)
    f = functools.partial(jr.apply_rotary_pos_emb, layout="BNSD")
    jargs = [jnp.asarray(a) for a in args_of(inp)]
    _, vjp = jax.vjp(f, *jargs)
    via_vjp = vjp((jnp.asarray(wq), jnp.asarray(wk)))
    direct = jr.apply_rotary_pos_emb_grad(wq, wk, inp["cos"], inp["sin"], query=inp["query"],
                                          key=inp["key"], layout="BNSD")
    for a, b in zip(via_vjp, direct):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout,cos_batch_one", GRAD_LAYOUT_CASES)
def test_grad_function_direct(backend, layout, cos_batch_one):
    rng = rng_for("direct", layout, cos_batch_one)
    inp = make_inputs(rng, layout, "float32", B=3, S=2, Nq=2, Nk=3, D=12, r=8,
                      cos_batch_one=cos_batch_one)
    gq, gk = weights(rng, inp)
    exp = expected_grads(inp, gq, gk, layout)
    got = jr.apply_rotary_pos_emb_grad(jnp.asarray(gq), jnp.asarray(gk), jnp.asarray(inp["cos"]),
                                       jnp.asarray(inp["sin"]), query=jnp.asarray(inp["query"]),
                                       key=jnp.asarray(inp["key"]), layout=layout)
    assert len(got) == 4
    check_grads_against_oracle(got, inp, gq, gk, layout, "float32")
    # without query/key: dq, dk only; dcos and dsin are None
    dq, dk, dcos, dsin = jr.apply_rotary_pos_emb_grad(gq, gk, inp["cos"], inp["sin"],
                                                      layout=layout)
    assert dcos is None and dsin is None
    assert_close(dq, exp[0], np.float32, tol=GRAD_TOL, err_msg="dq")
    assert_close(dk, exp[1], np.float32, tol=GRAD_TOL, err_msg="dk")
    np.testing.assert_array_equal(np.asarray(dq)[..., 8:], gq[..., 8:])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_grad_function_direct_jit_and_dtypes(backend, dtype):
    rng = rng_for("direct-jit", dtype)
    inp = make_inputs(rng, "BSND", dtype, B=2, S=3, Nq=4, Nk=1, D=16, cos_batch_one=True)
    gq, gk = weights(rng, inp)
    f = jax.jit(functools.partial(jr.apply_rotary_pos_emb_grad, layout="BSND",
                                  rotary_mode="half"))
    got = f(gq, gk, inp["cos"], inp["sin"], inp["query"], inp["key"])
    check_grads_against_oracle(got, inp, gq, gk, "BSND", dtype)
    got2 = jax.jit(lambda a, b, c, s: jr.apply_rotary_pos_emb_grad(a, b, c, s))(
        gq, gk, inp["cos"], inp["sin"])
    assert got2[2] is None and got2[3] is None
    check_grads_against_oracle(got2[:2], inp, gq, gk, "BSND", dtype)


@pytest.mark.parametrize("mode", ["quarter", "interleave"])
def test_grad_rejected_for_non_half_modes(backend, mode):
    inp = make_inputs(rng_for("nohalf", mode), "BSND", "float32", B=1, S=2, Nq=1, Nk=1, D=8)
    wq, wk = weights(rng_for("w"), inp)
    loss = make_loss("BSND", mode)
    with pytest.raises(ValueError, match=mode):
        jax.grad(loss, argnums=(0, 1, 2, 3))(*args_of(inp), wq, wk)
    with pytest.raises(ValueError, match=mode):
        jax.grad(loss, argnums=2)(*args_of(inp), wq, wk)
    with pytest.raises(ValueError, match=mode):
        jax.jit(jax.grad(loss))(*args_of(inp), wq, wk)
    f = functools.partial(jr.apply_rotary_pos_emb, layout="BSND", rotary_mode=mode)
    with pytest.raises(ValueError, match=mode):
        jax.vjp(f, *(jnp.asarray(a) for a in args_of(inp)))
    # the forward alone still works in that mode
    jax.block_until_ready(f(*args_of(inp)))


@pytest.mark.parametrize("mode", ["quarter", "interleave"])
def test_grad_function_rejects_non_half_modes(backend, mode):
    inp = make_inputs(rng_for("nohalf-fn", mode), "BSND", "float32", B=1, S=2, Nq=1, Nk=1, D=8)
    with pytest.raises(ValueError, match=mode):
        jr.apply_rotary_pos_emb_grad(inp["query"], inp["key"], inp["cos"], inp["sin"],
                                     rotary_mode=mode)


def test_grad_inputs_not_modified(backend):
    rng = rng_for("grad-nomod")
    inp = make_inputs(rng, "BSND", "bfloat16", B=2, S=3, Nq=2, Nk=2, D=8)
    wq, wk = weights(rng, inp)
    saved = {n: a.copy() for n, a in inp.items()}
    jargs = [jnp.asarray(a) for a in args_of(inp)]
    jw = [jnp.asarray(wq), jnp.asarray(wk)]
    jax.block_until_ready(jax.jit(jax.grad(make_loss("BSND"), argnums=(0, 1, 2, 3)))(*jargs, *jw))
    jax.block_until_ready(jr.apply_rotary_pos_emb_grad(*jw, jargs[2], jargs[3], query=jargs[0],
                                                       key=jargs[1]))
    for n, a in zip(helpers.ARG_NAMES, jargs):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), saved[n].view(np.uint8))
    np.testing.assert_array_equal(np.asarray(jw[0]).view(np.uint8), wq.view(np.uint8))


@given(case=helpers.rope_cases(modes=("half",)))
def test_random_shapes_grad(backend, case):
    inp = helpers.inputs_for_case(case)
    layout = case["layout"]
    wq, wk = weights(np.random.default_rng(case["seed"] + 1), inp)
    grads = jax.grad(make_loss(layout), argnums=(0, 1, 2, 3))(*args_of(inp), wq, wk)
    check_grads_against_oracle(grads, inp, wq, wk, layout, "float32")


@pytest.mark.parametrize("r", [128, 96])
def test_large_fresh_gradients(r):
    """dq and dk of 64 MiB and more (72 MiB here), which the CPU kernel streams to memory,
    against the oracle; cos broadcast over a batch of 2 (dcos/dsin summed in a second pass)."""
    require_backend("ffi")
    rng = rng_for("large grad", r)
    inp = make_inputs(rng, "BSND", "float32", B=2, S=2048, Nq=32, Nk=4, D=128, r=r,
                      cos_batch_one=True)
    assert inp["query"].nbytes + inp["key"].nbytes >= 64 << 20
    wq, wk = weights(rng, inp)
    with jr.backend("ffi"):
        grads = jax.jit(jax.grad(make_loss("BSND"), argnums=(0, 1, 2, 3)))(*args_of(inp), wq, wk)
    grads = [np.asarray(g) for g in grads]
    assert [g.shape for g in grads] == [inp[n].shape for n in helpers.ARG_NAMES]
    # The oracle a slice of positions at a time (every gradient is per position; dcos and
    # dsin sum over batch and heads only), as test_large_fresh_outputs does.
    for part in (slice(s0, s0 + 512) for s0 in range(0, grads[0].shape[1], 512)):
        check_grads_against_oracle([g[:, part] for g in grads],
                                   {n: a[:, part] for n, a in inp.items()}, wq[:, part],
                                   wk[:, part], "BSND", "float32")
