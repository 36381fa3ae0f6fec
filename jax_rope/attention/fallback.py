"""Pure jax.numpy masked attention with the semantics of spec/attention.md.

Dense in windows, used wherever no kernel covers a call: the forward and
backward go through the query rows in chunks, each against a window of key
columns that holds every key its rows can see (row_chunks.py: a bounded score
grid at a time, and where the band is known when tracing, a causal call computes
5/8 of it). Grouped query heads (GQA) read their key/value head's rows, never a
copy per query head. Operands are in the kernels' canonical form:
query/key/value with a head axis in layout BSND, SBND, BNSD or TND, the int32
sequence table of masks.py and an optional uint8 element mask (Bm, Nm, rows,
cols).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_rope.attention import bias, dropout, masks, row_chunks
from jax_rope.attention.options import DEAD_ROW_SUM, MASK_VALUE, AttentionOptions


def _to_bnsd(x, options):
    """(B, N, S, D); packed TND becomes one batch of all tokens."""
    roles = options.layout_info.roles
    if roles.batch is None:
        return jnp.swapaxes(x, 0, 1)[None]
    return jnp.moveaxis(x, (roles.batch, roles.head, roles.seq), (0, 1, 2))


def _from_bnsd(x, options):
    roles = options.layout_info.roles
    if roles.batch is None:
        return jnp.swapaxes(x[0], 0, 1)
    return jnp.moveaxis(x, (0, 1, 2), (roles.batch, roles.head, roles.seq))


def _stats_layout(x, options):
    """(B, N1, Sq) statistics; (Tq, N1) for TND."""
    return jnp.swapaxes(x[0], 0, 1) if options.varlen else x


def _stats_from_layout(x, options):
    return jnp.swapaxes(x, 0, 1)[None] if options.varlen else x


def _visibility(options, table, rows, mask):
    """Visibility at the query rows and key window of `rows` (row_chunks.Rows); rows that
    pad a last chunk see none."""
    if options.varlen:
        visible = masks.packed_visibility(table, rows.at, rows.keys, mask)
    else:
        visible = masks.padded_visibility(table, rows.at, rows.cols, mask)
    if rows.padded_past is None:
        return visible
    return visible & (rows.at < rows.padded_past)[:, None]


def score_grid(options, query, key):
    """(rows, cols) of the score grid: (Sq, Skv), or (Tq, Tkv) for TND."""
    seq = options.layout_info.roles.seq
    return query.shape[seq], key.shape[seq]


def _extras(options, extras, names=None):
    return dict(zip(options.extra_names if names is None else names, extras))


def _bnsd_float32(x, options):
    """(B, N, S, D) float32."""
    return _to_bnsd(x, options).astype(jnp.float32)


def _groups(x, kv_heads):
    """(B, N1, ...) -> (B, N2, G, ...): the query heads of each key/value head (GQA), so
    that key and value are read per group instead of repeated for every query head. A head
    axis of 1 (broadcast over the heads) stays broadcast: (B, 1, 1, ...)."""
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape((x.shape[0], kv_heads, x.shape[1] // kv_heads) + x.shape[2:])


def _heads(x):
    """(B, N2, G, ...) -> (B, N1, ...)."""
    return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])


def _dot_products(options, q, k, table, rows):
    """Unscaled q.k (B, N1, R, Skv) of bnsd float32 q (the rows) and k, and visibility
    broadcastable to them."""
    dots = _heads(jnp.einsum("bhgqd,bhkd->bhgqk", _groups(q, k.shape[1]), k))
    return dots, _visibility(options, table, rows, rows.extras.get("mask"))


def _dense_scores(options, q, k, table, rows):
    """float32 scores with the bias (B, N1, R, Skv) and visibility broadcastable to them."""
    dots, visible = _dot_products(options, q, k, table, rows)
    values = None
    if options.bias is not None:
        values = bias.values(options, rows.extras["bias"], rows.extras.get("offsets"), table,
                             rows.at, rows.cols)
    return bias.biased_scores(options, dots, values), visible


def _keep_scale(options, table, rows):
    """R = keep / keep_prob over the rows' score grid, or None without dropout."""
    if options.dropout is None:
        return None
    keep = dropout.keep_bits(options, table, rows.extras, rows.at, rows.cols)
    return jnp.where(keep, dropout.keep_scale(options.keep_prob), np.float32(0))


def _finite_and_cleaned(x):
    """(finite mask, x with non-finite entries 0), from the bit pattern: an exponent of all
    ones is Inf or NaN. (Integer ops: with `isfinite`/select feeding the product, XLA's CPU
    backend was seen to miscompile gradient programs.)"""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    finite = (bits & jnp.uint32(0x7F800000)) != jnp.uint32(0x7F800000)
    keep = jnp.where(finite, jnp.uint32(0xFFFFFFFF), jnp.uint32(0))
    return finite, jax.lax.bitcast_convert_type(bits & keep, jnp.float32)


