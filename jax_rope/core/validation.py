"""Argument checks shared by both operators: dtypes, arrays and ints, with
messages that name the argument, the expectation and what was given."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def shape_and_dtype(name, x):
    """(shape, dtype) of an array argument; TypeError if x is not an array."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(x.shape), jnp.dtype(x.dtype)


def check_dtypes(named) -> None:
    """All arrays share one dtype among float32, float16, bfloat16."""
    (first, x0), *rest = named
    dtype = jnp.dtype(x0.dtype)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{first} must have dtype float32, float16 or bfloat16, got {dtype.name}")
    for name, x in rest:
        if jnp.dtype(x.dtype) != dtype:
            raise TypeError(
                f"{name} must have the dtype of {first} ({dtype.name}), "
                f"got {jnp.dtype(x.dtype).name}")


def check_int(name, value) -> int:
    """A Python or NumPy int (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return int(value)
