"""RoPE primitives, forward and fused backward, each defined in one place: shape
inference, batching, the kernel of each platform (the CPU FFI handlers, the
Ascend NPU operators where the chip profile covers the call), the jnp fallback
elsewhere, and the factor map that partitions a sharded call.

The public functions (rope/api.py) validate the call; abstract evaluation here
only infers shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from jax_rope import npu
from jax_rope.core import batching, extension
from jax_rope.core.partitioning import FactorMap, axis_factors
from jax_rope.core.primitive import Kernel, define_primitive
from jax_rope.npu import cann, coverage
from jax_rope.rope import fallback
from jax_rope.rope.options import RopeOptions

FWD, BWD, BWD_NO_INPUTS = "jax_rope_rope_fwd", "jax_rope_rope_bwd", "jax_rope_rope_bwd_no_inputs"
#: Custom-call targets of the CPU kernels.
FFI_TARGETS = (FWD, BWD, BWD_NO_INPUTS)


def _aval(x):
    return jax.core.ShapedArray(x.shape, x.dtype)


def _attributes(options: RopeOptions) -> dict:
    """The attributes the C++ handlers (CPU and NPU) decode once per call."""
    return {"layout": np.int32(options.roles.code), "rotary_mode": np.int32(options.mode_code)}


# --- abstract evaluation ------------------------------------------------------

def _fwd_abstract_eval(query, key, cos, sin, *, options: RopeOptions):
    return _aval(query), _aval(key)


def _bwd_abstract_eval(grad_query, grad_key, cos, sin, *inputs, options: RopeOptions):
    outs = [_aval(grad_query), _aval(grad_key)]
    return outs + [_aval(cos), _aval(sin)] if inputs else outs


# --- batching: the vmapped axis folds into the batch (or TND token) axis ----

def _fold_operands(options, args, dims):
    """Folds the vmapped axis of (big, big, cos, sin, *big) into the fold axis.

    Returns the folded operands, the vmapped size, and whether cos/sin were
    broadcast from batch 1 to the full batch (then per-example dcos/dsin must
    be summed back over it).
    """
    f = options.roles.fold_axis
    size = batching.mapped_size(args, dims)
    big = [(i, batching.moved(x, d, f, size))
           for i, (x, d) in enumerate(zip(args, dims)) if i not in (2, 3)]
    fold_size = big[0][1].shape[f + 1]
    folded = dict((i, batching.merge(x, f)) for i, x in big)
    cos = args[2]
    per_example = len(args) > 4 or dims[2] is not None or dims[3] is not None
    table_fold_size = cos.shape[f] if dims[2] is None else cos.shape[f + (dims[2] <= f)]
    # Unmapped batch-1 tables broadcast over the folded batch as they are.
    keep_tables = (not per_example and options.roles.batch is not None
                   and table_fold_size == 1)
    broadcast_tables = not keep_tables and table_fold_size != fold_size
    for i in (2, 3):
        table = args[i]
        if not keep_tables:
            table = batching.moved(table, dims[i], f, size)
            table = jnp.broadcast_to(
                table, table.shape[:f + 1] + (fold_size,) + table.shape[f + 2:])
            table = batching.merge(table, f)
        folded[i] = table
    return [folded[i] for i in range(len(args))], size, broadcast_tables


def _fwd_batch(args, dims, *, options: RopeOptions):
    f = options.roles.fold_axis
    folded, size, _ = _fold_operands(options, args, dims)
    outs = rope_fwd_p.bind(*folded, options=options)
    return [batching.split(o, f, size) for o in outs], [f, f]


def _bwd_batch(args, dims, *, options: RopeOptions):
    f = options.roles.fold_axis
    folded, size, broadcast_tables = _fold_operands(options, args, dims)
    outs = [batching.split(o, f, size) for o in rope_bwd_p.bind(*folded, options=options)]
    if len(outs) == 4 and broadcast_tables:
        outs[2:] = [jnp.sum(o, axis=f + 1, keepdims=True, dtype=jnp.float32).astype(o.dtype)
                    for o in outs[2:]]
    return outs, [f] * len(outs)


# --- kernels ------------------------------------------------------------------

# The forward's operand -> result aliasing when options.in_place (query -> query_out,
# key -> key_out): XLA gives the kernel the operand's buffer as the result when it is
# donated or dead, else a copy of it.
IN_PLACE = {0: 0, 1: 1}


def _cpu_lowering(target_of, aliases=None):
    def lower(ctx, *args, options):
        alias = {"operand_output_aliases": aliases} if aliases and options.in_place else {}
        return jax.ffi.ffi_lowering(target_of(len(args)), **alias)(
            ctx, *args, **_attributes(options))
    return lower


def _npu_lowering(target_of, aliases=None):
    def lower(ctx, *args, options):
        shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ctx.avals_out)
        alias = {"input_output_aliases": aliases} if aliases and options.in_place else {}

        def call(*xs):
            return jax.ffi.ffi_call(target_of(len(xs)), shapes, **alias)(
                *xs, **_attributes(options))

        return mlir.lower_fun(call, multiple_results=True)(ctx, *args)
    return lower


def _single_grad_call(options, shapes, *xs):
    """The backward through aclnnRotaryPositionEmbeddingGrad: one operator call
    per path; with query/key the handler returns each path's dcos/dsin (already
    reduced over its broadcast axes) and they are added here, in float32."""
    attrs = _attributes(options)
    if len(xs) == 4:
        return jax.ffi.ffi_call(npu.ROPE_SINGLE_BWD_NO_INPUTS, shapes)(*xs, **attrs)
    dq, dk, dcos_q, dsin_q, dcos_k, dsin_k = jax.ffi.ffi_call(
        npu.ROPE_SINGLE_BWD, shapes[:2] + shapes[2:] * 2)(*xs, **attrs)
    add = lambda a, b: (a.astype(jnp.float32) + b.astype(jnp.float32)).astype(a.dtype)
    return dq, dk, add(dcos_q, dcos_k), add(dsin_q, dsin_k)


def _npu_backward_lowering(ctx, *args, options):
    # The profile's backward operator (checked by _npu_backward_gap) picks the target.
    if npu.current_profile()[0].rope_bwd_operator != cann.ROPE_SINGLE_GRAD:
        target = npu.ROPE_BWD if len(args) == 6 else npu.ROPE_BWD_NO_INPUTS
        return _npu_lowering(lambda n: target)(ctx, *args, options=options)
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ctx.avals_out)
    call = lambda *xs: _single_grad_call(options, shapes, *xs)
    return mlir.lower_fun(call, multiple_results=True)(ctx, *args)


def _npu_forward_gap(options, avals_in):
    missing = npu.missing_operator(cann.ROPE_V2)
    if missing is not None:
        return missing
    query, key, cos, _ = avals_in
    return coverage.rope_forward_gap(npu.current_profile()[0], npu.current_cann()[0], options,
                                     query, key, cos)


def _npu_backward_gap(options, avals_in):
    profile = npu.current_profile()[0]
    if profile.rope_bwd_operator is None:
        return f"no fused RoPE backward on profile {profile.name}"
    missing = npu.missing_operator(profile.rope_bwd_operator)
    if missing is not None:
        return missing
    grad_query, grad_key, cos = avals_in[:3]
    return coverage.rope_backward_gap(profile, options, grad_query, grad_key, cos,
                                      with_inputs=len(avals_in) == 6)


def _kernels(cpu_target, npu_lower, npu_gap, cpu_aliases=None):
    return (Kernel("cpu", _cpu_lowering(cpu_target, cpu_aliases),
                   unavailable=extension.kernels_unavailable),
            Kernel(npu.PLATFORM, npu_lower, npu_gap, unavailable=npu.kernels_unavailable))


# --- partitioning -------------------------------------------------------------

def _factor_map(params, shapes) -> FactorMap:
    roles = params["options"].roles
    q, k = axis_factors(roles, roles.rank, "h", "s"), axis_factors(roles, roles.rank, "g", "s")
    table = [None] * roles.rank
    table[roles.seq] = "s"
    if roles.batch is not None and shapes[2][roles.batch] == shapes[0][roles.batch]:
        table[roles.batch] = "b"
    table = tuple(table)
    if len(shapes) == 4:  # forward, or backward without query/key
        return FactorMap((q, k, table, table), (q, k))
    # backward with query/key: dcos/dsin are summed over heads (and broadcast batch)
    return FactorMap((q, k, table, table, q, k), (q, k, table, table), reduced=(2, 3))


# --- the primitives -------------------------------------------------------------

rope_fwd_p = define_primitive(
    FWD, multiple_results=True, abstract_eval=_fwd_abstract_eval, batcher=_fwd_batch,
    fallback=fallback.rope_forward,
    kernels=_kernels(lambda n: FWD, _npu_lowering(lambda n: npu.ROPE_FWD, IN_PLACE),
                     _npu_forward_gap, cpu_aliases=IN_PLACE),
    factor_map=_factor_map)

rope_bwd_p = define_primitive(
    BWD, multiple_results=True, abstract_eval=_bwd_abstract_eval, batcher=_bwd_batch,
    fallback=fallback.rope_backward,
    kernels=_kernels(lambda n: BWD if n == 6 else BWD_NO_INPUTS, _npu_backward_lowering,
                     _npu_backward_gap),
    factor_map=_factor_map)
