"""Positional score bias (spec/attention_bias_dropout.md section 2): `pse` of
every accepted shape and `pse_type` 0-3 with the start offsets.

`check_pse` validates a call's bias at trace time and names its form; `canonical`
turns the caller's `pse` into the operand the kernels index (jnp ops, so
`jax.grad` through it gives dpse in the caller's shape):
  "tensor"      (Bp, N1, R, Skv), R in {1, Sq}; TND row-broadcast: (N1, Tkv)
  "compressed"  (Bp, N1, 1024, W): the last 1024 rows of a bias of i - j
  "packed"      TND full form head-major: (N1, sum_b Sq_b * Skv_b)
  "alibi"/"alibi_sqrt"  float32 slopes (Bs, N1), with int32 offsets (B, 2)
`values` expands any of them to float32 bias values over the score grid; it is
the fallback's bias and, through its VJP, every platform's dpse.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_rope.attention.dropout import local_grid
from jax_rope.attention.masks import KV_LEN, Q_LEN
from jax_rope.attention.value_checks import INT32_MAX, INT32_MIN

COMPRESSED_ROWS = 1024
ALIBI_TYPES = (2, 3)
#: pse_type -> kernel kind for slopes; tensors keep the kind of their form.
_FORM_KIND = {"full": "tensor", "row": "tensor", "packed_row": "tensor",
              "compressed": "compressed", "packed_full": "packed"}


@dataclasses.dataclass(frozen=True)
class BiasInfo:
    """The static part of a call's bias."""

    pse_type: int
    kind: str | None  # None, tensor, compressed, packed, alibi, alibi_sqrt
    form: str | None  # full, row, compressed, packed_full, packed_row, slopes
    static_offsets: tuple | None  # (q_start_idx, kv_start_idx) when concrete


NO_BIAS = BiasInfo(1, None, None, (0, 0))


def check_offset(name, x):
    """(int32 value, concrete int or None): an int, a length-1 int sequence or an int32
    scalar array (may be traced)."""
    if isinstance(x, (list, tuple)):
        if len(x) != 1:
            raise TypeError(f"{name} must be an int, a length-1 int sequence or an int32 scalar "
                            f"array, got a sequence of length {len(x)}")
        x = x[0]
    if isinstance(x, bool):
        raise TypeError(f"{name} must be an int, got {x!r}")
    if isinstance(x, (int, np.integer)):
        value = int(x)
    elif hasattr(x, "dtype") and hasattr(x, "shape"):
        if jnp.dtype(x.dtype) != jnp.int32 or tuple(x.shape) != ():
            raise TypeError(f"{name} must be an int32 scalar array, got "
                            f"{jnp.dtype(x.dtype).name}{list(x.shape)}")
        if isinstance(x, jax.core.Tracer):
            return jnp.reshape(x, ()), None
        value = int(np.asarray(x).reshape(()))
    else:
        raise TypeError(f"{name} must be an int, a length-1 int sequence or an int32 scalar "
                        f"array, got {type(x).__name__}")
    if not INT32_MIN <= value <= INT32_MAX:
        raise ValueError(f"{name} must fit in int32, got {value}")
    return value, value


def _accepted(varlen, alibi, b, n1, sq, skv, pairs):
    """{shape: form} of the accepted pse shapes (TND 1-D forms need pairs)."""
    if alibi:
        return {(n1,): "slopes", (b, n1): "slopes"}
    shapes = {}
    if varlen:
        if pairs is not None:
            shapes[(n1 * sum(p[1] for p in pairs),)] = "packed_row"
            shapes[(n1 * sum(p[0] * p[1] for p in pairs),)] = "packed_full"  # wins at Sq_b = 1
            width = max((p[1] for p in pairs), default=0)
            for bb in (1, b):
                shapes[(bb, n1, COMPRESSED_ROWS, width)] = "compressed"
        return shapes
    for bb in (1, b):
        if sq > COMPRESSED_ROWS:
            shapes[(bb, n1, COMPRESSED_ROWS, skv)] = "compressed"
        shapes[(bb, n1, 1, skv)] = "row"
        shapes[(bb, n1, sq, skv)] = "full"
    return shapes


