"""Pure jax.numpy masked attention with the semantics of spec/attention.md.

Dense (it builds the Sq x Skv scores), used wherever no kernel covers a call.
Operands are in the kernels' canonical form: query/key/value with a head axis
in layout BSND, SBND, BNSD or TND, the int32 sequence table of masks.py and an
optional uint8 element mask (Bm, Nm, rows, cols).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_rope.attention import bias, dropout, masks
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


def _visibility(options, table, q_len, kv_len, mask):
    if options.varlen:
        return masks.packed_visibility(table, q_len, kv_len, mask)
    return masks.padded_visibility(table, q_len, kv_len, mask)


def score_grid(options, query, key):
    """(rows, cols) of the score grid: (Sq, Skv), or (Tq, Tkv) for TND."""
    seq = options.layout_info.roles.seq
    return query.shape[seq], key.shape[seq]


def _extras(options, extras, names=None):
    return dict(zip(options.extra_names if names is None else names, extras))


def _dot_products(options, query, key, table, extras):
    """Unscaled float32 q.k (B, N1, Sq, Skv) and visibility broadcastable to them."""
    q = _to_bnsd(query, options).astype(jnp.float32)
    k = _to_bnsd(key, options).astype(jnp.float32)
    k = jnp.repeat(k, q.shape[1] // k.shape[1], axis=1)
    dots = jnp.einsum("bnqd,bnkd->bnqk", q, k)
    return dots, _visibility(options, table, q.shape[2], k.shape[2], extras.get("mask"))


def _dense_scores(options, query, key, table, extras):
    """float32 scores with the bias (B, N1, Sq, Skv) and visibility broadcastable to them."""
    dots, visible = _dot_products(options, query, key, table, extras)
    values = None
    if options.bias is not None:
        values = bias.values(options, extras["bias"], extras.get("offsets"), table,
                             dots.shape[2], dots.shape[3])
    return bias.biased_scores(options, dots, values), visible


def _keep_scale(options, table, extras, shape):
    """R = keep / keep_prob over the score grid, or None without dropout."""
    if options.dropout is None:
        return None
    keep = dropout.keep_bits(options, table, extras, shape[2], shape[3])
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
    scores, visible = _dense_scores(options, query, key, table, extras)
    scores = jnp.where(visible, scores, MASK_VALUE)
    return scores[0] if options.varlen else scores


def _probabilities(scores, visible, softmax_max, softmax_sum):
    # Rows with a NaN sum (a NaN or Inf reached their scores) get NaN at every visible
    # position, so that their gradient reaches every key they see.
    live = (softmax_max > MASK_VALUE) | jnp.isnan(softmax_sum)
    safe_max = jnp.where(live, softmax_max, 0.0)[..., None]
    p = jnp.exp(scores - safe_max) / softmax_sum[..., None]
    return jnp.where(visible & live[..., None], p, 0.0)  # masked: exactly 0, even if sum is NaN


def _exponentials(options, query, key, table, extras):
    """(unnormalized exp of the visible scores, visibility, live rows, row max)."""
    dots, visible = _dot_products(options, query, key, table, extras)
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
    values = bias.values(options, extras["bias"], extras.get("offsets"), table,
                         dots.shape[2], dots.shape[3])
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
    p, visible, live, top = _exponentials(options, query, key, table, extras)
    row_sum = jnp.where(live, p.sum(axis=-1), DEAD_ROW_SUM)
    # NaN where the sum is NaN: XLA's max may or may not skip a NaN score, by shape.
    row_max = jnp.where(jnp.isnan(row_sum), jnp.nan, jnp.where(live, top, MASK_VALUE))
    kept = _keep_scale(options, table, extras, p.shape)
    v = _to_bnsd(value, options).astype(jnp.float32)
    v = jnp.repeat(v, p.shape[1] // v.shape[1], axis=1)
    weights = _product_operand(p if kept is None else p * kept, query.dtype)
    out = _masked_product("bnqk,bnkd->bnqd", weights, v, visible) / row_sum[..., None]
    out = jnp.where(live[..., None], out, 0.0).astype(query.dtype)
    return (_from_bnsd(out, options), _stats_layout(row_max, options),
            _stats_layout(row_sum, options))


def _score_gradient(options, query, key, value, out, dout, softmax_max, softmax_sum, table,
                    extras):
    """(P, dS, R or None, visibility) over the dense score grid (spec section 4)."""
    scores, visible = _dense_scores(options, query, key, table, extras)
    p = _probabilities(scores, visible, _stats_from_layout(softmax_max, options),
                       _stats_from_layout(softmax_sum, options))
    v = _to_bnsd(value, options).astype(jnp.float32)
    o = _to_bnsd(out, options).astype(jnp.float32)
    do = _to_bnsd(dout, options).astype(jnp.float32)
    row_delta = jnp.sum(do * o, axis=-1, keepdims=True)
    dp = jnp.einsum("bnqd,bnkd->bnqk", do, jnp.repeat(v, p.shape[1] // v.shape[1], axis=1))
    kept = _keep_scale(options, table, extras, p.shape)
    if kept is not None:
        dp = dp * kept
    ds = jnp.where(visible, p * (dp - row_delta), 0.0)  # exactly 0 where masked, even if dp isn't
    return p, ds, kept, visible


def attention_backward(query, key, value, out, dout, softmax_max, softmax_sum, table, *extras,
                       options: AttentionOptions):
    """(dquery, dkey, dvalue) from the saved statistics (P and the keep mask recomputed)."""
    extras = _extras(options, extras)
    p, ds, kept, visible = _score_gradient(options, query, key, value, out, dout, softmax_max,
                                           softmax_sum, table, extras)
    q = _to_bnsd(query, options).astype(jnp.float32)
    k = _to_bnsd(key, options).astype(jnp.float32)
    do = _to_bnsd(dout, options).astype(jnp.float32)
    group = q.shape[1] // k.shape[1]
    ds = _product_operand(ds, query.dtype)
    dq = options.scale * _masked_product("bnqk,bnkd->bnqd", ds, jnp.repeat(k, group, axis=1),
                                         visible)

    def per_kv_head(x):  # (B, N1, ...) -> (B, N2, ...): sum over each group
        return x.reshape((x.shape[0], k.shape[1], group) + x.shape[2:]).sum(axis=2)

    dk = options.scale * per_kv_head(_masked_product("bnqk,bnqd->bnkd", ds, q, visible))
    weights = _product_operand(p if kept is None else p * kept, query.dtype)
    dv = per_kv_head(_masked_product("bnqk,bnqd->bnkd", weights, do, visible))
    return tuple(_from_bnsd(g.astype(x.dtype), options)
                 for g, x in ((dq, query), (dk, key), (dv, value)))


def bias_value_gradient(query, key, value, out, dout, softmax_max, softmax_sum, table, *extras,
                        options: AttentionOptions):
    """d(bias values) over the dense score grid (B, N1, Sq, Skv), TND (1, N1, Tq, Tkv):
    scale * dS for pse_type 1, dS otherwise (spec section 4)."""
    _, ds, _, _ = _score_gradient(options, query, key, value, out, dout, softmax_max,
                                  softmax_sum, table, _extras(options, extras))
    return ds * np.float32(options.scale) if options.pse_type == 1 else ds
