"""rope_cos_sin and positions_from_seq_lens (spec/api.md) against the float64 oracle in
rope_tables_oracle.py (written from Hugging Face transformers' modeling_rope_utils formulas).

Precision: rope_cos_sin reduces the phase exactly for integer |positions| < 2**24 whenever the
inverse frequencies are static (every type, longrope included, and "dynamic" up to
max_position_embeddings), so tables are checked at 1e-5 absolute (times the attention factor)
at any such position. "dynamic" beyond max_position_embeddings has traced float32 frequencies
(as Hugging Face's float32 tables) and an error of about eps32 * |angle| (2.4e-4 at 4096); it is
checked at that bound. Inverse frequencies are checked at 1e-5 relative.
"""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_rope as jr
import rope_tables_oracle as oracle
from jax_rope.rope.tables import frequency_plan


def inv_freq_and_attention_factor(positions, d, *, base=10000.0, scaling=None,
                                  max_position_embeddings=None):
    """rope_cos_sin's inverse frequencies and attention factor, from its frequency plan."""
    plan = frequency_plan(positions, d, base, scaling, max_position_embeddings)
    return plan.inv_freq, plan.attention


MODES = ("half", "quarter", "interleave")
EPS32 = float(np.finfo(np.float32).eps)


def _long(d4):
    """A longrope factor list of length d4 (d/2): a smooth ramp as in Phi-3 configs."""
    return [1.0 + 3.0 * i / max(d4 - 1, 1) for i in range(d4)]


def _short(d4):
    return [1.0 + 0.05 * i for i in range(d4)]


def scaling_cases(rotary_dim, mode):
    """(id, scaling, max_position_embeddings) for every type; d/2 depends on the mode."""
    d4 = (rotary_dim // 2 if mode == "quarter" else rotary_dim) // 2
    return [
        ("none", None, None),
        ("default", {"rope_type": "default"}, None),
        ("linear", {"rope_type": "linear", "factor": 4.0}, None),
        ("linear_type_alias", {"type": "linear", "factor": 2.5}, None),
        ("dynamic_within", {"rope_type": "dynamic", "factor": 2.0}, 8192),
        ("dynamic_beyond", {"rope_type": "dynamic", "factor": 3.0}, 512),
        ("yarn", {"rope_type": "yarn", "factor": 8.0,
                  "original_max_position_embeddings": 1024}, None),
        ("yarn_deepseek", {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32,
                           "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
                           "original_max_position_embeddings": 4096}, 163840),
        ("yarn_untruncated", {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16,
                              "beta_slow": 2, "truncate": False,
                              "attention_factor": 1.25}, 2048),
        ("longrope_short", {"rope_type": "longrope", "short_factor": _short(d4),
                            "long_factor": _long(d4),
                            "original_max_position_embeddings": 8192}, 131072),
        ("longrope_long", {"rope_type": "longrope", "short_factor": _short(d4),
                           "long_factor": _long(d4), "factor": 16.0,
                           "original_max_position_embeddings": 256}, 4096),
        ("longrope_att", {"type": "longrope", "short_factor": _short(d4),
                          "long_factor": _long(d4), "attention_factor": 0.9,
                          "original_max_position_embeddings": 100}, 200),
        ("llama3", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}, None),
    ]


CASE_IDS = [c[0] for c in scaling_cases(64, "half")]


def _case(name, rotary_dim, mode):
    return next(c for c in scaling_cases(rotary_dim, mode) if c[0] == name)


def assert_tables_close(got, want, positions, inv_freq, att, exact):
    got = np.asarray(got, np.float64)
    att = abs(att)
    if exact:
        tol = 1e-5 * max(att, 1.0)
    else:
        # float32 angle rounding: error grows with |angle| (see module docstring).
        angle = np.abs(np.asarray(positions, np.float64)).max() * float(np.max(inv_freq))
        tol = (1e-5 + EPS32 * angle) * max(att, 1.0)
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)


