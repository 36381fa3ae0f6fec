"""Public masked attention (spec/attention.md): sparse_mask, attention_scores and
flash_attention_score with gradients for query, key and value."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jax_rope import masks
from jax_rope.attention_options import MAX_TOKENS, attention_call, merge_heads
from jax_rope.attention_primitives import attention_bwd_p, attention_fwd_p, attention_scores_p
from jax_rope.backends import current_backend

sparse_mask = masks.sparse_mask


def _prepare(query, key, value, needs_value, **kwargs):
    options, sizes, heads, mask, prefix = attention_call(
        query, key, value, backend=current_backend(), needs_value=needs_value, **kwargs)
    table = masks.sequence_table(options, sizes.batch, sizes.q_len, sizes.kv_len, prefix=prefix,
                                 actual_seq_qlen=kwargs["actual_seq_qlen"],
                                 actual_seq_kvlen=kwargs["actual_seq_kvlen"])
    return options, heads, table, () if mask is None else (mask,)


def attention_scores(query, key, *, input_layout="BSND", head_num=None, scale=None,
                     sparse_mode=0, pre_tokens=MAX_TOKENS, next_tokens=MAX_TOKENS,
                     atten_mask=None, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None):
    """Masked, scaled attention scores in float32.

    Returns (B, N1, Sq, Skv), or (N1, Tq, Tkv) for TND, where masked positions
    (and, for TND, positions of different sequences) hold -3.4028235e38.
    Arguments and errors as in `flash_attention_score`.
    """
    options, (q, k, _), table, mask = _prepare(
        query, key, key, False, input_layout=input_layout, head_num=head_num, scale=scale,
        sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens,
        atten_mask=atten_mask, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen)
    return attention_scores_p.bind(q, k, table, *mask, options=options)


def flash_attention_score(query, key, value, *, input_layout="BSND", head_num=None, scale=None,
                          sparse_mode=0, pre_tokens=MAX_TOKENS, next_tokens=MAX_TOKENS,
                          atten_mask=None, prefix=None, actual_seq_qlen=None,
                          actual_seq_kvlen=None):
    """Fused masked attention: softmax(scale * q k^T, masked by sparse_mode) @ v.

    Args:
      query, key, value: in `input_layout` BSND (B, S, N, D), BNSD, BSH/SBH
        (hidden N*D, `head_num`=N1 required) or TND (packed tokens); float32,
        float16 or bfloat16; N1 % N2 == 0 (GQA); value's head dim Dv <= D.
      scale: None means 1/sqrt(D).
      sparse_mode: 0-8 as in spec/attention.md, with pre_tokens/next_tokens,
        atten_mask (bool/uint8, True = masked), prefix (modes 5/6) and the
        cumulative actual_seq_qlen/actual_seq_kvlen of TND (may be traced).

    Returns:
      (attention_out, softmax_max, softmax_sum): out in query's layout and dtype
      with value's head dim; the float32 statistics (B, N1, Sq), or (Tq, N1) for
      TND. Rows with no visible key give 0, -3.4028235e38 and 3.4028235e38.
      Differentiable with respect to query, key and value (through attention_out).

    Raises:
      ValueError/TypeError at trace time for input that breaks attention.md's rules.
    """
    options, (q, k, v), table, mask = _prepare(
        query, key, value, True, input_layout=input_layout, head_num=head_num, scale=scale,
        sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens,
        atten_mask=atten_mask, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen)
    out, softmax_max, softmax_sum = _flash(options, q, k, v, table, mask)
    return merge_heads(out, options.info), softmax_max, softmax_sum


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(options, query, key, value, table, mask):
    return tuple(attention_fwd_p.bind(query, key, value, table, *mask, options=options))


def _flash_fwd(options, query, key, value, table, mask):
    args = (query.value, key.value, value.value, table.value)
    mask = jax.tree.map(lambda m: m.value, mask)
    outs = attention_fwd_p.bind(*args, *mask, options=options)
    return tuple(outs), (args, tuple(outs), mask)


def _flash_bwd(options, residuals, cotangents):
    (query, key, value, table), (out, softmax_max, softmax_sum), mask = residuals
    dout, dmax, dsum = cotangents
    if not (isinstance(dmax, SymbolicZero) and isinstance(dsum, SymbolicZero)):
        raise ValueError("flash_attention_score is differentiable through attention_out only; "
                         "softmax_max and softmax_sum are statistics without a gradient")
    if isinstance(dout, SymbolicZero):
        dout = jnp.zeros(out.shape, out.dtype)
    grads = attention_bwd_p.bind(query, key, value, out, dout, softmax_max, softmax_sum, table,
                                 *mask, options=options)
    return tuple(grads) + (None, None)


_flash.defvjp(_flash_fwd, _flash_bwd, symbolic_zeros=True)
