"""Ascend NPU lowering: per-chip profiles, the choice between the NPU's fused
kernels and the jnp fallback, and the lowering rules for the NPU platform.

The platform name is `npu` unless JAX_ROPE_NPU_PLATFORM says otherwise (the
name the NPU's PJRT plugin registers). The chip profile comes from the CANN
runtime (aclrtGetSocName) when it is loaded, else from JAX_ROPE_NPU_PROFILE
(A2, A3, 310P or 950; default A2), e.g. when exporting for an NPU from a host
without one. Each call lowers to the NPU kernel where the profile covers it
(spec/rope.md "NPU operator limits"; FlashAttentionScore's documented limits)
and to the jnp fallback, on the same platform, everywhere else.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from jax_rope import _extension, _jax_shim

PLATFORM = os.environ.get("JAX_ROPE_NPU_PLATFORM", "npu") or "npu"
DEFAULT_PROFILE = "A2"
STATS_WIDTH = 8  # the NPU pads softmax_max / softmax_sum to a trailing axis of 8

ROPE_FWD, ROPE_BWD, ROPE_BWD_NO_INPUTS = (
    "jax_rope_npu_rope_fwd", "jax_rope_npu_rope_bwd", "jax_rope_npu_rope_bwd_no_inputs")
ATTENTION_FWD, ATTENTION_BWD = "jax_rope_npu_attention_fwd", "jax_rope_npu_attention_bwd"
#: Custom-call targets of the NPU kernels (for jax.export's disabled_checks).
FFI_TARGETS = (ROPE_FWD, ROPE_BWD, ROPE_BWD_NO_INPUTS, ATTENTION_FWD, ATTENTION_BWD)

_F32, _F16, _BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class Profile:
    """What one chip family's fused kernels cover."""

    name: str
    chips: str
    rope_fwd_layouts: tuple[str, ...]
    rope_dims: tuple[int, ...] | None  # allowed D and r; None: any D <= rope_max_dim
    rope_max_dim: int
    rope_max_heads: int | None  # Nq + Nk limit
    rope_cos_batch_full: bool  # cos batch must equal query batch
    rope_dtypes: tuple
    rope_bwd_layouts: tuple[str, ...]  # empty: no fused backward
    attention: bool  # FlashAttentionScore(+Grad) available
    attention_max_dim: int = 768
    attention_max_heads: int = 256

    def rules(self) -> str:
        dims = (f"D and r in {set(self.rope_dims)}" if self.rope_dims
                else f"D <= {self.rope_max_dim}")
        parts = [f"RoPE forward: layouts {'/'.join(self.rope_fwd_layouts)}, {dims}, r <= D"]
        if self.rope_max_heads:
            parts.append(f"Nq + Nk <= {self.rope_max_heads}")
        parts.append("cos batch == query batch" if self.rope_cos_batch_full
                     else "cos batch 1 or B")
        if _BF16 not in self.rope_dtypes:
            parts.append("no bfloat16")
        parts.append(f"RoPE backward: half mode, layouts {'/'.join(self.rope_bwd_layouts)}, r == D"
                     if self.rope_bwd_layouts else "RoPE backward: jnp fallback")
        parts.append(f"attention fwd/bwd: D <= {self.attention_max_dim}, N1 <= "
                     f"{self.attention_max_heads}, every sparse_mode" if self.attention
                     else "attention: jnp fallback")
        return "; ".join(parts)


_ALL = (_F32, _F16, _BF16)
PROFILES = {
    "A2": Profile("A2", "Atlas A2 training/inference", ("BSND", "TND"), (64, 128), 128, 255,
                  True, _ALL, (), True),
    "A3": Profile("A3", "Atlas A3 training/inference", ("BSND", "TND"), (64, 128), 128, 255,
                  True, _ALL, (), True),
    "310P": Profile("310P", "Atlas inference (310P)", ("BSND", "TND"), (64, 128), 128, 255,
                    True, (_F32, _F16), (), False),
    "950": Profile("950", "Ascend 950", ("BSND", "SBND", "BNSD", "TND"), None, 1024, None,
                   False, _ALL, ("BSND", "SBND", "TND"), False),
}


def profile_for_soc(soc: str) -> str | None:
    """The profile of a CANN SoC name (aclrtGetSocName), or None if unknown."""
    s = soc.replace(" ", "").lower()
    if s.startswith(("ascend910_95", "ascend950")):
        return "950"
    if s.startswith("ascend910_93"):
        return "A3"
    if s.startswith("ascend910b"):
        return "A2"
    if s.startswith("ascend310p"):
        return "310P"
    return None


@functools.lru_cache(maxsize=None)
def runtime() -> tuple[bool, str, str]:
    """(available, detail, SoC name) of the CANN runtime, loaded on first use."""
    if not _extension.STATUS.loaded:
        return False, f"compiled extension not loaded ({_extension.STATUS.detail})", ""
    return tuple(_extension.module().npu_runtime())


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


