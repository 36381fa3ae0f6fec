"""The one place that touches private JAX: a config state for the backend,
platform registration for the NPU, and devices while lowering for partitioning.

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


# --- platforms JAX may not know yet (see jax_rope/core/platforms.py) ---
# JAX accepts a platform-specific lowering rule only for a platform it knows
# (one with a registered PJRT plugin). A plugin may register after jax_rope is
# imported; and lowering for a platform on a machine without its plugin (the
# tests, `jax.export` for an NPU from a CPU host) needs the name made known.

def is_known_platform(name: str) -> bool:
    try:
        from jax._src import xla_bridge  # private: see module docstring
        return xla_bridge.is_known_platform(name)
    except (ImportError, AttributeError):  # pragma: no cover - other JAX versions
        return False


def make_platform_known(name: str) -> bool:
    """Makes `name` a platform JAX accepts lowering rules for, without a plugin
    (an alias of itself: no backend is created). Returns False where this JAX
    has no such hook."""
    try:
        from jax._src import xla_bridge  # private: see module docstring
        if not xla_bridge.is_known_platform(name):
            xla_bridge._platform_aliases[name] = name
        return xla_bridge.is_known_platform(name)
    except (ImportError, AttributeError, TypeError):  # pragma: no cover
        return False


def on_plugins_discovered(callback) -> None:
    """Calls `callback()` once JAX has discovered its PJRT plugins (at once if
    it already has)."""
    try:
        from jax._src import xla_bridge  # private: see module docstring
        xla_bridge.register_plugin_callbacks(lambda c_api=None: callback())
    except (ImportError, AttributeError):  # pragma: no cover
        pass


# --- partitioning (see jax_rope/core/primitive.py) ---
# A lowering that calls custom_partitioning needs the device assignment; jit
# computes it during lowering only for primitives in a private set.

def require_devices_during_lowering(prim) -> bool:
    """Makes jit pass the device assignment when lowering `prim`. Returns False
    where this JAX has no such set (sharded calls then fail to lower there)."""
    try:
        from jax._src import dispatch  # private: see module docstring
        dispatch.prim_requires_devices_during_lowering.add(prim)
        return True
    except (ImportError, AttributeError):  # pragma: no cover - other JAX versions
        return False
