"""Nothing silently wrong: input that would be converted, wrapped or truncated is refused with
an error naming the argument; a few edge shapes behave the same on both backends; and the
fallback's numbers are as precise as the spec says (statistics at large logits; float32 RoPE
within 1 ulp of the golden, bitwise on the kernel)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import jax_rope as jr
import rope_oracle as oracle
from conftest import require_backend

Q4 = jnp.ones((1, 4, 2, 8), jnp.float32)
T8 = jnp.ones((8, 2, 8), jnp.float32)


def tnd_call(**kw):
    return lambda: jr.flash_attention_score(T8, T8, T8, input_layout="TND", **kw)


# ---- point 3: refuse what would be converted -------------------------------------------------

@pytest.mark.parametrize("call, error, message", [
    (tnd_call(actual_seq_qlen=[2.0, 8.0], actual_seq_kvlen=[2, 8]), TypeError,
     "actual_seq_qlen must have an integer dtype, got float64"),
    (tnd_call(actual_seq_qlen=np.array([2, 8]), actual_seq_kvlen=np.array([2.5, 8.0])),
     TypeError, "actual_seq_kvlen must have an integer dtype"),
    (tnd_call(actual_seq_qlen=jnp.array([2.0, 8.0]), actual_seq_kvlen=[2, 8]), TypeError,
     "actual_seq_qlen must have an integer dtype, got float32"),
    (tnd_call(actual_seq_qlen=[True, True], actual_seq_kvlen=[2, 8]), TypeError,
     "actual_seq_qlen must have an integer dtype, got bool"),
    (lambda: jr.flash_attention_score(Q4, Q4, Q4, sparse_mode=6, prefix=[2.0]), TypeError,
     "prefix must have an integer dtype"),
    (tnd_call(actual_seq_qlen=np.array([2, 2**32 + 8]), actual_seq_kvlen=[2, 8]), ValueError,
     "actual_seq_qlen values must fit in int32"),
    (lambda: jr.flash_attention_score(Q4, Q4, Q4, sparse_mode=6, prefix=np.array([2**31])),
     ValueError, "prefix values must fit in int32"),
    (lambda: jr.rope_cos_sin(np.array([5, 2**32 + 5]), 8), ValueError,
     "positions values must fit in int32"),
    (lambda: jr.positions_from_seq_lens(np.array([2**31 + 1]), 4), ValueError,
     "actual_seq_len values must fit in int32"),
    (lambda: jr.varlen_sequence_parallel_split([4.0, 8.0], [4, 8], 2, 2), TypeError,
     "actual_seq_qlen must be integers"),
    (lambda: jr.varlen_sequence_parallel_split([4, 8], np.array([4.5, 8]), 2, 2), TypeError,
     "actual_seq_kvlen must be integers"),
    (lambda: jr.varlen_sequence_parallel_split([4, 8], [4, 8], 2, 2, cuts=[3.5]), TypeError,
     "cuts must be integers"),
    (lambda: jr.varlen_sequence_parallel_split([4, 2**32], [4, 8], 2, 2), ValueError,
     "actual_seq_qlen values must fit in int32"),
    (lambda: jax.jit(lambda a: jr.varlen_sequence_parallel_split(a, [4, 8], 2, 2))(
        jnp.array([4, 8])), TypeError, "actual_seq_qlen must be concrete values"),
    (lambda: jr.flash_attention_score(Q4, Q4, Q4, scale=float("nan")), ValueError,
     "scale must be finite, got nan"),
    (lambda: jr.attention_scores(Q4, Q4, scale=float("inf")), ValueError,
     "scale must be finite, got inf"),
    (lambda: jr.rope_cos_sin(np.arange(3), 8, base=float("inf")), ValueError,
     "base must be finite and > 0, got inf"),
    (lambda: jr.rope_cos_sin(np.arange(3), 8, base=float("nan")), ValueError,
     "base must be finite and > 0, got nan"),
    (lambda: jr.flash_attention_score(Q4, Q4, Q4, sparse_mode=4, pre_tokens=2**31),
     ValueError, "pre_tokens must fit in int32"),
])
def test_converted_or_wrapping_input_is_refused(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_sequences_beyond_the_band_table_limit_are_refused():
    long = jax.ShapeDtypeStruct((1, 2**30 + 1, 1, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"query sequence length must be <= 1073741824"):
        jax.eval_shape(lambda q: jr.flash_attention_score(q, q, q, sparse_mode=2), long)
    short = jax.ShapeDtypeStruct((1, 4, 1, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"key sequence length must be <= 1073741824"):
        jax.eval_shape(lambda q, k: jr.attention_scores(q, k), short, long)


# ---- point 4: every bad input named --------------------------------------------------------

@pytest.mark.parametrize("call, message", [
    (lambda: jr.flash_attention_score(jnp.float32(1.0), Q4, Q4),
     r"query must have rank 4 for input_layout BSND, got shape \(\)"),
    (lambda: jr.flash_attention_score(Q4, jnp.ones((1, 4, 2, 8, 1)), Q4),
     "key must have rank 4 for input_layout BSND"),
    (lambda: jr.flash_attention_score(jnp.ones((1, 4, 16)), jnp.ones((1, 4, 16)),
                                      jnp.ones((4, 8)), input_layout="BSH", head_num=2),
     "value must have rank 3"),
    (lambda: jr.sparse_mask(2, -3, 4), "q_len must be a positive int, got -3"),
    (lambda: jr.sparse_mask(2, 4, 0), "kv_len must be a positive int, got 0"),
    (lambda: jr.sparse_mask(3, None, None, actual_seq_qlen=[], actual_seq_kvlen=[]),
     "actual_seq_qlen must be a non-empty 1-D sequence"),
    (lambda: jr.sparse_mask(3, None, None, actual_seq_qlen=[2, 4]),
     "actual_seq_kvlen is required"),
    (tnd_call(actual_seq_qlen=[], actual_seq_kvlen=[]),
     "actual_seq_qlen must be a non-empty 1-D sequence"),
    (lambda: jr.positions_from_seq_lens(np.zeros(0, np.int32), 4),
     "actual_seq_len must be 1-D and non-empty"),
    (lambda: jr.rope_cos_sin(np.arange(3), 8, scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": -1}), r"scaling\['beta_fast'\] must be > 0"),
    (lambda: jr.rope_cos_sin(np.arange(3), 8, scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_slow": 0}), r"scaling\['beta_slow'\] must be > 0"),
    (lambda: jr.rope_cos_sin(np.arange(3), 8, scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": "x", "mscale_all_dim": 1.0}), r"scaling\['mscale'\] must be a finite number"),
    (lambda: jr.rope_cos_sin(np.arange(3), 8, base=1.0, scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
     "base must not be 1 with rope_type 'yarn'"),
    (lambda: jr.rope_cos_sin(np.arange(3), 8, scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": -64}),
     r"scaling\['original_max_position_embeddings'\] must be > 0"),
    (lambda: jr.rope_cos_sin(np.arange(3), 8, max_position_embeddings=100, scaling={
        "rope_type": "longrope", "short_factor": [1] * 4, "long_factor": [1] * 4,
        "original_max_position_embeddings": 1}),
     r"scaling\['original_max_position_embeddings'\] must be > 1"),
    (lambda: jr.rope_cos_sin(np.arange(3), 8, max_position_embeddings=100, scaling={
        "rope_type": "longrope", "short_factor": [1] * 4, "long_factor": [1] * 4,
        "original_max_position_embeddings": 50, "attention_factor": float("nan")}),
     r"scaling\['attention_factor'\] must be a finite number"),
])
def test_bad_input_names_the_argument(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


@pytest.mark.parametrize("backend", ["ffi", "fallback"])
@pytest.mark.parametrize("tq, tkv", [(0, 0), (3, 0), (0, 5)])
def test_empty_packed_tokens_give_empty_or_dead_outputs_on_both_backends(backend, tq, tkv):
    require_backend(backend)
    q, k = jnp.ones((tq, 2, 8)), jnp.ones((tkv, 2, 8))
    f = lambda q, k: jr.flash_attention_score(q, k, k, input_layout="TND",
                                              actual_seq_qlen=[tq], actual_seq_kvlen=[tkv])
    with jr.backend(backend):
        out, smax, ssum = jax.jit(f)(q, k)
        dq = jax.grad(lambda q: jnp.sum(f(q, k)[0]))(q)
    assert out.shape == (tq, 2, 8) and smax.shape == ssum.shape == (tq, 2) and dq.shape == q.shape
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    np.testing.assert_array_equal(np.asarray(smax), np.float32(-3.4028235e38))
    np.testing.assert_array_equal(np.asarray(ssum), np.float32(3.4028235e38))


# ---- point 6: precision ----------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["ffi", "fallback"])
@pytest.mark.parametrize("logit", [1e3, 1e4])
def test_statistics_are_accurate_to_float32_rounding_at_large_logits(backend, logit):
    """Integer q, k make every dot product exact; the scores are then rounded once
    (scale * dot in float32, as the spec computes them) and the oracle sums exp(score - max)
    over those scores in float64. The statistics must agree to float32 rounding of the sum."""
    require_backend(backend)
    rng = np.random.default_rng(3)
    d, s = 8, 96
    scale = np.float32(1 / np.sqrt(d))  # not a power of two: the scores are rounded
    q = np.round(rng.uniform(-1, 1, (1, s, 2, d)) * np.sqrt(logit / d / scale) * 2)
    k = np.round(rng.uniform(-1, 1, (1, s, 2, d)) * np.sqrt(logit / d / scale) * 2)
    q, k = q.astype(np.float32), k.astype(np.float32)
    dots = np.einsum("bqnd,bknd->bnqk", q.astype(np.float64), k.astype(np.float64))
    scores = (scale * dots.astype(np.float32)).astype(np.float64)
    assert np.abs(scores).max() > logit / 4
    want_max = scores.max(-1)
    want_sum = np.exp(scores - want_max[..., None]).sum(-1)
    with jr.backend(backend):
        _, smax, ssum = jax.jit(jr.flash_attention_score)(q, k, k)
    np.testing.assert_array_equal(np.asarray(smax, np.float64), want_max)
    np.testing.assert_allclose(np.asarray(ssum, np.float64), want_sum, rtol=4 * s * 6e-8)


@pytest.mark.parametrize("backend", ["ffi", "fallback"])
@pytest.mark.parametrize("mode", oracle.MODES)
def test_float32_rope_within_the_stated_bound_of_the_golden(backend, mode):
    """float32: the kernel is bit-identical to the spec's golden (float32 NumPy, each product
    rounded, then the sum); the fallback may differ where XLA fuses one product into a
    multiply-add: by at most 1 ulp of the result plus half an ulp of the larger product (the
    bound the README states; more than 1 ulp of the result only under cancellation). 16-bit
    dtypes are bitwise on both (test_rope_forward.py)."""
    require_backend(backend)
    inp = helpers.make_inputs(np.random.default_rng(11), "BSND", "float32", B=2, S=64, Nq=4,
                              Nk=2, D=64, r=64, cos_batch_one=True)
    with jr.backend(backend):
        out = jax.jit(jr.apply_rotary_pos_emb, static_argnames=("layout", "rotary_mode"))(
            *helpers.args_of(inp), rotary_mode=mode)
    args = helpers.args_of(inp)
    golden = oracle.apply_rotary_pos_emb(*args, layout="BSND", rotary_mode=mode,
                                         dtype=np.float32)
    cos, sin = (np.asarray(t, np.float32) for t in args[2:])
    for got, g, x in zip(out, golden, args[:2]):
        got, g = np.asarray(got), np.asarray(g, np.float32)
        if backend == "ffi":
            np.testing.assert_array_equal(got, g)
            continue
        x = np.asarray(x, np.float32)
        rotated = np.asarray(oracle.rotate(x.astype(np.float64), mode), np.float32)
        larger = np.maximum(np.abs(x * cos), np.abs(rotated * sin))
        bound = np.spacing(np.abs(g)) + 0.5 * np.spacing(larger)
        assert np.all(np.abs(got.astype(np.float64) - g) <= bound)
        assert np.mean(got != g) < 0.5