def check_pse(pse, pse_type, q_start_idx, kv_start_idx, *, query_dtype, batch, heads, q_len,
              kv_len, varlen, mode, pairs):
    """Validates the bias arguments (spec section 5): (BiasInfo, pse, (q_off, kv_off)).
    pairs: TND (Sq_b, Skv_b) per sequence when the lengths are concrete, else None."""
    if isinstance(pse_type, bool) or not isinstance(pse_type, (int, np.integer)) or \
            int(pse_type) not in (0, 1, 2, 3):
        raise ValueError(f"pse_type must be an int in 0..3, got {pse_type!r}")
    pse_type = int(pse_type)
    q_off, q_static = check_offset("q_start_idx", q_start_idx)
    kv_off, kv_static = check_offset("kv_start_idx", kv_start_idx)
    alibi = pse_type in ALIBI_TYPES
    for name, static in (("q_start_idx", q_static), ("kv_start_idx", kv_static)):
        if not alibi and static != 0:
            raise ValueError(f"{name} applies to pse_type 2/3 only, got "
                             f"{'a traced value' if static is None else static} with pse_type "
                             f"{pse_type}")
    if pse is None:
        if pse_type != 1:
            raise ValueError(f"pse_type {pse_type} needs pse, got None")
        return NO_BIAS, None, (0, 0)
    if not hasattr(pse, "shape") or not hasattr(pse, "dtype"):
        raise TypeError(f"pse must be an array, got {type(pse).__name__}")
    want = jnp.dtype(jnp.float32) if alibi else jnp.dtype(query_dtype)
    if jnp.dtype(pse.dtype) != want:
        which = "float32 slopes for pse_type 2/3" if alibi else \
            f"query's dtype {want.name} for pse_type {pse_type}"
        raise TypeError(f"pse must have {which}, got {jnp.dtype(pse.dtype).name}")
    if mode == 7:
        raise ValueError("pse is not supported with sparse_mode 7")
    shape = tuple(pse.shape)
    accepted = _accepted(varlen, alibi, batch, heads, q_len, kv_len, pairs)
    if varlen and not alibi and len(shape) == 1 and pairs is None:
        raise ValueError("a packed TND pse needs concrete actual_seq_qlen/actual_seq_kvlen, "
                         "got traced lengths")
    form = accepted.get(shape)
    if form is None and varlen and not alibi and pairs is None and len(shape) == 4 and \
            shape[0] in (1, batch) and shape[1:3] == (heads, COMPRESSED_ROWS):
        form = "compressed"  # the width is checked with the lengths, when the call runs
    if form is None:
        listed = ", ".join(str(s) for s in accepted) or "none while the lengths are traced"
        raise ValueError(f"pse must have one of the shapes {listed} for input_layout "
                         f"{'TND' if varlen else 'BSND/BNSD/BSH/SBH'} and pse_type {pse_type}, "
                         f"got {shape}")
    if form == "compressed":
        if mode not in (0, 2, 3):
            raise ValueError(f"the compressed 1024-row pse needs sparse_mode 0, 2 or 3, "
                             f"got {mode}")
        if not varlen and q_len != kv_len:
            raise ValueError(f"the compressed 1024-row pse needs Sq == Skv, got {q_len} and "
                             f"{kv_len}")
        if varlen and pairs is not None and any(a != b for a, b in pairs):
            raise ValueError("the compressed 1024-row pse needs equal query and key lengths in "
                             f"every sequence, got {pairs}")
    if alibi:
        kind = "alibi" if pse_type == 2 else "alibi_sqrt"
    else:
        kind = _FORM_KIND[form]
    static = (q_static, kv_static) if q_static is not None and kv_static is not None else None
    return BiasInfo(pse_type, kind, form, static), pse, (q_off, kv_off)


def _packed_index(pairs, heads, full: bool):
    """Static gather index from the caller's packed TND layout to the head-major one."""
    blocks = [(p[0] * p[1] if full else p[1]) for p in pairs]
    index, start = [], 0
    for size in blocks:
        index.append(heads * start + np.arange(heads)[:, None] * size + np.arange(size)[None, :])
        start += size
    return np.concatenate(index, axis=1) if index else np.zeros((heads, 0), np.int64)


def canonical(info: BiasInfo, pse, *, heads, kv_tokens, pairs):
    """The kernels' bias operand (see the module docstring)."""
    if info.form == "slopes":
        return pse.reshape((-1, heads))
    if info.form in ("packed_full", "packed_row"):
        index = _packed_index(pairs, heads, info.form == "packed_full")
        out = jnp.take(pse, jnp.asarray(index, jnp.int32))
        if info.form == "packed_row":  # columns are key tokens: pad to Tkv
            out = jnp.pad(out, ((0, 0), (0, kv_tokens - out.shape[1])))
        return out
    return pse


