"""Partitioning rules: every primitive splits over batch and heads without communication.

Mechanism: each primitive's own lowering rule (cpu and default platform, from
its module's LOWERING_RULES) is wrapped in a `jax.experimental.custom_partitioning`
call around a private "local" twin of the primitive, which lowers exactly as the primitive always did (kernel or fallback,
by options.backend). Because the wrapping happens at lowering time, jit, vmap
(folded before lowering), grad (custom_vjp over fwd/bwd primitives), scan and
the backend switch all see the ordinary primitives; with one device, or inside
a fully manual shard_map, the twin is lowered directly and the program is the
one it always was.

Per primitive, a factor map names each operand/result axis: "b" batch (and the
sequence table's rows), "s" the sequence/token axis (RoPE only: it is element-
wise along it), "h" query heads, "g" key/value heads (sharded on the same mesh
axes as "h", so GQA groups stay together). Any other axis is replicated. Shardy
propagation gets the same map as an einsum-like sharding rule; the partition
callback keeps the mesh axes the operands carry for those factors where they
divide every axis of that factor, and runs the twin on the local blocks. Only
dcos/dsin of the RoPE backward, summed over heads (and over batch when cos has
batch 1), get a psum over those axes: an all-reduce, as any data-parallel
gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from jax_rope import _jax_shim, attention_primitives, rope_primitives

_GROUPS = (("b",), ("s",), ("h", "g"))  # factors sharing mesh axes are decided together


@dataclasses.dataclass(frozen=True)
class FactorMap:
    """Factor name (or None: replicated) per axis of every operand and result."""

    operands: tuple
    results: tuple
    reduced: tuple = ()  # result indices summed over the factors they lack


def _tensor(roles, rank, head, seq=None):
    f = [None] * rank
    if roles.batch is not None:
        f[roles.batch] = "b"
    f[roles.seq] = seq
    f[roles.head] = head
    return tuple(f)


def _rope_map(options, shapes, backward):
    roles = options.roles
    rank = roles.rank
    q, k = _tensor(roles, rank, "h", "s"), _tensor(roles, rank, "g", "s")
    table = [None] * rank
    table[roles.seq] = "s"
    if roles.batch is not None and shapes[2][roles.batch] == shapes[0][roles.batch]:
        table[roles.batch] = "b"
    table = tuple(table)
    if not backward:
        return FactorMap((q, k, table, table), (q, k))
    ops = (q, k, table, table) + ((q, k) if len(shapes) == 6 else ())
    if len(shapes) == 6:
        return FactorMap(ops, (q, k, table, table), reduced=(2, 3))
    return FactorMap(ops, (q, k))


def _attention_map(prim, options, shapes):
    roles, varlen = options.info.roles, options.varlen
    rank = len(shapes[0])
    q, kv = _tensor(roles, rank, "h"), _tensor(roles, rank, "g")
    table = (None, None) if varlen else ("b", None)
    stats = (None, "h") if varlen else ("b", "h", None)
    mask = ()
    if options.has_mask:
        bm, nm = shapes[-1][:2]
        batch = None if varlen else shapes[0][roles.batch]
        heads = shapes[0][roles.head]
        mask = (("b" if bm == batch else None, "h" if nm == heads else None, None, None),)
    if prim is attention_primitives.attention_scores_p:
        scores = ("h", None, None) if varlen else ("b", "h", None, None)
        return FactorMap((q, kv, table) + mask, (scores,))
    if prim is attention_primitives.attention_fwd_p:
        return FactorMap((q, kv, kv, table) + mask, (q, stats, stats))
    return FactorMap((q, kv, kv, q, q, stats, stats, table) + mask, (q, kv, kv))


def factor_map(prim, params, shapes) -> FactorMap:
    """The factor map of one primitive call (shapes of its operands)."""
    if prim is rope_primitives.rope_fwd_p or prim is rope_primitives.rope_bwd_p:
        return _rope_map(params["options"], shapes, prim is rope_primitives.rope_bwd_p)
    return _attention_map(prim, params["options"], shapes)


# --- deciding the mesh axes of each factor -----------------------------------

def _axes(entry):
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _spec_axes(sharding, ndim):
    if not isinstance(sharding, NamedSharding):
        return ((),) * ndim
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return tuple(_axes(e) for e in spec)


def decide(fmap: FactorMap, shapes, shardings, mesh) -> dict:
    """Mesh axes per factor, taken from the first operand sharding that factor,
    kept only when they divide every axis of the factor's group."""
    dims = {}
    for factors, shape in zip(fmap.operands, shapes):
        for f, size in zip(factors, shape):
            if f is not None:
                dims.setdefault(f, []).append(size)
    assigned, used = {}, set()
    for group in _GROUPS:
        candidate = ()
        for factors, shape, sharding in zip(fmap.operands, shapes, shardings):
            for f, axes in zip(factors, _spec_axes(sharding, len(shape))):
                if f in group and axes and not candidate:
                    candidate = axes
        if not candidate or used & set(candidate):
            continue
        count = math.prod(mesh.shape[a] for a in candidate)
        if all(size % count == 0 for f in group for size in dims.get(f, ())):
            assigned.update((f, candidate) for f in group)
            used |= set(candidate)
    return assigned


