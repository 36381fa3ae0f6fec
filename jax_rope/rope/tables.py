"""cos/sin tables for real models: positions and a Hugging Face style `rope_scaling` config in,
tables laid out for `apply_rotary_pos_emb` out (spec/api.md, spec/rope.md).

The scaling formulas are those of Hugging Face transformers' `modeling_rope_utils.py`
(`_compute_{default,linear_scaling,dynamic_ntk,yarn,longrope,llama3}_rope_parameters`, as of
transformers 5.x). Everything that does not depend on the positions is computed once in
NumPy float64 and rounded once to float32; the parts that depend on the largest position
(dynamic NTK, longrope's short/long choice) are computed with jnp so they work on traced
positions. Angles are float32, with the phase of integer positions reduced exactly where the
frequencies are static (see `_angles`); cos and sin are float32, cast once to `dtype`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_rope.core import runtime_checks
from jax_rope.core.validation import FLOAT_DTYPES
from jax_rope.rope.options import ROTARY_MODES

_MODES = tuple(ROTARY_MODES)
_DTYPES = tuple(d.name for d in FLOAT_DTYPES)
_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

def _check_positions(positions):
    """Returns positions as an array (tracers kept as they are); TypeError if not integer."""
    if not isinstance(positions, jax.Array) and not hasattr(positions, "dtype"):
        positions = np.asarray(positions)
    dtype = positions.dtype
    if dtype == np.bool_ or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"rope_cos_sin: positions must be an integer array, got dtype {dtype}")
    return runtime_checks.fits_int32("rope_cos_sin: positions", positions)


def _check_rotary_dim(rotary_dim, rotary_mode):
    if rotary_mode not in _MODES:
        raise ValueError(
            f"rope_cos_sin: rotary_mode must be one of {_MODES}, got {rotary_mode!r}")
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, numbers.Integral):
        raise TypeError(
            f"rope_cos_sin: rotary_dim must be a positive int, got {rotary_dim!r}")
    rotary_dim = int(rotary_dim)
    multiple = 4 if rotary_mode == "quarter" else 2
    if rotary_dim <= 0 or rotary_dim % multiple:
        raise ValueError(
            f"rope_cos_sin: rotary_dim must be a positive multiple of {multiple} in "
            f"rotary_mode {rotary_mode!r}, got {rotary_dim}")
    return rotary_dim


def _check_dtype(dtype):
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in _DTYPES:
        raise ValueError(f"rope_cos_sin: dtype must be one of {_DTYPES}, got {dtype!r}")
    return jnp.dtype(name)


def _number(scaling, key, rope_type, *, default=None, positive=True):
    """scaling[key] as a float (or default when absent/None); ValueError naming the key."""
    value = scaling.get(key)
    if value is None:
        if default is None:
            raise ValueError(
                f"rope_cos_sin: scaling of rope_type {rope_type!r} needs the key {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(
            f"rope_cos_sin: scaling[{key!r}] must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"rope_cos_sin: scaling[{key!r}] must be > 0, got {value!r}")
    return float(value)


def _max_pos(max_position_embeddings, rope_type):
    if max_position_embeddings is None:
        raise ValueError(
            f"rope_cos_sin: scaling of rope_type {rope_type!r} needs max_position_embeddings")
    if (isinstance(max_position_embeddings, bool)
            or not isinstance(max_position_embeddings, numbers.Integral)
            or max_position_embeddings <= 0):
        raise ValueError(
            "rope_cos_sin: max_position_embeddings must be a positive int, got "
            f"{max_position_embeddings!r}")
    return int(max_position_embeddings)


def _original_max(scaling, rope_type, max_position_embeddings):
    """original_max_position_embeddings; as HF's standardize_rope_params, it defaults to
    max_position_embeddings when the config does not give it."""
    value = scaling.get("original_max_position_embeddings")
    if value is None:
        if max_position_embeddings is None:
            raise ValueError(
                f"rope_cos_sin: scaling of rope_type {rope_type!r} needs the key "
                "'original_max_position_embeddings' (or max_position_embeddings)")
        return _max_pos(max_position_embeddings, rope_type)
    value = _number(scaling, "original_max_position_embeddings", rope_type)
    return int(value) if value.is_integer() else value


def _rope_type(scaling, base):
    if scaling is None:
        return "default"
    if not isinstance(scaling, Mapping):
        raise TypeError(
            f"rope_cos_sin: scaling must be None or a dict, got {type(scaling).__name__}")
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type is None:
        raise ValueError("rope_cos_sin: scaling needs the key 'rope_type' (or its alias 'type')")
    if rope_type not in _TYPES:
        raise ValueError(
            f"rope_cos_sin: scaling['rope_type'] must be one of {_TYPES}, got {rope_type!r}")
    # transformers 5 puts rope_theta inside the dict; a second, different base is ambiguous.
    theta = scaling.get("rope_theta")
    if theta is not None and float(theta) != float(base):
        raise ValueError(
            f"rope_cos_sin: scaling['rope_theta'] = {theta!r} differs from base = {base!r}; "
            "pass the model's rope_theta as base")
    return rope_type


# ---------------------------------------------------------------------------------------------
# Inverse frequencies (float64 where static) and the attention factor
# ---------------------------------------------------------------------------------------------

def _exponents(d):
    """2i / d for i < d/2 (float64)."""
    return np.arange(0, d, 2, dtype=np.float64) / d


def _yarn(base, d, scaling, max_position_embeddings):
    factor = scaling.get("factor")
    original = _original_max(scaling, "yarn", max_position_embeddings)
    if factor is None and "factor" in scaling and max_position_embeddings is not None:
        # transformers 5: an explicit None factor means max / original.
        factor = _max_pos(max_position_embeddings, "yarn") / original
    else:
        factor = _number(scaling, "factor", "yarn")
    mscale = _number(scaling, "mscale", "yarn", default=0.0, positive=False)
    mscale_all_dim = _number(scaling, "mscale_all_dim", "yarn", default=0.0, positive=False)

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = _number(scaling, "attention_factor", "yarn", default=0.0) or None
    if attention is None:
        if mscale and mscale_all_dim:
            attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention = get_mscale(factor)
    beta_fast = _number(scaling, "beta_fast", "yarn", default=32.0)
    beta_slow = _number(scaling, "beta_slow", "yarn", default=1.0)
    truncate = scaling.get("truncate", True)
    if base == 1.0:
        raise ValueError("rope_cos_sin: base must not be 1 with rope_type 'yarn' (its correction "
                         "range divides by log(base))")

    def correction_dim(rotations):
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = base ** -_exponents(d)
    interpolation = extrapolation / factor
    # ramp 0 (high frequencies) keeps the original frequency, ramp 1 interpolates.
    return interpolation * ramp + extrapolation * (1.0 - ramp), float(attention)


def _llama3(base, d, scaling, max_position_embeddings):
    factor = _number(scaling, "factor", "llama3")
    low_ff = _number(scaling, "low_freq_factor", "llama3")
    high_ff = _number(scaling, "high_freq_factor", "llama3")
    if high_ff <= low_ff:
        raise ValueError(
            "rope_cos_sin: scaling['high_freq_factor'] must be > scaling['low_freq_factor'], "
            f"got {high_ff} and {low_ff}")
    original = _original_max(scaling, "llama3", max_position_embeddings)
    inv = base ** -_exponents(d)
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low_ff) / (high_ff - low_ff)
    medium = (1 - smooth) * inv / factor + smooth * inv
    out = np.where(wavelen > original / low_ff, inv / factor, inv)
    is_medium = (wavelen >= original / high_ff) & (wavelen <= original / low_ff)
    return np.where(is_medium, medium, out), 1.0


def _longrope_tables(base, d, scaling, max_position_embeddings):
    """(short inv_freq, long inv_freq, original max, attention factor), all static."""
    mpe = _max_pos(max_position_embeddings, "longrope")
    original = _original_max(scaling, "longrope", mpe)
    tables = []
    for key in ("short_factor", "long_factor"):
        if scaling.get(key) is None:
            raise ValueError(
                f"rope_cos_sin: scaling of rope_type 'longrope' needs the key {key!r}")
        ext = np.asarray(scaling[key], dtype=np.float64)
        if ext.shape != (d // 2,):
            raise ValueError(
                f"rope_cos_sin: scaling[{key!r}] must be a list of {d // 2} numbers "
                f"(rotary frequencies), got shape {ext.shape}")
        tables.append(1.0 / (ext * base ** _exponents(d)))
    factor = _number(scaling, "factor", "longrope", default=mpe / original)
    attention = _number(scaling, "attention_factor", "longrope", default=0.0) or None
    if attention is None and factor > 1 and original <= 1:
        raise ValueError("rope_cos_sin: scaling['original_max_position_embeddings'] must be > 1 "
                         f"for rope_type 'longrope' with factor > 1, got {original!r}")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return tables[0], tables[1], original, float(attention)


class FrequencyPlan(NamedTuple):
    """The inverse frequencies of one rope_cos_sin call and how to turn them into phases."""

    inv_freq: jax.Array      # float32 (d/2,), traced when it depends on traced positions
    pieces: jax.Array        # float32 (6, d/2): `_turn_pieces` of inv_freq (or of the default)
    exact: object            # True, or a traced bool: the pieces describe inv_freq
    attention: float


def _turn_pieces(inv64):
    """inv_freq / 2pi in turns, as float32 pieces that make integer positions' phases exact.

    For tau = inv/2pi and sigma = frac(4096 tau): [sigma1, sigma2, sigma3, tau1, tau2, tau3],
    where x1 and x2 carry 12 significant bits each (so a 12-bit integer times them is exact in
    float32) and x3 is the float32 rest.
    """
    tau = np.asarray(inv64, np.float64) / (2 * np.pi)
    out = []
    for rest in (np.mod(4096.0 * tau, 1.0), tau):
        for _ in range(2):
            mant, exp = np.frexp(rest)
            hi = np.ldexp(np.round(np.ldexp(mant, 12)), exp - 12)
            out.append(hi)
            rest = rest - hi
        out.append(rest)
    return np.stack(out).astype(np.float32)


def _static_plan(inv64, attention):
    return FrequencyPlan(jnp.asarray(inv64, jnp.float32), jnp.asarray(_turn_pieces(inv64)), True,
                 float(attention))


def frequency_plan(positions, d, base, scaling, max_position_embeddings) -> FrequencyPlan:
    """The plan of `rope_cos_sin` for width d (rotary_dim, or rotary_dim/2 in quarter mode):
    inverse frequencies (float32 (d/2,), traced when they depend on traced positions) and
    the attention factor."""
    if isinstance(base, bool) or not isinstance(base, numbers.Real):
        raise TypeError(f"rope_cos_sin: base must be a number, got {base!r}")
    base = float(base)
    if not (base > 0 and math.isfinite(base)):
        raise ValueError(f"rope_cos_sin: base must be finite and > 0, got {base!r}")
    rope_type = _rope_type(scaling, base)
    default = base ** -_exponents(d)
    if rope_type == "default":
        return _static_plan(default, 1.0)
    if rope_type == "linear":
        return _static_plan(default / _number(scaling, "factor", "linear"), 1.0)
    if rope_type == "yarn":
        return _static_plan(*_yarn(base, d, scaling, max_position_embeddings))
    if rope_type == "llama3":
        return _static_plan(*_llama3(base, d, scaling, max_position_embeddings))
    if rope_type == "dynamic":
        factor = _number(scaling, "factor", "dynamic")
        mpe = _max_pos(max_position_embeddings, "dynamic")
        largest = _largest_position(positions)
        seq_len = jnp.maximum(largest.astype(jnp.float32) + 1.0, float(mpe))
        # base' = base * m ** (d/(d-2)) with m = factor*seq/mpe - (factor-1), so
        # base' ** (-2i/d) = base ** (-2i/d) * m ** (-2i/(d-2)); m == 1 up to mpe.
        m = 1.0 + factor * (seq_len - mpe) / mpe
        exps = np.arange(d // 2, dtype=np.float64) * 2 / (d - 2) if d > 2 else np.zeros(1)
        inv = jnp.asarray(default, jnp.float32) * m ** jnp.asarray(-exps, jnp.float32)
        # Up to max_position_embeddings the default frequencies (and exact phases) apply.
        return FrequencyPlan(inv, jnp.asarray(_turn_pieces(default)), largest < mpe, 1.0)
    short, long, original, attention = _longrope_tables(base, d, scaling,
                                                        max_position_embeddings)
    # seq_len = largest + 1 > original  <=>  largest >= floor(original) (no overflow at int max)
    threshold = min(math.floor(original), np.iinfo(np.int32).max)
    use_long = _largest_position(positions) >= threshold
    inv = jnp.where(use_long, jnp.asarray(long, jnp.float32), jnp.asarray(short, jnp.float32))
    pieces = jnp.where(use_long, _turn_pieces(long), _turn_pieces(short))
    return FrequencyPlan(inv, pieces, True, attention)


def _angles(positions, plan):
    """positions[..., None] * inv_freq, float32, reduced to [-pi, pi].

    A float32 product pos * inv_freq would be off by up to eps32 * |angle| (2.4e-4 at 4096),
    so for |positions| < 2**24 the phase is built from exact float32 pieces (`_turn_pieces`):
    pos = hi * 4096 + lo with 12-bit hi, lo, and frac() of each exact product.
    """
    pos = jnp.asarray(positions).astype(jnp.int32)[..., None]
    hi = jnp.floor_divide(pos, 4096)
    lo = (pos - hi * 4096).astype(jnp.float32)
    hi = hi.astype(jnp.float32)

    def frac(x):
        return x - jnp.round(x)

    p = plan.pieces
    turns = (frac(hi * p[0]) + frac(hi * p[1]) + hi * p[2]
             + frac(lo * p[3]) + frac(lo * p[4]) + lo * p[5])
    exact = jnp.float32(2 * np.pi) * frac(turns)
    if plan.exact is True:
        return exact
    plain = jnp.asarray(positions).astype(jnp.float32)[..., None] * plan.inv_freq
    return jnp.where(plan.exact, exact, plain)


def _largest_position(positions):
    if np.size(positions) == 0:
        return jnp.asarray(-1, jnp.int32)
    return jnp.max(jnp.asarray(positions)).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------

def rope_cos_sin(positions, rotary_dim, *, base=10000.0, rotary_mode="half", scaling=None,
                 max_position_embeddings=None, dtype=jnp.float32):
    """cos and sin tables for `apply_rotary_pos_emb`, from integer positions.

    Args:
      positions: integer array of any shape P (traced or not), e.g. (S,), (B, S) or (T,).
      rotary_dim: r, the rotated width: a positive int, even (a multiple of 4 in quarter mode).
      base: rope_theta.
      rotary_mode: "half" -> cat(f, f); "quarter" -> cat(f, f, f, f) with d = r/2 (two
        independent rotaries, ChatGLM 2-D RoPE); "interleave" -> each frequency twice,
        adjacent. f = positions * inv_freq, inv_freq[i] = base ** (-2i/d), d = r (r/2 for
        quarter), before scaling.
      scaling: None or a Hugging Face `rope_scaling` dict: "rope_type" (alias "type") one of
        "default", "linear", "dynamic", "yarn", "longrope", "llama3" plus that type's keys.
        "dynamic" and "longrope" use seq_len = max(positions) + 1 (traced when positions are).
      max_position_embeddings: the model's max_position_embeddings; needed by "dynamic" and
        "longrope" (and by "yarn"/"llama3" without original_max_position_embeddings).
      dtype: float32, float16 or bfloat16; math is float32, rounded once at the end.

    Returns:
      (cos, sin), each of shape P + (rotary_dim,) and dtype `dtype`, multiplied by the scaling's
      attention factor. Insert head/batch axes to match the layout, e.g. cos[:, None, :] for
      TND or cos[None, :, None, :] for BSND.

    Raises:
      TypeError: positions not integer; rotary_dim not an int; scaling not a dict.
      ValueError: positions beyond int32 (traced 64-bit ones when the computation runs,
        unless `jax_rope.runtime_checks(False)`).
      ValueError: bad rotary_mode, rotary_dim, dtype or base; unknown rope_type; a missing or
        invalid scaling key (named); max_position_embeddings missing where needed.
    """
    positions = _check_positions(positions)
    rotary_dim = _check_rotary_dim(rotary_dim, rotary_mode)
    out_dtype = _check_dtype(dtype)
    d = rotary_dim // 2 if rotary_mode == "quarter" else rotary_dim
    plan = frequency_plan(positions, d, base, scaling, max_position_embeddings)
    angles = _angles(positions, plan)
    if rotary_mode == "half":
        angles = jnp.concatenate([angles, angles], axis=-1)
    elif rotary_mode == "quarter":
        angles = jnp.concatenate([angles] * 4, axis=-1)
    else:
        angles = jnp.repeat(angles, 2, axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if plan.attention != 1.0:
        cos, sin = cos * jnp.float32(plan.attention), sin * jnp.float32(plan.attention)
    return cos.astype(out_dtype), sin.astype(out_dtype)


def positions_from_seq_lens(actual_seq_len, total):
    """Per-token positions of packed sequences (TND), restarting at 0 for each sequence.

    Args:
      actual_seq_len: 1-D integer array (or list) of cumulative end offsets, non-decreasing,
        e.g. [3, 5, 9] for lengths 3, 2, 4; may be traced.
      total: T, the number of packed tokens (static int >= 0).

    Returns:
      int32 positions of shape (T,), e.g. [0, 1, 2, 0, 1, 0, 1, 2, 3] for the example above.
      Tokens at or beyond the last end offset (padding) belong to the last sequence: their
      positions continue counting from its start (T = 11 above ends in ..., 3, 4, 5).
      Sequences of length 0 are allowed.

    Raises:
      TypeError: actual_seq_len not integer, or total not an int.
      ValueError: actual_seq_len not 1-D or empty, total < 0, or (when not traced)
        actual_seq_len negative or decreasing.
    """
    if isinstance(total, bool) or not isinstance(total, numbers.Integral):
        raise TypeError(f"positions_from_seq_lens: total must be a static int, got {total!r}")
    if total < 0:
        raise ValueError(f"positions_from_seq_lens: total must be >= 0, got {total}")
    if not isinstance(actual_seq_len, jax.Array) and not hasattr(actual_seq_len, "dtype"):
        actual_seq_len = np.asarray(actual_seq_len)
    dtype = actual_seq_len.dtype
    if dtype == np.bool_ or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError("positions_from_seq_lens: actual_seq_len must be an integer array, "
                        f"got dtype {dtype}")
    if actual_seq_len.ndim != 1 or actual_seq_len.shape[0] == 0:
        raise ValueError("positions_from_seq_lens: actual_seq_len must be 1-D and non-empty, "
                         f"got shape {actual_seq_len.shape}")
    actual_seq_len = runtime_checks.fits_int32("positions_from_seq_lens: actual_seq_len",
                                               actual_seq_len)
    if not isinstance(actual_seq_len, jax.core.Tracer):
        ends = np.asarray(actual_seq_len)
        if ends[0] < 0 or np.any(np.diff(ends) < 0):
            raise ValueError("positions_from_seq_lens: actual_seq_len must be non-negative and "
                             f"non-decreasing cumulative lengths, got {ends.tolist()}")
    ends = jnp.asarray(actual_seq_len).astype(jnp.int32)
    tokens = jnp.arange(total, dtype=jnp.int32)
    # k = how many sequences end at or before each token; clipping to n - 1 keeps the tokens
    # past the last end in the last sequence.
    k = jnp.searchsorted(ends, tokens, side="right")
    k = jnp.minimum(k, ends.shape[0] - 1)
    starts = jnp.where(k > 0, ends[jnp.maximum(k - 1, 0)], 0)
    return tokens - starts
