"""Public masked attention (spec/attention.md, spec/attention_bias_dropout.md):
attention_scores, flash_attention_score with gradients for query, key, value and
the positional bias, and dropout_keep_mask."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from jax_rope.attention import dropout as dropout_module
from jax_rope.attention import ops
from jax_rope.attention.masks import sparse_mask
from jax_rope.attention.options import MAX_TOKENS


def attention_scores(query, key, *, input_layout="BSND", head_num=None, scale=None,
                     sparse_mode=0, pre_tokens=MAX_TOKENS, next_tokens=MAX_TOKENS,
                     atten_mask=None, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                     pse=None, pse_type=1, q_start_idx=0, kv_start_idx=0):
    """Masked, scaled attention scores in float32, with the positional bias.

    Returns (B, N1, Sq, Skv), or (N1, Tq, Tkv) for TND, where masked positions
    (and, for TND, positions of different sequences) hold -3.4028235e38.
    Arguments and errors as in `flash_attention_score` (no dropout here).
    """
    call = ops.prepare(
        query, key, input_layout=input_layout, head_num=head_num, scale=scale,
        sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens,
        atten_mask=atten_mask, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, pse=pse, pse_type=pse_type,
        q_start_idx=q_start_idx, kv_start_idx=kv_start_idx)
    return ops.scores(call)


def flash_attention_score(query, key, value, *, input_layout="BSND", head_num=None, scale=None,
                          sparse_mode=0, pre_tokens=MAX_TOKENS, next_tokens=MAX_TOKENS,
                          atten_mask=None, prefix=None, actual_seq_qlen=None,
                          actual_seq_kvlen=None, pse=None, pse_type=1, q_start_idx=0,
                          kv_start_idx=0, keep_prob=1.0, dropout_key=None, dropout_mask=None):
    """Fused masked attention: dropout(softmax(biased scale * q k^T, masked by sparse_mode)) @ v.

    Args:
      query, key, value: in `input_layout` BSND (B, S, N, D), BNSD, BSH/SBH
        (hidden N*D, `head_num`=N1 required) or TND (packed tokens); float32,
        float16 or bfloat16; N1 % N2 == 0 (GQA); value's head dim Dv <= D.
      scale: None means 1/sqrt(D).
      sparse_mode: 0-8 as in spec/attention.md, with pre_tokens/next_tokens,
        atten_mask (bool/uint8, True = masked), prefix (modes 5/6) and the
        cumulative actual_seq_qlen/actual_seq_kvlen of TND (may be traced).
      pse, pse_type, q_start_idx, kv_start_idx: the positional score bias of
        spec/attention_bias_dropout.md: type 1 scale * (q.k + pse), type 0
        scale * q.k + pse (pse in query's dtype, (B|1, N1, Sq|1, Skv), the
        compressed (B|1, N1, 1024, Skv) form, or TND packed forms); types 2/3
        ALiBi from float32 slopes (N1,) or (B, N1): - slope * |dist| (3: sqrt),
        dist = (j + kv_start_idx) - (i + q_start_idx).
      keep_prob, dropout_key, dropout_mask: dropout on the probabilities; the
        keep mask is `dropout_keep_mask(dropout_key, ...)` (Threefry, the same
        bits on every platform), or a packed uint8 `dropout_mask` instead.

    Returns:
      (attention_out, softmax_max, softmax_sum): out in query's layout and dtype
      with value's head dim; the float32 statistics (B, N1, Sq), or (Tq, N1) for
      TND. Rows with no visible key give 0, -3.4028235e38 and 3.4028235e38.
      Differentiable with respect to query, key, value and pse (through
      attention_out); the backward regenerates the dropout mask from the key.

    Raises:
      ValueError/TypeError at trace time for input that breaks attention.md's rules; for
      traced actual_seq_qlen/actual_seq_kvlen/prefix, the same ValueError (inside the
      runtime error) when the computation runs, unless `jax_rope.runtime_checks(False)`.
      Masked positions never influence the result, NaN or Inf included.
    """
    call = ops.prepare(
        query, key, value, input_layout=input_layout, head_num=head_num, scale=scale,
        sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens,
        atten_mask=atten_mask, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, pse=pse, pse_type=pse_type, q_start_idx=q_start_idx,
        kv_start_idx=kv_start_idx, keep_prob=keep_prob, dropout_key=dropout_key,
        dropout_mask=dropout_mask)
    out, softmax_max, softmax_sum = _flash(call.options, call.query, call.key, call.value,
                                           call.table, call.extras)
    return call.merge_heads(out), softmax_max, softmax_sum


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(options, query, key, value, table, extras):
    return ops.forward(options, query, key, value, table, extras)


def _flash_fwd(options, query, key, value, table, extras):
    args = (query.value, key.value, value.value, table.value)
    # dpse only when the bias is differentiated (it computes every score again);
    # an empty tuple or (None,) carries the flag in the residuals' structure.
    wants_dpse = tuple(None for name, x in zip(options.extra_names, extras)
                       if name == "bias" and x.perturbed)
    extras = jax.tree.map(lambda m: m.value, extras)
    outs = ops.forward(options, *args, extras)
    return outs, (args, outs, extras, wants_dpse)  # dropout: the key's words, not the mask


def _flash_bwd(options, residuals, cotangents):
    (query, key, value, table), (out, softmax_max, softmax_sum), extras, wants_dpse = residuals
    dout, dmax, dsum = cotangents
    if not (isinstance(dmax, SymbolicZero) and isinstance(dsum, SymbolicZero)):
        raise ValueError("flash_attention_score is differentiable through attention_out only; "
                         "softmax_max and softmax_sum are statistics without a gradient")
    if isinstance(dout, SymbolicZero):
        dout = jnp.zeros(out.shape, out.dtype)
    saved = (query, key, value, out, dout, softmax_max, softmax_sum, table, extras)
    grads = ops.backward(options, *saved)
    extra_grads = tuple(ops.bias_gradient(options, *saved) if name == "bias" and wants_dpse
                        else None for name in options.extra_names)
    return grads + (None, extra_grads)


_flash.defvjp(_flash_fwd, _flash_bwd, symbolic_zeros=True)


def dropout_keep_mask(dropout_key, keep_prob, q_len, kv_len, *, batch=1, heads=1,
                      actual_seq_qlen=None, actual_seq_kvlen=None, packed=False):
    """The dropout keep mask flash_attention_score draws (True = keep).

    bool (batch, heads, q_len, kv_len), or for TND lengths (heads, Tq, Tkv) with
    positions of different sequences False (q_len/kv_len are then Tq/Tkv);
    packed=True gives the uint8 bytes of the NPU's dropMask layout instead
    (B, N1, Sq, Skv order; TND per-sequence blocks; ceil(numel/128)*16 bytes).
    """
    keep_prob = dropout_module.check_keep_prob(keep_prob)
    lengths = {"actual_seq_qlen": actual_seq_qlen, "actual_seq_kvlen": actual_seq_kvlen}
    # Concrete lengths stay static (a packed TND mask needs them); traced ones are operands.
    static = {k: tuple(np.asarray(v).reshape(-1).tolist()) for k, v in lengths.items()
              if v is not None and not isinstance(v, jax.core.Tracer)}
    traced = {k: v for k, v in lengths.items() if v is not None and k not in static}
    return _keep_mask(None if keep_prob == 1.0 else dropout_key, traced, keep_prob=keep_prob,
                      q_len=q_len, kv_len=kv_len, batch=batch, heads=heads, packed=packed,
                      static=tuple(sorted(static.items())))


@functools.partial(jax.jit, static_argnames=("keep_prob", "q_len", "kv_len", "batch", "heads",
                                             "packed", "static"))
def _keep_mask(dropout_key, traced, *, keep_prob, q_len, kv_len, batch, heads, packed, static):
    """dropout_keep_mask, compiled once per shape (the hash is many small operations)."""
    lengths = dict(static, **traced)
    varlen = bool(lengths)
    query = jax.ShapeDtypeStruct((q_len, heads, 1) if varlen else (batch, q_len, heads, 1),
                                 jnp.float32)
    kv = jax.ShapeDtypeStruct((kv_len, heads, 1) if varlen else (batch, kv_len, heads, 1),
                              jnp.float32)
    call = ops.prepare(query, kv, kv, input_layout="TND" if varlen else "BSND", head_num=None,
                       scale=None, sparse_mode=0, pre_tokens=MAX_TOKENS, next_tokens=MAX_TOKENS,
                       atten_mask=None, prefix=None,
                       actual_seq_qlen=lengths.get("actual_seq_qlen"),
                       actual_seq_kvlen=lengths.get("actual_seq_kvlen"), keep_prob=keep_prob,
                       dropout_key=dropout_key)
    return ops.keep_mask(call, packed)
