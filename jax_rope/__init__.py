"""jax_rope: the Ascend NPU's fused transformer operators for JAX.

Fused query/key rotary position embedding with compiled CPU kernels (XLA FFI)
and a pure jax.numpy fallback with identical semantics.
"""

from jax_rope._version import __version__
from jax_rope.attention import attention_scores, flash_attention_score, sparse_mask
from jax_rope.backends import backend, set_backend
from jax_rope.context_parallel import context_parallel_attention
from jax_rope.sequence_parallel import SequenceParallelShard, varlen_sequence_parallel_split
from jax_rope.describe import describe
from jax_rope.rope import apply_rotary_pos_emb, apply_rotary_pos_emb_grad
from jax_rope import attention_primitives as _attention_primitives
from jax_rope import rope_primitives as _rope_primitives
from jax_rope import sharding as _sharding  # partitioning rules for every primitive
from jax_rope.rope_tables import positions_from_seq_lens, rope_cos_sin

#: Custom-call targets of the compiled kernels (e.g. for jax.export's disabled_checks).
FFI_TARGETS = _rope_primitives.FFI_TARGETS + _attention_primitives.FFI_TARGETS

__all__ = [
    "FFI_TARGETS",
    "__version__",
    "apply_rotary_pos_emb",
    "attention_scores",
    "context_parallel_attention",
    "SequenceParallelShard",
    "apply_rotary_pos_emb_grad",
    "backend",
    "describe",
    "flash_attention_score",
    "positions_from_seq_lens",
    "rope_cos_sin",
    "set_backend",
    "sparse_mask",
    "varlen_sequence_parallel_split",
]
