"""Whether the NPU kernel covers a call on a chip profile with a CANN
generation: None when it does, else the reason (shown in errors under the
"ffi" backend). Operator availability is asked of `runtime` by the caller."""

from __future__ import annotations

import jax.numpy as jnp

from jax_rope.npu.cann import ROPE_SINGLE_GRAD, Generation
from jax_rope.npu.profiles import Profile, rope_ub_required


def rope_forward_gap(p: Profile, gen: Generation, options, query, key, cos) -> str | None:
    roles = options.roles
    head_dim, rotary_dim = query.shape[-1], cos.shape[-1]
    if options.layout not in p.rope_fwd_layouts:
        return f"layout {options.layout} (profile {p.name}: {'/'.join(p.rope_fwd_layouts)})"
    if options.rotary_mode not in p.rope_modes:
        # The A2/A3/310P kernel never reads rotary_mode: it would compute half.
        return (f"rotary_mode {options.rotary_mode!r} (profile {p.name} computes "
                f"{'/'.join(p.rope_modes)} only)")
    if jnp.dtype(query.dtype) not in p.rope_dtypes:
        return f"dtype {jnp.dtype(query.dtype).name} on profile {p.name}"
    if p.rope_dims is not None and (head_dim not in p.rope_dims or rotary_dim not in p.rope_dims):
        return f"head dim {head_dim} / rotary dim {rotary_dim} not in {set(p.rope_dims)}"
    if head_dim > p.rope_max_dim:
        return f"head dim {head_dim} > {p.rope_max_dim}"
    if rotary_dim != head_dim and not gen.partial_rotary:
        return (f"partial rotary (r={rotary_dim} < D={head_dim}): CANN {gen.version} needs "
                "cos D == query D")
    heads = query.shape[roles.head] + key.shape[roles.head]
    if p.rope_max_heads and heads > p.rope_max_heads:
        return f"Nq + Nk > {p.rope_max_heads}"
    if p.rope_ub_bytes and rope_ub_required(heads, query.dtype) > p.rope_ub_bytes:
        return (f"Nq + Nk = {heads} needs {rope_ub_required(heads, query.dtype)} bytes of UB "
                f"per token, more than profile {p.name}'s {p.rope_ub_bytes}")
    if p.rope_cos_batch_full and roles.batch is not None and \
            cos.shape[roles.batch] != query.shape[roles.batch]:
        return "cos batch 1 with query batch > 1 (profile needs equal batches)"
    return None


def rope_backward_gap(p: Profile, options, grad_query, grad_key, cos,
                      with_inputs: bool) -> str | None:
    """`with_inputs`: query/key are given, so dcos/dsin are computed."""
    if options.layout not in p.rope_bwd_layouts:
        return f"no fused backward for layout {options.layout} on profile {p.name}"
    head_dim = grad_query.shape[-1]
    if head_dim != cos.shape[-1]:
        return "partial rotary (r < D) in the backward"
    if head_dim > p.rope_bwd_max_dim:
        return f"head dim {head_dim} > {p.rope_bwd_max_dim} in the backward"
    if p.rope_bwd_operator == ROPE_SINGLE_GRAD:
        return _single_grad_gap(options, grad_query, grad_key, cos, with_inputs)
    return None


def _single_grad_gap(options, grad_query, grad_key, cos, with_inputs) -> str | None:
    # aclnnRotaryPositionEmbeddingGrad.md, A2/A3 half mode, per call (query, key):
    # B, N < 1000; B * N <= 1024 when dcos/dsin are computed; cos BS1D needs B < S.
    roles = options.roles
    batch = grad_query.shape[roles.batch] if roles.batch is not None else 1  # TND: (1, T, N, D)
    for name, grad in (("query", grad_query), ("key", grad_key)):
        heads = grad.shape[roles.head]
        if batch >= 1000 or heads >= 1000:
            return f"B={batch} or N={heads} of the {name} >= 1000 (RotaryPositionEmbeddingGrad)"
        if with_inputs and batch * heads > 1024:
            return (f"B * N = {batch * heads} of the {name} > 1024 with dcos/dsin "
                    "(RotaryPositionEmbeddingGrad)")
    if roles.batch is not None and batch > 1 and cos.shape[roles.batch] == batch \
            and batch >= grad_query.shape[roles.seq]:
        return f"cos batch B={batch} needs B < S={grad_query.shape[roles.seq]} (BS1D)"
    return None