# ---- against the oracle -----------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CASE_IDS)
def test_tables_match_oracle(name, mode):
    rotary_dim = 64
    _, scaling, mpe = _case(name, rotary_dim, mode)
    rng = np.random.default_rng(0)
    for positions in (np.arange(64).reshape(4, 16), rng.integers(0, 4096, size=(3, 40))):
        exact = not (name == "dynamic_beyond" and positions.max() >= mpe)
        cos, sin = jr.rope_cos_sin(positions, rotary_dim, rotary_mode=mode, scaling=scaling,
                                   max_position_embeddings=mpe)
        assert cos.shape == sin.shape == positions.shape + (rotary_dim,)
        assert cos.dtype == sin.dtype == jnp.float32
        want_cos, want_sin = oracle.cos_sin(positions, rotary_dim, rotary_mode=mode,
                                            rope_scaling=scaling, max_position_embeddings=mpe)
        d = rotary_dim // 2 if mode == "quarter" else rotary_dim
        inv, att = oracle.inv_freq_and_attention(d, 10000.0, scaling, mpe,
                                                 int(positions.max()) + 1)
        assert_tables_close(cos, want_cos, positions, inv, att, exact)
        assert_tables_close(sin, want_sin, positions, inv, att, exact)


@pytest.mark.parametrize("name", CASE_IDS)
@pytest.mark.parametrize("base", [10000.0, 500000.0])
@pytest.mark.parametrize("seq_len", [100, 5000])
def test_inv_freq_and_attention_factor_match_oracle(name, base, seq_len):
    d = 128
    _, scaling, mpe = _case(name, d, "half")
    positions = np.arange(seq_len)
    inv, att = inv_freq_and_attention_factor(positions, d, base=base, scaling=scaling,
                                             max_position_embeddings=mpe)
    want_inv, want_att = oracle.inv_freq_and_attention(d, base, scaling, mpe, seq_len)
    assert inv.shape == (d // 2,) and inv.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(inv), want_inv, rtol=1e-5, atol=0)
    assert math.isclose(att, want_att, rel_tol=1e-12)


@pytest.mark.parametrize("name", ["none", "yarn_deepseek", "longrope_long", "llama3",
                                  "dynamic_within"])
def test_large_and_negative_positions_are_exact(name):
    """Phases are reduced exactly for |positions| < 2**24, far beyond float32 pos * inv_freq."""
    _, scaling, mpe = _case(name, 64, "interleave")
    if name == "dynamic_within":
        mpe = 2 ** 24
    rng = np.random.default_rng(4)
    positions = np.concatenate([rng.integers(-2 ** 24 + 1, 2 ** 24, 300), [2 ** 24 - 1, -4097]])
    cos, sin = jax.jit(lambda p: jr.rope_cos_sin(p, 64, rotary_mode="interleave", base=1e6,
                                                 scaling=scaling,
                                                 max_position_embeddings=mpe))(positions)
    want_cos, want_sin = oracle.cos_sin(positions, 64, base=1e6, rotary_mode="interleave",
                                        rope_scaling=scaling, max_position_embeddings=mpe)
    att = abs(float(want_cos[0, 0] ** 2 + want_sin[0, 0] ** 2) ** 0.5)
    np.testing.assert_allclose(cos, want_cos, rtol=0, atol=1e-5 * max(att, 1.0))
    np.testing.assert_allclose(sin, want_sin, rtol=0, atol=1e-5 * max(att, 1.0))


def test_layouts_per_mode():
    positions = np.array([0, 3, 7])
    inv = 10000.0 ** (-np.arange(0, 8, 2) / 8)
    f = positions[:, None] * inv
    cos, _ = jr.rope_cos_sin(positions, 8, rotary_mode="half")
    np.testing.assert_allclose(cos, np.cos(np.concatenate([f, f], -1)), atol=1e-6)
    cos, _ = jr.rope_cos_sin(positions, 8, rotary_mode="interleave")
    np.testing.assert_allclose(cos, np.cos(np.repeat(f, 2, -1)), atol=1e-6)
    inv4 = 10000.0 ** (-np.arange(0, 4, 2) / 4)
    f4 = positions[:, None] * inv4
    _, sin = jr.rope_cos_sin(positions, 8, rotary_mode="quarter")
    np.testing.assert_allclose(sin, np.sin(np.concatenate([f4] * 4, -1)), atol=1e-6)


def test_shapes_scalar_and_empty_positions():
    cos, sin = jr.rope_cos_sin(np.int32(5), 4)
    assert cos.shape == (4,)
    np.testing.assert_allclose(cos[0], np.cos(5.0), atol=1e-6)
    dyn = {"rope_type": "dynamic", "factor": 2.0}
    cos, sin = jr.rope_cos_sin(np.zeros((0, 3), np.int64), 8, scaling=dyn,
                               max_position_embeddings=16)
    assert cos.shape == sin.shape == (0, 3, 8)
    cos, _ = jr.rope_cos_sin([[1, 2], [3, 4]], 8)  # a nested list of ints is an integer array
    assert cos.shape == (2, 2, 8)


def test_rope_theta_in_scaling_must_match_base():
    s = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}
    cos, _ = jr.rope_cos_sin(np.arange(5), 8, base=500000, scaling=s)
    want, _ = oracle.cos_sin(np.arange(5), 8, base=500000.0, rope_scaling=s)
    np.testing.assert_allclose(cos, want, atol=1e-6)
    with pytest.raises(ValueError, match="rope_theta"):
        jr.rope_cos_sin(np.arange(5), 8, scaling=s)


