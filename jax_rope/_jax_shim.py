"""The one place that touches private JAX: a config state for the backend.

The backend choice must be part of JAX's jit cache key, or a function traced
under one backend would silently keep it after `set_backend`. JAX has no public
way to define such a state, so it is defined here, with a plain fallback for
JAX versions where the private helper moved.
"""

from __future__ import annotations

import contextlib
import os

BACKENDS = ("auto", "ffi", "fallback")
_ENV = "JAX_ROPE_BACKEND"


def _validated(name):
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name


_validated(os.environ.get(_ENV, "auto"))  # a clear message for a bad variable

try:
    from jax._src import config as _config  # private: see module docstring

    _STATE = _config.enum_state(
        name="jax_rope_backend",  # the environment variable JAX_ROPE_BACKEND
        enum_values=list(BACKENDS),
        default="auto",
        help="jax_rope implementation: auto, ffi (compiled kernels) or fallback (jax.numpy).",
        include_in_jit_key=True,
        include_in_trace_context=True,
    )
    IN_JIT_KEY = True

    def get_backend() -> str:
        return _STATE.value

    def set_global_backend(name: str) -> None:
        _STATE._set(_validated(name))

    def backend_context(name: str):
        return _STATE(_validated(name))

except (ImportError, AttributeError, TypeError):  # pragma: no cover - other JAX versions
    IN_JIT_KEY = False
    _global = [_validated(os.environ.get(_ENV, "auto"))]

    def get_backend() -> str:
        return _global[-1]

    def set_global_backend(name: str) -> None:
        _global[0] = _validated(name)

    @contextlib.contextmanager
    def backend_context(name: str):
        _global.append(_validated(name))
        try:
            yield
        finally:
            _global.pop()
