"""Attention primitives (scores, fused forward, fused backward), each defined in
one place: shape inference, batching, the kernel of each platform (the CPU FFI
handlers; FlashAttentionScore(+Grad) on the Ascend NPU where the chip profile
covers the call; scores have no NPU kernel), the jnp fallback elsewhere, and
the factor map that partitions a sharded call.

Operands are canonical (head axis present, see fallback.py): query, key[,
value, ...], the int32 (B, 7) sequence table of masks.py and the optional
operands `options.extra_names` lists (element mask, bias, ALiBi offsets,
dropout keys/position words/packed mask; see ops.py). The CPU handlers always
take every optional operand: a small placeholder for an absent one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from jax_rope import npu
from jax_rope.attention import dropout, fallback
from jax_rope.attention.masks import KV_START, Q_START
from jax_rope.attention.npu_lowering import npu_backward, npu_forward, npu_gap
from jax_rope.attention.options import AttentionOptions
from jax_rope.core import batching, extension
from jax_rope.core.partitioning import FactorMap, axis_factors
from jax_rope.core.primitive import Kernel, define_primitive

SCORES, FWD, BWD = "jax_rope_attention_scores", "jax_rope_attention_fwd", "jax_rope_attention_bwd"
#: Custom-call targets of the CPU kernels.
FFI_TARGETS = (SCORES, FWD, BWD)


def _aval(shape, dtype):
    return jax.core.ShapedArray(tuple(shape), jnp.dtype(dtype))


# --- abstract evaluation --------------------------------------------------------

def _dims(options, q_shape, kv_shape):
    """(B or None, N1, Sq) of query and Skv of key in the canonical layout."""
    roles = options.layout_info.roles
    batch = None if roles.batch is None else q_shape[roles.batch]
    return batch, q_shape[roles.head], q_shape[roles.seq], kv_shape[roles.seq]


def stats_shape(options: AttentionOptions, q_shape) -> tuple:
    """Shape of softmax_max/softmax_sum: (B, N1, Sq), or (Tq, N1) for TND."""
    batch, heads, q_len, _ = _dims(options, q_shape, q_shape)
    return (q_len, heads) if options.varlen else (batch, heads, q_len)


def _scores_abstract_eval(query, key, table, *mask, options: AttentionOptions):
    batch, heads, q_len, kv_len = _dims(options, query.shape, key.shape)
    shape = (heads, q_len, kv_len) if options.varlen else (batch, heads, q_len, kv_len)
    return _aval(shape, jnp.float32)


def _fwd_abstract_eval(query, key, value, table, *mask, options: AttentionOptions):
    stats = _aval(stats_shape(options, query.shape), jnp.float32)
    return _aval(query.shape[:-1] + value.shape[-1:], query.dtype), stats, stats


def _bwd_abstract_eval(query, key, value, out, dout, softmax_max, softmax_sum, table, *mask,
                       options: AttentionOptions):
    return tuple(_aval(x.shape, x.dtype) for x in (query, key, value))


# --- batching -------------------------------------------------------------------
# A vmapped axis folds into the batch axis (padded layouts: the table and every
# per-row operand get a row per folded entry) or the token axis (TND: each
# copy's sequences are shifted by the copy's token offset, and options.copies
# counts the copies, which the NPU lowering unfolds again). TND scores, TND
# calls with per-copy masks or any bias/dropout, and per-copy packed dropout
# masks map over the copies instead.

def _map_over_copies(prim, args, dims, options):
    size = batching.mapped_size(args, dims)
    args = [batching.moved(x, d, 0, size) for x, d in zip(args, dims)]
    outs = jax.lax.map(lambda xs: prim.bind(*xs, options=options), args)
    return outs, (0 if not prim.multiple_results else [0] * len(outs))


def _extra_names(name, options):
    return options.score_extra_names if name == SCORES else options.extra_names


def _folded_extra(name, x, dim, size, rows):
    """An optional operand of a padded-layout call with the vmapped axis folded into
    its (batch or sequence-table row) axis 0."""
    if name in ("offsets", "drop_keys", "drop_rows"):  # one row per table row
        return batching.merge(batching.moved(x, dim, 0, size), 0)
    if name == "drop_mask":  # unbatched here: every copy reads the same bits
        return x
    if dim is None and x.shape[0] == 1:  # broadcast over the batch: stays so
        return x
    x = batching.moved(x, dim, 0, size)
    return batching.merge(jnp.broadcast_to(x, (size, rows) + x.shape[2:]), 0)


def _batch_rule(name, num_tensors, stats_slots):
    def rule(args, dims, *, options: AttentionOptions):
        prim = PRIMITIVES[name]
        names = _extra_names(name, options)
        table_at = len(args) - 1 - len(names)
        extra_dims = dict(zip(names, dims[table_at + 1:]))
        per_copy = (options.varlen and (name == SCORES or options.bias is not None
                                        or options.dropout is not None
                                        or extra_dims.get("mask") is not None)
                    or extra_dims.get("drop_mask") is not None)
        if per_copy:
            return _map_over_copies(prim, args, dims, options)
        size = batching.mapped_size(args, dims)
        fold = options.layout_info.roles.fold_axis
        folded = list(args)
        for i in range(num_tensors):
            folded[i] = batching.merge(batching.moved(args[i], dims[i], fold, size), fold)
        for i in stats_slots:
            folded[i] = batching.merge(batching.moved(args[i], dims[i], 0, size), 0)
        table = batching.moved(args[table_at], dims[table_at], 0, size)
        rows = table.shape[1]
        if options.varlen:
            copy = jnp.arange(size, dtype=jnp.int32)[:, None]
            q_tokens = folded[0].shape[fold] // size
            kv_tokens = folded[1].shape[fold] // size
            table = (table.at[..., Q_START].add(copy * q_tokens)
                     .at[..., KV_START].add(copy * kv_tokens))
            options = dataclasses.replace(options, copies=options.copies * size)
        folded[table_at] = batching.merge(table, 0)
        if not options.varlen:
            for k, extra in enumerate(names):
                at = table_at + 1 + k
                folded[at] = _folded_extra(extra, args[at], dims[at], size, rows)
        outs = prim.bind(*folded, options=options)
        if not prim.multiple_results:
            return batching.split(outs, 0, size), 0
        out_axes = [fold, 0, 0] if name == FWD else [fold, fold, fold]
        return [batching.split(o, a, size) for o, a in zip(outs, out_axes)], out_axes
    return rule


# --- kernels --------------------------------------------------------------------

#: Kernel codes of the bias kinds (xla_ffi/attention_decode.cc: DecodeBias).
BIAS_KINDS = {None: 0, "tensor": 1, "compressed": 2, "packed": 3, "alibi": 4, "alibi_sqrt": 5}
DROPOUT_MODES = {None: 0, "key": 1, "mask": 2}
# What the handlers get for an absent optional operand.
_PLACEHOLDERS = {"mask": np.zeros((1, 1, 1, 1), np.uint8), "bias": np.zeros((1,), np.float32),
                 "offsets": np.zeros((1, 2), np.int32), "drop_keys": np.zeros((1, 2), np.uint32),
                 "drop_rows": np.zeros((1, 1), np.uint32), "drop_mask": np.zeros((1,), np.uint8)}
_HANDLER_EXTRAS = {SCORES: ("mask", "bias", "offsets"), FWD: tuple(_PLACEHOLDERS),
                   BWD: tuple(_PLACEHOLDERS)}


def _cpu_lowering(target):
    def lower(ctx, *args, options):
        names = _extra_names(target, options)
        first = len(args) - len(names)
        given = dict(zip(names, zip(args[first:], ctx.avals_in[first:])))
        operands, avals = list(args[:first]), list(ctx.avals_in[:first])
        for name in _HANDLER_EXTRAS[target]:
            if name in given:
                operands.append(given[name][0])
                avals.append(given[name][1])
            else:
                operands.append(mlir.ir_constant(_PLACEHOLDERS[name]))
                avals.append(_aval(_PLACEHOLDERS[name].shape, _PLACEHOLDERS[name].dtype))
        ctx = ctx.replace(avals_in=tuple(avals))
        attributes = {"layout": np.int32(options.layout_info.roles.code),
                      "scale": np.float32(options.scale), "has_mask": np.int32(options.has_mask),
                      "bias_kind": np.int32(BIAS_KINDS[options.bias]),
                      "bias_after_scale": np.int32(options.pse_type != 1)}
        if target != SCORES:
            keep = options.keep_prob
            attributes.update(
                dropout=np.int32(DROPOUT_MODES[options.dropout]),
                keep_threshold=np.int64(dropout.keep_threshold(keep) if keep < 1 else 2**32),
                keep_scale=dropout.keep_scale(keep))
        return jax.ffi.ffi_lowering(target)(ctx, *operands, **attributes)
    return lower


def _cpu_kernel(target):
    return Kernel("cpu", _cpu_lowering(target), unavailable=extension.kernels_unavailable)


def _npu_kernel(lower, mask_at, backward):
    return Kernel(npu.PLATFORM, lower, npu_gap(mask_at, backward),
                  unavailable=npu.kernels_unavailable)


# --- partitioning ---------------------------------------------------------------

def _extra_factors(options, name, shape, batch, heads):
    """Factors of an optional operand: batch "b" and query heads "h" where it has them."""
    varlen = options.varlen
    b = lambda size: "b" if not varlen and size == batch else None
    if name == "mask":
        return (b(shape[0]), "h" if shape[1] == heads else None, None, None)
    if name in ("offsets", "drop_keys"):
        return (b(shape[0]), None)
    if name == "drop_rows":
        return (b(shape[0]), "h")
    if name == "drop_mask":
        return (None,)
    if options.bias in ("alibi", "alibi_sqrt"):  # slopes (Bs, N1)
        return (b(shape[0]), "h")
    if len(shape) == 2:  # TND (N1, Tkv) / (N1, C)
        return ("h", None)
    return (b(shape[0]), "h", None, None)


def _factor_map(name):
    def factor_map(params, shapes) -> FactorMap:
        options = params["options"]
        roles, varlen = options.layout_info.roles, options.varlen
        rank = len(shapes[0])
        q, kv = axis_factors(roles, rank, "h"), axis_factors(roles, rank, "g")
        table = (None, None) if varlen else ("b", None)
        stats = (None, "h") if varlen else ("b", "h", None)
        names = _extra_names(name, options)
        batch = None if varlen else shapes[0][roles.batch]
        heads = shapes[0][roles.head]
        extras = tuple(_extra_factors(options, n, shape, batch, heads)
                       for n, shape in zip(names, shapes[len(shapes) - len(names):]))
        if name == SCORES:
            scores = ("h", None, None) if varlen else ("b", "h", None, None)
            return FactorMap((q, kv, table) + extras, (scores,))
        if name == FWD:
            return FactorMap((q, kv, kv, table) + extras, (q, stats, stats))
        return FactorMap((q, kv, kv, q, q, stats, stats, table) + extras, (q, kv, kv))
    return factor_map


# --- the primitives ---------------------------------------------------------------

attention_scores_p = define_primitive(
    SCORES, multiple_results=False, abstract_eval=_scores_abstract_eval,
    batcher=_batch_rule(SCORES, 2, ()), fallback=fallback.attention_scores,
    kernels=(_cpu_kernel(SCORES),), factor_map=_factor_map(SCORES))

attention_fwd_p = define_primitive(
    FWD, multiple_results=True, abstract_eval=_fwd_abstract_eval,
    batcher=_batch_rule(FWD, 3, ()), fallback=fallback.attention_forward,
    kernels=(_cpu_kernel(FWD), _npu_kernel(npu_forward, 4, False)), factor_map=_factor_map(FWD))

attention_bwd_p = define_primitive(
    BWD, multiple_results=True, abstract_eval=_bwd_abstract_eval,
    batcher=_batch_rule(BWD, 5, (5, 6)), fallback=fallback.attention_backward,
    kernels=(_cpu_kernel(BWD), _npu_kernel(npu_backward, 8, True)), factor_map=_factor_map(BWD))

PRIMITIVES = {SCORES: attention_scores_p, FWD: attention_fwd_p, BWD: attention_bwd_p}
