"""`jax.nn.dot_product_attention`'s signature, computed by this package's fused attention
(spec/api.md "Where users already are").

The translation, decided once per call at trace time:
- layout: jax.nn's BTNH (or TNH) is our BSND (a batch axis of 1 is added for TNH);
- `mask` (True = attend, broadcastable to (B, N, T, S)) becomes `atten_mask` with the opposite
  polarity, in the smallest shape flash_attention_score accepts ((1|B, 1, T, S) or (B, N, T, S));
- `query_seq_lengths` / `key_value_seq_lengths` are folded into that element mask;
- `is_causal` (top-left: j <= i) and `local_window_size` (left, right: i - left <= j <= i + right)
  are top-left bands: without an element mask, causal alone is sparse_mode 2 and a window is
  the bottom-right band of mode 4 shifted by delta = S - T; with an element mask, mode 0's
  band (which counts from the top-left corner) carries them. Either way the kernels skip the
  tiles outside the band.
"""

from __future__ import annotations

import numbers

import jax.numpy as jnp
import numpy as np

from jax_rope.attention.api import flash_attention_score
from jax_rope.attention.options import MAX_TOKENS
from jax_rope.core.implementation import IMPLEMENTATIONS, backend

_NAME = "dot_product_attention"
# jax.nn's names for its implementations, and what each means here.
_XLA = {"xla": "fallback"}


def _implementation(implementation):
    """None (the current jax_rope backend) or the backend name to trace this call with."""
    if implementation is None:
        return None
    if implementation in _XLA:
        return _XLA[implementation]
    if implementation in IMPLEMENTATIONS:
        return implementation
    raise ValueError(f"{_NAME}: implementation must be None, 'xla' (= jax_rope's 'fallback': "
                     f"the jax.numpy implementation) or one of {tuple(IMPLEMENTATIONS)}, got "
                     f"{implementation!r} (there is no cuDNN path here)")


def _array(name, x):
    if x is None or isinstance(x, (str, bytes)):
        raise TypeError(f"{_NAME}: {name} must be an array, got {type(x).__name__}")
    return x if hasattr(x, "shape") and hasattr(x, "dtype") else jnp.asarray(x)


def _window(local_window_size):
    """(left, right) as non-negative ints, or None."""
    if local_window_size is None:
        return None
    pair = local_window_size
    if isinstance(pair, numbers.Integral) and not isinstance(pair, bool):
        pair = (pair, pair)
    ok = (isinstance(pair, (tuple, list)) and len(pair) == 2
          and all(isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= 0
                  for w in pair))
    if not ok:
        raise ValueError(f"{_NAME}: local_window_size must be None, a non-negative int or a "
                         f"pair (left, right) of non-negative ints, got {local_window_size!r}")
    return int(pair[0]), int(pair[1])


def _lengths(name, lengths, batch):
    """int32 (B,) lengths, or None."""
    if lengths is None:
        return None
    lengths = _array(name, lengths)
    if lengths.dtype == np.bool_ or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"{_NAME}: {name} must be an integer array, got dtype {lengths.dtype}")
    if tuple(lengths.shape) != (batch,):
        raise ValueError(f"{_NAME}: {name} must have shape (B,) = ({batch},), "
                         f"got {tuple(lengths.shape)}")
    return jnp.asarray(lengths).astype(jnp.int32)


def _visible(mask, q_lens, kv_lens, b, n, t, s):
    """The element mask, True = attend, shaped (1|B, 1, T, S) or (B, N, T, S); or None."""
    if mask is None and q_lens is None and kv_lens is None:
        return None
    target = (b, n, t, s)
    keep_b = keep_n = False
    visible = jnp.ones((1, 1, t, s), bool)
    if mask is not None:
        mask = _array("mask", mask)
        if mask.dtype != np.bool_:
            raise TypeError(f"{_NAME}: mask must be a bool array (True = attend), "
                            f"got dtype {mask.dtype}")
        shape = tuple(mask.shape)
        padded = (1,) * (4 - len(shape)) + shape
        if len(shape) > 4 or any(d not in (1, want) for d, want in zip(padded, target)):
            raise ValueError(f"{_NAME}: mask must be broadcastable to (B, N, T, S) = {target}, "
                             f"got shape {shape}")
        keep_b, keep_n = padded[0] == b, padded[1] == n
        visible = visible & jnp.reshape(mask, padded)
    if q_lens is not None:
        visible = visible & (jnp.arange(t)[None, None, :, None] < q_lens[:, None, None, None])
        keep_b = True
    if kv_lens is not None:
        visible = visible & (jnp.arange(s)[None, None, None, :] < kv_lens[:, None, None, None])
        keep_b = True
    # flash_attention_score has no (1, N, T, S) form: a per-head mask takes the batch axis too.
    shape = (b if keep_b or (keep_n and n > 1) else 1, n if keep_n and n > 1 else 1, t, s)
    return jnp.broadcast_to(visible, shape)


