"""Independent float64 NumPy oracle for rope_cos_sin, written from Hugging Face transformers'
modeling_rope_utils.py formulas (transformers 5.x: `_compute_default_rope_parameters`,
`_compute_linear_scaling_rope_parameters`, `_compute_dynamic_ntk_parameters`,
`_compute_yarn_parameters`, `_compute_longrope_parameters`, `_compute_llama3_parameters`) and
from spec/api.md for the table layout. No JAX, no jax_rope.

Each `*_params` function takes a config-like dict `cfg` (rope_theta, dim, max_position_embeddings,
rope_scaling) and an optional seq_len, and returns (inv_freq float64 (dim/2,), attention_factor),
mirroring HF's (config, device, seq_len) -> (inv_freq, attention_factor) signature.
"""

import math

import numpy as np


def default_params(cfg, seq_len=None):
    base, dim = cfg["rope_theta"], cfg["dim"]
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float64) / dim))
    return inv_freq, 1.0


def linear_params(cfg, seq_len=None):
    inv_freq, attention_factor = default_params(cfg)
    return inv_freq / cfg["rope_scaling"]["factor"], attention_factor


def dynamic_params(cfg, seq_len=None):
    base, dim = cfg["rope_theta"], cfg["dim"]
    max_pos = cfg["max_position_embeddings"]
    factor = cfg["rope_scaling"]["factor"]
    seq_len = max_pos if seq_len is None else max(seq_len, max_pos)
    base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    return inv_freq, 1.0


def yarn_params(cfg, seq_len=None):
    base, dim = cfg["rope_theta"], cfg["dim"]
    rs = cfg["rope_scaling"]
    factor = rs["factor"]
    attention_factor = rs.get("attention_factor")
    mscale = rs.get("mscale")
    mscale_all_dim = rs.get("mscale_all_dim")
    original_max = rs.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))

    def get_mscale(scale, mscale=1):
        if scale <= 1:
            return 1.0
        return 0.1 * mscale * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1

    def find_correction_dim(num_rotations, dim, base, max_position_embeddings):
        return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base))

    def find_correction_range(low_rot, high_rot, dim, base, max_position_embeddings, truncate):
        low = find_correction_dim(low_rot, dim, base, max_position_embeddings)
        high = find_correction_dim(high_rot, dim, base, max_position_embeddings)
        if truncate:
            low = math.floor(low)
            high = math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def linear_ramp_factor(lo, hi, n):
        if lo == hi:
            hi += 0.001
        linear_func = (np.arange(n, dtype=np.float64) - lo) / (hi - lo)
        return np.clip(linear_func, 0, 1)

    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    truncate = rs.get("truncate", True)
    low, high = find_correction_range(beta_fast, beta_slow, dim, base, original_max, truncate)
    inv_freq_extrapolation_factor = 1 - linear_ramp_factor(low, high, dim // 2)
    inv_freq = (inv_freq_interpolation * (1 - inv_freq_extrapolation_factor)
                + inv_freq_extrapolation * inv_freq_extrapolation_factor)
    return inv_freq, attention_factor


def longrope_params(cfg, seq_len=None):
    base, dim = cfg["rope_theta"], cfg["dim"]
    rs = cfg["rope_scaling"]
    long_factor, short_factor = rs["long_factor"], rs["short_factor"]
    factor = rs.get("factor")
    attention_factor = rs.get("attention_factor")
    original_max = rs.get("original_max_position_embeddings", cfg["max_position_embeddings"])
    if factor is None:
        factor = cfg["max_position_embeddings"] / original_max
    if attention_factor is None:
        if factor <= 1.0:
            attention_factor = 1.0
        else:
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(original_max))
    if seq_len and seq_len > original_max:
        ext_factors = np.array(long_factor, dtype=np.float64)
    else:
        ext_factors = np.array(short_factor, dtype=np.float64)
    inv_freq_shape = np.arange(0, dim, 2, dtype=np.float64) / dim
    return 1.0 / (ext_factors * base ** inv_freq_shape), attention_factor


def llama3_params(cfg, seq_len=None):
    inv_freq, attention_factor = default_params(cfg)
    rs = cfg["rope_scaling"]
    factor = rs["factor"]
    low_freq_factor = rs["low_freq_factor"]
    high_freq_factor = rs["high_freq_factor"]
    old_context_len = rs["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_llama), attention_factor


ROPE_INIT_FUNCTIONS = {
    "default": default_params,
    "linear": linear_params,
    "dynamic": dynamic_params,
    "yarn": yarn_params,
    "longrope": longrope_params,
    "llama3": llama3_params,
}


def inv_freq_and_attention(dim, base, rope_scaling, max_position_embeddings, seq_len):
    rope_type = "default"
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    cfg = {"rope_theta": base, "dim": dim, "max_position_embeddings": max_position_embeddings,
           "rope_scaling": rope_scaling}
    return ROPE_INIT_FUNCTIONS[rope_type](cfg, seq_len)


def cos_sin(positions, rotary_dim, base=10000.0, rotary_mode="half", rope_scaling=None,
            max_position_embeddings=None):
    """float64 (cos, sin) of shape positions.shape + (rotary_dim,) per spec/api.md."""
    positions = np.asarray(positions)
    dim = rotary_dim // 2 if rotary_mode == "quarter" else rotary_dim
    seq_len = int(positions.max()) + 1 if positions.size else 0
    inv_freq, attention = inv_freq_and_attention(dim, base, rope_scaling,
                                                 max_position_embeddings, seq_len)
    freqs = positions.astype(np.float64)[..., None] * inv_freq
    if rotary_mode == "half":
        emb = np.concatenate([freqs, freqs], axis=-1)
    elif rotary_mode == "quarter":
        emb = np.concatenate([freqs, freqs, freqs, freqs], axis=-1)
    else:
        emb = np.stack([freqs, freqs], axis=-1).reshape(freqs.shape[:-1] + (rotary_dim,))
    return np.cos(emb) * attention, np.sin(emb) * attention


# ---- independent RoPE forms for end-to-end checks (float64) ----------------------------------

def rope_rotate_half(x, positions, inv_freq):
    """HF/NeoX form: x * cos + rotate_half(x) * sin on x[..., :r], r = 2 * len(inv_freq).
    x: (..., S, D) with positions broadcastable to x.shape[:-1]."""
    r = 2 * len(inv_freq)
    ang = np.asarray(positions, np.float64)[..., None] * inv_freq
    cos = np.cos(np.concatenate([ang, ang], -1))
    sin = np.sin(np.concatenate([ang, ang], -1))
    xr = x[..., :r]
    x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
    rotated = np.concatenate([-x2, x1], -1)
    return np.concatenate([xr * cos + rotated * sin, x[..., r:]], -1)


def rope_complex(x, positions, inv_freq):
    """GPT-J / Meta LLaMA form: pairs (x[2m], x[2m+1]) as complex numbers times
    exp(i * pos * inv_freq[m]) on x[..., :r], r = 2 * len(inv_freq)."""
    r = 2 * len(inv_freq)
    xr = x[..., :r]
    z = xr[..., 0::2] + 1j * xr[..., 1::2]
    z = z * np.exp(1j * np.asarray(positions, np.float64)[..., None] * inv_freq)
    out = np.empty_like(xr)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return np.concatenate([out, x[..., r:]], -1)
