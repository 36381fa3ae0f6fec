"""Platforms JAX may not know yet.

JAX accepts a platform-specific lowering rule (and FFI target) only for a
platform it knows, one with a registered PJRT plugin. A plugin may register
after jax_rope is imported, and lowering for a platform on a machine without
its plugin (the tests, `jax.export` for an NPU from a CPU host) needs the name
made known. `when_known(platform, action)` runs an action now if JAX knows the
platform, else as soon as it does.
"""

from __future__ import annotations

from jax_rope.core import _jax_shim

_pending: list = []  # (platform, action) not yet run


def is_known(platform: str) -> bool:
    return _jax_shim.is_known_platform(platform)


def when_known(platform: str, action) -> None:
    """Runs `action()` once JAX knows `platform` (at once if it does)."""
    _pending.append((platform, action))
    refresh()


def refresh() -> None:
    """Runs the pending actions of every platform JAX now knows."""
    ready = [(p, a) for p, a in _pending if _jax_shim.is_known_platform(p)]
    for item in ready:
        _pending.remove(item)
    for _, action in ready:
        action()


def make_known(platform: str) -> None:
    """Makes `platform` known to JAX without a plugin, so that functions can be
    lowered or exported for it, and runs its pending actions."""
    if not _jax_shim.make_platform_known(platform):
        raise RuntimeError(f"this JAX version cannot be told about platform {platform!r}")
    refresh()


_jax_shim.on_plugins_discovered(refresh)
