"""Flax NNX layers built on jax_rope's operators (the optional extra ``flax``).

- `RotaryEmbedding`: cos/sin tables for positions (traced or not), built from rope_cos_sin's
  arguments or from a whole Hugging Face config (`RotaryEmbedding.from_config`).
- `GroupedQueryAttention`: q/k/v/o projections, fused RoPE (`apply_rotary_pos_emb`) and
  `flash_attention_score` with any sparse mode, padded (B, S, H) or packed (T, H) input, and a
  key/value cache for decoding (`init_cache`), attended bottom-right causal over its valid part.

Both work under `nnx.jit`, `nnx.grad` and `nnx.value_and_grad`. ``import jax_rope`` never
needs Flax; importing this module without it raises an ImportError naming the extra.
"""

try:
    from flax import nnx as _nnx  # noqa: F401  (only to fail early with a clear message)
except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "jax_rope.nn needs Flax NNX (flax>=0.12), which is not installed: "
        "pip install 'jax_rope[flax]'") from error

from jax_rope.nn.attention import GroupedQueryAttention
from jax_rope.nn.rotary import RotaryEmbedding

__all__ = ["GroupedQueryAttention", "RotaryEmbedding"]