def _named(mesh, factors, assigned):
    spec = []
    for f in factors:
        axes = assigned.get(f, ())
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return NamedSharding(mesh, PartitionSpec(*spec))


def _reduce_axes(fmap, result_index, assigned):
    present = set(fmap.results[result_index])
    axes = []
    for factors in fmap.operands:
        for f in factors:
            if f is not None and f not in present:
                axes += [a for a in assigned.get(f, ()) if a not in axes]
    return tuple(axes)


# --- custom_partitioning callbacks -------------------------------------------

def _leaves(tree):
    return jax.tree.leaves(tree)


def _plan(static, mesh, arg_shapes):
    prim, local, params = static
    args = _leaves(arg_shapes)
    shapes = [tuple(a.shape) for a in args]
    fmap = factor_map(prim, dict(params), shapes)
    assigned = decide(fmap, shapes, [a.sharding for a in args], mesh)
    return prim, local, dict(params), fmap, assigned


def _out(prim, values):
    return list(values) if prim.multiple_results else values[0]


def _infer(static, mesh, arg_shapes, result_shape):
    prim, _, _, fmap, assigned = _plan(static, mesh, arg_shapes)
    return _out(prim, [_named(mesh, f, assigned) for f in fmap.results])


def _partition(static, mesh, arg_shapes, result_shape):
    prim, local, params, fmap, assigned = _plan(static, mesh, arg_shapes)
    arg_shardings = (tuple(_named(mesh, f, assigned) for f in fmap.operands),)
    result_shardings = _out(prim, [_named(mesh, f, assigned) for f in fmap.results])
    reductions = {i: _reduce_axes(fmap, i, assigned) for i in fmap.reduced}

    def lower_fn(args):
        outs = local.bind(*args, **params)
        outs = list(outs) if prim.multiple_results else [outs]
        for i, axes in reductions.items():
            if axes:  # partial sums over local heads/batch: add them up
                outs[i] = jax.lax.psum(outs[i], axes)
        return _out(prim, outs)

    return mesh, lower_fn, result_shardings, arg_shardings


def _rule_string(static, mesh, value_types, result_types):
    prim, _, params = static
    shapes = [tuple(mlir.ir.RankedTensorType(t).shape) for t in value_types]
    fmap = factor_map(prim, dict(params), shapes)
    replicated = []

    def names(group, tag):
        out = []
        for i, factors in enumerate(group):
            dims = []
            for d, f in enumerate(factors):
                if f is None:
                    f = f"{tag}{i}_{d}"
                    replicated.append(f)
                dims.append(f)
            out.append(" ".join(dims))
        return ", ".join(out)

    rule = names(fmap.operands, "x") + " -> " + names(fmap.results, "y")
    return rule, {"need_replication_factors": tuple(replicated)}


@functools.cache
def _partitioned():
    def call(static, args):
        prim, local, params = static
        return local.bind(*args, **dict(params))

    cp = custom_partitioning(call, static_argnums=(0,))
    cp.def_partition(partition=_partition, infer_sharding_from_operands=_infer,
                     sharding_rule=_rule_string)
    return cp


# --- installing the rules ----------------------------------------------------

def _local_twin(prim, rule):
    local = Primitive(prim.name + "_local")
    local.multiple_results = prim.multiple_results
    local.def_effectful_abstract_eval(prim.abstract_eval)
    mlir.register_lowering(local, rule)
    mlir.register_lowering(local, functools.partial(rule, platform="cpu"), platform="cpu")
    return local


def _install(prim, rule):
    local = _local_twin(prim, rule)

    def partitioned(*args, **params):
        static = (prim, local, tuple(sorted(params.items())))
        return _partitioned()(static, tuple(args))

    sharded = mlir.lower_fun(partitioned, multiple_results=prim.multiple_results)
    direct = mlir.lower_fun(local.bind, multiple_results=prim.multiple_results)

    def lowering(ctx, *args, **params):
        context = ctx.module_context.axis_context
        if getattr(context, "num_devices", 2) == 1:  # one device: nothing to partition
            return direct(ctx, *args, **params)
        return sharded(ctx, *args, **params)

    mlir.register_lowering(prim, lowering)
    mlir.register_lowering(prim, lowering, platform="cpu")
    # custom_partitioning needs the device assignment while lowering; jit computes it
    # only for primitives that ask for it.
    _jax_shim.require_devices_during_lowering(prim)
    return local


# The twins lower with the primitives' own rules (kernel where allowed, else jnp).
LOCAL_PRIMITIVES = {
    prim: _install(prim, rule)
    for rules in (rope_primitives.LOWERING_RULES, attention_primitives.LOWERING_RULES)
    for prim, rule in rules.items()
}
