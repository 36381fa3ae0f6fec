"""What this installation is: version, compiled extension, backend per platform."""

from __future__ import annotations

import jax
import jaxlib

from jax_rope import npu
from jax_rope._version import __version__
from jax_rope.core import _jax_shim, extension, implementation, runtime_checks
from jax_rope.core.primitive import DEFINITIONS


def _kernel_platforms() -> tuple[str, ...]:
    found = []
    for definition in DEFINITIONS.values():
        found += [k.platform for k in definition.kernels if k.platform not in found]
    return tuple(found)


def _platform_backends(status, kernel_platforms) -> dict[str, str]:
    chosen = implementation.current_backend()
    table = {}
    for platform in kernel_platforms + ("other platforms",):
        has_kernel = platform in kernel_platforms and status.loaded
        npu_why = npu.kernels_unavailable() if platform == npu.PLATFORM and has_kernel else None
        if chosen == "fallback" or not has_kernel or npu_why:
            table[platform] = "error (no kernel)" if chosen == "ffi" else "jnp fallback"
            if npu_why and chosen != "fallback":
                table[platform] += f" ({npu_why})"
        else:
            table[platform] = ("NPU kernel where the profile covers the call, else jnp fallback"
                               if platform == npu.PLATFORM else "XLA FFI kernel")
    return table


def _runtime_checks() -> str:
    if not runtime_checks.enabled():
        return "off: traced lengths, prefixes and positions are not checked when the call runs"
    return (f"on: traced lengths, prefixes and positions are checked on the host when the call "
            f"runs on {', '.join(runtime_checks.CALLBACK_PLATFORMS)} (host callbacks); on "
            f"{npu.PLATFORM} the NPU handlers check the sequence table, but its jnp fallback "
            "cannot check traced values (no host callbacks there)")


def describe(as_dict: bool = False):
    """Reports the version, whether the compiled extension loaded (and if not,
    why), the backend choice, which implementation each platform lowers to,
    and the NPU runtime state. Returns a str, or a dict with `as_dict=True`."""
    status = extension.STATUS
    kernel_platforms = _kernel_platforms()
    info = {
        "jax_rope": __version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "extension": ("loaded" if status.loaded else "not loaded") + f" ({status.detail})",
        "extension built against jaxlib": status.built_against_jaxlib or "-",
        "ffi targets": ", ".join(status.targets) or "-",
        "backend": implementation.current_backend()
        + ("" if _jax_shim.IN_JIT_KEY else " (not part of the jit cache key in this JAX)"),
        "lowering per platform": _platform_backends(status, kernel_platforms),
        "run-time checks": _runtime_checks(),
        "platforms with kernels": ", ".join(kernel_platforms) if status.loaded else "none",
        **npu.describe(),
        "default JAX platform": jax.default_backend(),
    }
    if as_dict:
        return info
    lines = [f"jax_rope {__version__}"]
    for name, value in info.items():
        if name == "jax_rope":
            continue
        if isinstance(value, dict):
            value = "; ".join(f"{k}: {v}" for k, v in value.items())
        lines.append(f"  {name}: {value}")
    return "\n".join(lines)
