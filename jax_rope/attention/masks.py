"""Mask geometry: every sparse_mode as a per-sequence band.

Each sequence b gets one row of an int32 table (the kernels' `SequenceBand`):
    q_start, q_len, kv_start, kv_len, lo_off, hi_off, hi_floor
and query row i (0-based in its sequence) sees key column j when
    max(0, i + lo_off) <= j <= min(kv_len - 1, max(i + hi_off, hi_floor))
and the element mask, where one is given, is 0 at (i, j). Both limits never
decrease with i, so a kernel classifies a (query block, key block) tile as
empty, partial or full in O(1) and never touches an empty one; the S x S mask
never exists. The table is computed with jax.numpy, so varlen lengths may be
traced: new lengths mean a new table, not a new compilation.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_rope.attention import options as attention_options
from jax_rope.attention import sparse_modes
from jax_rope.attention.options import MAX_TOKENS, AttentionOptions
from jax_rope.attention.sparse_modes import UNLIMITED
from jax_rope.attention.value_checks import concrete
from jax_rope.core.validation import check_int

#: The table's columns, in order.
Q_START, Q_LEN, KV_START, KV_LEN, LO, HI, FLOOR = range(7)


def _clip(x):
    return jnp.clip(x, -UNLIMITED, UNLIMITED)


def _starts_and_lengths(cumulative):
    ends = jnp.asarray(cumulative, jnp.int32).reshape(-1)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends - starts


def sequence_table(options: AttentionOptions, batch: int, q_len: int, kv_len: int, *,
                   prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None):
    """The (batch, 7) int32 band table of spec/attention.md's sparse modes."""
    if options.varlen:
        q_start, q_lens = _starts_and_lengths(actual_seq_qlen)
        kv_start, kv_lens = _starts_and_lengths(actual_seq_kvlen)
    else:
        q_start = kv_start = jnp.zeros((batch,), jnp.int32)
        q_lens = jnp.full((batch,), q_len, jnp.int32)
        kv_lens = jnp.full((batch,), kv_len, jnp.int32)
    inputs = sparse_modes.BandInputs(
        q_lens, kv_lens, min(options.pre_tokens, UNLIMITED),
        max(min(options.next_tokens, UNLIMITED), -UNLIMITED),
        prefix, options.has_mask)
    lo, hi, floor = sparse_modes.rule(options.sparse_mode).band(inputs)
    columns = [q_start, q_lens, kv_start, kv_lens, _clip(lo), _clip(hi), _clip(floor)]
    return jnp.stack([jnp.broadcast_to(c, (batch,)).astype(jnp.int32) for c in columns], axis=1)


def visible_columns(table, rows):
    """Per sequence and local row: the inclusive visible column interval (lo, hi)."""
    i = rows[None, :]
    lo = jnp.maximum(0, i + table[:, LO:LO + 1])
    hi = jnp.minimum(table[:, KV_LEN:KV_LEN + 1] - 1,
                     jnp.maximum(i + table[:, HI:HI + 1], table[:, FLOOR:FLOOR + 1]))
    return lo, hi


def query_rows(q_len: int):
    """The indices of every query row (TND: token) of a score grid, as the grid functions
    take them (the fallback passes a chunk's rows instead)."""
    return jnp.arange(q_len, dtype=jnp.int32)


def key_columns(kv_len: int, first=0):
    """The int32 indices of `kv_len` key columns (TND: tokens) from `first` (0: every column
    of a score grid; the fallback passes a window of them)."""
    return first + jnp.arange(kv_len, dtype=jnp.int32)


def padded_visibility(table, rows, cols, mask=None):
    """Visible positions (True = visible) of the padded layouts at the query rows `rows` and
    key columns `cols` (key_columns): (B, Nm, R, C); `mask` holds those rows and columns."""
    lo, hi = visible_columns(table, rows)
    visible = (cols >= lo[..., None]) & (cols <= hi[..., None])
    visible = visible[:, None]
    if mask is not None:
        visible = visible & (mask == 0)
    return visible


