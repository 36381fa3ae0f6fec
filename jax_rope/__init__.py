"""jax_rope: the Ascend NPU's fused transformer operators for JAX.

Fused query/key rotary position embedding (`apply_rotary_pos_emb`, with
`rope_cos_sin` for real models' tables) and masked attention with the NPU's
nine sparse modes (`flash_attention_score`, `attention_scores`,
`sparse_mask`), plus context- and sequence-parallel helpers. Every operator
is a JAX primitive that lowers to compiled XLA FFI kernels on `cpu`, to the NPU
operators on an Ascend platform where they cover the call, and to a pure
jax.numpy fallback with the same semantics everywhere else.

The package is laid out by role: `core/` (codes, layouts, the extension, one
registration per primitive with its lowering and partitioning), `rope/`,
`attention/`, `parallel/` and `npu/` (chip profiles, coverage, runtime).
"""

from jax_rope._version import __version__
from jax_rope.attention.api import (attention_scores, dropout_keep_mask, flash_attention_score,
                                    sparse_mask)
from jax_rope.attention.dot_product import dot_product_attention
from jax_rope.attention.primitives import FFI_TARGETS as _ATTENTION_TARGETS
from jax_rope.core.implementation import backend, set_backend
from jax_rope.core.runtime_checks import runtime_checks, set_runtime_checks
from jax_rope.describe import describe
from jax_rope.parallel.context import context_parallel_attention
from jax_rope.parallel.sequence import SequenceParallelShard, varlen_sequence_parallel_split
from jax_rope.rope.api import apply_rotary_pos_emb, apply_rotary_pos_emb_grad
from jax_rope.rope.config import rope_config
from jax_rope.rope.primitives import FFI_TARGETS as _ROPE_TARGETS
from jax_rope.rope.tables import positions_from_seq_lens, rope_cos_sin

#: Custom-call targets of the compiled CPU kernels (e.g. for jax.export's disabled_checks);
#: the NPU's are `jax_rope.npu.FFI_TARGETS`.
FFI_TARGETS = _ROPE_TARGETS + _ATTENTION_TARGETS

__all__ = [
    "FFI_TARGETS",
    "SequenceParallelShard",
    "__version__",
    "apply_rotary_pos_emb",
    "apply_rotary_pos_emb_grad",
    "attention_scores",
    "backend",
    "context_parallel_attention",
    "describe",
    "dot_product_attention",
    "dropout_keep_mask",
    "flash_attention_score",
    "positions_from_seq_lens",
    "rope_config",
    "rope_cos_sin",
    "runtime_checks",
    "set_backend",
    "set_runtime_checks",
    "sparse_mask",
    "varlen_sequence_parallel_split",
]
