"""Attention primitives (scores, fused forward, fused backward), each defined in
one place: shape inference, batching, the kernel of each platform (the CPU FFI
handlers; FlashAttentionScore(+Grad) on the Ascend NPU where the chip profile
covers the call; scores have no NPU kernel), the jnp fallback elsewhere, and
the factor map that partitions a sharded call.

Operands are canonical (head axis present, see fallback.py): query, key[,
value, ...], the int32 (B, 7) sequence table of masks.py and, when
options.has_mask, a uint8 element mask. The handlers always take a mask
operand: a 1x1x1x1 placeholder when there is none.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from jax_rope import npu
from jax_rope.attention import fallback
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
# A vmapped axis folds into the batch axis (padded layouts: the table gets a
# row per folded entry) or the token axis (TND: each copy's sequences are
# shifted by the copy's token offset). Per-copy TND masks and TND scores, whose
# output is not foldable, map over the copies instead.

def _map_over_copies(prim, args, dims, options):
    size = batching.mapped_size(args, dims)
    args = [batching.moved(x, d, 0, size) for x, d in zip(args, dims)]
    outs = jax.lax.map(lambda xs: prim.bind(*xs, options=options), args)
    return outs, (0 if not prim.multiple_results else [0] * len(outs))


def _batch_rule(name, num_tensors, stats_slots):
    def rule(args, dims, *, options: AttentionOptions):
        prim = PRIMITIVES[name]
        table_at = len(args) - 1 - options.has_mask
        mask_batched = options.has_mask and dims[-1] is not None
        if options.varlen and (mask_batched or name == SCORES):
            return _map_over_copies(prim, args, dims, options)
        size = batching.mapped_size(args, dims)
        fold = options.layout_info.roles.fold_axis
        folded = list(args)
        for i in range(num_tensors):
            folded[i] = batching.merge(batching.moved(args[i], dims[i], fold, size), fold)
        for i in stats_slots:
            folded[i] = batching.merge(batching.moved(args[i], dims[i], 0, size), 0)
        table = batching.moved(args[table_at], dims[table_at], 0, size)
        if options.varlen:
            copy = jnp.arange(size, dtype=jnp.int32)[:, None]
            q_tokens = folded[0].shape[fold] // size
            kv_tokens = folded[1].shape[fold] // size
            table = (table.at[..., Q_START].add(copy * q_tokens)
                     .at[..., KV_START].add(copy * kv_tokens))
        folded[table_at] = batching.merge(table, 0)
        if options.has_mask:
            mask = args[-1]
            if not options.varlen and (dims[-1] is not None or mask.shape[0] != 1):
                mask = batching.moved(mask, dims[-1], 0, size)
                mask = jnp.broadcast_to(mask, (size, table.shape[1]) + mask.shape[2:])
                folded[-1] = batching.merge(mask, 0)
        outs = prim.bind(*folded, options=options)
        if not prim.multiple_results:
            return batching.split(outs, 0, size), 0
        out_axes = [fold, 0, 0] if name == FWD else [fold, fold, fold]
        return [batching.split(o, a, size) for o, a in zip(outs, out_axes)], out_axes
    return rule


# --- kernels --------------------------------------------------------------------

def _cpu_lowering(target):
    def lower(ctx, *args, options):
        if not options.has_mask:
            args = args + (mlir.ir_constant(np.zeros((1, 1, 1, 1), np.uint8)),)
            ctx = ctx.replace(avals_in=ctx.avals_in + (_aval((1, 1, 1, 1), np.uint8),))
        return jax.ffi.ffi_lowering(target)(
            ctx, *args, layout=np.int32(options.layout_info.roles.code),
            scale=np.float32(options.scale), has_mask=np.int32(options.has_mask))
    return lower


def _cpu_kernel(target):
    return Kernel("cpu", _cpu_lowering(target), unavailable=extension.kernels_unavailable)


def _npu_kernel(lower, mask_at, backward):
    return Kernel(npu.PLATFORM, lower, npu_gap(mask_at, backward),
                  unavailable=npu.kernels_unavailable)


# --- partitioning ---------------------------------------------------------------

def _factor_map(name):
    def factor_map(params, shapes) -> FactorMap:
        options = params["options"]
        roles, varlen = options.layout_info.roles, options.varlen
        rank = len(shapes[0])
        q, kv = axis_factors(roles, rank, "h"), axis_factors(roles, rank, "g")
        table = (None, None) if varlen else ("b", None)
        stats = (None, "h") if varlen else ("b", "h", None)
        mask = ()
        if options.has_mask:
            bm, nm = shapes[-1][:2]
            batch = None if varlen else shapes[0][roles.batch]
            heads = shapes[0][roles.head]
            mask = (("b" if bm == batch else None, "h" if nm == heads else None, None, None),)
        if name == SCORES:
            scores = ("h", None, None) if varlen else ("b", "h", None, None)
            return FactorMap((q, kv, table) + mask, (scores,))
        if name == FWD:
            return FactorMap((q, kv, kv, table) + mask, (q, stats, stats))
        return FactorMap((q, kv, kv, q, q, stats, stats, table) + mask, (q, kv, kv))
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
