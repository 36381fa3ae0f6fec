"""The internal forward/backward API of fused attention, for code in this
package that composes the kernels: the public functions and their custom_vjp
(api.py) and context parallelism (parallel/context.py).

`prepare(query, key, value, **keywords)` validates a call exactly as the public
functions do (same keywords; traced lengths/prefix are checked when the
computation runs, see core/runtime_checks.py) and returns an `AttentionCall`: the static options,
the canonical operands (head axis split out of BSH/SBH), the sequence table and
the optional operands `options.extra_names` lists (element mask, bias, ALiBi
offsets, dropout keys/position words/packed mask). `scores`, `forward` and
`backward` bind the primitives on such a call; `backward` takes the statistics
of `forward` (or any statistics with the same meaning: context parallelism
passes global ones). The bias operand comes from `pse` by differentiable jnp
ops, so the gradient of the bias operand (`bias_gradient`) reaches `pse`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_rope.attention import bias, dropout, fallback, masks
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
    extras: tuple  # the operands named by options.extra_names, in that order

    def merge_heads(self, out):
        """The output back in the caller's layout (BSH/SBH heads merged)."""
        return merge_heads(out, self.options.layout_info)


def prepare(query, key, value=None, **keywords) -> AttentionCall:
    """Validates a call (keywords as flash_attention_score's); value=None for scores."""
    needs_value = value is not None
    value = key if value is None else value
    options, sizes, heads, mask, prefix, value_checks, inputs = attention_call(
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
    extras = {"mask": mask}
    rows = table.shape[0]
    if options.bias is not None:
        extras["bias"] = bias.canonical(options_bias(options), inputs["pse"],
                                        heads=sizes.q_heads, kv_tokens=sizes.kv_len,
                                        pairs=inputs["pairs"])
        extras["offsets"] = bias.offset_rows(*inputs["offsets"], rows,
                                             options.varlen and options.sparse_mode == 8)
    if options.dropout is not None:
        extras["drop_rows"] = dropout.row_words(options.dropout, table, sizes.q_heads,
                                                options.varlen)
        extras["drop_keys"] = (dropout.row_keys(inputs["key_words"], rows)
                               if options.dropout == "key" else jnp.zeros((rows, 2), jnp.uint32))
        extras["drop_mask"] = inputs["drop_mask"]
    return AttentionCall(options, *heads, table,
                         tuple(extras[name] for name in options.extra_names))


def options_bias(options):
    return bias.BiasInfo(options.pse_type, options.bias, options.bias_form,
                         options.static_offsets)


def scores(call: AttentionCall):
    """Masked, scaled float32 scores (with the bias)."""
    extras = dict(zip(call.options.extra_names, call.extras))
    return attention_scores_p.bind(call.query, call.key, call.table,
                                   *(extras[n] for n in call.options.score_extra_names),
                                   options=call.options)


def forward(options, query, key, value, table, extras=()):
    """(out, softmax_max, softmax_sum) of canonical operands."""
    return tuple(attention_fwd_p.bind(query, key, value, table, *extras, options=options))


def backward(options, query, key, value, out, dout, softmax_max, softmax_sum, table, extras=()):
    """(dquery, dkey, dvalue) of canonical operands, from forward's statistics."""
    return tuple(attention_bwd_p.bind(query, key, value, out, dout, softmax_max, softmax_sum,
                                      table, *extras, options=options))


def bias_gradient(options, query, key, value, out, dout, softmax_max, softmax_sum, table,
                  extras=()):
    """The gradient of the bias operand (same shape and dtype), on every platform from the
    saved statistics by the fallback's code (the NPU kernels never write dpse: spec
    section 4)."""
    return fallback.bias_gradient(query, key, value, out, dout, softmax_max, softmax_sum,
                                  table, *extras, options=options)


def keep_mask(call: AttentionCall, packed: bool):
    """The call's dropout keep mask: bool (B, N1, Sq, Skv), TND (N1, Tq, Tkv) with
    positions of different sequences False; packed: the NPU's dropMask bytes."""
    options = call.options
    q_len, kv_len = fallback.score_grid(options, call.query, call.key)
    heads = call.query.shape[options.layout_info.roles.head]
    if options.dropout is None:
        rows = 1 if options.varlen else call.table.shape[0]
        keep = jnp.ones((rows, heads, q_len, kv_len), bool)
    else:
        keep = dropout.keep_bits(options, call.table, dict(zip(options.extra_names, call.extras)),
                                 masks.query_rows(q_len), masks.key_columns(kv_len))
    if not options.varlen:
        return dropout.pack_bits(keep) if packed else keep
    keep = (keep & masks.packed_visibility(call.table, masks.query_rows(q_len), kv_len))[0]
    if not packed:
        return keep
    if options.static_lengths is None:
        raise ValueError("a packed TND keep mask needs concrete actual_seq_qlen/actual_seq_kvlen")
    return dropout.pack_bits(dropout.sequence_blocks(keep, options.static_lengths))