def attention_gap(p: Profile, gen: Generation, options, query, key, value,
                  extras: dict) -> str | None:
    """`extras`: the optional operands' avals by name (options.extra_names)."""
    if not p.attention:
        return f"no FlashAttentionScore on profile {p.name}"
    roles = options.layout_info.roles
    heads, dim = query.shape[roles.head], query.shape[-1]
    if dim > p.attention_max_dim or heads > p.attention_max_heads:
        return f"D={dim} or N1={heads} beyond {p.attention_max_dim}/{p.attention_max_heads}"
    mask = extras.get("mask")
    if mask is not None:
        m = mask.shape
        if options.varlen:
            return "element atten_mask with TND"
        batch = query.shape[roles.batch]
        if (m[0], m[1]) not in ((1, 1), (batch, 1), (batch, heads)):
            return f"atten_mask shape {m}"
    no_sq_above_skv, no_keyless = _length_rules(gen, options)
    if no_sq_above_skv and options.sq_above_skv:
        return "sparse_mode 3 with TND and a sequence with Sq > Skv"
    if no_keyless and options.keyless_sequence:
        if not gen.keyless_sequences:
            return f"a TND sequence with query tokens and no key on CANN {gen.version}"
        return "sparse_mode 4 with a TND sequence with query tokens and no key"
    return bias_dropout_gap(options, query.shape[roles.seq], key.shape[roles.seq])


def _length_rules(gen: Generation, options) -> tuple[bool, bool]:
    """Which rules the VarLen operator puts on a call's per-sequence lengths: (no
    Sq_b > Skv_b, no sequence with query tokens and no key)."""
    # "sparse_mode=3 ... needs Sq <= Skv in every batch" (no fully masked rows there);
    # "band场景，preTokens和nextTokens之间必须要有交集" per sequence: where there is no key
    # the operator may find no intersection (the spec skips such sequences).
    return (options.sparse_mode == 3,
            not gen.keyless_sequences or options.sparse_mode == 4)


def attention_lengths_gap(gen: Generation, options):
    """The rules above on TND lengths that are traced: a function of the per-sequence
    lengths (Sq_b, Skv_b), true where the operator does not cover them (the lowering
    takes the fallback then, when the call runs); None when it covers any lengths."""
    no_sq_above_skv, no_keyless = _length_rules(gen, options)
    mode3 = no_sq_above_skv and options.sq_above_skv is None
    keyless = no_keyless and options.keyless_sequence is None
    if not (mode3 or keyless):
        return None

    def uncovered(q_lens, kv_lens):
        found = jnp.zeros(q_lens.shape, bool)
        if mode3:
            found |= q_lens > kv_lens
        if keyless:
            found |= (q_lens > 0) & (kv_lens == 0)
        return jnp.any(found)
    return uncovered


def bias_dropout_gap(options, q_rows: int, kv_rows: int) -> str | None:
    """spec/attention_bias_dropout.md section 6: what FlashAttentionScore(+Grad)
    (V1, and V2 for pse_type 0/2/3) covers of pse and dropout."""
    lengths = options.static_lengths
    if options.varlen and (options.bias is not None or options.dropout is not None) \
            and lengths is None:
        return "pse/dropout with TND needs concrete actual_seq_qlen/actual_seq_kvlen on the NPU"
    if options.bias is not None:
        why = _pse_gap(options, q_rows, kv_rows, lengths)
        if why is not None:
            return why
    return None


def _pse_gap(options, q_rows, kv_rows, lengths) -> str | None:
    mode = options.sparse_mode
    if mode == 7:
        return "pse with sparse_mode 7"
    equal = True
    if options.varlen:
        q_lens, kv_lens = lengths
        if any(n == 0 for n in q_lens + kv_lens):
            return "pse with a zero-length TND sequence"
        equal = all(a == b for a, b in zip(q_lens, kv_lens))
    if options.bias in ("alibi", "alibi_sqrt"):
        if options.static_offsets is None:
            return "traced q_start_idx/kv_start_idx (the operator takes host values)"
        if not options.varlen:
            return None if q_rows == kv_rows else f"pse_type {options.pse_type} with Sq != Skv"
        q_off, kv_off = options.static_offsets
        rest = zip(q_lens[1:], kv_lens[1:]) if mode == 8 else zip(q_lens, kv_lens)
        if mode == 8 and q_lens[0] + q_off != kv_lens[0] + kv_off:
            return (f"pse_type {options.pse_type} in sparse_mode 8 needs Sq_0 + q_start_idx == "
                    "Skv_0 + kv_start_idx")
        if any(a != b for a, b in rest):
            return f"pse_type {options.pse_type} with TND needs Sq_b == Skv_b"
        return None
    if mode == 8 and not equal:
        return "pse in sparse_mode 8 needs every Sq_b == Skv_b"
    if options.bias == "compressed" and mode not in (2, 3):
        return f"compressed pse in sparse_mode {mode} (the operator: 2 or 3)"
    return None
