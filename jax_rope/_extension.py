"""Loads the compiled CPU extension and registers its FFI targets with XLA.

Importing never fails: without the compiled module (a pure-Python install, a
jaxlib older than the one it was built against, or JAX_ROPE_DISABLE_EXTENSION=1)
every call uses the jax.numpy fallback and `describe()` says why.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jaxlib


@dataclasses.dataclass(frozen=True)
class ExtensionStatus:
    loaded: bool
    detail: str  # why it did not load, or where it came from
    built_against_jaxlib: str | None = None
    targets: tuple[str, ...] = ()


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _load() -> ExtensionStatus:
    if os.environ.get("JAX_ROPE_DISABLE_EXTENSION", "") not in ("", "0"):
        return ExtensionStatus(False, "disabled by JAX_ROPE_DISABLE_EXTENSION")
    try:
        from jax_rope import _jax_rope_cpu as module
    except ImportError as error:
        return ExtensionStatus(False, f"compiled module not importable ({error})")
    built = module.built_against_jaxlib
    if _version(jaxlib.__version__) < _version(built):
        # FFI ABI rule: handlers built against newer headers do not load here.
        return ExtensionStatus(
            False, f"built against jaxlib {built}, but jaxlib {jaxlib.__version__} is "
            "older; reinstall jax_rope", built)
    targets = module.registrations()
    for name, capsule in targets.items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    return ExtensionStatus(True, module.__file__, built, tuple(sorted(targets)))


STATUS = _load()


def module():
    """The compiled module (only when STATUS.loaded)."""
    from jax_rope import _jax_rope_cpu
    return _jax_rope_cpu
