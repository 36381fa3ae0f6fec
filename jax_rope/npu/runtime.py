"""The Ascend NPU at run time: the platform name, the CANN runtime state, the
chip profile in force, and the NPU handlers' registration.

The platform name is `npu` unless JAX_ROPE_NPU_PLATFORM says otherwise (the
name the NPU's PJRT plugin registers). The chip profile comes from the CANN
runtime (aclrtGetSocName) when it is loaded, else from JAX_ROPE_NPU_PROFILE
(A2, A3, 310P or 950; default A2), e.g. when exporting for an NPU from a host
without one.
"""

from __future__ import annotations

import functools
import os

import jax

from jax_rope.core import extension, platforms
from jax_rope.npu.profiles import DEFAULT_PROFILE, PROFILES, Profile, profile_for_soc

PLATFORM = os.environ.get("JAX_ROPE_NPU_PLATFORM", "npu") or "npu"


@functools.lru_cache(maxsize=None)
def runtime() -> tuple[bool, str, str]:
    """(available, detail, SoC name) of the CANN runtime, loaded on first use."""
    if not extension.STATUS.loaded:
        return False, f"compiled extension not loaded ({extension.STATUS.detail})", ""
    return tuple(extension.module().npu_runtime())


def current_profile() -> tuple[Profile, str]:
    """The chip profile and where it came from."""
    available, _, soc = runtime()
    if available and soc:
        name = profile_for_soc(soc)
        if name is not None:
            return PROFILES[name], f"SoC {soc}"
    name = os.environ.get("JAX_ROPE_NPU_PROFILE", DEFAULT_PROFILE)
    if name not in PROFILES:
        raise ValueError(f"JAX_ROPE_NPU_PROFILE must be one of {sorted(PROFILES)}, got {name!r}")
    where = f"SoC {soc} not recognised; " if available else ""
    return PROFILES[name], where + ("JAX_ROPE_NPU_PROFILE" if "JAX_ROPE_NPU_PROFILE" in os.environ
                                    else "default")


def _register_handlers() -> None:
    if extension.STATUS.loaded:
        for name, capsule in extension.module().npu_registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform=PLATFORM)


platforms.when_known(PLATFORM, _register_handlers)


def enable_lowering_without_device() -> None:
    """Makes PLATFORM known to JAX without a plugin, so that jitted functions can
    be lowered or exported for it on a machine without an NPU:

        jax_rope.npu.enable_lowering_without_device()
        jax.export.export(jax.jit(f), platforms=["npu"],
                          disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(t)
                                           for t in jax_rope.npu.FFI_TARGETS])(*args)
    """
    platforms.make_known(PLATFORM)


def describe() -> dict:
    available, detail, soc = runtime()
    profile, source = current_profile()
    return {
        "NPU runtime": ("available" if available else "absent") + f" ({detail})",
        "NPU platform": PLATFORM + (" (known to JAX)" if platforms.is_known(PLATFORM)
                                    else " (no PJRT plugin registered)"),
        "NPU profile": f"{profile.name}: {profile.chips} (from {source})",
        "NPU rules": profile.rules(),
    }
