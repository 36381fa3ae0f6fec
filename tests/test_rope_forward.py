"""Forward of apply_rotary_pos_emb against the NumPy oracle (spec/rope.md)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

import helpers
import jax_rope as jr
import rope_oracle as oracle
from conftest import require_backend
from helpers import DTYPES, args_of, assert_forward_matches, make_inputs, rng_for


def rope(inputs, layout="BSND", mode="half", jit=False):
    f = functools.partial(jr.apply_rotary_pos_emb, layout=layout, rotary_mode=mode)
    if jit:
        f = jax.jit(f)
    q_out, k_out = f(*(jnp.asarray(a) for a in args_of(inputs)))
    return np.asarray(q_out), np.asarray(k_out)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", oracle.LAYOUTS)
@pytest.mark.parametrize("mode", oracle.MODES)
def test_mode_layout_dtype(backend, mode, layout, dtype):
    """Every mode x layout x dtype, with GQA (Nq=4, Nk=2) and full rotary."""
    inp = make_inputs(rng_for(mode, layout, dtype), layout, dtype, B=2, S=3, Nq=4, Nk=2, D=16)
    assert_forward_matches(rope(inp, layout, mode), inp, layout, mode, dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", oracle.LAYOUTS)
@pytest.mark.parametrize("mode", oracle.MODES)
def test_partial_rotary(backend, mode, layout, dtype):
    """r < D: only x[..., :r] is rotated; x[..., r:] passes through bit for bit."""
    inp = make_inputs(rng_for("partial", mode, layout, dtype), layout, dtype, B=2, S=3, Nq=2,
                      Nk=3, D=24, r=8)
    out = rope(inp, layout, mode)
    assert_forward_matches(out, inp, layout, mode, dtype)
    for got, x in zip(out, (inp["query"], inp["key"])):
        np.testing.assert_array_equal(got[..., 8:].view(np.uint8), x[..., 8:].view(np.uint8))


@pytest.mark.parametrize("nq,nk", [(1, 1), (4, 1), (1, 3), (3, 2), (2, 4)])
def test_gqa_head_counts(backend, nq, nk):
    for layout in ("BSND", "BNSD", "TND"):
        inp = make_inputs(rng_for("gqa", nq, nk, layout), layout, "float32", B=2, S=3, Nq=nq,
                          Nk=nk, D=8, r=4)
        assert_forward_matches(rope(inp, layout), inp, layout, "half", "float32")


@pytest.mark.parametrize("cos_batch_one", [True, False])
@pytest.mark.parametrize("layout", ["BSND", "BSH", "SBND", "BNSD"])
def test_cos_batch_broadcast(backend, layout, cos_batch_one):
    """cos/sin batch axis 1 broadcasts over B; batch B is used per batch element."""
    inp = make_inputs(rng_for("cosb", layout, cos_batch_one), layout, "float32", B=3, S=4,
                      Nq=2, Nk=1, D=8, cos_batch_one=cos_batch_one)
    out = rope(inp, layout)
    assert_forward_matches(out, inp, layout, "half", "float32")
    if cos_batch_one:
        # batch 1 is the same as the table repeated B times
        b_axis = oracle.LAYOUT_AXES[layout]["batch"]
        rep = dict(inp)
        for n in ("cos", "sin"):
            rep[n] = np.repeat(inp[n], 3, axis=b_axis)
        np.testing.assert_allclose(rope(rep, layout)[0], out[0], rtol=1e-6, atol=1e-6)


def test_bsh_is_bsnd(backend):
    inp = make_inputs(rng_for("bsh"), "BSND", "float32", B=2, S=3, Nq=2, Nk=2, D=8)
    a, b = rope(inp, "BSND"), rope(inp, "BSH")
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_worked_example_half(backend, dtype):
    c = np.array([0.5, 0.25, -1.5, 2.0])
    s = np.array([3.0, -0.5, 0.75, 1.25])
    x = np.array([1.0, 2.0, 3.0, 4.0])
    dt = DTYPES[dtype]
    inp = {"query": x.reshape(1, 1, 1, 4).astype(dt), "key": (2 * x).reshape(1, 1, 1, 4).astype(dt),
           "cos": c.reshape(1, 1, 1, 4).astype(dt), "sin": s.reshape(1, 1, 1, 4).astype(dt)}
    q_out, k_out = rope(inp, "BSND", "half")
    c0, c1, c2, c3 = c
    s0, s1, s2, s3 = s
    expected = np.array([c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c2 + 1 * s2, 4 * c3 + 2 * s3])
    # all values are exact in every dtype, so the results are exact
    np.testing.assert_array_equal(helpers.f64(q_out).ravel(), expected)
    np.testing.assert_array_equal(helpers.f64(k_out).ravel(), 2 * expected)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_worked_example_interleave(backend, dtype):
    c = np.array([0.5, 0.25, -1.5, 2.0])
    s = np.array([3.0, -0.5, 0.75, 1.25])
    x = np.array([1.0, 2.0, 3.0, 4.0])
    dt = DTYPES[dtype]
    inp = {"query": x.reshape(1, 1, 1, 4).astype(dt), "key": (-x).reshape(1, 1, 1, 4).astype(dt),
           "cos": c.reshape(1, 1, 1, 4).astype(dt), "sin": s.reshape(1, 1, 1, 4).astype(dt)}
    q_out, k_out = rope(inp, "BSND", "interleave")
    c0, c1, c2, c3 = c
    s0, s1, s2, s3 = s
    expected = np.array([c0 - 2 * s0, 2 * c1 + 1 * s1, 3 * c2 - 4 * s2, 4 * c3 + 3 * s3])
    np.testing.assert_array_equal(helpers.f64(q_out).ravel(), expected)
    np.testing.assert_array_equal(helpers.f64(k_out).ravel(), -expected)


@pytest.mark.parametrize("layout", oracle.LAYOUTS)
def test_worked_example_quarter(backend, layout):
    """x = 1..8, c = 0, s = 1: the output is rot(x) = [-3, -4, 1, 2, -7, -8, 5, 6]."""
    B, S = (1, 1)
    qs, ks, cs = helpers.layout_shapes(layout, B, S, 1, 1, 8, 8, 1)
    x = np.arange(1.0, 9.0, dtype=np.float32)
    inp = {"query": x.reshape(qs), "key": (10 * x).reshape(ks),
           "cos": np.zeros(cs, np.float32), "sin": np.ones(cs, np.float32)}
    q_out, k_out = rope(inp, layout, "quarter")
    np.testing.assert_array_equal(q_out.ravel(), [-3, -4, 1, 2, -7, -8, 5, 6])
    np.testing.assert_array_equal(k_out.ravel(), 10 * np.array([-3, -4, 1, 2, -7, -8, 5, 6]))


@pytest.mark.parametrize("mode", oracle.MODES)
def test_identity_rotation(backend, mode):
    """cos = 1, sin = 0 gives the input back exactly."""
    inp = make_inputs(rng_for("id", mode), "SBND", "bfloat16", B=2, S=3, Nq=2, Nk=2, D=16)
    inp["cos"] = np.ones_like(inp["cos"])
    inp["sin"] = np.zeros_like(inp["sin"])
    q_out, k_out = rope(inp, "SBND", mode)
    np.testing.assert_array_equal(q_out, inp["query"])
    np.testing.assert_array_equal(k_out, inp["key"])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_inputs_not_modified(backend, dtype, jit):
    inp = make_inputs(rng_for("nomod", dtype), "BSND", dtype, B=2, S=5, Nq=4, Nk=2, D=16, r=8)
    saved = {n: a.copy() for n, a in inp.items()}
    jargs = [jnp.asarray(a) for a in args_of(inp)]
    f = functools.partial(jr.apply_rotary_pos_emb, layout="BSND", rotary_mode="half")
    if jit:
        f = jax.jit(f)
    for _ in range(2):
        outs = f(*jargs)
        jax.block_until_ready(outs)
    for n, a in zip(helpers.ARG_NAMES, jargs):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), saved[n].view(np.uint8),
                                      err_msg=n)
        np.testing.assert_array_equal(inp[n].view(np.uint8), saved[n].view(np.uint8),
                                      err_msg=n)
    # outputs are new arrays of the query/key shapes and dtype
    assert outs[0].shape == inp["query"].shape and outs[0].dtype == DTYPES[dtype]
    assert outs[1].shape == inp["key"].shape and outs[1].dtype == DTYPES[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deterministic(backend, dtype):
    """Same inputs, bit-identical outputs (a shape large enough for a parallel kernel)."""
    inp = make_inputs(rng_for("det", dtype), "BSND", dtype, B=4, S=64, Nq=8, Nk=2, D=64)
    jargs = [jnp.asarray(a) for a in args_of(inp)]
    f = jax.jit(functools.partial(jr.apply_rotary_pos_emb, layout="BSND"))
    first = [np.asarray(o) for o in f(*jargs)]
    for _ in range(2):
        again = [np.asarray(o) for o in f(*jargs)]
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    eager = [np.asarray(o) for o in jr.apply_rotary_pos_emb(*jargs)]
    eager2 = [np.asarray(o) for o in jr.apply_rotary_pos_emb(*jargs)]
    for a, b in zip(eager, eager2):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    assert_forward_matches(first, inp, "BSND", "half", dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout,mode", [("BSND", "half"), ("SBND", "interleave"),
                                         ("BNSD", "quarter"), ("TND", "half")])
def test_ffi_matches_fallback(layout, mode, dtype):
    require_backend("ffi")
    inp = make_inputs(rng_for("agree", layout, mode, dtype), layout, dtype, B=3, S=5, Nq=4,
                      Nk=2, D=32, r=16, cos_batch_one=(layout == "SBND"))
    with jr.backend("ffi"):
        a = rope(inp, layout, mode)
    with jr.backend("fallback"):
        b = rope(inp, layout, mode)
    for x, y in zip(a, b):
        if dtype == "float32":
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
        else:
            helpers.assert_within_ulp(x, y, DTYPES[dtype])


@given(case=helpers.rope_cases(dtypes=("float32", "float16", "bfloat16")))
def test_random_shapes(backend, case):
    inp = helpers.inputs_for_case(case)
    out = rope(inp, case["layout"], case["mode"])
    assert_forward_matches(out, inp, case["layout"], case["mode"], case["dtype"])
    r = case["r"]
    for got, x in zip(out, (inp["query"], inp["key"])):
        np.testing.assert_array_equal(got[..., r:].view(np.uint8), x[..., r:].view(np.uint8))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mode", oracle.MODES)
@pytest.mark.parametrize("D,r", [(32, 16), (128, 128)])  # 128: the kernel's full-vector loops
def test_low_precision_bitwise_golden(backend, mode, dtype, D, r):
    """Stricter than 1 ulp: with float16/bfloat16 inputs every product is exact in float32, so
    "all arithmetic in float32, one rounding at the end" has exactly one possible result: the
    spec's golden (float32 NumPy reference, then one cast), bit for bit."""
    for layout in ("BSND", "BNSD", "TND"):
        inp = make_inputs(rng_for("bitwise", mode, dtype, layout, D), layout, dtype, B=3, S=7,
                          Nq=4, Nk=2, D=D, r=r, cos_batch_one=True)
        out = rope(inp, layout, mode)
        golden = oracle.apply_rotary_pos_emb(*args_of(inp), layout=layout, rotary_mode=mode,
                                             dtype=np.float32)
        for got, g in zip(out, golden):
            helpers.assert_within_ulp(got, g, DTYPES[dtype], ulps=0, err_msg=layout)


@pytest.mark.parametrize("mode,r", [("half", 128), ("interleave", 96)])
def test_large_fresh_outputs(mode, r):
    """Fresh outputs of 64 MiB and more, which the CPU kernel streams to memory past the
    cache (72 MiB here), against the oracle like any other call."""
    require_backend("ffi")
    inp = make_inputs(rng_for("large", mode, r), "BSND", "float32", B=1, S=4096, Nq=32, Nk=4,
                      D=128, r=r, cos_batch_one=True)
    assert (inp["query"].nbytes + inp["key"].nbytes) >= 64 << 20
    with jr.backend("ffi"):
        out = rope(inp, "BSND", mode, jit=True)
    q_out, k_out = (np.asarray(o) for o in out)
    assert (q_out.shape, k_out.shape) == (inp["query"].shape, inp["key"].shape)
    # The oracle a slice of positions at a time: its float64 temporaries of 600 MB at once
    # took seconds to fault in on a VM whose free memory goes back to the host.
    for part in (slice(s0, s0 + 512) for s0 in range(0, q_out.shape[1], 512)):
        assert_forward_matches((q_out[:, part], k_out[:, part]),
                               {n: a[:, part] for n, a in inp.items()}, "BSND", mode, "float32")