def offset_rows(q_off, kv_off, rows: int, varlen_mode8: bool):
    """int32 (B, 2) offsets per sequence-table row (TND mode 8: sequence 0 only)."""
    offsets = jnp.stack([jnp.asarray(q_off, jnp.int32), jnp.asarray(kv_off, jnp.int32)])
    out = jnp.broadcast_to(offsets[None, :], (rows, 2))
    if varlen_mode8:
        out = out * (jnp.arange(rows) == 0)[:, None].astype(jnp.int32)
    return out


def _abs_float32(x, y, z):
    """float32(|x + y - z|) of int32 arrays, exact before the one rounding (no int64)."""
    parts = [(a >> 16, a & 0xFFFF) for a in (x, y, z)]
    high = parts[0][0] + parts[1][0] - parts[2][0]
    low = parts[0][1] + parts[1][1] - parts[2][1]
    high, low = high + (low >> 16), low & 0xFFFF  # value = high * 65536 + low, 0 <= low < 65536
    negative = high < 0
    mag_high = jnp.where(negative, jnp.where(low > 0, -high - 1, -high), high)
    mag_low = jnp.where(negative, jnp.where(low > 0, 65536 - low, 0), low)
    return mag_high.astype(jnp.float32) * np.float32(65536) + mag_low.astype(jnp.float32)


def values(options, bias, offsets, table, rows, cols):
    """float32 bias values broadcastable to the scores (B, N1, R, C) at the query rows `rows`
    (masks.query_rows) and key columns `cols` (masks.key_columns), TND (1, N1, R, C) at
    query and key tokens: the caller's P (types 0/1) or -slope * g(|dist|) (types 2/3). A
    "tensor" bias holds those rows (when it has Sq of them) and columns."""
    kind, varlen = options.bias, options.varlen
    b, i, j = local_grid(table, rows, cols, varlen)
    if kind == "tensor":
        bias = bias.astype(jnp.float32)
        return bias[None, :, None, :] if varlen else bias
    if kind in ("alibi", "alibi_sqrt"):
        off = offsets[b]  # (.., 2)
        a = _abs_float32(j, off[..., 1], i + off[..., 0])
        if kind == "alibi_sqrt":
            a = jnp.sqrt(a)
        slopes = -bias.astype(jnp.float32)
        if varlen:
            slope = slopes[0 if slopes.shape[0] == 1 else b[0, 0, :, 0]]  # (Tq, N1) or (N1,)
            slope = jnp.broadcast_to(slope, (rows.shape[0], slopes.shape[1]))
            return jnp.swapaxes(slope, 0, 1)[None, :, :, None] * a
        return slopes[:, :, None, None] * a
    if kind == "packed":
        blocks = table[:, Q_LEN] * table[:, KV_LEN]
        starts = jnp.cumsum(blocks) - blocks
        index = starts[b] + i * table[:, KV_LEN][b] + j  # (1, 1, Tq, Tkv)
        index = jnp.clip(index, 0, max(bias.shape[1] - 1, 0))[0, 0]
        return bias.astype(jnp.float32)[:, index][None]
    # compressed: P = pse[b', n, 1023, W-1-d] (d = i - j >= 0), pse[b', n, 1023+d, W-1]
    # (-1023 <= d < 0), 0 below.
    width = bias.shape[-1]
    d = (i - j)[:, 0]  # (B|1, Sq, Skv)
    row = jnp.clip(jnp.where(d >= 0, COMPRESSED_ROWS - 1, COMPRESSED_ROWS - 1 + d), 0,
                   COMPRESSED_ROWS - 1)
    col = jnp.clip(jnp.where(d >= 0, width - 1 - d, width - 1), 0, width - 1)
    valid = (d >= -(COMPRESSED_ROWS - 1)) & (width - 1 - d >= 0)
    source = bias.astype(jnp.float32)
    if varlen:
        batch = b[0, 0, :, 0] if bias.shape[0] > 1 else jnp.zeros_like(b[0, 0, :, 0])
        picked = source[batch[:, None], :, row[0], col[0]]  # (Tq, Tkv, N1)
        return jnp.where(valid[0][..., None], picked, 0.0).transpose(2, 0, 1)[None]
    picked = source[:, :, row[0], col[0]]  # (Bp, N1, Sq, Skv)
    return jnp.where(valid[:, None], picked, 0.0)


def biased_scores(options, dots, bias_values):
    """float32 scores of q.k with the bias: type 1 scale*(x + P), others scale*x + P."""
    if options.bias is None:
        return options.scale * dots
    if options.pse_type == 1:
        return (dots + bias_values) * np.float32(options.scale)
    return np.float32(options.scale) * dots + bias_values
