"""Choosing the implementation ("backend" in the public API): the compiled
kernels ("ffi"), the jax.numpy "fallback", or "auto" (kernels where they cover
the case). The choice is read when a call is traced and travels in the
operator's options object, because lowering happens after a `backend(...)`
context has exited."""

from __future__ import annotations

from jax_rope.core import _jax_shim

IMPLEMENTATIONS = _jax_shim.BACKENDS


def set_backend(name: str) -> None:
    """Sets the backend globally: "auto", "ffi" or "fallback".

    The default comes from the JAX_ROPE_BACKEND environment variable. The choice
    is part of the jit cache key, so jitted functions retrace when it changes.
    """
    _jax_shim.set_global_backend(name)


def backend(name: str):
    """Context manager choosing the backend for calls traced inside it."""
    return _jax_shim.backend_context(name)


def current_backend() -> str:
    """The backend calls traced now will use."""
    return _jax_shim.get_backend()
