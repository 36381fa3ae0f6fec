"""What each Ascend chip family's fused kernels cover, as data.

A profile lists the limits the NPU operators document for one chip family
(spec/rope.md "NPU operator limits", corrected by the CANN sources: see the
README's "On Ascend"; FlashAttentionScore's documented limits); `coverage.py`
applies them to a call, together with the CANN generation (`cann.py`).
"""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp

from jax_rope.npu.cann import ROPE_GRAD, ROPE_SINGLE_GRAD

DEFAULT_PROFILE = "A2"
_F32, _F16, _BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)
_MODES = ("half", "quarter", "interleave")


@dataclasses.dataclass(frozen=True)
class Profile:
    """What one chip family's fused kernels cover."""

    name: str
    chips: str
    rope_fwd_layouts: tuple[str, ...]
    rope_modes: tuple[str, ...]  # rotary modes the kernel computes (old chips: half only)
    rope_dims: tuple[int, ...] | None  # allowed D and r; None: any D <= rope_max_dim
    rope_max_dim: int
    rope_max_heads: int | None  # Nq + Nk limit
    rope_ub_bytes: int | None  # the per-token UB formula's budget (None: no such limit)
    rope_cos_batch_full: bool  # cos batch must equal query batch
    rope_dtypes: tuple
    rope_bwd_layouts: tuple[str, ...]  # empty: no fused backward
    attention: bool  # FlashAttentionScore(+Grad) available
    attention_max_dim: int = 768
    attention_max_heads: int = 256
    # The backward's operator: ApplyRotaryPosEmbGrad (query and key in one
    # call) or RotaryPositionEmbeddingGrad (one call per tensor); its D limit.
    rope_bwd_operator: str | None = None
    rope_bwd_max_dim: int = 0

    def rules(self, partial_rotary: bool) -> str:
        """The limits in words; `partial_rotary`: the CANN accepts r < D."""
        dims = (f"D and r in {set(self.rope_dims)}" if self.rope_dims
                else f"D <= {self.rope_max_dim}")
        parts = [f"RoPE forward: layouts {'/'.join(self.rope_fwd_layouts)}, rotary_mode "
                 f"{'/'.join(self.rope_modes)}, {dims}, "
                 + ("r <= D" if partial_rotary else "r == D (this CANN rejects r < D)")]
        if self.rope_max_heads:
            parts.append(f"Nq + Nk <= {self.rope_max_heads}")
        if self.rope_ub_bytes:
            parts.append(f"the per-token UB formula within {self.rope_ub_bytes // 1024} KiB "
                         "(D=128: Nq + Nk <= 76 for float32/bfloat16, 152 for float16)")
        parts.append("cos batch == query batch" if self.rope_cos_batch_full
                     else "cos batch 1 or B")
        if _BF16 not in self.rope_dtypes:
            parts.append("no bfloat16")
        if not self.rope_bwd_layouts:
            parts.append("RoPE backward: jnp fallback")
        else:
            bwd = (f"RoPE backward ({self.rope_bwd_operator}): half mode, layouts "
                   f"{'/'.join(self.rope_bwd_layouts)}, r == D <= {self.rope_bwd_max_dim}")
            if self.rope_bwd_operator == ROPE_SINGLE_GRAD:
                bwd += (", B and each of Nq, Nk < 1000, B * N <= 1024 when dcos/dsin are "
                        "wanted, B < S when cos batch == B > 1")
            parts.append(bwd)
        parts.append(f"attention fwd/bwd: D <= {self.attention_max_dim}, N1 <= "
                     f"{self.attention_max_heads}, every sparse_mode" if self.attention
                     else "attention: jnp fallback")
        return "; ".join(parts)


_ALL = (_F32, _F16, _BF16)
_UB_A2 = 192 * 1024  # Atlas A2/A3 AI Core unified buffer
_UB_310P = 256 * 1024
# A2/A3 backward: aclnnRotaryPositionEmbeddingGrad.md (D even and < 896). It
# also takes SBND/BNSD; jax_rope sends BSND, and TND as the BSND view (1, T, N, D).
_SINGLE_BWD = dict(rope_bwd_operator=ROPE_SINGLE_GRAD, rope_bwd_max_dim=894)
PROFILES = {
    "A2": Profile("A2", "Atlas A2 training/inference", ("BSND", "TND"), ("half",), (64, 128), 128,
                  255, _UB_A2, True, _ALL, ("BSND", "TND"), True, **_SINGLE_BWD),
    "A3": Profile("A3", "Atlas A3 training/inference", ("BSND", "TND"), ("half",), (64, 128), 128,
                  255, _UB_A2, True, _ALL, ("BSND", "TND"), True, **_SINGLE_BWD),
    "310P": Profile("310P", "Atlas inference (310P)", ("BSND", "TND"), ("half",), (64, 128), 128,
                    255, _UB_310P, True, (_F32, _F16), (), False),
    "950": Profile("950", "Ascend 950", ("BSND", "SBND", "BNSD", "TND"), _MODES, None, 1024, None,
                   None, False, _ALL, ("BSND", "SBND", "TND"), False, rope_bwd_operator=ROPE_GRAD,
                   rope_bwd_max_dim=1024),
}

# The documented SoC names (torch_npu's NpuVariables.cpp) of each family.
# Ascend910A/ProA/ProB/PremiumA (Atlas training) and Ascend310B* (Atlas 200I/500
# A2) have neither operator: no profile, so every call takes the fallback.
_SOCS = ((re.compile(r"ascend910b[1-4](-1)?"), "A2"),
         (re.compile(r"ascend910_93\d\d"), "A3"),
         (re.compile(r"ascend310p\d*"), "310P"),
         (re.compile(r"(ascend950\w*|ascend910_95\d\d)"), "950"))


def profile_for_soc(soc: str) -> str | None:
    """The profile of a CANN SoC name (aclrtGetSocName), or None if not supported."""
    s = soc.replace(" ", "").lower()
    for pattern, name in _SOCS:
        if pattern.fullmatch(s):
            return name
    return None


def rope_ub_required(heads: int, dtype) -> int:
    """aclnnApplyRotaryPosEmbV2.md's per-token UB need on A2/A3/310P (Nq + Nk = heads):
    (qn+kn)*128*castSize*2 + 128*dtypeSize*4 + (qn+kn)*128*castSize
    + (qn+kn)*128*castSize*2 + cast*(128*4*2), computing in float32 except for float16."""
    dtype = jnp.dtype(dtype)
    cast_size = 2 if dtype == _F16 else 4
    cast = 1 if dtype == _BF16 else 0
    return heads * 128 * cast_size * 5 + 128 * dtype.itemsize * 4 + cast * 128 * 4 * 2