def _masked_product(equation, a, x, visible):
    """einsum(equation, a, x) where a is 0 at masked positions and they contribute nothing,
    exactly, even where x is NaN or Inf there (0 * NaN is NaN). An output element that a
    non-finite x reaches through a visible position is NaN (the data propagates)."""
    finite, cleaned = _finite_and_cleaned(x)
    clean = jnp.einsum(equation, a, cleaned)
    mask = jnp.broadcast_to(visible, a.shape).astype(jnp.float32)
    # No control flow here: XLA's CPU backend was seen to miscompile products inside a
    # conditional in gradient programs; one more product counts the non-finite entries seen.
    seen = jnp.einsum(equation, mask, (~finite).astype(jnp.float32))
    return jnp.where(seen > 0, jnp.nan, clean)


def attention_scores(query, key, table, *extras, options: AttentionOptions):
    extras = _extras(options, extras, options.score_extra_names)
    q, k = _bnsd_float32(query, options), _bnsd_float32(key, options)
    scores, visible = _dense_scores(options, q, k, table,
                                    row_chunks.all_rows(q.shape[2], k.shape[2], extras))
    scores = jnp.where(visible, scores, MASK_VALUE)
    return scores[0] if options.varlen else scores


def _probabilities(scores, visible, softmax_max, softmax_sum):
    # Rows with a NaN sum (a NaN or Inf reached their scores) get NaN at every visible
    # position, so that their gradient reaches every key they see.
    live = (softmax_max > MASK_VALUE) | jnp.isnan(softmax_sum)
    safe_max = jnp.where(live, softmax_max, 0.0)[..., None]
    p = jnp.exp(scores - safe_max) / softmax_sum[..., None]
    return jnp.where(visible & live[..., None], p, 0.0)  # masked: exactly 0, even if sum is NaN


def _exponentials(options, q, k, table, rows):
    """(unnormalized exp of the visible scores, visibility, live rows, row max) of the rows."""
    dots, visible = _dot_products(options, q, k, table, rows)
    visible = jnp.broadcast_to(visible, dots.shape)
    live = visible.any(axis=-1)
    if options.bias is None:
        # exp(scale * s - max) as exp(|scale| * (t - max t)), t = sign(scale) * s: the
        # difference is taken before scaling, so large logits keep the statistics' precision
        # (XLA would contract `scale * s - max` into a fused multiply-add). max(scale * s) is
        # |scale| * max t, rounded once, as the rounded scores' max.
        t = dots if options.scale >= 0 else -dots
        t_max = jnp.max(jnp.where(visible, t, -jnp.inf), axis=-1, initial=-jnp.inf)
        safe_max = jnp.where(live, t_max, 0.0)[..., None]
        p = jnp.where(visible, jnp.exp(abs(options.scale) * (t - safe_max)), 0.0)
        return p, visible, live, abs(options.scale) * t_max
    values = bias.values(options, rows.extras["bias"], rows.extras.get("offsets"), table,
                         rows.at, rows.cols)
    s = bias.biased_scores(options, dots, values)
    s_max = jnp.max(jnp.where(visible, s, -jnp.inf), axis=-1, initial=-jnp.inf)
    safe_max = jnp.where(live, s_max, 0.0)[..., None]
    p = jnp.where(visible, jnp.exp(jnp.where(visible, s, 0.0) - safe_max), 0.0)
    return p, visible, live, s_max


def _product_operand(x, dtype):
    """Probabilities (and, in the backward, dS) as their products take them: rounded to
    bfloat16 for bfloat16 inputs (the NPU's kernel rounds them so for its matrix unit, the
    CPU kernel for its bf16 dot products), float32 otherwise."""
    if jnp.dtype(dtype) != jnp.bfloat16:
        return x
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def attention_forward(query, key, value, table, *extras, options: AttentionOptions):
    """(out, softmax_max, softmax_sum) with the spec's dead-row convention; dropout scales
    the kept probabilities after normalization (statistics undropped)."""
    extras = _extras(options, extras)
    q, k, v = (_bnsd_float32(x, options) for x in (query, key, value))

    def rows_forward(rows, operands):
        k_rows, v_rows = row_chunks.window(k, rows, 2), row_chunks.window(v, rows, 2)
        p, visible, live, top = _exponentials(options, operands[0], k_rows, table, rows)
        row_sum = jnp.where(live, p.sum(axis=-1), DEAD_ROW_SUM)
        # NaN where the sum is NaN: XLA's max may or may not skip a NaN score, by shape.
        row_max = jnp.where(jnp.isnan(row_sum), jnp.nan, jnp.where(live, top, MASK_VALUE))
        kept = _keep_scale(options, table, rows)
        weights = _product_operand(p if kept is None else p * kept, query.dtype)
        out = _heads(_masked_product("bhgqk,bhkd->bhgqd", _groups(weights, v.shape[1]), v_rows,
                                     _groups(visible, v.shape[1]))) / row_sum[..., None]
        out = jnp.where(live[..., None], out, 0.0).astype(query.dtype)
        return (out, row_max, row_sum), ()

    (out, row_max, row_sum), _ = row_chunks.in_row_chunks(rows_forward, options, q.shape[2],
                                                           k.shape[2], (q,), extras)
    return (_from_bnsd(out, options), _stats_layout(row_max, options),
            _stats_layout(row_sum, options))