# --- coverage: None when the NPU kernel covers a call, else the reason -------------

def rope_forward_gap(p: Profile, options, query, key, cos) -> str | None:
    roles = options.roles
    head_dim, rotary_dim = query.shape[-1], cos.shape[-1]
    if options.layout not in p.rope_fwd_layouts:
        return f"layout {options.layout} (profile {p.name}: {'/'.join(p.rope_fwd_layouts)})"
    if jnp.dtype(query.dtype) not in p.rope_dtypes:
        return f"dtype {jnp.dtype(query.dtype).name} on profile {p.name}"
    if p.rope_dims is not None and (head_dim not in p.rope_dims or rotary_dim not in p.rope_dims):
        return f"head dim {head_dim} / rotary dim {rotary_dim} not in {set(p.rope_dims)}"
    if head_dim > p.rope_max_dim:
        return f"head dim {head_dim} > {p.rope_max_dim}"
    if p.rope_max_heads and query.shape[roles.head] + key.shape[roles.head] > p.rope_max_heads:
        return f"Nq + Nk > {p.rope_max_heads}"
    if p.rope_cos_batch_full and roles.batch is not None and \
            cos.shape[roles.batch] != query.shape[roles.batch]:
        return "cos batch 1 with query batch > 1 (profile needs equal batches)"
    return None


def rope_backward_gap(p: Profile, options, grad_query, cos) -> str | None:
    if options.layout not in p.rope_bwd_layouts:
        return f"no fused backward for layout {options.layout} on profile {p.name}"
    if grad_query.shape[-1] != cos.shape[-1]:
        return "partial rotary (r < D) in the backward"
    if grad_query.shape[-1] > p.rope_max_dim:
        return f"head dim > {p.rope_max_dim}"
    return None


def attention_gap(p: Profile, options, query, key, value, mask) -> str | None:
    if not p.attention:
        return f"no FlashAttentionScore on profile {p.name}"
    roles = options.info.roles
    heads, dim = query.shape[roles.head], query.shape[-1]
    if dim > p.attention_max_dim or heads > p.attention_max_heads:
        return f"D={dim} or N1={heads} beyond {p.attention_max_dim}/{p.attention_max_heads}"
    if mask:
        m = mask[0].shape
        if options.varlen:
            return "element atten_mask with TND"
        batch = query.shape[roles.batch]
        if (m[0], m[1]) not in ((1, 1), (batch, 1), (batch, heads)):
            return f"atten_mask shape {m}"
    return None


# --- lowering ----------------------------------------------------------------------

def _gap_or_error(backend: str, gap: str | None) -> bool:
    """True to use the NPU kernel; "ffi" where none covers the case is an error."""
    if gap is None and not _extension.STATUS.loaded:
        gap = f"the compiled extension is not loaded: {_extension.STATUS.detail}"
    if backend == "ffi" and gap is not None:
        raise ValueError(f"backend 'ffi' was requested but no {PLATFORM} kernel covers this "
                         f"case ({gap}); use 'auto' or 'fallback'")
    return backend != "fallback" and gap is None


def _shape(aval, shape=None, dtype=None):
    return jax.ShapeDtypeStruct(aval.shape if shape is None else shape,
                                aval.dtype if dtype is None else dtype)


def _rope_attrs(options):
    return {"layout": np.int32(options.roles.code), "rotary_mode": np.int32(options.mode_code)}


def rope_forward_rule(fallback):
    fallback_rule = mlir.lower_fun(fallback, multiple_results=True)

    def rule(ctx, *args, options):
        query, key, cos, _ = ctx.avals_in
        profile, _ = current_profile()
        if not _gap_or_error(options.backend,
                             rope_forward_gap(profile, options, query, key, cos)):
            return fallback_rule(ctx, *args, options=options)

        def call(q, k, c, s):
            return jax.ffi.ffi_call(ROPE_FWD, (_shape(query), _shape(key)))(
                q, k, c, s, **_rope_attrs(options))

        return mlir.lower_fun(call, multiple_results=True)(ctx, *args)

    return rule


def rope_backward_rule(fallback):
    fallback_rule = mlir.lower_fun(fallback, multiple_results=True)

    def rule(ctx, *args, options):
        grad_query, grad_key, cos, sin = ctx.avals_in[:4]
        profile, _ = current_profile()
        if not _gap_or_error(options.backend, rope_backward_gap(profile, options, grad_query, cos)):
            return fallback_rule(ctx, *args, options=options)
        outs = [_shape(grad_query), _shape(grad_key)]
        if len(args) == 6:
            outs += [_shape(cos), _shape(sin)]
        target = ROPE_BWD if len(args) == 6 else ROPE_BWD_NO_INPUTS

        def call(*xs):
            return jax.ffi.ffi_call(target, tuple(outs))(*xs, **_rope_attrs(options))

        return mlir.lower_fun(call, multiple_results=True)(ctx, *args)

    return rule


