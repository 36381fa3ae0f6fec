"""Axis moves shared by the batching rules: a vmapped axis is folded into the
batch (or packed token) axis, the kernels run once, and the result is split."""

from __future__ import annotations

import jax.numpy as jnp


def moved(x, bdim, axis: int, size: int):
    """Puts the vmapped axis `bdim` of x at `axis`, broadcasting if unmapped (None)."""
    if bdim is None:
        x = jnp.expand_dims(x, axis)
        return jnp.broadcast_to(x, x.shape[:axis] + (size,) + x.shape[axis + 1:])
    return jnp.moveaxis(x, bdim, axis)


def merge(x, axis: int):
    """Merges axes `axis` and `axis + 1`."""
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def split(x, axis: int, size: int):
    """Splits axis `axis` into (size, rest)."""
    return x.reshape(x.shape[:axis] + (size, x.shape[axis] // size) + x.shape[axis + 1:])


def mapped_size(args, dims) -> int:
    """The size of the vmapped axis."""
    return next(x.shape[d] for x, d in zip(args, dims) if d is not None)
