"""One registration per primitive: abstract evaluation, batching, the lowering
for every platform and the partitioning, defined together in one call.

`define_primitive(...)` builds a pair, as TransformerEngine's
`register_primitive` and JAX's cuDNN attention do:

- the **outer** primitive is what the operators bind. It has the operator's
  abstract evaluation and batching rule; its lowering, the same on every
  platform, lowers the inner primitive directly on one device and wraps it in
  `custom_partitioning` (core/partitioning.py, by the call's factor map) under
  a sharded jit, so sharded inputs are never gathered, on the NPU as on CPU.
- the **inner** ("local") primitive computes on one device's operands. Its
  lowering picks per platform: the platform's compiled `Kernel` where one
  exists and covers the call, unless the implementation choice says
  "fallback"; else the jax.numpy fallback. "ffi" where no kernel covers the
  call is an error, never a silent fallback.

Validation happens once, in the operator's public function: abstract
evaluation only infers shapes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from jax.extend.core import Primitive
from jax.interpreters import batching, mlir, xla

from jax_rope.core import _jax_shim, partitioning, platforms


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A compiled kernel of a primitive on one platform.

    lower(ctx, *args, options) is an MLIR lowering rule; gap(options, avals_in)
    returns None when the kernel covers the call, else why not; unavailable()
    returns None when the kernel can run at all, else why not.
    """

    platform: str
    lower: Callable
    gap: Callable = lambda options, avals_in: None
    unavailable: Callable = lambda: None


@dataclasses.dataclass(frozen=True)
class Definition:
    """What `define_primitive` built: the primitive to bind and its local form."""

    primitive: Primitive
    local: Primitive
    kernels: tuple[Kernel, ...]
    local_rules: dict  # platform (None: every other) -> the local primitive's lowering rule


#: Every defined primitive, by name.
DEFINITIONS: dict[str, Definition] = {}


def _reason_not_to_use(kernel: Kernel | None, platform: str, options, avals_in) -> str | None:
    if kernel is None:
        return f"jax_rope has no kernel for platform {platform!r}"
    why = kernel.unavailable()
    if why is not None:
        return why
    gap = kernel.gap(options, avals_in)
    return None if gap is None else f"no {platform} kernel covers this case ({gap})"


def _local_lowering(kernel: Kernel | None, fallback_rule):
    def rule(ctx, *args, options):
        platform = kernel.platform if kernel else ctx.module_context.platforms[0]
        why = _reason_not_to_use(kernel, platform, options, ctx.avals_in)
        if options.backend == "ffi" and why is not None:
            raise ValueError(f"backend 'ffi' was requested but {why}; use 'auto' or 'fallback'")
        if options.backend != "fallback" and why is None:
            return kernel.lower(ctx, *args, options=options)
        return fallback_rule(ctx, *args, options=options)

    return rule


def _one_device(ctx) -> bool:
    context = ctx.module_context.axis_context
    return isinstance(context, mlir.ShardingContext) and context.num_devices == 1


def define_primitive(name: str, *, multiple_results: bool, abstract_eval: Callable,
                     batcher: Callable, fallback: Callable, kernels: tuple[Kernel, ...],
                     factor_map: Callable) -> Primitive:
    """Defines primitive `name` and registers all its rules; returns it.

    Args:
      abstract_eval: (*avals, options) -> result aval(s); shape inference only.
      batcher: JAX batching rule (args, dims, *, options) binding the returned primitive.
      fallback: jax.numpy implementation (*args, options) -> result(s).
      kernels: the compiled kernels, at most one per platform.
      factor_map: (params, operand shapes) -> core.partitioning.FactorMap.
    """
    outer, local = Primitive(name), Primitive(name + "_local")
    for prim in (outer, local):
        prim.multiple_results = multiple_results
        prim.def_impl(functools.partial(xla.apply_primitive, prim))
        prim.def_abstract_eval(abstract_eval)
    batching.primitive_batchers[outer] = batcher

    fallback_rule = mlir.lower_fun(fallback, multiple_results=multiple_results)
    local_rules = {None: _local_lowering(None, fallback_rule)}
    mlir.register_lowering(local, local_rules[None])
    for kernel in kernels:
        rule = local_rules[kernel.platform] = _local_lowering(kernel, fallback_rule)
        platforms.when_known(kernel.platform, functools.partial(
            mlir.register_lowering, local, rule, platform=kernel.platform))

    direct = mlir.lower_fun(local.bind, multiple_results=multiple_results)
    sharded = mlir.lower_fun(
        lambda *args, **params: partitioning.partitioned_bind(local, factor_map, args, params),
        multiple_results=multiple_results)

    def lowering(ctx, *args, **params):
        return (direct if _one_device(ctx) else sharded)(ctx, *args, **params)

    mlir.register_lowering(outer, lowering)  # every platform: no platform-specific rule
    # custom_partitioning needs the device assignment while lowering; jit computes
    # it only for primitives that ask for it.
    _jax_shim.require_devices_during_lowering(outer)
    DEFINITIONS[name] = Definition(outer, local, tuple(kernels), local_rules)
    return outer
