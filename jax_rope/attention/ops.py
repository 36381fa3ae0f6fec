"""The internal forward/backward API of fused attention, for code in this
package that composes the kernels: the public functions and their custom_vjp
(api.py) and context parallelism (parallel/context.py).

`prepare(query, key, value, **keywords)` validates a call exactly as the public
functions do (same keywords; traced lengths/prefix are checked when the
computation runs, see core/runtime_checks.py) and returns an `AttentionCall`: the static options,
the canonical operands (head axis split out of BSH/SBH), the sequence table and
the optional element mask. `scores`, `forward` and `backward` bind the
primitives on such a call; `backward` takes the statistics of `forward` (or any
statistics with the same meaning: context parallelism passes global ones).
"""

from __future__ import annotations

import dataclasses

from jax_rope.attention import masks
from jax_rope.attention.options import AttentionOptions, attention_call, merge_heads
from jax_rope.attention.primitives import attention_bwd_p, attention_fwd_p, attention_scores_p
from jax_rope.core import runtime_checks
from jax_rope.core.implementation import current_backend


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """A validated attention call in the kernels' canonical form."""

    options: AttentionOptions
    query: object
    key: object
    value: object
    table: object  # int32 (sequences, 7), masks.sequence_table
    mask: tuple  # () or (uint8 element mask (Bm, Nm, rows, cols),)

    def merge_heads(self, out):
        """The output back in the caller's layout (BSH/SBH heads merged)."""
        return merge_heads(out, self.options.layout_info)


def prepare(query, key, value=None, **keywords) -> AttentionCall:
    """Validates a call (keywords as flash_attention_score's); value=None for scores."""
    needs_value = value is not None
    value = key if value is None else value
    options, sizes, heads, mask, prefix, value_checks = attention_call(
        query, key, value, backend=current_backend(), needs_value=needs_value, **keywords)
    lengths = {"actual_seq_qlen": keywords.get("actual_seq_qlen"),
               "actual_seq_kvlen": keywords.get("actual_seq_kvlen"), "prefix": prefix}
    given = {name: x for name, x in lengths.items() if x is not None}
    # Traced lengths/prefix: the value rules run on the host before anything uses them.
    checked = runtime_checks.checked(
        tuple(given.values()), lambda *values: value_checks(**dict(zip(given, values))))
    lengths.update(zip(given, checked))
    table = masks.sequence_table(options, sizes.batch, sizes.q_len, sizes.kv_len,
                                 prefix=lengths["prefix"],
                                 actual_seq_qlen=lengths["actual_seq_qlen"],
                                 actual_seq_kvlen=lengths["actual_seq_kvlen"])
    return AttentionCall(options, *heads, table, () if mask is None else (mask,))


def scores(call: AttentionCall):
    """Masked, scaled float32 scores."""
    return attention_scores_p.bind(call.query, call.key, call.table, *call.mask,
                                   options=call.options)


def forward(options, query, key, value, table, mask=()):
    """(out, softmax_max, softmax_sum) of canonical operands."""
    return tuple(attention_fwd_p.bind(query, key, value, table, *mask, options=options))


def backward(options, query, key, value, out, dout, softmax_max, softmax_sum, table, mask=()):
    """(dquery, dkey, dvalue) of canonical operands, from forward's statistics."""
    return tuple(attention_bwd_p.bind(query, key, value, out, dout, softmax_max, softmax_sum,
                                      table, *mask, options=options))
