"""What each Ascend chip family's fused kernels cover, as data.

A profile lists the limits the NPU operators document for one chip family
(spec/rope.md "NPU operator limits"; FlashAttentionScore's documented limits);
`coverage.py` applies them to a call.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

DEFAULT_PROFILE = "A2"
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
