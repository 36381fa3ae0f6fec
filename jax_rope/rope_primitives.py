"""RoPE primitives: abstract evaluation, batching and per-platform lowering.

Two primitives, forward and fused backward. Lowering: `cpu` goes to the XLA FFI
kernels when the extension is loaded and the backend allows it; every other
platform (and the "fallback" backend) lowers the jax.numpy implementation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir, xla

from jax_rope import npu, rope_fallback
from jax_rope.backends import use_kernel
from jax_rope.rope_options import RopeOptions, check_grad_inputs, check_rope_shapes, ffi_attributes

rope_fwd_p = Primitive("jax_rope_rope_fwd")
rope_fwd_p.multiple_results = True
rope_bwd_p = Primitive("jax_rope_rope_bwd")
rope_bwd_p.multiple_results = True

FFI_TARGETS = ("jax_rope_rope_fwd", "jax_rope_rope_bwd", "jax_rope_rope_bwd_no_inputs")

#: Each primitive's own default/cpu lowering rule, rule(ctx, *args, options, platform=None):
#: kernel or fallback by options.backend. jax_rope/sharding.py wraps these.
LOWERING_RULES = {}


def _aval(x):
    return jax.core.ShapedArray(x.shape, x.dtype)


# --- abstract evaluation: validate, then infer shapes -----------------------

def _fwd_abstract_eval(query, key, cos, sin, *, options: RopeOptions):
    check_rope_shapes(options, query, key, cos, sin)
    return _aval(query), _aval(key)


def _bwd_abstract_eval(grad_query, grad_key, cos, sin, *inputs, options: RopeOptions):
    check_grad_inputs(options, grad_query, grad_key, cos, sin, *(inputs or (None, None)))
    outs = [_aval(grad_query), _aval(grad_key)]
    return outs + [_aval(cos), _aval(sin)] if inputs else outs


# --- batching: the vmapped axis folds into the batch (or TND token) axis ----

def _to_fold_position(x, bdim, fold_axis: int, size: int):
    """Puts the vmapped axis just before `fold_axis`, broadcasting if unmapped."""
    if bdim is None:
        x = jnp.expand_dims(x, fold_axis)
        return jnp.broadcast_to(x, x.shape[:fold_axis] + (size,) + x.shape[fold_axis + 1:])
    return jnp.moveaxis(x, bdim, fold_axis)


def _merge(x, axis: int):
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def _split(x, axis: int, size: int):
    return x.reshape(x.shape[:axis] + (size, x.shape[axis] // size) + x.shape[axis + 1:])


def _fold_operands(options, args, dims):
    """Folds the vmapped axis of (big, big, cos, sin, *big) into the fold axis.

    Returns the folded operands, the vmapped size, and whether cos/sin were
    broadcast from batch 1 to the full batch (then per-example dcos/dsin must
    be summed back over it).
    """
    f = options.roles.fold_axis
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    big = [(i, _to_fold_position(x, d, f, size))
           for i, (x, d) in enumerate(zip(args, dims)) if i not in (2, 3)]
    fold_size = big[0][1].shape[f + 1]
    folded = dict((i, _merge(x, f)) for i, x in big)
    cos, sin = args[2], args[3]
    per_example = len(args) > 4 or dims[2] is not None or dims[3] is not None
    table_fold_size = cos.shape[f] if dims[2] is None else cos.shape[f + (dims[2] <= f)]
    # Unmapped batch-1 tables broadcast over the folded batch as they are.
    keep_tables = (not per_example and options.roles.batch is not None
                   and table_fold_size == 1)
    broadcast_tables = not keep_tables and table_fold_size != fold_size
    for i in (2, 3):
        table = args[i]
        if not keep_tables:
            table = _to_fold_position(table, dims[i], f, size)
            table = jnp.broadcast_to(
                table, table.shape[:f + 1] + (fold_size,) + table.shape[f + 2:])
            table = _merge(table, f)
        folded[i] = table
    return [folded[i] for i in range(len(args))], size, broadcast_tables


def _fwd_batch(args, dims, *, options: RopeOptions):
    f = options.roles.fold_axis
    folded, size, _ = _fold_operands(options, args, dims)
    outs = rope_fwd_p.bind(*folded, options=options)
    return [_split(o, f, size) for o in outs], [f, f]


def _bwd_batch(args, dims, *, options: RopeOptions):
    f = options.roles.fold_axis
    folded, size, broadcast_tables = _fold_operands(options, args, dims)
    outs = [_split(o, f, size) for o in rope_bwd_p.bind(*folded, options=options)]
    if len(outs) == 4 and broadcast_tables:
        outs[2:] = [jnp.sum(o, axis=f + 1, keepdims=True, dtype=jnp.float32).astype(o.dtype)
                    for o in outs[2:]]
    return outs, [f] * len(outs)


# --- lowering ----------------------------------------------------------------

def _lowering(ffi_target, fallback):
    """One rule per platform: our kernel where allowed, else the jnp fallback."""
    fallback_rule = mlir.lower_fun(fallback, multiple_results=True)

    def rule(ctx, *args, options: RopeOptions, platform: str | None = None):
        platform = platform or ctx.module_context.platforms[0]
        if use_kernel(options.backend, platform):
            lower = jax.ffi.ffi_lowering(ffi_target(len(args)))
            return lower(ctx, *args, **ffi_attributes(options))
        return fallback_rule(ctx, *args, options=options)

    return rule


def _register(prim, abstract_eval, batch_rule, ffi_target, fallback, npu_rule):
    prim.def_impl(functools.partial(xla.apply_primitive, prim))
    prim.def_abstract_eval(abstract_eval)
    batching.primitive_batchers[prim] = batch_rule
    rule = LOWERING_RULES[prim] = _lowering(ffi_target, fallback)
    mlir.register_lowering(prim, rule)
    mlir.register_lowering(prim, functools.partial(rule, platform="cpu"), platform="cpu")
    npu.register_rule(prim, npu_rule(fallback))  # the Ascend NPU (jax_rope/npu.py)


_register(rope_fwd_p, _fwd_abstract_eval, _fwd_batch,
          lambda num_args: "jax_rope_rope_fwd", rope_fallback.rope_forward, npu.rope_forward_rule)
_register(rope_bwd_p, _bwd_abstract_eval, _bwd_batch,
          lambda num_args: "jax_rope_rope_bwd" if num_args == 6 else "jax_rope_rope_bwd_no_inputs",
          rope_fallback.rope_backward, npu.rope_backward_rule)
