"""The attention primitives' lowering for the Ascend NPU: the operands and
attributes FlashAttentionScore(+Grad) need for the spec's result (mask
operand, statistics in the operator's layout, pse in the shapes the tiling
reads, the packed dropMask), and the coverage check that decides between the
NPU kernel and the fallback (npu/coverage.py): when the call is traced, and
for traced TND lengths also when it runs.

Bias and dropout (spec/attention_bias_dropout.md): the primitives carry the
canonical operands (options.extra_names); the NPU reads
  pse     non-TND (1|B, N1, Sq|1|1024, Skv) as is; TND per-sequence blocks
          concatenated: [N1, Skv_b] (row form) or [N1, Sq_b, Skv_b] (full), the
          compressed (1|B, N1, 1024, W) as is; slopes (N1,) or (B, N1) float32;
  dropMask the keep bits of dropout.keep_bits (the function the fallback and
          the CPU kernel evaluate) packed LSB first in B, N1, Sq, Skv order (TND:
          per sequence [N1, Sq_b, Skv_b]), ceil(numel/128)*16 bytes, tail 0.
pseType 0/2/3 (and the start offsets) go to the V2 operators. dpse never
comes from the kernel (jax_rope computes it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from jax_rope import npu
from jax_rope.attention import dropout, fallback, masks
from jax_rope.attention.masks import KV_LEN, KV_START, Q_LEN, Q_START
from jax_rope.npu import cann, coverage


def _shape(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _offsets(options):
    """(qStartIdx, kvStartIdx): the ALiBi kinds' concrete offsets, else (0, 0)."""
    if options.bias in ("alibi", "alibi_sqrt") and options.static_offsets is not None:
        return tuple(int(x) for x in options.static_offsets)
    return 0, 0


def _npu_attributes(options):
    q_start, kv_start = _offsets(options)
    return {"layout": np.int32(options.layout_info.roles.code),
            "scale": np.float32(options.scale), "has_mask": np.int32(options.has_mask),
            "sparse_mode": np.int32(options.sparse_mode),
            "pre_tokens": np.int64(options.pre_tokens),
            "next_tokens": np.int64(options.next_tokens),
            "has_pse": np.int32(options.bias is not None),
            "pse_type": np.int32(options.pse_type if options.bias is not None else 1),
            "q_start_idx": np.int64(q_start), "kv_start_idx": np.int64(kv_start),
            "keep_prob": np.float64(options.keep_prob if options.dropout else 1.0)}


def _sequence_starts(lengths):
    return np.cumsum((0,) + tuple(lengths[:-1])) if lengths else np.zeros((0,), np.int64)


def _pse_operand(options, bias):
    """The canonical bias as the NPU reads it (see the module docstring)."""
    if options.bias is None:
        return jnp.zeros((1,), jnp.float32)
    if options.bias in ("alibi", "alibi_sqrt"):  # slopes (Bs, N1)
        return bias[0] if bias.shape[0] == 1 else bias
    if not options.varlen or options.bias == "compressed":
        return bias
    q_lens, kv_lens = options.static_lengths
    if options.bias == "tensor":  # (N1, Tkv) -> [N1, Skv_b] blocks
        sizes, starts = kv_lens, _sequence_starts(kv_lens)
    else:  # packed (N1, C) -> [N1, Sq_b * Skv_b] blocks
        sizes = tuple(a * b for a, b in zip(q_lens, kv_lens))
        starts = _sequence_starts(sizes)
    blocks = [bias[:, int(s):int(s) + n].reshape(-1) for s, n in zip(starts, sizes)]
    return jnp.concatenate(blocks) if blocks else jnp.zeros((0,), bias.dtype)


def _drop_mask_operand(options, table, extras, q_rows, kv_rows):
    """The packed dropMask of this call's keep bits (a placeholder without dropout)."""
    if options.dropout is None:
        return jnp.zeros((1,), jnp.uint8)
    keep = dropout.keep_bits(options, table, extras, masks.query_rows(q_rows),
                             masks.key_columns(kv_rows))
    if options.varlen:
        keep = dropout.sequence_blocks(keep[0], options.static_lengths)
    return dropout.pack_bits(keep)


