"""Attention dropout (spec/attention_bias_dropout.md section 3): the keep mask
from a JAX key, the same bits on every platform.

Element (b, n, i, j) keeps its probability when
    Threefry-2x32-20(key=(k0, k1), counter=(r, j)).y0 < floor(keep_prob * 2**32)
with the position word r = (b*N1 + n)*Sq + i (TND: N1*Q_b + n*Sq_b + i, Q_b the
sequence's first query token). The kernels receive, per sequence-table row b and
query head n, the word of row 0 (`drop_rows`), so a sharded call (global b, n)
draws the mask of the unsharded one. A caller's packed `dropout_mask` (section
3.2 layout) is read through the same operand: there it holds the bit index of
element (b, n, 0, 0).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_rope.attention.masks import KV_LEN, KV_START, Q_LEN, Q_START

_ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
_PARITY = 0x1BD11BDA
UINT32_LIMIT = 2**32


def threefry_2x32(k0, k1, c0, c1):
    """y0 of Threefry-2x32-20 (Random123) elementwise over broadcast uint32 arrays."""
    k0, k1, c0, c1 = (jnp.asarray(x, jnp.uint32) for x in (k0, k1, c0, c1))
    ks = (k0, k1, k0 ^ k1 ^ jnp.uint32(_PARITY))
    x0, x1 = c0 + ks[0], c1 + ks[1]
    for group in range(5):
        for r in _ROTATIONS[4 * (group % 2):4 * (group % 2) + 4]:
            x0 = x0 + x1
            x1 = (x1 << jnp.uint32(r)) | (x1 >> jnp.uint32(32 - r))
            x1 = x1 ^ x0
        s = group + 1
        x0 = x0 + ks[s % 3]
        x1 = x1 + ks[(s + 1) % 3] + jnp.uint32(s)
    return x0


def keep_threshold(keep_prob: float) -> int:
    """floor(keep_prob * 2**32): y0 below it keeps (keep_prob < 1)."""
    return int(math.floor(keep_prob * UINT32_LIMIT))


def keep_scale(keep_prob: float) -> np.float32:
    """What kept probabilities are multiplied by: float32(1 / keep_prob)."""
    return np.float32(1.0 / keep_prob)


# --- validation ---------------------------------------------------------------

def check_keep_prob(keep_prob) -> float:
    if isinstance(keep_prob, jax.core.Tracer):
        raise TypeError("keep_prob must be a static Python number in (0, 1], got a traced value")
    if isinstance(keep_prob, bool) or not isinstance(keep_prob, (int, float, np.integer,
                                                                  np.floating)):
        raise TypeError(f"keep_prob must be a Python number in (0, 1], got {keep_prob!r}")
    value = float(keep_prob)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"keep_prob must be in (0, 1], got {keep_prob!r}")
    return value


def key_words(dropout_key):
    """uint32 (2,) words of a threefry2x32 key (typed key or legacy uint32[2])."""
    if not hasattr(dropout_key, "dtype") or not hasattr(dropout_key, "shape"):
        raise TypeError(f"dropout_key must be a JAX PRNG key, got {type(dropout_key).__name__}")
    if jax.dtypes.issubdtype(dropout_key.dtype, jax.dtypes.prng_key):
        impl = str(jax.random.key_impl(dropout_key))
        if "threefry2x32" not in impl:
            raise TypeError(f"dropout_key must use the threefry2x32 implementation, got {impl}")
        if dropout_key.shape != ():
            raise TypeError(f"dropout_key must be a single key (shape ()), got shape "
                            f"{dropout_key.shape}")
        return jax.random.key_data(dropout_key)
    if jnp.dtype(dropout_key.dtype) != jnp.uint32 or tuple(dropout_key.shape) != (2,):
        raise TypeError(f"dropout_key must be a typed threefry key or a legacy uint32[2] key, got "
                        f"{jnp.dtype(dropout_key.dtype).name}{list(dropout_key.shape)}")
    return dropout_key


def check_dropout(keep_prob, dropout_key, dropout_mask, *, positions, row_words, numel):
    """(mode, keep_prob, key words or None, mask or None); mode None, "key" or "mask".

    positions: B*N1*Sq (TND N1*Tq) rows of position words; row_words: Skv (the column
    word); numel: elements of the packed mask layout, None while TND lengths are traced.
    """
    keep_prob = check_keep_prob(keep_prob)
    if keep_prob == 1.0:
        return None, 1.0, None, None
    if (dropout_key is None) == (dropout_mask is None):
        raise ValueError("keep_prob < 1 needs exactly one of dropout_key and dropout_mask, got "
                         + ("neither" if dropout_key is None else "both"))
    for name, count in (("B*N1*Sq (TND: N1*Tq)", positions), ("Skv", row_words)):
        if count >= UINT32_LIMIT:
            raise ValueError(f"dropout position words must fit uint32: {name} = {count} "
                             f">= 2**32")
    if dropout_key is not None:
        return "key", keep_prob, key_words(dropout_key), None
    if not hasattr(dropout_mask, "dtype") or jnp.dtype(dropout_mask.dtype) != jnp.uint8 or \
            len(dropout_mask.shape) != 1:
        raise ValueError(f"dropout_mask must be a 1-D uint8 array (packed bits), got "
                         f"{getattr(dropout_mask, 'dtype', type(dropout_mask).__name__)}"
                         f"{list(getattr(dropout_mask, 'shape', ()))}")
    if numel is None:
        raise ValueError("dropout_mask with input_layout TND needs concrete actual_seq_qlen/"
                         "actual_seq_kvlen (the mask's layout depends on them)")
    if numel >= UINT32_LIMIT:
        raise ValueError(f"dropout_mask covers {numel} elements; at most 2**32 - 1 are "
                         f"supported (use dropout_key)")
    if dropout_mask.shape[0] < -(-numel // 8):
        raise ValueError(f"dropout_mask must have at least ceil({numel}/8) = {-(-numel // 8)} "
                         f"bytes, got {dropout_mask.shape[0]}")
    return "mask", keep_prob, None, dropout_mask


# --- kernel operands ----------------------------------------------------------

def row_words(mode, table, heads: int, varlen: bool, head_offset=0):
    """uint32 (B, N1) per table row and query head: the position word of row 0
    ("key"), or the packed-mask bit index of element (0, 0) ("mask")."""
    u = lambda x: jnp.asarray(x).astype(jnp.uint32)
    n = u(jnp.arange(heads) + head_offset)[None, :]
    q_len, kv_len = u(table[:, Q_LEN])[:, None], u(table[:, KV_LEN])[:, None]
    if varlen:
        if mode == "key":  # N1*Q_b + n*Sq_b
            return jnp.uint32(heads) * u(table[:, Q_START])[:, None] + n * q_len
        blocks = q_len * kv_len  # N1*C_b + n*Sq_b*Skv_b
        starts = jnp.cumsum(blocks, axis=0, dtype=jnp.uint32) - blocks
        return jnp.uint32(heads) * starts + n * blocks
    b = u(jnp.arange(table.shape[0]))[:, None]
    rows = (b * jnp.uint32(heads) + n) * q_len
    return rows if mode == "key" else rows * kv_len


def row_keys(words, rows: int):
    """The key words repeated per table row: uint32 (B, 2)."""
    return jnp.broadcast_to(jnp.asarray(words, jnp.uint32).reshape(1, 2), (rows, 2))


# --- the mask, densely (fallback, NPU glue, public function) ------------------

def _token_sequences(table, tokens):
    """Per packed query token in `tokens`: its sequence (clipped) and local row."""
    ends = table[:, Q_START] + table[:, Q_LEN]
    b = jnp.minimum(jnp.searchsorted(ends, tokens, side="right"), table.shape[0] - 1)
    return b, tokens - table[b, Q_START]


def local_grid(table, rows, cols, varlen: bool):
    """(b, i, j) int32 index grids broadcastable to (B, 1, R, C) at the int32 query rows
    `rows` (masks.query_rows) and key columns `cols` (masks.key_columns; TND: (1, 1, R, C)
    at query and key tokens, b the sequence of the query token, i/j sequence-local)."""
    if varlen:
        b, i = _token_sequences(table, rows)
        j = cols[None, :] - table[b, KV_START][:, None]
        return b[None, None, :, None], i[None, None, :, None], j[None, None]
    b = jnp.arange(table.shape[0], dtype=jnp.int32)[:, None, None, None]
    i = rows[None, None, :, None]
    j = cols[None, None, None, :]
    return b, i, j


def keep_bits(options, table, extras: dict, rows, cols):
    """bool keep mask (B, N1, R, C) at the query rows `rows` and key columns `cols`, or
    (1, N1, R, C) at query and key tokens for TND (positions outside a sequence are
    unspecified): the function every platform evaluates."""
    b, i, j = local_grid(table, rows, cols, options.varlen)
    words = extras["drop_rows"]  # (B, N1)
    if options.varlen:
        base = jnp.swapaxes(words[b[0, 0, :, 0]], 0, 1)[None, :, :, None]  # (1, N1, R, 1)
    else:
        base = words[:, :, None, None]
    u = lambda x: x.astype(jnp.uint32)
    if options.dropout == "key":
        keys = extras["drop_keys"]
        kb = keys[b]  # (.., 1, Sq|Tq, 1|Tkv... , 2) broadcast per row
        r = base + u(i)
        y0 = threefry_2x32(kb[..., 0], kb[..., 1], r, u(j))
        return y0 < jnp.uint32(keep_threshold(options.keep_prob))
    kv_lens = table[:, KV_LEN][b]
    e = base + u(i) * u(kv_lens) + u(j)
    mask = extras["drop_mask"]
    byte = mask[jnp.minimum(e >> jnp.uint32(3), jnp.uint32(mask.shape[0] - 1)).astype(jnp.int32)]
    return ((byte >> (e & jnp.uint32(7)).astype(jnp.uint8)) & jnp.uint8(1)) == 1


def pack_bits(keep):
    """Bits of a flat bool array packed LSB first, padded to ceil(numel/128)*16 bytes."""
    flat = jnp.asarray(keep, jnp.uint8).reshape(-1)
    size = -(-flat.shape[0] // 128) * 128
    flat = jnp.pad(flat, (0, size - flat.shape[0])).reshape(-1, 8)
    weights = jnp.asarray([1 << k for k in range(8)], jnp.uint8)
    return jnp.sum(flat * weights, axis=1, dtype=jnp.uint8)


def sequence_blocks(grid, lengths):
    """(N1, Tq, Tkv) -> the flat concatenation over sequences b of grid[:, Sq_b rows,
    Skv_b cols] blocks (the TND packed layout of spec section 3.2)."""
    q_lens, kv_lens = lengths
    q_starts, kv_starts = np.cumsum((0,) + q_lens[:-1]), np.cumsum((0,) + kv_lens[:-1])
    blocks = [grid[:, qs:qs + sq, ks:ks + skv].reshape(-1)
              for qs, ks, sq, skv in zip(q_starts, kv_starts, q_lens, kv_lens)]
    return jnp.concatenate(blocks) if blocks else jnp.zeros((0,), grid.dtype)