def test_yarn_factor_none_uses_max_over_original():
    s = {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 1024}
    inv, att = inv_freq_and_attention_factor(np.arange(3), 64, scaling=s,
                                             max_position_embeddings=4096)
    want, want_att = oracle.inv_freq_and_attention(64, 10000.0, dict(s, factor=4.0), 4096, 3)
    np.testing.assert_allclose(np.asarray(inv), want, rtol=1e-6)
    assert math.isclose(att, want_att)


# ---- traced positions -------------------------------------------------------------------------

@pytest.mark.parametrize("name", CASE_IDS)
def test_jit_traced_positions_match_oracle(name):
    rotary_dim, mode = 32, "half"
    _, scaling, mpe = _case(name, rotary_dim, mode)
    f = jax.jit(lambda p: jr.rope_cos_sin(p, rotary_dim, rotary_mode=mode, scaling=scaling,
                                          max_position_embeddings=mpe))
    # One compiled function, two inputs on either side of every threshold used above.
    for top in (90, 4095):
        positions = np.array([[0, 5, top], [top // 2, 1, 2]], np.int32)
        cos, sin = f(positions)
        want_cos, want_sin = oracle.cos_sin(positions, rotary_dim, rotary_mode=mode,
                                            rope_scaling=scaling, max_position_embeddings=mpe)
        inv, att = oracle.inv_freq_and_attention(rotary_dim, 10000.0, scaling, mpe, top + 1)
        exact = not (name == "dynamic_beyond" and top >= mpe)
        assert_tables_close(cos, want_cos, positions, inv, att, exact)
        assert_tables_close(sin, want_sin, positions, inv, att, exact)
    assert f._cache_size() == 1


@pytest.mark.parametrize("mode", MODES)
def test_jit_dynamic_and_longrope_follow_traced_max(mode):
    rotary_dim = 16
    d4 = (rotary_dim // 2 if mode == "quarter" else rotary_dim) // 2
    long = {"rope_type": "longrope", "short_factor": [1.0] * d4, "long_factor": [4.0] * d4,
            "factor": 8.0, "original_max_position_embeddings": 10}
    dyn = {"rope_type": "dynamic", "factor": 4.0}
    for scaling in (long, dyn):
        f = jax.jit(lambda p, s=scaling: jr.rope_cos_sin(p, rotary_dim, rotary_mode=mode,
                                                          scaling=s, max_position_embeddings=10))
        short_pos = jnp.arange(10)        # seq_len 10: short factors / no NTK change
        long_pos = jnp.arange(11)[::-1]   # seq_len 11: long factors / NTK base grows
        c_short, _ = f(short_pos)
        c_long, _ = f(long_pos)
        for pos, got in ((short_pos, c_short), (long_pos, c_long)):
            want, _ = oracle.cos_sin(np.asarray(pos), rotary_dim, rotary_mode=mode,
                                     rope_scaling=scaling, max_position_embeddings=10)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
        # the same position gets a different angle once the traced max crosses the threshold
        assert not np.allclose(c_short[9], c_long[1], atol=1e-3)


def test_vmap_each_row_uses_its_own_max():
    s = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
         "original_max_position_embeddings": 8}
    pos = np.array([[0, 1, 2, 3], [0, 1, 2, 9]])
    cos = jax.vmap(lambda p: jr.rope_cos_sin(p, 8, scaling=s, max_position_embeddings=16)[0])(pos)
    for row in range(2):
        want, _ = oracle.cos_sin(pos[row], 8, rope_scaling=s, max_position_embeddings=16)
        np.testing.assert_allclose(cos[row], want, atol=1e-5)


# ---- dtype ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, "float16", np.dtype("float32"),
                                   "bfloat16"])
def test_dtype_is_one_cast_of_float32(dtype):
    s = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    positions = np.arange(200)
    c32, s32 = jr.rope_cos_sin(positions, 16, scaling=s)
    c, sn = jr.rope_cos_sin(positions, 16, scaling=s, dtype=dtype)
    assert c.dtype == sn.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(c), np.asarray(c32.astype(dtype)))
    np.testing.assert_array_equal(np.asarray(sn), np.asarray(s32.astype(dtype)))