def _attention_attrs(options):
    return {"layout": np.int32(options.info.roles.code), "scale": np.float32(options.scale),
            "has_mask": np.int32(options.has_mask), "sparse_mode": np.int32(options.sparse_mode),
            "pre_tokens": np.int64(options.pre_tokens),
            "next_tokens": np.int64(options.next_tokens)}


def _mask_operand(options, mask):
    # The handlers always take a mask operand: a 1x1x1x1 placeholder without one.
    return mask[0] if options.has_mask else jnp.zeros((1, 1, 1, 1), jnp.uint8)


def attention_forward_rule(fallback):
    fallback_rule = mlir.lower_fun(fallback, multiple_results=True)

    def rule(ctx, *args, options):
        query, key, value = ctx.avals_in[:3]
        out_aval, stats_aval, _ = ctx.avals_out
        profile, _ = current_profile()
        if not _gap_or_error(options.backend, attention_gap(profile, options, query, key, value,
                                                            ctx.avals_in[4:])):
            return fallback_rule(ctx, *args, options=options)
        wide = _shape(stats_aval, stats_aval.shape + (STATS_WIDTH,))

        def call(q, k, v, table, *mask):
            out, smax, ssum = jax.ffi.ffi_call(ATTENTION_FWD, (_shape(out_aval), wide, wide))(
                q, k, v, table, _mask_operand(options, mask), **_attention_attrs(options))
            return out, smax[..., 0], ssum[..., 0]  # the spec's statistics: one copy

        return mlir.lower_fun(call, multiple_results=True)(ctx, *args)

    return rule


def attention_backward_rule(fallback):
    fallback_rule = mlir.lower_fun(fallback, multiple_results=True)

    def rule(ctx, *args, options):
        query, key, value = ctx.avals_in[:3]
        profile, _ = current_profile()
        if not _gap_or_error(options.backend, attention_gap(profile, options, query, key, value,
                                                            ctx.avals_in[8:])):
            return fallback_rule(ctx, *args, options=options)
        outs = tuple(_shape(a) for a in ctx.avals_out)

        def call(q, k, v, out, dout, smax, ssum, table, *mask):
            wide = lambda s: jnp.broadcast_to(s[..., None], s.shape + (STATS_WIDTH,))
            return jax.ffi.ffi_call(ATTENTION_BWD, outs)(
                q, k, v, out, dout, wide(smax), wide(ssum), table, _mask_operand(options, mask),
                **_attention_attrs(options))

        return mlir.lower_fun(call, multiple_results=True)(ctx, *args)

    return rule


# --- registration ----------------------------------------------------------------

_RULES: list = []  # (primitive, rule) for the NPU platform
_registered = set()


def register_rule(prim, rule) -> None:
    """Records an NPU lowering rule and registers it once JAX knows the platform."""
    _RULES.append((prim, rule))
    register_known_platform()


def register_known_platform() -> bool:
    """Registers the recorded rules (and FFI handlers) if JAX knows PLATFORM."""
    if not _jax_shim.is_known_platform(PLATFORM):
        return False
    for prim, rule in _RULES:
        if prim not in _registered:
            mlir.register_lowering(prim, rule, platform=PLATFORM)
            _registered.add(prim)
    _register_handlers()
    return True


def enable_lowering_without_device() -> None:
    """Makes PLATFORM known to JAX without a plugin, so that jitted functions can
    be lowered or exported for it on a machine without an NPU:

        jax_rope.npu.enable_lowering_without_device()
        jax.export.export(jax.jit(f), platforms=["npu"],
                          disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(t)
                                           for t in jax_rope.npu.FFI_TARGETS])(*args)
    """
    if not _jax_shim.make_platform_known(PLATFORM):
        raise RuntimeError(f"this JAX version cannot be told about platform {PLATFORM!r}")
    register_known_platform()


@functools.lru_cache(maxsize=None)
def _register_handlers() -> None:
    if _extension.STATUS.loaded:
        for name, capsule in _extension.module().npu_registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform=PLATFORM)


_jax_shim.on_plugins_discovered(register_known_platform)


def describe() -> dict:
    available, detail, soc = runtime()
    profile, source = current_profile()
    return {
        "NPU runtime": ("available" if available else "absent") + f" ({detail})",
        "NPU platform": PLATFORM + (" (known to JAX)" if _jax_shim.is_known_platform(PLATFORM)
                                    else " (no PJRT plugin registered)"),
        "NPU profile": f"{profile.name}: {profile.chips} (from {source})",
        "NPU rules": profile.rules(),
    }
