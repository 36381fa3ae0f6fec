"""What this installation is: version, compiled extension, backend per platform."""

from __future__ import annotations

import jax
import jaxlib

from jax_rope import _extension, _jax_shim, backends, npu
from jax_rope._version import __version__


def _platform_backends(status) -> dict[str, str]:
    chosen = backends.current_backend()
    table = {}
    for platform in ("cpu", npu.PLATFORM, "other platforms"):
        has_kernel = platform in backends.KERNEL_PLATFORMS + (npu.PLATFORM,) and status.loaded
        if chosen == "fallback" or not has_kernel:
            table[platform] = "error (no kernel)" if chosen == "ffi" else "jnp fallback"
        else:
            table[platform] = ("NPU kernel where the profile covers the call, else jnp fallback"
                               if platform == npu.PLATFORM else "XLA FFI kernel")
    return table


def describe(as_dict: bool = False):
    """Reports the version, whether the compiled extension loaded (and if not,
    why), the backend choice, which implementation each platform lowers to,
    and the NPU runtime state. Returns a str, or a dict with `as_dict=True`."""
    status = _extension.STATUS
    info = {
        "jax_rope": __version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "extension": ("loaded" if status.loaded else "not loaded") + f" ({status.detail})",
        "extension built against jaxlib": status.built_against_jaxlib or "-",
        "ffi targets": ", ".join(status.targets) or "-",
        "backend": backends.current_backend()
        + ("" if _jax_shim.IN_JIT_KEY else " (not part of the jit cache key in this JAX)"),
        "lowering per platform": _platform_backends(status),
        "platforms with kernels": ", ".join(backends.KERNEL_PLATFORMS + (npu.PLATFORM,))
        if status.loaded else "none",
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