# ---- errors -----------------------------------------------------------------------------------

P = np.arange(4)
D4 = [1.0] * 4


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(positions=np.arange(4.0)), TypeError, "positions must be an integer"),
    (dict(positions=np.array([True, False])), TypeError, "positions must be an integer"),
    (dict(positions=jnp.zeros(3, jnp.bfloat16)), TypeError, "positions must be an integer"),
    (dict(rotary_dim=8.0), TypeError, "rotary_dim"),
    (dict(rotary_dim=True), TypeError, "rotary_dim"),
    (dict(rotary_dim=0), ValueError, "rotary_dim"),
    (dict(rotary_dim=7), ValueError, "rotary_dim must be a positive multiple of 2"),
    (dict(rotary_dim=6, rotary_mode="quarter"), ValueError, "multiple of 4"),
    (dict(rotary_mode="rotate"), ValueError, "rotary_mode"),
    (dict(dtype=jnp.int32), ValueError, "dtype"),
    (dict(dtype=jnp.float64), ValueError, "dtype"),
    (dict(dtype="nonsense"), ValueError, "dtype"),
    (dict(base=0.0), ValueError, "base"),
    (dict(scaling=[("rope_type", "linear")]), TypeError, "scaling must be None or a dict"),
    (dict(scaling={"factor": 2.0}), ValueError, "rope_type"),
    (dict(scaling={"rope_type": "ntk-by-parts"}), ValueError, "ntk-by-parts"),
    (dict(scaling={"rope_type": "linear"}), ValueError, "'factor'"),
    (dict(scaling={"rope_type": "linear", "factor": "2"}), ValueError, "'factor'"),
    (dict(scaling={"rope_type": "linear", "factor": -1.0}), ValueError, "'factor'"),
    (dict(scaling={"rope_type": "dynamic", "factor": 2.0}), ValueError,
     "max_position_embeddings"),
    (dict(scaling={"rope_type": "dynamic"}, max_position_embeddings=8), ValueError, "'factor'"),
    (dict(scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=0),
     ValueError, "max_position_embeddings"),
    (dict(scaling={"rope_type": "yarn", "original_max_position_embeddings": 8}), ValueError,
     "'factor'"),
    (dict(scaling={"rope_type": "yarn", "factor": 2.0}), ValueError,
     "original_max_position_embeddings"),
    (dict(scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}), ValueError, "low_freq_factor"),
    (dict(scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 64}), ValueError, "high_freq_factor"),
    (dict(scaling={"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}), ValueError, "'factor'"),
    (dict(scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0}), ValueError, "original_max_position_embeddings"),
    (dict(scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
     ValueError, "high_freq_factor"),
    (dict(scaling={"rope_type": "longrope", "short_factor": D4, "long_factor": D4,
                   "original_max_position_embeddings": 8}), ValueError,
     "max_position_embeddings"),
    (dict(scaling={"rope_type": "longrope", "long_factor": D4,
                   "original_max_position_embeddings": 8}, max_position_embeddings=16),
     ValueError, "short_factor"),
    (dict(scaling={"rope_type": "longrope", "short_factor": D4,
                   "original_max_position_embeddings": 8}, max_position_embeddings=16),
     ValueError, "long_factor"),
    (dict(scaling={"rope_type": "longrope", "short_factor": D4, "long_factor": [1.0] * 3,
                   "original_max_position_embeddings": 8}, max_position_embeddings=16),
     ValueError, "long_factor.*4"),
])
def test_errors(kwargs, exc, match):
    args = dict(positions=P, rotary_dim=8)
    args.update(kwargs)
    positions, rotary_dim = args.pop("positions"), args.pop("rotary_dim")
    with pytest.raises(exc, match=match):
        jr.rope_cos_sin(positions, rotary_dim, **args)


def test_errors_raise_under_jit_at_trace_time():
    with pytest.raises(TypeError, match="positions must be an integer"):
        jax.jit(lambda p: jr.rope_cos_sin(p, 8))(jnp.arange(4.0))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        jax.jit(lambda p: jr.rope_cos_sin(p, 8, scaling={"rope_type": "dynamic",
                                                          "factor": 2.0}))(jnp.arange(4))


# ---- positions_from_seq_lens ------------------------------------------------------------------

def _packed_positions(ends, total):
    """Independent loop: restart at each end offset; the tail continues the last sequence."""
    out, start = [], 0
    starts = [0] + list(ends[:-1])
    for t in range(total):
        while len(starts) > 1 and t >= starts[1]:
            starts.pop(0)
        start = starts[0]
        out.append(t - start)
    return np.array(out)


@pytest.mark.parametrize("ends, total", [
    ([3, 5, 9], 9), ([3, 5, 9], 11), ([3, 5, 9], 6), ([4], 4), ([0, 2, 2, 5], 7),
    ([1, 2, 3], 3), ([7], 0),
])
def test_positions_from_seq_lens(ends, total):
    got = jr.positions_from_seq_lens(np.array(ends), total)
    assert got.shape == (total,) and got.dtype == jnp.int32
    np.testing.assert_array_equal(got, _packed_positions(ends, total))


def test_positions_from_seq_lens_examples_and_jit():
    np.testing.assert_array_equal(jr.positions_from_seq_lens([3, 5, 9], 9),
                                  [0, 1, 2, 0, 1, 0, 1, 2, 3])
    np.testing.assert_array_equal(jr.positions_from_seq_lens([3, 5, 9], 11),
                                  [0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5])
    f = jax.jit(jr.positions_from_seq_lens, static_argnums=1)
    for ends in ([3, 5, 9], [1, 8, 9], [9, 9, 9]):
        np.testing.assert_array_equal(f(jnp.array(ends), 9), _packed_positions(ends, 9))
    assert f._cache_size() == 1


@pytest.mark.parametrize("args, exc, match", [
    ((np.array([3.0, 5.0]), 5), TypeError, "actual_seq_len must be an integer"),
    ((np.array([3, 5]), 5.0), TypeError, "total"),
    ((np.array([3, 5]), -1), ValueError, "total"),
    ((np.array([[3, 5]]), 5), ValueError, "1-D"),
    ((np.array([], np.int32), 5), ValueError, "non-empty"),
    ((np.array([5, 3]), 5), ValueError, "non-decreasing"),
    ((np.array([-1, 3]), 5), ValueError, "non-negative"),
])
def test_positions_from_seq_lens_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        jr.positions_from_seq_lens(*args)


# ---- end to end through apply_rotary_pos_emb --------------------------------------------------

def test_end_to_end_interleave_matches_complex_form():
    B, S, N, D, r = 2, 7, 3, 24, 16
    rng = np.random.default_rng(1)
    q = rng.standard_normal((B, S, N, D)).astype(np.float32)
    k = rng.standard_normal((B, S, 1, D)).astype(np.float32)
    positions = np.stack([np.arange(S), np.arange(S) + 100])  # (B, S), per-batch positions
    cos, sin = jr.rope_cos_sin(positions, r, rotary_mode="interleave", base=500.0)
    qo, ko = jr.apply_rotary_pos_emb(q, k, cos[:, :, None, :], sin[:, :, None, :],
                                     layout="BSND", rotary_mode="interleave")
    inv = 500.0 ** (-np.arange(0, r, 2) / r)
    pos4 = positions[:, :, None]  # broadcast over heads
    np.testing.assert_allclose(qo, oracle.rope_complex(q.astype(np.float64), pos4, inv),
                               atol=1e-4)
    np.testing.assert_allclose(ko, oracle.rope_complex(k.astype(np.float64), pos4, inv),
                               atol=1e-4)


def test_end_to_end_half_matches_rotate_half_with_llama3_scaling():
    B, S, N, D = 1, 9, 2, 32
    rng = np.random.default_rng(2)
    q = rng.standard_normal((B, N, S, D)).astype(np.float32)
    s = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    positions = np.arange(S) * 3
    cos, sin = jr.rope_cos_sin(positions, D, scaling=s)
    qo, _ = jr.apply_rotary_pos_emb(q, q, cos[None, None], sin[None, None], layout="BNSD")
    inv, _ = oracle.llama3_params({"rope_theta": 10000.0, "dim": D, "rope_scaling": s})
    want = oracle.rope_rotate_half(q.astype(np.float64), positions, inv)
    np.testing.assert_allclose(qo, want, atol=1e-4)


def test_end_to_end_packed_tnd():
    ends, T, Nq, Nk, D, r = [3, 5, 9, 12], 14, 4, 2, 16, 8
    rng = np.random.default_rng(3)
    q = rng.standard_normal((T, Nq, D)).astype(np.float32)
    k = rng.standard_normal((T, Nk, D)).astype(np.float32)

    @jax.jit
    def step(q, k, ends):
        positions = jr.positions_from_seq_lens(ends, T)
        cos, sin = jr.rope_cos_sin(positions, r)
        return jr.apply_rotary_pos_emb(q, k, cos[:, None, :], sin[:, None, :], layout="TND")

    qo, ko = step(q, k, jnp.array(ends))
    inv = 10000.0 ** (-np.arange(0, r, 2) / r)
    # Each sequence on its own, positions 0.. (the padding tail continues the last one).
    bounds = [0] + ends[:-1] + [T]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        pos = np.arange(hi - lo)[:, None]
        np.testing.assert_allclose(qo[lo:hi], oracle.rope_rotate_half(q[lo:hi].astype(float),
                                                                      pos, inv), atol=1e-5)
        np.testing.assert_allclose(ko[lo:hi], oracle.rope_rotate_half(k[lo:hi].astype(float),
                                                                      pos, inv), atol=1e-5)


def test_bfloat16_tables_feed_bfloat16_rope():
    q = jnp.ones((1, 4, 1, 8), jnp.bfloat16)
    cos, sin = jr.rope_cos_sin(np.arange(4), 8, dtype=jnp.bfloat16)
    assert cos.dtype == jnp.bfloat16
    qo, _ = jr.apply_rotary_pos_emb(q, q, cos[None, :, None], sin[None, :, None])
    assert qo.dtype == ml_dtypes.bfloat16