def _operands(options, table, extras, query_shape, key_shape):
    """mask, pse and dropMask operands of the NPU handlers."""
    seq = options.layout_info.roles.seq
    return (_mask_operand(options, extras.get("mask"), query_shape),
            _pse_operand(options, extras.get("bias")),
            _drop_mask_operand(options, table, extras, query_shape[seq], key_shape[seq]))


def _mask_operand(options, mask, query_shape):
    """The mask the NPU operator needs for the spec's result (the mask is data,
    so this runs on the device inside the NPU lowering)."""
    if not options.has_mask:
        return jnp.zeros((1, 1, 1, 1), jnp.uint8)
    m = mask
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


def _ends(table):
    """The tokens the sequences hold: (query, key) ends of the last one."""
    last = table[-1]
    return last[Q_START] + last[Q_LEN], last[KV_START] + last[KV_LEN]


def _npu_stats_width(options, stats_shape):
    # VarLen writes [N1, Tq, 8] (NTD); the others [B, N1, Sq, 8].
    if options.varlen:
        return (stats_shape[1], stats_shape[0], npu.STATS_WIDTH)
    return stats_shape + (npu.STATS_WIDTH,)


def _valid_table(table, q_rows, kv_rows):
    """Whether the NPU handler takes a TND sequence table (attention_launch.cc,
    CheckTable): each sequence starts where the one before ends, with a length
    >= 0, and ends within the rows."""
    def chained(start, length, rows):
        end = start + length
        before = jnp.concatenate([jnp.zeros((1,), end.dtype), end[:-1]])
        return jnp.all((start == before) & (length >= 0) & (end <= rows))
    return (chained(table[:, Q_START], table[:, Q_LEN], q_rows)
            & chained(table[:, KV_START], table[:, KV_LEN], kv_rows))


def _fallback_at_run_time(kernel, fallback_call, options, table_at):
    """`kernel`, or for traced TND lengths that the operator may not cover
    (coverage.attention_lengths_gap) a choice made when the call runs: the
    fallback for valid lengths it does not cover. Invalid ones stay the
    operator's, whose handler refuses them (the fallback here cannot); so do
    all with "ffi". (XLA reserves memory for an untaken branch's temporaries
    too: the fallback's go by row_chunks.GRID_CHUNK_BYTES of scores at a time.)"""
    uncovered = coverage.attention_lengths_gap(npu.current_cann()[0], options)
    if uncovered is None or options.backend == "ffi":
        return kernel

    def call(*args):
        q, k, table = args[0], args[1], args[table_at]
        use_fallback = (_valid_table(table, q.shape[0], k.shape[0])
                        & uncovered(table[:, Q_LEN], table[:, KV_LEN]))
        return jax.lax.cond(use_fallback, lambda *a: tuple(fallback_call(*a, options=options)),
                            lambda *a: tuple(kernel(*a)), *args)
    return call


def _copy_by_copy(call, options, table_at):
    """`call`, one copy at a time where vmap folded copies of a TND call into its
    token axis (options.copies): the operator's cumulative lengths cannot skip the
    tokens after a copy's last sequence. The operands before the table are
    token-major, as are the results; the ones after it are every copy's."""
    copies = options.copies
    if copies == 1:
        return call

    def call_each(*args):
        table, rest = args[table_at], args[table_at + 1:]
        q_tokens, kv_tokens = args[0].shape[0] // copies, args[1].shape[0] // copies
        offset = jnp.arange(copies, dtype=table.dtype)[:, None]
        tables = (table.reshape(copies, -1, table.shape[1])
                  .at[..., Q_START].add(-offset * q_tokens)
                  .at[..., KV_START].add(-offset * kv_tokens))
        split = [x.reshape((copies, -1) + x.shape[1:]) for x in args[:table_at]]
        outs = jax.lax.map(lambda xs: call(*xs[:-1], xs[-1], *rest), (*split, tables))
        return tuple(x.reshape((-1,) + x.shape[2:]) for x in outs)
    return call_each


