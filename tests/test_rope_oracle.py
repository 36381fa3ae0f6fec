"""Self-checks of the NumPy oracle against spec/rope.md (no jax_rope needed)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import helpers
import rope_oracle as oracle

C = np.array([0.5, 0.25, -1.5, 2.0])
S = np.array([3.0, -0.5, 0.75, 1.25])
X = np.array([1.0, 2.0, 3.0, 4.0])


def test_worked_example_half():
    c0, c1, c2, c3 = C
    s0, s1, s2, s3 = S
    expected = [c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c2 + 1 * s2, 4 * c3 + 2 * s3]
    np.testing.assert_array_equal(oracle.rope_forward(X, C, S, "half"), expected)


def test_worked_example_interleave():
    c0, c1, c2, c3 = C
    s0, s1, s2, s3 = S
    expected = [c0 - 2 * s0, 2 * c1 + 1 * s1, 3 * c2 - 4 * s2, 4 * c3 + 3 * s3]
    np.testing.assert_array_equal(oracle.rope_forward(X, C, S, "interleave"), expected)


def test_worked_example_quarter():
    x = np.arange(1.0, 9.0)
    np.testing.assert_array_equal(oracle.rotate(x, "quarter"), [-3, -4, 1, 2, -7, -8, 5, 6])
    out = oracle.rope_forward(x, np.zeros(8), np.ones(8), "quarter")
    np.testing.assert_array_equal(out, [-3, -4, 1, 2, -7, -8, 5, 6])


def test_rotate_half_and_interleave_small():
    x = np.arange(1.0, 9.0)
    np.testing.assert_array_equal(oracle.rotate(x, "half"), [-5, -6, -7, -8, 1, 2, 3, 4])
    np.testing.assert_array_equal(oracle.rotate(x, "interleave"), [-2, 1, -4, 3, -6, 5, -8, 7])


@pytest.mark.parametrize("mode", oracle.MODES)
def test_rotation_is_orthogonal_and_squares_to_minus_one(mode):
    r = 16
    mat = oracle.rotation_matrix(mode, r)
    np.testing.assert_array_equal(mat @ mat.T, np.eye(r))
    np.testing.assert_array_equal(mat @ mat, -np.eye(r))  # a rotation by 90 degrees
    x = np.random.default_rng(0).standard_normal((3, r))
    np.testing.assert_array_equal(oracle.rotate(x, mode), x @ mat.T)


def test_partial_rotary_passes_through():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 4, 12))
    c = rng.uniform(-1, 1, (2, 3, 1, 8))
    s = rng.uniform(-1, 1, (2, 3, 1, 8))
    for mode in ("half", "interleave", "quarter"):
        out = oracle.rope_forward(x, c, s, mode)
        np.testing.assert_array_equal(out[..., 8:], x[..., 8:])
        full = oracle.rope_forward(x[..., :8], c, s, mode)
        np.testing.assert_array_equal(out[..., :8], full)


def test_identity_when_cos_one_sin_zero():
    x = np.random.default_rng(2).standard_normal((2, 3, 2, 8))
    for mode in oracle.MODES:
        out = oracle.rope_forward(x, np.ones((1, 3, 1, 8)), np.zeros((1, 3, 1, 8)), mode)
        np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize("layout", oracle.LAYOUTS)
@pytest.mark.parametrize("cos_batch_one", [False, True])
def test_layouts_agree_with_bsnd(layout, cos_batch_one):
    """Every layout is the BSND computation with the axes permuted."""
    rng = np.random.default_rng(3)
    B, S_, Nq, Nk, D, r = 2, 3, 4, 2, 8, 4
    inp = helpers.make_inputs(rng, "BSND", "float32", B, S_, Nq, Nk, D, r, cos_batch_one)
    q, k, c, s = (helpers.f64(inp[n]) for n in ("query", "key", "cos", "sin"))
    ref_q, ref_k = oracle.apply_rotary_pos_emb(q, k, c, s, "BSND", "half")
    if layout in ("BSND", "BSH"):
        perm = None
    elif layout == "SBND":
        perm = (1, 0, 2, 3)
    elif layout == "BNSD":
        perm = (0, 2, 1, 3)
    if layout == "TND":
        if cos_batch_one:
            c, s = np.broadcast_to(c, (B,) + c.shape[1:]), np.broadcast_to(s, (B,) + s.shape[1:])
        tq, tk = q.reshape(B * S_, Nq, D), k.reshape(B * S_, Nk, D)
        tc, ts = c.reshape(B * S_, 1, r), s.reshape(B * S_, 1, r)
        oq, ok = oracle.apply_rotary_pos_emb(tq, tk, tc, ts, "TND", "half")
        np.testing.assert_array_equal(oq, ref_q.reshape(oq.shape))
        np.testing.assert_array_equal(ok, ref_k.reshape(ok.shape))
        return
    t = (lambda a: a) if perm is None else (lambda a: np.transpose(a, perm))
    oq, ok = oracle.apply_rotary_pos_emb(t(q), t(k), t(c), t(s), layout, "half")
    np.testing.assert_array_equal(oq, t(ref_q))
    np.testing.assert_array_equal(ok, t(ref_k))


@given(seed=st.integers(0, 2**32 - 1), h=st.integers(1, 8), extra=st.integers(0, 3),
       mode=st.sampled_from(oracle.MODES))
def test_adjoint_formula_is_transpose_of_rotation(seed, h, extra, mode):
    """<J x, g> == <x, J^T g>, and the spec's half-mode formula equals c*g + R^T(s*g)."""
    rng = np.random.default_rng(seed)
    r = 4 * h if mode == "quarter" else 2 * h
    D = r + 2 * extra * (2 if mode == "quarter" else 1)
    x = rng.standard_normal((3, 2, D))
    g = rng.standard_normal((3, 2, D))
    c = rng.uniform(-1, 1, (3, 1, r))
    s = rng.uniform(-1, 1, (3, 1, r))
    jx = oracle.rope_forward(x, c, s, mode)
    jtg = oracle.rope_adjoint_x_matrix(g, c, s, mode)
    np.testing.assert_allclose(np.sum(jx * g), np.sum(x * jtg), rtol=1e-12, atol=1e-12)
    # the explicit Jacobian of one row, transposed, is the matrix adjoint
    jac = np.zeros((D, D))
    for i in range(D):
        e = np.zeros(D)
        e[i] = 1.0
        jac[:, i] = oracle.rope_forward(e, c[0, 0], s[0, 0], mode)
    np.testing.assert_allclose(jac.T @ g[0, 0],
                               oracle.rope_adjoint_x_matrix(g[0, 0], c[0, 0], s[0, 0], mode),
                               rtol=1e-12, atol=1e-12)
    if mode == "half":
        np.testing.assert_allclose(oracle.rope_adjoint_x(g, c, s), jtg, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", oracle.LAYOUTS)
@pytest.mark.parametrize("cos_batch_one", [False, True])
def test_grad_bilinear_identity(layout, cos_batch_one):
    """The forward is bilinear: <out[:r], g[:r]> == <cos, dcos> + <sin, dsin> over q and k, and
    <out, g> == <x, dx> (the dot-product test at the level of the whole operator)."""
    rng = np.random.default_rng(4)
    inp = helpers.make_inputs(rng, layout, "float32", B=3, S=2, Nq=4, Nk=2, D=12, r=8,
                              cos_batch_one=cos_batch_one)
    q, k, c, s = (helpers.f64(inp[n]) for n in ("query", "key", "cos", "sin"))
    gq = rng.standard_normal(q.shape)
    gk = rng.standard_normal(k.shape)
    oq, ok = oracle.apply_rotary_pos_emb(q, k, c, s, layout, "half")
    dq, dk, dc, ds = oracle.apply_rotary_pos_emb_grad(gq, gk, c, s, q, k, layout)
    assert dc.shape == c.shape and ds.shape == s.shape
    r = c.shape[-1]
    lhs = np.sum(oq[..., :r] * gq[..., :r]) + np.sum(ok[..., :r] * gk[..., :r])
    np.testing.assert_allclose(lhs, np.sum(c * dc) + np.sum(s * ds), rtol=1e-12)
    np.testing.assert_allclose(np.sum(oq * gq) + np.sum(ok * gk),
                               np.sum(q * dq) + np.sum(k * dk), rtol=1e-12)
    np.testing.assert_array_equal(dq[..., r:], gq[..., r:])
    # numerical check of dcos / dsin along a random direction (exact: linear in cos, sin)
    dcv, dsv = rng.standard_normal(c.shape), rng.standard_normal(s.shape)
    oq2, ok2 = oracle.apply_rotary_pos_emb(q, k, c + dcv, s + dsv, layout, "half")
    diff = np.sum((oq2 - oq) * gq) + np.sum((ok2 - ok) * gk)
    np.testing.assert_allclose(diff, np.sum(dcv * dc) + np.sum(dsv * ds), rtol=1e-10)
    _, _, none_c, none_s = oracle.apply_rotary_pos_emb_grad(gq, gk, c, s, layout=layout)
    assert none_c is None and none_s is None


def test_float32_golden_is_one_rounding_for_low_precision_inputs():
    """With bf16/f16 inputs the float32 products are exact, so the float32 golden is within
    1 ulp of the float64 oracle after the cast (the premise of the 1-ulp checks)."""
    rng = np.random.default_rng(5)
    for dtype in ("float16", "bfloat16"):
        inp = helpers.make_inputs(rng, "BSND", dtype, B=2, S=5, Nq=3, D=16)
        args = [inp[n] for n in ("query", "key", "cos", "sin")]
        g64 = oracle.apply_rotary_pos_emb(*(helpers.f64(a) for a in args))
        g32 = oracle.apply_rotary_pos_emb(*args, dtype=np.float32)
        for a, b in zip(g32, g64):
            helpers.assert_within_ulp(a.astype(helpers.DTYPES[dtype]), b, helpers.DTYPES[dtype])


def test_ulp_distance():
    bf = helpers.BF16
    one = np.array([1.0], dtype=bf)
    nxt = np.nextafter(np.float32(1.0), np.float32(2.0))  # rounds back to 1 in bf16
    assert helpers.ulp_distance(one, np.array([nxt]).astype(bf), bf)[0] == 0
    assert helpers.ulp_distance(np.array([1.0078125], dtype=bf), one, bf)[0] == 1
    assert helpers.ulp_distance(np.array([-0.0], np.float16), np.array([0.0], np.float16),
                                np.float16)[0] == 0
    tiny = np.array([np.float16(6e-8)], np.float16)  # smallest subnormal
    assert helpers.ulp_distance(tiny, -tiny, np.float16)[0] == 2
