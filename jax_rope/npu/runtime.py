"""The Ascend NPU at run time: the platform name, the CANN runtime state (per
operator), the chip profile and CANN generation in force, and the NPU
handlers' registration.

The platform name is `npu` unless JAX_ROPE_NPU_PLATFORM says otherwise (the
name the NPU's PJRT plugin registers; a platform JAX already has is refused).
With a CANN runtime loaded, the SoC (aclrtGetSocName) selects the profile (an
unsupported SoC gets none: every call takes the fallback), the libraries say
which operators exist and the install's version file which generation it is.
Without one, lowering for the NPU (`enable_lowering_without_device`) uses
JAX_ROPE_NPU_PROFILE (A2, A3, 310P or 950; default A2) and
JAX_ROPE_CANN_VERSION (default cann.DEFAULT_CANN); without either, the NPU
kernels are unavailable.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax

from jax_rope.core import extension, platforms
from jax_rope.npu import cann
from jax_rope.npu.profiles import DEFAULT_PROFILE, PROFILES, Profile, profile_for_soc

_JAX_PLATFORMS = ("cpu", "cuda", "rocm", "tpu", "gpu", "METAL")
PLATFORM = os.environ.get("JAX_ROPE_NPU_PLATFORM", "npu") or "npu"
if PLATFORM.lower() in {p.lower() for p in _JAX_PLATFORMS}:
    raise ValueError(f"JAX_ROPE_NPU_PLATFORM must name the Ascend NPU's PJRT platform, not one "
                     f"JAX already has ({', '.join(_JAX_PLATFORMS[:4])}); got {PLATFORM!r}")
_lowering_without_device = False


class CannRuntime(NamedTuple):
    available: bool
    detail: str
    soc: str
    acl_library: str
    operators: dict  # aclnn name -> library that defines it, "" when missing


@functools.lru_cache(maxsize=None)
def runtime() -> CannRuntime:
    """The CANN runtime, loaded on first use."""
    if not extension.STATUS.loaded:
        return CannRuntime(False, f"compiled extension not loaded ({extension.STATUS.detail})",
                           "", "", {})
    return CannRuntime(*extension.module().npu_runtime())


def current_profile() -> tuple[Profile | None, str]:
    """The chip profile (None: an unsupported SoC, no NPU kernels) and whence."""
    rt = runtime()
    if rt.available:
        name = profile_for_soc(rt.soc)
        if name is None:
            return None, f"SoC {rt.soc!r} is not supported by jax_rope's NPU operators"
        return PROFILES[name], f"SoC {rt.soc}"
    name = os.environ.get("JAX_ROPE_NPU_PROFILE", DEFAULT_PROFILE)
    if name not in PROFILES:
        raise ValueError(f"JAX_ROPE_NPU_PROFILE must be one of {sorted(PROFILES)}, got {name!r}")
    return PROFILES[name], ("JAX_ROPE_NPU_PROFILE" if "JAX_ROPE_NPU_PROFILE" in os.environ
                            else "default")


def current_cann() -> tuple[cann.Generation, str]:
    """The CANN generation in force and whence: the install's version file when
    a runtime is loaded and has one, else JAX_ROPE_CANN_VERSION or the default."""
    rt = runtime()
    found = cann.installed_version(rt.acl_library) if rt.available else None
    if found is not None:
        version, where = found
        return cann.generation_for(cann.parse_version(version)), f"CANN {version} ({where})"
    return cann.configured()


def operator_library(op: str) -> str | None:
    """Where operator `op` comes from, or None when it cannot be called."""
    rt = runtime()
    if rt.available:
        return rt.operators.get(op) or None
    if _lowering_without_device and op in current_cann()[0].operators:
        return "assumed from the CANN generation (no runtime)"
    return None


def missing_operator(op: str) -> str | None:
    """None when `op` is there to call, else why not."""
    if operator_library(op) is not None:
        return None
    rt = runtime()
    if rt.available:
        return f"{op} is not in this CANN's operator libraries"
    if _lowering_without_device:
        return f"{op} is not in CANN {current_cann()[0].version}"
    return f"the CANN runtime is absent ({rt.detail})"


def kernels_unavailable() -> str | None:
    """Why no NPU kernel can be used at all, or None."""
    why = extension.kernels_unavailable()
    if why is not None:
        return why
    profile, source = current_profile()
    if profile is None:
        return source + ": every call uses the jnp fallback"
    if not runtime().available and not _lowering_without_device:
        return f"the CANN runtime is absent ({runtime().detail})"
    return None


def _register_handlers() -> None:
    if extension.STATUS.loaded:
        for name, capsule in extension.module().npu_registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform=PLATFORM)


platforms.when_known(PLATFORM, _register_handlers)


def enable_lowering_without_device() -> None:
    """Makes PLATFORM known to JAX without a plugin, so that jitted functions can
    be lowered or exported for it on a machine without an NPU; without a CANN
    runtime the NPU kernels are chosen by JAX_ROPE_NPU_PROFILE and
    JAX_ROPE_CANN_VERSION:

        jax_rope.npu.enable_lowering_without_device()
        jax.export.export(jax.jit(f), platforms=["npu"],
                          disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(t)
                                           for t in jax_rope.npu.FFI_TARGETS])(*args)
    """
    global _lowering_without_device
    _lowering_without_device = True
    platforms.make_known(PLATFORM)


def describe() -> dict:
    """The NPU part of jax_rope.describe()."""
    rt = runtime()
    profile, source = current_profile()
    generation, cann_source = current_cann()
    operators = {}
    for op in cann.OPERATORS:
        where = operator_library(op)
        operators[op] = where if where is not None else "missing"
    return {
        "NPU runtime": ("available" if rt.available else "absent") + f" ({rt.detail})",
        "NPU platform": PLATFORM + (" (known to JAX)" if platforms.is_known(PLATFORM)
                                    else " (no PJRT plugin registered)"),
        "NPU profile": (f"{profile.name}: {profile.chips} (from {source})" if profile
                        else f"none: {source}; every call uses the jnp fallback"),
        "NPU CANN": f"{generation.version} generation, {generation.install} (from {cann_source})",
        "NPU operators": operators,
        "NPU rules": profile.rules(generation.partial_rotary) if profile else "no NPU kernels",
    }
