"""Attention primitives: scores, fused forward and fused backward.

Operands are canonical (head axis present, see attention_fallback.py): query,
key[, value, ...], the int32 (B, 7) sequence table and, when options.has_mask,
a uint8 element mask. `cpu` lowers to the XLA FFI kernels (the mask operand is
a 1x1x1x1 placeholder when there is none); other platforms to the jnp fallback.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir, xla

from jax_rope import attention_fallback, npu
from jax_rope.attention_options import AttentionOptions
from jax_rope.backends import use_kernel

attention_scores_p = Primitive("jax_rope_attention_scores")
attention_fwd_p = Primitive("jax_rope_attention_fwd")
attention_fwd_p.multiple_results = True
attention_bwd_p = Primitive("jax_rope_attention_bwd")
attention_bwd_p.multiple_results = True

FFI_TARGETS = ("jax_rope_attention_scores", "jax_rope_attention_fwd", "jax_rope_attention_bwd")

#: Each primitive's own default/cpu lowering rule, rule(ctx, *args, options, platform=None):
#: kernel or fallback by options.backend. jax_rope/sharding.py wraps these.
LOWERING_RULES = {}


def _aval(shape, dtype):
    return jax.core.ShapedArray(tuple(shape), jnp.dtype(dtype))


def _check_table(options, table, mask, q_shape):
    if table.ndim != 2 or table.shape[1] != 7 or jnp.dtype(table.dtype) != jnp.int32:
        raise ValueError(f"sequence table must be int32 (B, 7), got {table.dtype}{table.shape}")
    roles = options.info.roles
    if roles.batch is not None and table.shape[0] != q_shape[roles.batch]:
        raise ValueError(f"sequence table must have a row per batch entry "
                         f"({q_shape[roles.batch]}), got {table.shape[0]}")
    if options.has_mask != bool(mask):
        raise ValueError("element mask operand must be present exactly when has_mask")


def _dims(options, q_shape, kv_shape):
    """(B or None, N1, Sq) of query and Skv of key in the canonical layout."""
    roles = options.info.roles
    batch = None if roles.batch is None else q_shape[roles.batch]
    return batch, q_shape[roles.head], q_shape[roles.seq], kv_shape[roles.seq]


def _stats_shape(options, q_shape):
    batch, heads, q_len, _ = _dims(options, q_shape, q_shape)
    return (q_len, heads) if options.varlen else (batch, heads, q_len)


def _scores_abstract_eval(query, key, table, *mask, options: AttentionOptions):
    _check_table(options, table, mask, query.shape)
    batch, heads, q_len, kv_len = _dims(options, query.shape, key.shape)
    shape = (heads, q_len, kv_len) if options.varlen else (batch, heads, q_len, kv_len)
    return _aval(shape, jnp.float32)


def _fwd_abstract_eval(query, key, value, table, *mask, options: AttentionOptions):
    _check_table(options, table, mask, query.shape)
    stats = _aval(_stats_shape(options, query.shape), jnp.float32)
    return _aval(query.shape[:-1] + value.shape[-1:], query.dtype), stats, stats


def _bwd_abstract_eval(query, key, value, out, dout, softmax_max, softmax_sum, table, *mask,
                       options: AttentionOptions):
    _check_table(options, table, mask, query.shape)
    if dout.shape != out.shape or softmax_max.shape != _stats_shape(options, query.shape):
        raise ValueError(f"attention backward got dout {dout.shape} for out {out.shape} and "
                         f"statistics {softmax_max.shape}")
    return tuple(_aval(x.shape, x.dtype) for x in (query, key, value))


# --- batching ----------------------------------------------------------------
# A vmapped axis folds into the batch axis (padded layouts: the table gets a
# row per folded entry) or the token axis (TND: each copy's sequences are
# shifted by the copy's token offset). Per-copy TND masks and TND scores, whose
# output is not foldable, map over the copies instead.

def _moved(x, d, axis, size):
    if d is None:
        x = jnp.expand_dims(x, axis)
        return jnp.broadcast_to(x, x.shape[:axis] + (size,) + x.shape[axis + 1:])
    return jnp.moveaxis(x, d, axis)


def _merge(x, axis):
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def _split(x, axis, size):
    return x.reshape(x.shape[:axis] + (size, -1) + x.shape[axis + 1:])


def _map_over_copies(prim, args, dims, options):
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    args = [_moved(x, d, 0, size) for x, d in zip(args, dims)]
    outs = jax.lax.map(lambda xs: prim.bind(*xs, options=options), args)
    return outs, (0 if not prim.multiple_results else [0] * len(outs))


def _batch_rule(prim, num_tensors, stats_slots):
    def rule(args, dims, *, options: AttentionOptions):
        table_at = len(args) - 1 - options.has_mask
        mask_batched = options.has_mask and dims[-1] is not None
        if options.varlen and (mask_batched or prim is attention_scores_p):
            return _map_over_copies(prim, args, dims, options)
        size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
        roles = options.info.roles
        fold = roles.fold_axis
        folded = list(args)
        for i in range(num_tensors):
            folded[i] = _merge(_moved(args[i], dims[i], fold, size), fold)
        for i in stats_slots:
            folded[i] = _merge(_moved(args[i], dims[i], 0, size), 0)
        table = _moved(args[table_at], dims[table_at], 0, size)
        if options.varlen:
            copy = jnp.arange(size, dtype=jnp.int32)[:, None]
            q_tokens = folded[0].shape[fold] // size
            kv_tokens = folded[1].shape[fold] // size
            table = table.at[..., 0].add(copy * q_tokens).at[..., 2].add(copy * kv_tokens)
        folded[table_at] = _merge(table, 0)
        if options.has_mask:
            mask = args[-1]
            if not options.varlen and (dims[-1] is not None or mask.shape[0] != 1):
                mask = _moved(mask, dims[-1], 0, size)
                mask = jnp.broadcast_to(mask, (size, table.shape[1]) + mask.shape[2:])
                folded[-1] = _merge(mask, 0)
        outs = prim.bind(*folded, options=options)
        if not prim.multiple_results:
            return _split(outs, 0, size), 0
        out_axes = [fold, 0, 0] if prim is attention_fwd_p else [fold, fold, fold]
        return [_split(o, a, size) for o, a in zip(outs, out_axes)], out_axes
    return rule


# --- lowering ----------------------------------------------------------------

def _lowering(target, fallback):
    fallback_rule = mlir.lower_fun(fallback, multiple_results=target != "jax_rope_attention_scores")

    def rule(ctx, *args, options: AttentionOptions, platform: str | None = None):
        platform = platform or ctx.module_context.platforms[0]
        if not use_kernel(options.backend, platform):
            return fallback_rule(ctx, *args, options=options)
        if not options.has_mask:  # the handlers take the mask operand always
            placeholder = mlir.ir_constant(np.zeros((1, 1, 1, 1), np.uint8))
            args = args + (placeholder,)
            ctx = ctx.replace(avals_in=ctx.avals_in + (_aval((1, 1, 1, 1), np.uint8),))
        lower = jax.ffi.ffi_lowering(target)
        return lower(ctx, *args, layout=np.int32(options.info.roles.code),
                     scale=np.float32(options.scale), has_mask=np.int32(options.has_mask))

    return rule


def _register(prim, abstract_eval, batch_rule, target, fallback, npu_rule=None):
    prim.def_impl(functools.partial(xla.apply_primitive, prim))
    prim.def_abstract_eval(abstract_eval)
    batching.primitive_batchers[prim] = batch_rule
    rule = LOWERING_RULES[prim] = _lowering(target, fallback)
    mlir.register_lowering(prim, rule)
    mlir.register_lowering(prim, functools.partial(rule, platform="cpu"), platform="cpu")
    if npu_rule is not None:  # the Ascend NPU (jax_rope/npu.py); scores: fallback there
        npu.register_rule(prim, npu_rule(fallback))


_register(attention_scores_p, _scores_abstract_eval, _batch_rule(attention_scores_p, 2, ()),
          "jax_rope_attention_scores", attention_fallback.attention_scores)
_register(attention_fwd_p, _fwd_abstract_eval, _batch_rule(attention_fwd_p, 3, ()),
          "jax_rope_attention_fwd", attention_fallback.attention_forward, npu.attention_forward_rule)
_register(attention_bwd_p, _bwd_abstract_eval, _batch_rule(attention_bwd_p, 5, (5, 6)),
          "jax_rope_attention_bwd", attention_fallback.attention_backward, npu.attention_backward_rule)
