"""Partitioning: every primitive splits over batch and heads without communication.

A primitive's definition (core/primitive.py) names, per call, a factor map: a
factor for each axis of every operand and result, "b" batch (and the sequence
table's rows), "s" the sequence/token axis (RoPE only: it is elementwise along
it), "h" query heads, "g" key/value heads (sharded on the same mesh axes as
"h", so GQA groups stay together); any other axis is replicated. This module
knows no primitive: from the factor map it builds the
`jax.experimental.custom_partitioning` call that wraps the primitive's
one-device ("local") form. Shardy propagation gets the same map as an
einsum-like sharding rule; the partition callback keeps the mesh axes the
operands carry for those factors where they divide every axis of that factor,
and runs the local primitive on the local blocks. Only results that lack a
factor the operands have (RoPE's dcos/dsin, summed over heads, and over batch
when cos has batch 1) get a psum over those axes: an all-reduce, as any
data-parallel gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

_GROUPS = (("b",), ("s",), ("h", "g"))  # factors sharing mesh axes are decided together


@dataclasses.dataclass(frozen=True)
class FactorMap:
    """Factor name (or None: replicated) per axis of every operand and result."""

    operands: tuple
    results: tuple
    reduced: tuple = ()  # result indices summed over the factors they lack


def axis_factors(roles, rank: int, head: str | None, seq: str | None = None) -> tuple:
    """Factors of a tensor laid out by `roles` (core.layouts.AxisRoles): "b" on
    the batch axis, `head` on the head axis, `seq` on the sequence axis."""
    factors = [None] * rank
    if roles.batch is not None:
        factors[roles.batch] = "b"
    factors[roles.seq] = seq
    factors[roles.head] = head
    return tuple(factors)


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
# The static argument is a `Partitioned` (hashable): the local primitive, the
# function giving a call's factor map, and the call's parameters.

@dataclasses.dataclass(frozen=True)
class Partitioned:
    local: object  # the one-device primitive
    factor_map: object  # factor_map(params: dict, operand shapes) -> FactorMap
    params: tuple  # sorted (name, value) pairs

    def fmap(self, shapes) -> FactorMap:
        return self.factor_map(dict(self.params), shapes)

    def out(self, values):
        return list(values) if self.local.multiple_results else values[0]


def _decide(static: Partitioned, mesh, arg_shapes):
    args = jax.tree.leaves(arg_shapes)
    shapes = [tuple(a.shape) for a in args]
    fmap = static.fmap(shapes)
    return fmap, decide(fmap, shapes, [a.sharding for a in args], mesh)


def _infer(static, mesh, arg_shapes, result_shape):
    fmap, assigned = _decide(static, mesh, arg_shapes)
    return static.out([_named(mesh, f, assigned) for f in fmap.results])


def _partition(static, mesh, arg_shapes, result_shape):
    fmap, assigned = _decide(static, mesh, arg_shapes)
    arg_shardings = (tuple(_named(mesh, f, assigned) for f in fmap.operands),)
    result_shardings = static.out([_named(mesh, f, assigned) for f in fmap.results])
    reductions = {i: _reduce_axes(fmap, i, assigned) for i in fmap.reduced}

    def lower_fn(args):
        outs = static.local.bind(*args, **dict(static.params))
        outs = list(outs) if static.local.multiple_results else [outs]
        for i, axes in reductions.items():
            if axes:  # partial sums over local heads/batch: add them up
                outs[i] = jax.lax.psum(outs[i], axes)
        return static.out(outs)

    return mesh, lower_fn, result_shardings, arg_shardings


def _rule_string(static, mesh, value_types, result_types):
    shapes = [tuple(mlir.ir.RankedTensorType(t).shape) for t in value_types]
    fmap = static.fmap(shapes)
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
def _custom_partitioning():
    def call(static, args):
        return static.local.bind(*args, **dict(static.params))

    cp = custom_partitioning(call, static_argnums=(0,))
    cp.def_partition(partition=_partition, infer_sharding_from_operands=_infer,
                     sharding_rule=_rule_string)
    return cp


def partitioned_bind(local, factor_map, args, params):
    """Binds `local` on `args` inside a custom_partitioning call that splits it
    by the call's factor map (see the module docstring)."""
    static = Partitioned(local, factor_map, tuple(sorted(params.items())))
    return _custom_partitioning()(static, tuple(args))
