"""The one place that touches private JAX: config states for the settings,
platform registration for the NPU, and devices while lowering for partitioning.

The backend choice (and whether run-time checks are on) must be part of JAX's
jit cache key, or a function traced under one setting would silently keep it
after it changes. JAX has no public way to define such a state, so it is
defined here, with a plain fallback for JAX versions where the private helper
moved.
"""

from __future__ import annotations

import contextlib
import os

BACKENDS = ("auto", "ffi", "fallback")
RUNTIME_CHECKS = ("on", "off")


class KeyedSetting:
    """A jax_rope setting that is part of JAX's jit cache key, read from the environment
    variable NAME.upper() (JAX_ROPE_BACKEND, JAX_ROPE_RUNTIME_CHECKS) by default."""

    def __init__(self, name: str, values: tuple, default: str, help: str):
        self.name, self.values = name, values
        self._validated(os.environ.get(name.upper(), default))  # a clear message for a bad variable
        try:
            from jax._src import config as _config  # private: see module docstring
            self._state = _config.enum_state(
                name=name, enum_values=list(values), default=default, help=help,
                include_in_jit_key=True, include_in_trace_context=True)
            self.in_jit_key = True
        except (ImportError, AttributeError, TypeError):  # pragma: no cover - other JAX versions
            self._state = None
            self.in_jit_key = False
            self._stack = [self._validated(os.environ.get(name.upper(), default))]

    def _validated(self, value):
        if value not in self.values:
            what = self.name.removeprefix("jax_rope_")
            raise ValueError(f"{what} must be one of {self.values}, got {value!r}")
        return value

    def get(self) -> str:
        return self._state.value if self._state is not None else self._stack[-1]

    def set(self, value: str) -> None:
        if self._state is not None:
            self._state._set(self._validated(value))
        else:  # pragma: no cover
            self._stack[0] = self._validated(value)

    def context(self, value: str):
        if self._state is not None:
            return self._state(self._validated(value))
        return self._fallback_context(self._validated(value))  # pragma: no cover

    @contextlib.contextmanager
    def _fallback_context(self, value):  # pragma: no cover - other JAX versions
        self._stack.append(value)
        try:
            yield
        finally:
            self._stack.pop()


_BACKEND = KeyedSetting(
    "jax_rope_backend", BACKENDS, "auto",
    "jax_rope implementation: auto, ffi (compiled kernels) or fallback (jax.numpy).")
RUNTIME_CHECKS_SETTING = KeyedSetting(
    "jax_rope_runtime_checks", RUNTIME_CHECKS, "on",
    "jax_rope run-time checks of traced lengths/positions through host callbacks: on or off.")
IN_JIT_KEY = _BACKEND.in_jit_key


def get_backend() -> str:
    return _BACKEND.get()


def set_global_backend(name: str) -> None:
    _BACKEND.set(name)


def backend_context(name: str):
    return _BACKEND.context(name)


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
