"""GroupedQueryAttention: projections, fused RoPE and masked flash attention as a Flax NNX layer.

The key/value cache is attended as packed (TND) sequences so that its valid length can be
traced: batch row b becomes two sequences, (S new queries, the L valid cache slots) and
(no queries, the Smax - L unused slots). Rotary- and sparse-mode semantics are then exactly
those of `flash_attention_score` (bottom-right causal = sparse_mode 3, per sequence), the
kernel skips the unused slots' tiles, and jit compiles one program for every cache length.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from flax import nnx

from jax_rope.attention.api import flash_attention_score
from jax_rope.nn.rotary import RotaryEmbedding
from jax_rope.rope.api import apply_rotary_pos_emb
from jax_rope.rope.tables import positions_from_seq_lens

INT_MAX = 2147483647
# Over a cache (Sq new rows against Skv >= Sq keys) a mode keeps its meaning only when it
# counts from the bottom-right corner; leftUpCausal (2) of self-attention becomes mode 3.
_DECODE_MODES = {2: 3, 3: 3, 4: 4}


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"GroupedQueryAttention: {name} must be a positive int, got {value!r}")
    return int(value)


class GroupedQueryAttention(nnx.Module):
    """Multi-head attention with grouped key/value heads, fused RoPE and any sparse mode.

    Args:
      hidden_size: H, the model width (input and output features).
      num_heads: N1, query heads. num_kv_heads: N2 (default N1), dividing N1.
      head_dim: D (default H // N1).
      rotary: a `RotaryEmbedding` (its rotary_dim <= D; partial rotary passes the rest
        through), or None for no position encoding.
      sparse_mode, pre_tokens, next_tokens, scale: as in `flash_attention_score`
        (default 2: causal self-attention); per-call data (atten_mask, prefix, lengths) goes
        to `__call__`.
      qkv_bias / out_bias: biases of the q/k/v (Qwen2) and output projections.
      dtype / param_dtype: computation and parameter dtypes of the projections.
    Parameters: `q_proj`, `k_proj`, `v_proj`, `o_proj` (nnx.Linear, kernels (in, out)).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, *, rotary: RotaryEmbedding | None = None,
                 sparse_mode: int = 2, pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX,
                 scale: float | None = None, qkv_bias: bool = False, out_bias: bool = False,
                 dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        hidden_size = _positive_int("hidden_size", hidden_size)
        num_heads = _positive_int("num_heads", num_heads)
        num_kv_heads = _positive_int("num_kv_heads",
                                     num_heads if num_kv_heads is None else num_kv_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"GroupedQueryAttention: num_heads must be a multiple of "
                             f"num_kv_heads, got {num_heads} and {num_kv_heads}")
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"GroupedQueryAttention: hidden_size must be divisible by "
                                 f"num_heads when head_dim is not given, got {hidden_size} "
                                 f"and {num_heads}")
            head_dim = hidden_size // num_heads
        head_dim = _positive_int("head_dim", head_dim)
        if rotary is not None:
            if not isinstance(rotary, RotaryEmbedding):
                raise TypeError(f"GroupedQueryAttention: rotary must be a RotaryEmbedding or "
                                f"None, got {type(rotary).__name__}")
            if rotary.rotary_dim > head_dim:
                raise ValueError(f"GroupedQueryAttention: rotary.rotary_dim must be <= "
                                 f"head_dim {head_dim}, got {rotary.rotary_dim}")
        if (isinstance(sparse_mode, bool) or not isinstance(sparse_mode, numbers.Integral)
                or not 0 <= sparse_mode <= 8):
            raise ValueError(f"GroupedQueryAttention: sparse_mode must be an int in 0..8, "
                             f"got {sparse_mode!r}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rotary = rotary
        self.sparse_mode = int(sparse_mode)
        self.pre_tokens, self.next_tokens = pre_tokens, next_tokens
        self.scale = scale
        self.dtype = dtype if dtype is None else jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)

        def linear(n_in, n_out, bias):
            return nnx.Linear(n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=param_dtype,
                              rngs=rngs)
        self.q_proj = linear(hidden_size, num_heads * head_dim, qkv_bias)
        self.k_proj = linear(hidden_size, num_kv_heads * head_dim, qkv_bias)
        self.v_proj = linear(hidden_size, num_kv_heads * head_dim, qkv_bias)
        self.o_proj = linear(num_heads * head_dim, hidden_size, out_bias)
        # Declared as data (state) now, so init_cache may later put nnx.Cache variables here.
        self.cache_key = nnx.data(None)
        self.cache_value = nnx.data(None)
        self.cache_index = nnx.data(None)

    # -- cache ---------------------------------------------------------------------------------

    def init_cache(self, batch: int, max_length: int, dtype=None) -> None:
        """Allocates (or resets) an empty key/value cache for `batch` rows of up to `max_length`
        tokens (nnx.Cache state: it is carried through nnx.jit and updated in place)."""
        batch, max_length = _positive_int("batch", batch), _positive_int("max_length", max_length)
        dtype = jnp.dtype(dtype or self.dtype or self.param_dtype)
        shape = (batch, max_length, self.num_kv_heads, self.head_dim)
        self.cache_key = nnx.Cache(jnp.zeros(shape, dtype))
        self.cache_value = nnx.Cache(jnp.zeros(shape, dtype))
        self.cache_index = nnx.Cache(jnp.zeros((), jnp.int32))

    @property
    def cache_length(self):
        """Tokens held by the cache (an int32 array), or None without a cache."""
        return None if self.cache_index is None else self.cache_index[...]

    # -- forward -------------------------------------------------------------------------------

    def __call__(self, x, *, positions=None, decode: bool = False, atten_mask=None, prefix=None,
                 actual_seq_qlen=None, actual_seq_kvlen=None):
        """Self-attention of `x`: (B, S, H) -> (B, S, H), or packed (T, H) -> (T, H) when
        `actual_seq_qlen` is given (TND; cumulative ends, traced or not; `actual_seq_kvlen`
        defaults to it).

        positions: integer (S,) or (B, S) ((T,) packed) for RoPE; default 0..S-1 (packed: each
          sequence from 0; decoding: after the cached tokens).
        decode: append this step's keys/values to the cache (`init_cache` first) and attend to
          every valid cached token, bottom-right causal (the layer's mode 2 or 3 -> 3; mode 4
          keeps its band from the bottom-right corner, e.g. a sliding window; other modes are
          a ValueError). If the cache would overflow, the output is NaN (a traced length
          cannot raise).
        atten_mask, prefix: as in `flash_attention_score`, for the layer's sparse_mode.
        """
        x = jnp.asarray(x)
        packed = actual_seq_qlen is not None
        if x.ndim != (2 if packed else 3):
            expected = "(T, H) with actual_seq_qlen" if packed else "(B, S, H)"
            raise ValueError(f"GroupedQueryAttention: x must be {expected}, got shape "
                             f"{x.shape}")
        if decode and packed:
            raise ValueError("GroupedQueryAttention: decode=True takes (B, S, H) input, not "
                             "packed input with actual_seq_qlen")
        if decode and self.cache_index is None:
            raise ValueError("GroupedQueryAttention: decode=True needs a cache: call "
                             "init_cache(batch, max_length) first")
        lead = x.shape[:-1]
        q = self.q_proj(x).reshape(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        start = self.cache_index[...] if decode else 0
        if self.rotary is not None:
            q, k = self._rotate(q, k, positions, start, packed, actual_seq_qlen)
        if decode:
            out = self._attend_cache(q, k, v, atten_mask, prefix)
        else:
            out, _, _ = flash_attention_score(
                q, k, v, input_layout="TND" if packed else "BSND", scale=self.scale,
                sparse_mode=self.sparse_mode, pre_tokens=self.pre_tokens,
                next_tokens=self.next_tokens, atten_mask=atten_mask, prefix=prefix,
                actual_seq_qlen=actual_seq_qlen,
                actual_seq_kvlen=actual_seq_qlen if packed and actual_seq_kvlen is None
                else actual_seq_kvlen)
        return self.o_proj(out.reshape(*lead, self.num_heads * self.head_dim))

    def _rotate(self, q, k, positions, start, packed, actual_seq_qlen):
        seq = q.shape[0] if packed else q.shape[1]
        if positions is None:
            positions = (positions_from_seq_lens(actual_seq_qlen, seq) if packed
                         else start + jnp.arange(seq, dtype=jnp.int32))
        positions = jnp.asarray(positions)
        expected = ((seq,),) if packed else ((seq,), (q.shape[0], seq))
        if positions.shape not in expected:
            raise ValueError(f"GroupedQueryAttention: positions must have shape "
                             f"{' or '.join(map(str, expected))}, got {positions.shape}")
        cos, sin = self.rotary(positions)
        if packed:
            cos, sin = cos[:, None, :], sin[:, None, :]                # (T, 1, r)
        elif positions.ndim == 1:
            cos, sin = cos[None, :, None, :], sin[None, :, None, :]   # (1, S, 1, r)
        else:
            cos, sin = cos[:, :, None, :], sin[:, :, None, :]         # (B, S, 1, r)
        return apply_rotary_pos_emb(q, k, cos.astype(q.dtype), sin.astype(q.dtype),
                                    layout="TND" if packed else "BSND",
                                    rotary_mode=self.rotary.rotary_mode)

    def _attend_cache(self, q, k, v, atten_mask, prefix):
        mode = _DECODE_MODES.get(self.sparse_mode)
        if mode is None or atten_mask is not None or prefix is not None:
            raise ValueError(f"GroupedQueryAttention: decode=True supports sparse_mode 2, 3 "
                             f"and 4, without atten_mask or prefix; the layer has sparse_mode "
                             f"{self.sparse_mode}"
                             + (" and an atten_mask" if atten_mask is not None else "")
                             + (" and a prefix" if prefix is not None else ""))
        batch, seq = q.shape[:2]
        cache_batch, capacity = self.cache_key.shape[:2]
        if batch != cache_batch or seq > capacity:
            raise ValueError(f"GroupedQueryAttention: decode input (B, S) = {(batch, seq)} must "
                             f"have the cache's batch {cache_batch} and S <= its max_length "
                             f"{capacity}")
        index = self.cache_index[...]
        at = (0, index, 0, 0)
        self.cache_key[...] = jax.lax.dynamic_update_slice(
            self.cache_key[...], k.astype(self.cache_key.dtype), at)
        self.cache_value[...] = jax.lax.dynamic_update_slice(
            self.cache_value[...], v.astype(self.cache_value.dtype), at)
        length = index + seq
        self.cache_index[...] = length
        # Row b -> sequences (S queries, L keys) and (0 queries, Smax - L unused keys).
        rows = jnp.ones((batch,), jnp.int32)
        q_lens = jnp.stack([rows * seq, rows * 0], axis=1).reshape(-1)
        valid = jnp.minimum(length, capacity)  # keeps the lengths consistent on overflow
        kv_lens = jnp.stack([rows * valid, rows * (capacity - valid)], axis=1).reshape(-1)
        keys = self.cache_key[...].astype(q.dtype).reshape(batch * capacity, *k.shape[2:])
        values = self.cache_value[...].astype(q.dtype).reshape(batch * capacity, *v.shape[2:])
        out, _, _ = flash_attention_score(
            q.reshape(batch * seq, *q.shape[2:]), keys, values, input_layout="TND",
            scale=self.scale, sparse_mode=mode, pre_tokens=self.pre_tokens,
            next_tokens=self.next_tokens, actual_seq_qlen=jnp.cumsum(q_lens),
            actual_seq_kvlen=jnp.cumsum(kv_lens))
        out = jnp.where(length <= capacity, out, jnp.nan)  # overflow: visibly wrong, not silently
        return out.reshape(q.shape[:3] + v.shape[3:])
