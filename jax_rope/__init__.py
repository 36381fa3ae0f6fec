"""jax_rope: the Ascend NPU's fused transformer operators for JAX.

Fused query/key rotary position embedding with compiled CPU kernels (XLA FFI)
and a pure jax.numpy fallback with identical semantics.
"""

from jax_rope._version import __version__
from jax_rope.backends import backend, set_backend
from jax_rope.describe import describe
from jax_rope.rope import apply_rotary_pos_emb, apply_rotary_pos_emb_grad
from jax_rope.rope_primitives import FFI_TARGETS
from jax_rope.rope_tables import positions_from_seq_lens, rope_cos_sin

__all__ = [
    "FFI_TARGETS",
    "__version__",
    "apply_rotary_pos_emb",
    "apply_rotary_pos_emb_grad",
    "backend",
    "describe",
    "positions_from_seq_lens",
    "rope_cos_sin",
    "set_backend",
]
