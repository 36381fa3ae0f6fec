"""Run-time checks of traced values: lengths, prefixes and positions that are
only known when the computation runs.

Values known at trace time are checked at trace time. A traced value is checked
on the host when the computation runs: `checked(values, check)` returns the
values through a `jax.pure_callback` that calls `check(*numpy values)` first,
so everything computed from them (the kernel's sequence table, the fallback's
visibility) waits for the check, and its ValueError (which names the argument)
stops the computation with an error on every backend, the CPU kernel and the
jnp fallback alike. The callback exists only on platforms with host callbacks
(cpu, cuda, rocm, tpu); elsewhere (an NPU plugin) the value passes unchecked:
the NPU handlers check the sequence table themselves, the fallback there
cannot (describe() says so).

Cost: one host round trip per operator call with traced values (tens of
microseconds on CPU; a device synchronisation on accelerators). Host callbacks
cannot be serialised by jax.export, which then fails saying so: switch the
checks off with `jax_rope.runtime_checks(False)` (a context manager),
`set_runtime_checks`, or JAX_ROPE_RUNTIME_CHECKS=off. The setting is part of
the jit cache key.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir, xla

from jax_rope.core import _jax_shim
from jax_rope.core import batching as batching_helpers

#: Platforms whose PJRT backends run host callbacks.
CALLBACK_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def set_runtime_checks(enabled: bool) -> None:
    """Turns the run-time checks of traced lengths/positions on or off globally."""
    _jax_shim.RUNTIME_CHECKS_SETTING.set(_value(enabled))


def runtime_checks(enabled: bool):
    """Context manager turning the run-time checks on or off for calls traced inside it
    (off, e.g., to jax.export functions with traced lengths)."""
    return _jax_shim.RUNTIME_CHECKS_SETTING.context(_value(enabled))


def enabled() -> bool:
    return _jax_shim.RUNTIME_CHECKS_SETTING.get() == "on"


def _value(enabled) -> str:
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {enabled!r}")
    return "on" if enabled else "off"


def is_traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def checked(values: tuple, check) -> tuple:
    """`values` (arrays) unchanged; when the checks are on and one is traced, `check(*values
    as NumPy arrays)` runs on the host before anything that uses them (see module doc)."""
    if not enabled() or not any(is_traced(v) for v in values):
        return tuple(values)
    return tuple(host_check_p.bind(*(jax.numpy.asarray(v) for v in values), check=check))


# --- the primitive: a pure_callback that jax.export refuses with a clear message ----------

EXPORT_HINT = ("jax_rope checks traced lengths/prefixes/positions on the host when the call "
               "runs (a host callback), which jax.export cannot serialise: export inside "
               "`with jax_rope.runtime_checks(False):` (or set JAX_ROPE_RUNTIME_CHECKS=off)")

host_check_p = Primitive("jax_rope_host_check")
host_check_p.multiple_results = True
host_check_p.def_impl(functools.partial(xla.apply_primitive, host_check_p))
host_check_p.def_abstract_eval(lambda *avals, check: avals)


def _with_callback(*values, check):
    shapes = tuple(jax.ShapeDtypeStruct(v.shape, v.dtype) for v in values)

    def host(*arrays):
        check(*(np.asarray(a) for a in arrays))
        return tuple(np.asarray(a) for a in arrays)

    def callback(*xs):
        return jax.pure_callback(host, shapes, *xs, vmap_method="sequential")

    branches = {platform: callback for platform in CALLBACK_PLATFORMS}
    return tuple(jax.lax.platform_dependent(*values, **branches, default=lambda *xs: xs))


def _lowering(ctx, *args, check):
    if ctx.module_context.lowering_parameters.for_export:
        raise ValueError(EXPORT_HINT)
    return mlir.lower_fun(functools.partial(_with_callback, check=check),
                          multiple_results=True)(ctx, *args)


@dataclasses.dataclass(frozen=True)
class _PerExample:
    """A check of unbatched values, run on each example of a vmapped batch (axis 0)."""

    check: object

    def __call__(self, *arrays):
        for i in range(arrays[0].shape[0]):
            self.check(*(a[i] for a in arrays))


def _batching(args, dims, *, check):
    size = batching_helpers.mapped_size(args, dims)
    moved = [batching_helpers.moved(x, d, 0, size) for x, d in zip(args, dims)]
    outs = host_check_p.bind(*moved, check=_PerExample(check))
    return outs, [0] * len(outs)


def _jvp(primals, tangents, *, check):  # integer values: no tangents to carry
    outs = host_check_p.bind(*primals, check=check)
    return outs, [ad.Zero.from_primal_value(o) for o in outs]


mlir.register_lowering(host_check_p, _lowering)
batching.primitive_batchers[host_check_p] = _batching
ad.primitive_jvps[host_check_p] = _jvp


def fits_int32(name: str, x):
    """x (an integer array) unchanged; its values must fit in int32, the kernels' index
    type: checked now when concrete, when the computation runs when traced (64-bit only)."""
    def check(values):
        values = np.asarray(values)
        if values.size and (values.min() < -2**31 or values.max() > 2**31 - 1):
            bad = values[(values < -2**31) | (values > 2**31 - 1)].reshape(-1)[:4].tolist()
            raise ValueError(f"{name} values must fit in int32 [-2**31, 2**31 - 1], got {bad}")

    if not is_traced(x):
        check(x)
        return x
    if np.dtype(x.dtype).itemsize <= 4:
        return x
    return checked((x,), check)[0]
