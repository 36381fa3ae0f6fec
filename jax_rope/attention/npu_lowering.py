"""The attention primitives' lowering for the Ascend NPU: the operands and
attributes FlashAttentionScore(+Grad) need for the spec's result (mask
operand, statistics in the operator's layout), and the coverage check that
decides between the NPU kernel and the fallback (npu/coverage.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from jax_rope import npu
from jax_rope.attention.masks import Q_LEN, Q_START
from jax_rope.npu import cann, coverage


def _shape(aval, shape=None):
    return jax.ShapeDtypeStruct(aval.shape if shape is None else shape, aval.dtype)


def _npu_attributes(options):
    return {"layout": np.int32(options.layout_info.roles.code),
            "scale": np.float32(options.scale), "has_mask": np.int32(options.has_mask),
            "sparse_mode": np.int32(options.sparse_mode),
            "pre_tokens": np.int64(options.pre_tokens),
            "next_tokens": np.int64(options.next_tokens)}


def _mask_operand(options, mask, query_shape):
    """The mask the NPU operator needs for the spec's result (the mask is data,
    so this runs on the device inside the NPU lowering)."""
    if not options.has_mask:
        return jnp.zeros((1, 1, 1, 1), jnp.uint8)
    m = mask[0]
    q_len, kv_len = m.shape[-2:]
    if options.sparse_mode == 0 and (options.pre_tokens < q_len - 1
                                     or options.next_tokens < kv_len - 1):
        # Mode 0 applies only the mask element by element (pre/next just skip
        # whole blocks): the band goes into the mask.
        offset = (jnp.arange(kv_len, dtype=jnp.int32)[None, :]
                  - jnp.arange(q_len, dtype=jnp.int32)[:, None])
        outside = (offset < -options.pre_tokens) | (offset > options.next_tokens)
        m = jnp.logical_or(m != 0, outside).astype(m.dtype)
    roles = options.layout_info.roles
    if options.sparse_mode == 5 and not options.varlen and m.shape[0] != query_shape[roles.batch]:
        # Prefix mode with B > 1 takes only a [B,N,S,S] or [B,1,S,S] mask.
        m = jnp.broadcast_to(m, (query_shape[roles.batch],) + m.shape[1:])
    return m


def _ntd_rows(table, tokens, heads):
    """(Tq, N1) row of each statistic in the VarLen operator's NTD order (per
    sequence [N1, S_b] blocks, by the cumulative lengths it is given), and
    whether the token lies in a sequence."""
    ends = table[:, Q_START] + table[:, Q_LEN]
    starts = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])
    t = jnp.arange(tokens, dtype=ends.dtype)
    b = jnp.searchsorted(ends, t, side="right")
    inside = b < ends.shape[0]
    b = jnp.minimum(b, ends.shape[0] - 1)
    start, length = starts[b][:, None], (ends[b] - starts[b])[:, None]
    n = jnp.arange(heads, dtype=ends.dtype)[None, :]
    return start * heads + n * length + (t[:, None] - start), inside


def _npu_stats_width(options, stats_shape):
    # VarLen writes [N1, Tq, 8] (NTD); the others [B, N1, Sq, 8].
    if options.varlen:
        return (stats_shape[1], stats_shape[0], npu.STATS_WIDTH)
    return stats_shape + (npu.STATS_WIDTH,)


def npu_forward(ctx, *args, options):
    out_aval, stats_aval, _ = ctx.avals_out
    wide = _shape(stats_aval, _npu_stats_width(options, stats_aval.shape))

    def call(q, k, v, table, *mask):
        out, smax, ssum = jax.ffi.ffi_call(npu.ATTENTION_FWD, (_shape(out_aval), wide, wide))(
            q, k, v, table, _mask_operand(options, mask, q.shape), **_npu_attributes(options))
        if not options.varlen:
            return out, smax[..., 0], ssum[..., 0]  # the spec's statistics: one copy
        tokens, heads = stats_aval.shape
        rows, inside = _ntd_rows(table, tokens, heads)
        inside = inside[:, None]
        flat = lambda x: x[..., 0].reshape(-1)[rows]
        return (out, jnp.where(inside, flat(smax), -np.finfo(np.float32).max),
                jnp.where(inside, flat(ssum), np.finfo(np.float32).max))

    return mlir.lower_fun(call, multiple_results=True)(ctx, *args)


def npu_backward(ctx, *args, options):
    outs = tuple(_shape(a) for a in ctx.avals_out)

    def call(q, k, v, out, dout, smax, ssum, table, *mask):
        if options.varlen:
            tokens, heads = smax.shape
            rows, inside = _ntd_rows(table, tokens, heads)
            at = jnp.where(inside[:, None], rows, tokens * heads)
            ntd = lambda s: jnp.zeros((tokens * heads,), s.dtype).at[at].set(
                s, mode="drop").reshape(heads, tokens)
            smax, ssum = ntd(smax), ntd(ssum)
        wide = lambda s: jnp.broadcast_to(s[..., None], s.shape + (npu.STATS_WIDTH,))
        return jax.ffi.ffi_call(npu.ATTENTION_BWD, outs)(
            q, k, v, out, dout, wide(smax), wide(ssum), table,
            _mask_operand(options, mask, q.shape), **_npu_attributes(options))

    return mlir.lower_fun(call, multiple_results=True)(ctx, *args)


def npu_gap(mask_at, backward):
    def gap(options, avals_in):
        op = ((cann.FA_VARLEN_GRAD if options.varlen else cann.FA_GRAD) if backward
              else (cann.FA_VARLEN if options.varlen else cann.FA))
        missing = npu.missing_operator(op)
        if missing is not None:
            return missing
        query, key, value = avals_in[:3]
        return coverage.attention_gap(npu.current_profile()[0], options, query, key, value,
                                      avals_in[mask_at:])
    return gap
