"""Loads the compiled extension `jax_rope._jax_rope_ffi` (the CPU kernels' FFI
handlers, the NPU handlers and the CANN loader) and registers its CPU targets.

Importing never fails: without the compiled module (a pure-Python install, a
jaxlib older than the one it was built against, an extension whose codes differ
from core/codes.py, or JAX_ROPE_DISABLE_EXTENSION=1) every call uses the
jax.numpy fallback and `describe()` says why.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re

import jax
import jaxlib

from jax_rope.core import codes


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
        compiled = importlib.import_module("jax_rope._jax_rope_ffi")
    except ImportError as error:
        return ExtensionStatus(False, f"compiled module not importable ({error})")
    built = compiled.built_against_jaxlib
    if _version(jaxlib.__version__) < _version(built):
        # FFI ABI rule: handlers built against newer headers do not load here.
        return ExtensionStatus(
            False, f"built against jaxlib {built}, but jaxlib {jaxlib.__version__} is "
            "older; reinstall jax_rope", built)
    if compiled.codes() != codes.tables():
        return ExtensionStatus(False, "its layout/mode codes differ from jax_rope/core/codes.py; "
                               "rebuild jax_rope", built)
    targets = compiled.registrations()
    for name, capsule in targets.items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    return ExtensionStatus(True, compiled.__file__, built, tuple(sorted(targets)))


STATUS = _load()


def module():
    """The compiled module (only when STATUS.loaded)."""
    from jax_rope import _jax_rope_ffi
    return _jax_rope_ffi


def kernels_unavailable() -> str | None:
    """None when the CPU kernels can be lowered to, else why not."""
    if STATUS.loaded:
        return None
    return f"the compiled extension is not loaded: {STATUS.detail}"
