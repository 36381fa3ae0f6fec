"""Choosing the implementation: compiled kernels ("ffi"), the jax.numpy
"fallback", or "auto" (kernels where they cover the case)."""

from __future__ import annotations

from jax_rope import _extension, _jax_shim

BACKENDS = _jax_shim.BACKENDS
KERNEL_PLATFORMS = ("cpu",)


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
    return _jax_shim.get_backend()


def use_kernel(requested: str, platform: str, covered: bool = True) -> bool:
    """Whether a call lowers to our kernel on `platform`; "ffi" without one is an error."""
    available = platform in KERNEL_PLATFORMS and _extension.STATUS.loaded and covered
    if requested == "ffi" and not available:
        if platform not in KERNEL_PLATFORMS:
            why = f"jax_rope has no kernel for platform {platform!r}"
        elif not _extension.STATUS.loaded:
            why = f"the compiled extension is not loaded: {_extension.STATUS.detail}"
        else:
            why = "no kernel covers this case"
        raise ValueError(f"backend 'ffi' was requested but {why}; use 'auto' or 'fallback'")
    return requested != "fallback" and available