def _bias(bias, dtype, b, n, t, s):
    """jax.nn's bias as a (B|1, N, T|1, S) pse of query's dtype (added after scaling)."""
    bias = _array("bias", bias)
    full = (b, n, t, s)
    shape = (1,) * (4 - len(bias.shape)) + tuple(bias.shape)
    if len(bias.shape) > 4 or any(a not in (1, f) for a, f in zip(shape, full)):
        raise ValueError(f"{_NAME}: bias must be broadcastable to (B, N, T, S) = {full} with each "
                         f"axis 1 or full, got shape {tuple(bias.shape)}")
    target = (shape[0], n, shape[2], s)
    return jnp.broadcast_to(bias.reshape(shape), target).astype(dtype)


def _sparse_call(is_causal, window, t, s, has_mask):
    """(sparse_mode, pre_tokens, next_tokens) for the top-left causal/window band."""
    if window is None and not is_causal:
        return 0, MAX_TOKENS, MAX_TOKENS
    # Bands wider than the grid are the same as no limit (keeps the shifted values in int32).
    left, right = window if window is not None else (t + s, t + s)
    left, right = min(left, t + s), min(right, t + s)
    if is_causal:
        right = min(right, 0)
    if has_mask:
        return 0, left, right  # mode 0's band counts from the top-left corner
    if window is None:
        return 2, MAX_TOKENS, MAX_TOKENS  # leftUpCausal: j > i masked
    delta = s - t  # mode 4 counts from the bottom-right corner: shift back to the top-left
    return 4, left + delta, right - delta


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size=None, implementation=None):
    """`jax.nn.dot_product_attention`, computed by jax_rope's fused attention kernels.

    Same signature, defaults and meaning as jax.nn's (a one-line swap):
    softmax(scale * q k^T, masked) @ v per head, with grouped-query attention.

    Args:
      query: (B, T, N, H) or (T, N, H); key: (B, S, K, H) or (S, K, H), N % K == 0; value:
        key's shape (its head dim may also be smaller). float32, float16 or bfloat16, one dtype.
      bias: additive score bias after scaling, broadcastable to (B, N, T, S) (rank <= 4, each
        axis 1 or full); cast to query's dtype; passed as flash_attention_score's
        pse (pse_type 0), so the gradient w.r.t. bias is dpse.
      mask: bool, True = attend, broadcastable to (B, N, T, S) (rank <= 4, each axis 1 or full).
      scale: None means 1/sqrt(H).
      is_causal: top-left causal (query i sees keys j <= i), as jax.nn.
      query_seq_lengths, key_value_seq_lengths: int (B,) valid lengths of the padded batch.
      local_window_size: None, w (= (w, w)) or (left, right): query i sees i-left <= j <= i+right.
      implementation: None -> jax_rope's current backend (`jr.set_backend` / `jr.backend`,
        default "auto": the compiled kernels where they cover the call); "xla" -> "fallback"
        (the jax.numpy implementation, compiled by XLA, like jax.nn's "xla"); "auto", "ffi" or
        "fallback" name a jax_rope backend directly. "cudnn" is an error.

    Returns:
      query's shape and dtype with value's head dim. Differentiable w.r.t. query, key, value
      and bias.

    Differences from jax.nn: a query row that sees no key (fully masked by mask, window or
    key_value_seq_lengths) gives 0 and zero gradient, not the average of value; no
    `return_residual`; scale must be a static number; local_window_size must be non-negative;
    float64 is not supported.

    Raises:
      TypeError/ValueError at trace time naming the argument (mask, lengths, window,
      implementation, and flash_attention_score's rules for query/key/value/scale).
    """
    chosen = _implementation(implementation)
    query, key, value = (_array(n, x) for n, x in (("query", query), ("key", key),
                                                   ("value", value)))
    ranks = {len(query.shape), len(key.shape), len(value.shape)}
    if ranks not in ({3}, {4}):
        raise ValueError(f"{_NAME}: query, key and value must all be BTNH (rank 4) or all TNH "
                         f"(rank 3), got shapes {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)}")
    unbatched = ranks == {3}
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"{_NAME}: is_causal must be a bool, got {is_causal!r}")
    b, t, n = query.shape[:3]
    s = key.shape[1]
    window = _window(local_window_size)
    q_lens = _lengths("query_seq_lengths", query_seq_lengths, b)
    kv_lens = _lengths("key_value_seq_lengths", key_value_seq_lengths, b)
    visible = _visible(mask, q_lens, kv_lens, b, n, t, s)
    mode, pre, nxt = _sparse_call(bool(is_causal), window, t, s, visible is not None)
    pse = None if bias is None else _bias(bias, query.dtype, b, n, t, s)

    def call():
        out, _, _ = flash_attention_score(
            query, key, value, input_layout="BSND", scale=scale, sparse_mode=mode,
            pre_tokens=pre, next_tokens=nxt,
            atten_mask=None if visible is None else jnp.logical_not(visible),
            pse=pse, pse_type=1 if pse is None else 0)
        return out

    if chosen is None:
        out = call()
    else:
        with backend(chosen):
            out = call()
    return out[0] if unbatched else out