def packed_visibility(table, rows, kv_tokens: int, mask=None):
    """Visible positions over packed TND tokens at the query tokens `rows`: (1, Nm, R, Tkv);
    different sequences (and tokens beyond the last length) never see each other."""
    q_seq, q_row = _token_owner(table[:, Q_START], table[:, Q_LEN], rows)
    kv_seq, kv_col = _token_owner(table[:, KV_START], table[:, KV_LEN], query_rows(kv_tokens))
    row_table = table[jnp.clip(q_seq, 0, table.shape[0] - 1)]
    lo = jnp.maximum(0, q_row + row_table[:, LO])
    hi = jnp.minimum(row_table[:, KV_LEN] - 1,
                     jnp.maximum(q_row + row_table[:, HI], row_table[:, FLOOR]))
    visible = ((q_seq[:, None] == kv_seq[None, :]) & (q_seq[:, None] >= 0)
               & (kv_col[None, :] >= lo[:, None]) & (kv_col[None, :] <= hi[:, None]))
    visible = visible[None, None]
    if mask is not None:
        rows = jnp.clip(q_row, 0, mask.shape[2] - 1)
        cols = jnp.clip(kv_col, 0, mask.shape[3] - 1)
        visible = visible & (jnp.asarray(mask)[:, :, rows[:, None], cols[None, :]] == 0)
    return visible


def _token_owner(starts, lengths, tokens):
    """Sequence index (-1: none) and position within it of each packed token in `tokens`."""
    t = tokens[:, None]
    inside = (t >= starts[None, :]) & (t < (starts + lengths)[None, :])
    owner = jnp.where(inside.any(axis=1), jnp.argmax(inside, axis=1), -1)
    position = t[:, 0] - starts[jnp.clip(owner, 0, starts.shape[0] - 1)]
    return owner, position


def _packed_total(name, given, lengths_name, lengths):
    """The packed token count: `given`, or the last cumulative length."""
    if lengths is None:
        raise ValueError(f"{lengths_name} is required for a packed (TND) mask when the other "
                         f"cumulative lengths are given, got None")
    if np.ndim(lengths) != 1 or np.shape(lengths)[0] == 0:
        raise ValueError(f"{lengths_name} must be a non-empty 1-D sequence of cumulative "
                         f"lengths, got shape {np.shape(lengths)}")
    if given is not None:
        return given
    values = concrete(lengths)
    if values is None:
        raise ValueError(f"{name} is required when {lengths_name} is traced, got None")
    return int(values[-1])


def sparse_mask(sparse_mode, q_len, kv_len, *, pre_tokens=MAX_TOKENS, next_tokens=MAX_TOKENS,
                prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, atten_mask=None):
    """The dense boolean mask of a sparse_mode (True = masked out), for inspection.

    Returns (B or 1, Sq, Skv) for the padded layouts (B from prefix or atten_mask;
    (B, N1, Sq, Skv) when atten_mask has a head axis) and (Tq, Tkv) over the packed
    tokens when actual_seq_qlen/actual_seq_kvlen are given (q_len/kv_len may then
    be None: the last cumulative lengths). Validation as in flash_attention_score.
    """
    varlen = actual_seq_qlen is not None or actual_seq_kvlen is not None
    if varlen:
        q_len = _packed_total("q_len", q_len, "actual_seq_qlen", actual_seq_qlen)
        kv_len = _packed_total("kv_len", kv_len, "actual_seq_kvlen", actual_seq_kvlen)
    for name, n in (("q_len", q_len), ("kv_len", kv_len)):
        if check_int(name, n) < (0 if varlen else 1):
            raise ValueError(f"{name} must be a {'non-negative' if varlen else 'positive'} int, "
                             f"got {n}")
    batch = 1
    for x in (prefix, atten_mask):
        if not varlen and x is not None and np.ndim(x) in (1, 4):
            batch = max(batch, np.shape(x)[0])
    shape_q = (q_len, 1, 1) if varlen else (batch, q_len, 1, 1)
    shape_kv = (kv_len, 1, 1) if varlen else (batch, kv_len, 1, 1)
    heads = np.shape(atten_mask)[1] if atten_mask is not None and np.ndim(atten_mask) == 4 else 1
    query = jnp.zeros(shape_q[:-2] + (heads, 1), jnp.float32)
    key = jnp.zeros(shape_kv, jnp.float32)
    options, sizes, _, mask, prefix, _, _ = attention_options.attention_call(
        query, key, key, input_layout="TND" if varlen else "BSND", head_num=None, scale=None,
        sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens,
        atten_mask=atten_mask, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, backend="fallback")
    table = sequence_table(options, sizes.batch, q_len, kv_len, prefix=prefix,
                           actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen)
    if varlen:
        return ~packed_visibility(table, query_rows(q_len), kv_len, mask)[0, 0]
    visible = padded_visibility(table, query_rows(q_len), key_columns(kv_len), mask)
    return ~(visible[:, 0] if visible.shape[1] == 1 else visible)