def npu_forward(ctx, *args, options):
    def call(q, k, v, table, *extra):
        # Shapes from the operands: with options.copies a call is one copy's.
        stats = (q.shape[0], q.shape[1]) if options.varlen else ctx.avals_out[1].shape
        wide = jax.ShapeDtypeStruct(_npu_stats_width(options, stats), jnp.float32)
        out_shape = jax.ShapeDtypeStruct(q.shape[:-1] + v.shape[-1:], q.dtype)
        extras = dict(zip(options.extra_names, extra))
        out, smax, ssum = jax.ffi.ffi_call(npu.ATTENTION_FWD, (out_shape, wide, wide))(
            q, k, v, table, *_operands(options, table, extras, q.shape, k.shape),
            **_npu_attributes(options))
        if not options.varlen:
            return out, smax[..., 0], ssum[..., 0]  # the spec's statistics: one copy
        # Tokens after the last sequence are rows the operator is not given
        # (attention_launch.cc): they see no key; with no key token at all it
        # is not called, and no row sees one.
        rows, inside = _ntd_rows(table, *stats)
        inside = (inside & (_ends(table)[1] > 0))[:, None]
        flat = lambda x: x[..., 0].reshape(-1)[rows]
        return (jnp.where(inside[..., None], out, jnp.zeros((), out.dtype)),
                jnp.where(inside, flat(smax), -np.finfo(np.float32).max),
                jnp.where(inside, flat(ssum), np.finfo(np.float32).max))

    call = _copy_by_copy(_fallback_at_run_time(call, fallback.attention_forward, options, 3),
                         options, 3)
    return mlir.lower_fun(call, multiple_results=True)(ctx, *args)


def npu_backward(ctx, *args, options):
    def call(q, k, v, out, dout, smax, ssum, table, *extra):
        extras = dict(zip(options.extra_names, extra))
        if options.varlen:
            tokens, heads = smax.shape
            rows, inside = _ntd_rows(table, tokens, heads)
            at = jnp.where(inside[:, None], rows, tokens * heads)
            ntd = lambda s: jnp.zeros((tokens * heads,), s.dtype).at[at].set(
                s, mode="drop").reshape(heads, tokens)
            smax, ssum = ntd(smax), ntd(ssum)
        wide = lambda s: jnp.broadcast_to(s[..., None], s.shape + (npu.STATS_WIDTH,))
        dq, dk, dv = jax.ffi.ffi_call(npu.ATTENTION_BWD, tuple(map(_shape, (q, k, v))))(
            q, k, v, out, dout, wide(smax), wide(ssum), table,
            *_operands(options, table, extras, q.shape, k.shape), **_npu_attributes(options))
        if not options.varlen:
            return dq, dk, dv
        # The rows after the last sequence's, which the operator is not given
        # (with no query or no key token it is not called: no gradient at all).
        q_end, kv_end = _ends(table)
        called = (q_end > 0) & (kv_end > 0)
        held = lambda x, end: jnp.where(
            (jnp.arange(x.shape[0]) < jnp.where(called, end, 0))[:, None, None], x,
            jnp.zeros((), x.dtype))
        return held(dq, q_end), held(dk, kv_end), held(dv, kv_end)

    call = _copy_by_copy(_fallback_at_run_time(call, fallback.attention_backward, options, 7),
                         options, 7)
    return mlir.lower_fun(call, multiple_results=True)(ctx, *args)


def npu_operator(options, backward: bool) -> str:
    """The aclnn operator of a call: the V2 forms for pseType 0/2/3 (and offsets)."""
    v2 = options.bias is not None and options.pse_type != 1
    return cann.FLASH_OPERATORS[(backward, options.varlen, v2)]


def npu_gap(extras_at, backward):
    def gap(options, avals_in):
        missing = npu.missing_operator(npu_operator(options, backward))
        if missing is not None:
            return missing
        query, key, value = avals_in[:3]
        extras = dict(zip(options.extra_names, avals_in[extras_at:]))
        return coverage.attention_gap(npu.current_profile()[0], npu.current_cann()[0], options,
                                      query, key, value, extras)
    return gap