def _score_gradient(options, q, k, v, o, do, softmax_max, softmax_sum, table, rows):
    """(P, dS, R or None, visibility) over the rows' score grid (spec section 4), from bnsd
    float32 operands and (B, N1, R) statistics."""
    scores, visible = _dense_scores(options, q, k, table, rows)
    p = _probabilities(scores, visible, softmax_max, softmax_sum)
    row_delta = jnp.sum(do * o, axis=-1, keepdims=True)
    dp = _heads(jnp.einsum("bhgqd,bhkd->bhgqk", _groups(do, v.shape[1]), v))
    kept = _keep_scale(options, table, rows)
    if kept is not None:
        dp = dp * kept
    ds = jnp.where(visible, p * (dp - row_delta), 0.0)  # exactly 0 where masked, even if dp isn't
    return p, ds, kept, visible


def _row_operands(options, query, out, dout, softmax_max, softmax_sum):
    """The backward's operands with a row per query row, bnsd float32 and (B, N1, Sq)."""
    return (tuple(_bnsd_float32(x, options) for x in (query, out, dout))
            + (_stats_from_layout(softmax_max, options), _stats_from_layout(softmax_sum, options)))


def attention_backward(query, key, value, out, dout, softmax_max, softmax_sum, table, *extras,
                       options: AttentionOptions):
    """(dquery, dkey, dvalue) from the saved statistics (P and the keep mask recomputed)."""
    extras = _extras(options, extras)
    operands = _row_operands(options, query, out, dout, softmax_max, softmax_sum)
    k, v = _bnsd_float32(key, options), _bnsd_float32(value, options)
    groups = functools.partial(_groups, kv_heads=k.shape[1])

    def rows_backward(rows, operands):
        q, o, do = operands[:3]
        k_rows, v_rows = row_chunks.window(k, rows, 2), row_chunks.window(v, rows, 2)
        p, ds, kept, visible = _score_gradient(options, q, k_rows, v_rows, o, do, *operands[3:],
                                               table, rows)
        ds, visible = groups(_product_operand(ds, query.dtype)), groups(visible)
        dq = options.scale * _heads(_masked_product("bhgqk,bhkd->bhgqd", ds, k_rows, visible))
        # Summed over the group's rows and heads in one product: per head, then over the
        # group, would hold a key-sized result per query head.
        dk = options.scale * _masked_product("bhgqk,bhgqd->bhkd", ds, groups(q), visible)
        weights = _product_operand(p if kept is None else p * kept, query.dtype)
        dv = _masked_product("bhgqk,bhgqd->bhkd", groups(weights), groups(do), visible)
        return dq, (dk, dv)

    dq, (dk, dv) = row_chunks.in_row_chunks(rows_backward, options, operands[0].shape[2],
                                            k.shape[2], operands, extras, summed_axes=(2, 2))
    return tuple(_from_bnsd(g.astype(x.dtype), options)
                 for g, x in ((dq, query), (dk, key), (dv, value)))


def bias_gradient(query, key, value, out, dout, softmax_max, softmax_sum, table, *extras,
                  options: AttentionOptions):
    """The gradient of the bias operand (its shape and dtype): the adjoint of bias.values at
    d(bias values) = scale * dS for pse_type 1, dS otherwise (spec section 4), from the saved
    statistics, a chunk of query rows at a time like the backward."""
    extras = _extras(options, extras)
    operands = _row_operands(options, query, out, dout, softmax_max, softmax_sum)
    q_len = operands[0].shape[2]
    k, v = _bnsd_float32(key, options), _bnsd_float32(value, options)
    by_rows = row_chunks.row_indexed(options, "bias", extras["bias"], q_len)

    def rows_gradient(rows, operands):
        k_rows, v_rows = row_chunks.window(k, rows, 2), row_chunks.window(v, rows, 2)
        _, ds, _, _ = _score_gradient(options, operands[0], k_rows, v_rows, *operands[1:], table,
                                      rows)
        d_values = ds * np.float32(options.scale) if options.pse_type == 1 else ds

        def paired(b):  # <bias values, d_values>: its gradient is the expansion's adjoint
            values = bias.values(options, b, rows.extras.get("offsets"), table, rows.at,
                                 rows.cols)
            return jnp.sum(jnp.broadcast_to(values, ds.shape) * d_values)

        d_bias = jax.grad(paired)(rows.extras["bias"].astype(jnp.float32))
        if by_rows:  # a tensor of Sq rows (and a window of its columns)
            return (row_chunks.placed(d_bias, rows, k.shape[2], d_bias.ndim - 1),), ()
        return (), (d_bias,)

    # Summed: a tensor's window of columns, the other forms' whole gradient.
    axis = extras["bias"].ndim - 1 if row_chunks.column_indexed(options, "bias") else None
    per_row, summed = row_chunks.in_row_chunks(rows_gradient, options, q_len, k.shape[2],
                                               operands, extras,
                                               summed_axes=() if by_rows else (axis,))
    return (per_row + summed)[0].astype(extras["bias"].dtype)
